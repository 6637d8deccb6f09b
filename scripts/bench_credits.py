#!/usr/bin/env python
"""What usage credits cost a session, as a share of the compute on each side, from one run.

    .venv/bin/python scripts/bench_credits.py [--tokens 64] [--sessions 3] [--dtype bf16]

A session of SmolLM2 runs in this process split as `ask` splits it through one peer: the client
computes the embeddings, block 0 and the head, "the peer" blocks 1:30 (their forwards timed
apart). Against the median session, the credit work each side does per session:

- client: signing its receipt, and recording it in a spent book that already holds 200 peers;
- peer: checking the receipt and taking it into a ledger (replay check included), booking the
  session, and writing the whole book once, holding MAX_HELD receipts (at most one write per
  FLUSH_S, in a worker thread: counted here in full for every session, an upper bound).

The target: each side's credit work under 2% of its compute for the session.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts

import trio  # noqa: E402

from diffuse.client.pipeline import LocalModel  # noqa: E402
from diffuse.control.identity import ephemeral, peer_id  # noqa: E402
from diffuse.control.receipts import issue, verify  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.config import ModelConfig  # noqa: E402
from diffuse.model.load import load_head, load_span, parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.trust.credits import MAX_HELD, Ledger, Spent  # noqa: E402
from support.swarm import decode  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue."
TARGET = 0.02


class Timed:
    """A stage whose forwards add their wall time to `spent` (the peer's share of a session)."""

    def __init__(self, stage, spent: list[float]):
        self.stage, self.spent = stage, spent
        self.start, self.end = stage.start, stage.end

    async def forward(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return await self.stage.forward(*args, **kw)
        finally:
            self.spent[0] += time.perf_counter() - t0

    def __getattr__(self, name: str):
        return getattr(self.stage, name)


def sessions(model_dir: Path, dtype: str, tokens: int, n: int) -> tuple[float, float]:
    """Median (client, peer) seconds of compute per session."""
    cfg, torch_dtype = ModelConfig.load(model_dir), parse_dtype(dtype)
    model = LocalModel(load_head(model_dir, torch_dtype), [load_span(model_dir, 0, 1, torch_dtype),
                                                          load_span(model_dir, 1, cfg.num_layers, torch_dtype)])
    prompt = Tokenizer.load(model_dir).encode_chat([{"role": "user", "content": QUESTION}])
    out = []
    for i in range(n + 1):  # the first warms up
        pipe, peer = model.session(len(prompt) + tokens), [0.0]
        pipe.stages[1] = Timed(pipe.stages[1], peer)
        t0 = time.perf_counter()
        trio.run(decode, pipe, prompt, tokens)
        if i:
            out.append((time.perf_counter() - t0 - peer[0], peer[0]))
    return statistics.median(c for c, _ in out), statistics.median(p for _, p in out)


def per_session(tokens: int, n: int = 200) -> dict[str, float]:
    """Seconds of each credit step per session, averaged over `n`."""
    client, peer = ephemeral(), ephemeral()
    me, them = peer_id(client).to_base58(), peer_id(peer).to_base58()
    with tempfile.TemporaryDirectory() as tmp:
        spent = Spent(Path(tmp) / "member")
        spent.record([issue(ephemeral(), peer_id(ephemeral()).to_base58(), "m", 0, 1, 1, 0.0, os.urandom(16))
                      for _ in range(200)])
        ledger = Ledger(Path(tmp) / "peer", them)
        ledger.held = [issue(ephemeral(), them, "m", 1, 30, tokens, 1.0, os.urandom(16)) for _ in range(MAX_HELD)]
        t = {}
        t0 = time.perf_counter()
        signed = [issue(client, them, "m", 1, 30, tokens, 1.0, os.urandom(16)) for _ in range(n)]
        t["client: sign a receipt"] = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for s in signed[:20]:
            spent.record([s])
        t["client: record it in spent.cbor"] = (time.perf_counter() - t0) / 20
        t0 = time.perf_counter()
        for s in signed:
            verify(s.payload, s.signature)
        t["peer: check a receipt"] = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for s in signed:
            ledger.accept([s.wire()], me)
            ledger.took(me, 29 * tokens)
        t["peer: take it and book the session"] = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(5):
            ledger.dirty = True
            ledger.flush()
        t[f"peer: write the book ({MAX_HELD} receipts)"] = (time.perf_counter() - t0) / 5
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    client_s, peer_s = sessions(store.resolve(data_home(), None), args.dtype, args.tokens, args.sessions)
    steps = per_session(args.tokens)
    print(f"session: {args.tokens} tokens, client {client_s * 1e3:.0f} ms of compute, peer {peer_s * 1e3:.0f} ms")
    print(f"| {'credit step':<44} | {'us':>8} | {'share of its side':>17} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 19}|")
    for name, s in steps.items():
        side = client_s if name.startswith("client") else peer_s
        print(f"| {name:<44} | {s * 1e6:>8.0f} | {s / side:>17.3%} |")
    for who, side in (("client", client_s), ("peer", peer_s)):
        total = sum(s for n, s in steps.items() if n.startswith(who))
        verdict = "under" if total / side < TARGET else "OVER"
        print(f"{who}: credits {total / side:.3%} of its compute per session ({verdict} the {TARGET:.0%} target)")


if __name__ == "__main__":
    main()
