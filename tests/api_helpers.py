"""Helpers for the API tests: a fake swarm backend, and the command line of a server on it (start
it with support.procs.start_server).

The fake stands in for the swarm where a test needs what one process cannot produce by itself:
several peers, uncovered blocks, an excluded peer, busy peers. It speaks the Backend protocol
with the coverage format of `diffuse.control.coverage.Coverage.to_dict()`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from diffuse.client.backend import Overloaded, UnknownModel, Unservable
from diffuse.model.tokenizer import Tokenizer

PEER_A = "12D3KooWA1aRqSx6ZtVKZ9sKmUj1FpD8RkYb6cJqGvWm4n2hHxYz"
PEER_B = "12D3KooWB7tQe3LnF4pPzW8yVxk9Jm2Rr5uCdS6gHh1aN3oTqEwK"
PEER_C = "12D3KooWC2mXv9RbT5kLq8WzYp3NfJ6dHs4GaU7eVc1xK9iBoPrM"
PEER_X = "12D3KooWX9zLr4TqN8mV2cKp6BwY3sFh7JdGx5aEu1oRk4iCnQeZ"  # announces the wrong weights
FULL, PARTIAL, NUM_BLOCKS = "full-model", "partial-model", 30


def _peer(pid: str, start: int, end: int, throughput: float, heartbeat: float) -> dict:
    return {"peer_id": pid, "start": start, "end": end, "addrs": [f"/ip4/10.0.0.1/tcp/31337/p2p/{pid}"],
            "dtype": "bfloat16", "throughput": throughput, "cache_tokens": 4096, "age_s": 3600.0,
            "last_heartbeat_s": heartbeat, "expires_in_s": 90.0 - heartbeat, "protocols": [],
            "software": "diffuse/0.1.0", "extra": {}}


def coverage(model: str, peers: list[dict], excluded: dict[str, str]) -> dict:
    blocks = [[p["peer_id"] for p in peers if p["start"] <= i < p["end"]] for i in range(NUM_BLOCKS)]
    missing = [i for i, b in enumerate(blocks) if not b]
    return {"model": model, "num_blocks": NUM_BLOCKS, "servable": not missing, "missing": missing,
            "min_replicas": min(len(b) for b in blocks),
            "blocks": [{"block": i, "replicas": len(b), "peers": b} for i, b in enumerate(blocks)],
            "peers": peers, "excluded": excluded}


class FakeSwarm:
    """Two models: FULL is covered (A, B, C) but every peer is busy; PARTIAL lacks blocks 20-29."""

    def __init__(self, model_dir: Path):
        self.tok = Tokenizer.load(model_dir)
        self.cov = {
            FULL: coverage(FULL, [_peer(PEER_A, 0, 12, 41.5, 3.0), _peer(PEER_B, 10, 30, 23.0, 4.0),
                                  _peer(PEER_C, 0, 30, 12.5, 70.0)],
                           {PEER_X: "announces other weights for blocks [3]"}),
            PARTIAL: coverage(PARTIAL, [_peer(PEER_A, 0, 12, 41.5, 3.0), _peer(PEER_B, 10, 20, 23.0, 4.0)], {}),
        }

    async def models(self) -> list[dict]:
        return list(self.cov.values())

    def tokenizer(self, model_id: str) -> Tokenizer:
        if model_id not in self.cov:
            raise UnknownModel(model_id, list(self.cov))
        return self.tok

    def context_length(self, model_id: str) -> int:
        return 8192

    async def session(self, model_id: str, max_len: int):
        cov = self.cov[model_id]
        if not cov["servable"]:
            raise Unservable(model_id, cov["missing"])
        raise Overloaded("every peer serving blocks 0-11 is busy")

    async def speculation(self, model_id: str) -> None:
        return None

    def fallbacks(self, model_id: str) -> tuple[str, ...]:
        return ()


FAKE_SERVER = """
import sys, trio
from pathlib import Path
sys.path.insert(0, {tests!r})
from api_helpers import FakeSwarm
from diffuse.api.app import create_app
from diffuse.http import serve_http

async def main():
    async with trio.open_nursery() as nursery:
        url = (await nursery.start(serve_http, create_app(FakeSwarm(Path({model_dir!r}))), "127.0.0.1:0"))[0]
        print("listening on", url, flush=True)

trio.run(main)
"""


def fake_server_cmd(model_dir: Path) -> list[str]:
    return [sys.executable, "-c", FAKE_SERVER.format(tests=str(Path(__file__).parent), model_dir=str(model_dir))]
