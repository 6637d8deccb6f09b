"""Whole models in this process: the reference, and what answers when no swarm is reachable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffuse.client import draft_head
from diffuse.client.backend import LOCAL_PEER, UnknownModel
from diffuse.client.pipeline import LocalModel, Pipeline
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.model import store
from diffuse.model.config import ModelConfig
from diffuse.model.load import load_head, load_span, parse_dtype
from diffuse.model.tokenizer import Tokenizer
from diffuse.model.weights import load_manifest


def open_local(home: Path, name: str | None, dtype: str = "bf16", device: str = "cpu", quant: str = "none"
               ) -> tuple[LocalModel, Tokenizer]:
    path = store.resolve(home, name)
    cfg = ModelConfig.load(path)
    torch_dtype = parse_dtype(dtype)
    span = load_span(path, 0, cfg.num_layers, torch_dtype, device, quant=quant)
    return LocalModel(load_head(path, torch_dtype, device), [span]), Tokenizer.load(path)


@dataclass
class _Loaded:
    model: LocalModel
    tokenizer: Tokenizer
    cfg: ModelConfig
    draft: draft_head.DraftHead | None  # speculation's draft head from the store, when it speculates
    dtype: str
    started: float
    throughput: float = 0.0

    @property
    def num_blocks(self) -> int:
        return self.cfg.num_layers


class LocalBackend:
    """Whole models in this process: every block is local, so coverage is always complete.
    Concurrent answers are batched on a worker thread (client/pipeline.LocalModel): the loop
    keeps admitting requests, serving the status page and noticing hang-ups. Here a step is no
    round trip, so answers speculate only when asked to (`speculate`)."""

    def __init__(self, speculate: bool = False, exact: bool = False) -> None:
        self._models: dict[str, _Loaded] = {}
        self.speculate, self.exact = speculate, exact

    @classmethod
    def open(cls, home: Path, names: list[str | None], dtype: str = "bf16", device: str = "cpu",
             speculate: bool = False, exact: bool = False, quant: str = "none") -> LocalBackend:
        """Load each named model of the store (None: the default one) under its swarm id, with the
        draft head `diffuse model draft-head` trained for it when answers speculate."""
        backend = cls(speculate, exact)
        for name in names:
            path = store.resolve(home, name)
            model, tokenizer = open_local(home, name, dtype, device, quant)
            cfg = ModelConfig.load(path)
            draft = draft_head.load(draft_head.path(home, path.name), cfg.hidden_size) if speculate else None
            backend._models[load_manifest(path).model_id] = _Loaded(model, tokenizer, cfg, draft, dtype, time.time())
        return backend

    async def warm_up(self, tokens: int = 8) -> None:
        """Run a few greedy steps per model: the first forward pays one-off setup costs, which
        would otherwise land on the first client, and the timed steps give the throughput the
        status page shows for the local 'peer'."""
        for loaded in self._models.values():
            pipeline = loaded.model.session(tokens + 2)
            try:
                await pipeline.forward(torch.tensor([[0, 0]]), rows=slice(-1, None))
                t0 = time.perf_counter()
                for _ in range(tokens):
                    await pipeline.forward(torch.tensor([[0]]))
                loaded.throughput = round(tokens / (time.perf_counter() - t0), 1)
            finally:
                await pipeline.close()

    async def models(self) -> list[dict[str, Any]]:
        now = time.time()
        return [_local_coverage(model_id, m, now) for model_id, m in self._models.items()]

    def _get(self, model_id: str) -> _Loaded:
        if model_id not in self._models:
            raise UnknownModel(model_id, list(self._models))
        return self._models[model_id]

    def tokenizer(self, model_id: str) -> Tokenizer:
        return self._get(model_id).tokenizer

    def context_length(self, model_id: str) -> int:
        return self._get(model_id).cfg.max_position_embeddings

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        return self._get(model_id).model.session(max_len, exact=self.exact)

    async def speculation(self, model_id: str) -> SpecConfig | None:
        loaded = self._get(model_id)
        return SpecConfig(draft=loaded.draft) if self.speculate else None

    def speculated(self, model_id: str, state: SpecState) -> None:
        pass

    def describe(self, model_id: str, pipeline: Pipeline, tokens: int) -> dict[str, Any]:
        return {}


def _local_coverage(model_id: str, m: _Loaded, now: float) -> dict[str, Any]:
    peer = {"peer_id": LOCAL_PEER, "start": 0, "end": m.num_blocks, "addrs": [], "dtype": m.dtype,
            "throughput": m.throughput, "cache_tokens": 0, "age_s": round(now - m.started, 1),
            "last_heartbeat_s": 0.0}
    return {
        "model": model_id,
        "num_blocks": m.num_blocks,
        "servable": m.num_blocks > 0,
        "missing": [],
        "min_replicas": 1,
        "blocks": [{"block": i, "replicas": 1, "peers": [LOCAL_PEER]} for i in range(m.num_blocks)],
        "peers": [peer],
        "excluded": {},
    }
