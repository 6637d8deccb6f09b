"""The swarm backend: every API answer is an inference session of its own through the swarm.

One libp2p node (a DHT client with an ephemeral identity, like `diffuse ask`) and one
`SwarmClient` per model the API offers. The API holds what a swarm client holds (tokenizer,
embeddings, head, its local blocks), so token ids never leave it. Coverage is read from the DHT
on every call: the status page and /v1/models show the swarm as it is, not as it was.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from diffuse.api.backend import LOCAL_PEER, Overloaded, UnknownModel, Unservable
from diffuse.client.pipeline import Pipeline
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of
from diffuse.control.coverage import coverage
from diffuse.control.records import PeerRecord
from diffuse.control.routing import Hop, NoRoute
from diffuse.metrics import FAILOVERS, MeteredStream
from diffuse.model.tokenizer import Tokenizer


class _MeteredClient(SwarmClient):
    """A SwarmClient whose streams count their bytes for /metrics."""

    async def dial(self, hop: Hop):
        return MeteredStream(await super().dial(hop))


class _Session(Pipeline):
    """A swarm session that reports its failovers to /metrics when it closes."""

    def __init__(self, pipeline: Pipeline, model: str):
        super().__init__(pipeline.head, pipeline.stages)
        self.model = model

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            FAILOVERS.labels(self.model).inc(len(remote_of(self).stats.failovers))


class SwarmBackend:
    """The Backend protocol over the swarm, for the models whose client side is in the store."""

    def __init__(self, clients: list[SwarmClient]):
        self.clients = {c.model_id: c for c in clients}
        self.tokenizers = {c.model_id: Tokenizer.load(c.model_dir) for c in clients}
        self.started = time.time()
        self.last: dict[str, list[PeerRecord]] = {}  # per model: the records last read

    def _client(self, model_id: str) -> SwarmClient:
        if model_id not in self.clients:
            raise UnknownModel(model_id, list(self.clients))
        return self.clients[model_id]

    def tokenizer(self, model_id: str) -> Tokenizer:
        self._client(model_id)
        return self.tokenizers[model_id]

    def context_length(self, model_id: str) -> int:
        return self._client(model_id).cfg.max_position_embeddings

    async def models(self) -> list[dict[str, Any]]:
        return [await self._coverage(c) for c in self.clients.values()]

    async def _records(self, client: SwarmClient) -> list[PeerRecord]:
        """This read's records merged with the last ones (newest per peer wins): a DHT lookup
        that misses a peer on a busy machine must not make the model unservable while that
        peer's signed record has not expired (coverage drops expired records)."""
        merged = {r.peer_id: r for r in self.last.get(client.model_id, [])}
        for r in await client.node.records(client.model_id, include_offline=True):
            if r.peer_id not in merged or r.timestamp >= merged[r.peer_id].timestamp:
                merged[r.peer_id] = r
        self.last[client.model_id] = [r for r in merged.values() if r.fresh()]
        return [r for r in self.last[client.model_id] if r.online]

    async def _coverage(self, client: SwarmClient) -> dict[str, Any]:
        """The DHT's block map (trusted records only), with the blocks this API computes itself
        as the peer 'local', and each peer's standing with this client (banned, RTT)."""
        cov = coverage(await self._records(client), client.model_id, client.cfg.num_layers,
                       expected_hashes=client.manifest.block_hashes).to_dict()
        start, end = client.remote_range
        local = [b for b in range(cov["num_blocks"]) if not start <= b < end]
        for b in local:
            cov["blocks"][b]["peers"].append(LOCAL_PEER)
            cov["blocks"][b]["replicas"] += 1
        banned, now = client.bans.active(), time.monotonic()
        for p in cov["peers"]:
            rtt = client.rtt.get(p["peer_id"])
            p.update(banned=p["peer_id"] in banned,
                     rtt_ms=round(rtt[0] * 1e3, 2) if rtt and now - rtt[1] < 600 else None)
        runs = [(a, b) for a, b in ((0, start), (end, cov["num_blocks"])) if a < b]  # front and back blocks
        cov["peers"][:0] = [{"peer_id": LOCAL_PEER, "start": a, "end": b, "addrs": [], "throughput": 0.0,
                             "dtype": str(client.opts.dtype).removeprefix("torch."), "cache_tokens": 0,
                             "age_s": round(time.time() - self.started, 1), "last_heartbeat_s": 0.0,
                             "extra": {"runs": "in this API process"}} for a, b in runs]
        cov["missing"] = [b for b in range(start, end) if not cov["blocks"][b]["replicas"]]
        cov["servable"] = cov["num_blocks"] > 0 and not cov["missing"]
        cov["min_replicas"] = min((b["replicas"] for b in cov["blocks"]), default=0)
        return cov

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        client = self._client(model_id)
        cov = await self._coverage(client)
        if not cov["servable"]:
            raise Unservable(model_id, cov["missing"])
        try:
            return _Session(await client.session(max_len), model_id)
        except NoRoute as e:  # every block is announced, but no peer took this session now
            raise Overloaded(f"the swarm cannot take another session right now ({e}); retry shortly") from None


@asynccontextmanager
async def open_swarm_backend(home: Path, names: list[str | None], bootstrap: list[str],
                             options: SwarmOptions, wait: float = 10.0) -> AsyncIterator[SwarmBackend]:
    """Join the swarm as a client and load each model's client side; waits up to `wait` seconds
    for full coverage (an API that starts with its swarm need not fail its first requests)."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from diffuse.control.node import open_node
    from diffuse.model import store

    async with open_node(create_new_key_pair(), listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap,
                         server=False) as node:
        clients = [_MeteredClient(node, store.resolve(home, name), options) for name in names]
        deadline = trio.current_time() + wait
        for client in clients:
            while not await client.covered() and trio.current_time() < deadline:
                await trio.sleep(0.25)
        yield SwarmBackend(clients)
