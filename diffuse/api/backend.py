"""What the OpenAI-compatible API needs from whatever runs the model: the `Backend` protocol.

The API never asks where blocks run. A backend lists the models it knows with their coverage,
hands out one inference session (a `Pipeline`) per answer, and the tokenizer of each model.
`LocalBackend` runs whole models in this process; the swarm backend routes the same sessions
through peers. Both report coverage in the control plane's `Coverage.to_dict()` shape, so the
status page and `/v1/models` read one format whatever the backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from diffuse.client.pipeline import LocalModel, Pipeline
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.errors import DiffuseError
from diffuse.model.tokenizer import Tokenizer

LOCAL_PEER = "local"  # the peer id the status page shows for blocks computed in this process


class UnknownModel(DiffuseError):
    """No backend knows this model id (HTTP 404)."""

    def __init__(self, model: str, known: list[str]):
        super().__init__(f"the model {model!r} does not exist here; known models: {', '.join(known) or 'none'}")
        self.model = model


class Unservable(DiffuseError):
    """The model is known but some blocks have no peer right now (HTTP 503)."""

    def __init__(self, model: str, missing: list[int]):
        super().__init__(f"the model {model!r} is not servable now: no peer serves blocks {_runs(missing)}")
        self.model, self.missing = model, missing


class Overloaded(DiffuseError):
    """Capacity is exhausted for now; the client should retry in `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Backend(Protocol):
    async def models(self) -> list[dict[str, Any]]:
        """Coverage of every known model, servable or not (one `Coverage.to_dict()` each)."""
        ...

    def tokenizer(self, model_id: str) -> Tokenizer:
        """The model's tokenizer; UnknownModel if the id is not known."""
        ...

    def context_length(self, model_id: str) -> int:
        """Longest session (prompt + answer, in tokens) the model supports."""
        ...

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        """A fresh session for up to `max_len` tokens, which the caller closes.
        Raises UnknownModel, Unservable (naming the uncovered blocks) or Overloaded."""
        ...

    def speculation(self, model_id: str) -> SpecConfig | None:
        """How this model's answers speculate (None: plain decoding, as where a step is no round trip)."""
        ...

    def speculated(self, model_id: str, state: SpecState) -> None:
        """A speculating answer ended with `state` (how its draft head guessed)."""
        ...


@dataclass
class _Loaded:
    model: LocalModel
    tokenizer: Tokenizer
    context_length: int
    num_blocks: int
    dtype: str
    started: float
    throughput: float = 0.0

    def session(self, max_len: int) -> Pipeline:
        """The model's batchers compute on a worker thread (the loop keeps admitting requests,
        serving the status page and noticing hang-ups) and batch concurrent sessions' rows."""
        return self.model.session(max_len)


class LocalBackend:
    """Whole models in this process: every block is local, so coverage is always complete.
    Concurrent answers are batched (client/pipeline.LocalModel)."""

    def __init__(self) -> None:
        self._models: dict[str, _Loaded] = {}

    def add(self, model_id: str, model: LocalModel, tokenizer: Tokenizer, context_length: int,
            dtype: str) -> None:
        num_blocks = sum(span.end - span.start for span in model.spans)
        self._models[model_id] = _Loaded(model, tokenizer, context_length, num_blocks, dtype, time.time())

    @classmethod
    def open(cls, home: Path, names: list[str | None], dtype: str = "bf16", device: str = "cpu"
             ) -> LocalBackend:
        """Load each named model of the store (None: the default one) under its swarm id."""
        from diffuse.client.local import open_local
        from diffuse.model import store
        from diffuse.model.config import ModelConfig
        from diffuse.model.weights import load_manifest

        backend = cls()
        for name in names:
            path = store.resolve(home, name)
            model, tokenizer = open_local(home, name, dtype, device)
            backend.add(load_manifest(path).model_id, model, tokenizer,
                        ModelConfig.load(path).max_position_embeddings, dtype)
        return backend

    async def warm_up(self, tokens: int = 8) -> None:
        """Run a few greedy steps per model: the first forward pays one-off setup costs, which
        would otherwise land on the first client, and the timed steps give the throughput the
        status page shows for the local 'peer'."""
        for loaded in self._models.values():
            pipeline = loaded.session(tokens + 2)
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
        return self._get(model_id).context_length

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        return self._get(model_id).session(max_len)

    def speculation(self, model_id: str) -> None:
        """None: in one process a step is no round trip, so a wider one only costs."""
        self._get(model_id)
        return None

    def speculated(self, model_id: str, state: SpecState) -> None:
        pass


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


def _runs(blocks: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9': uncovered blocks come in runs, and a long list helps nobody."""
    out: list[str] = []
    for b in sorted(blocks):
        if out and int(out[-1].rpartition("-")[2]) == b - 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{b}"
        else:
            out.append(str(b))
    return ", ".join(out)
