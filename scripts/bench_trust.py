#!/usr/bin/env python
"""Tokens/s of greedy decoding through a loopback swarm with the trust plane on (default settings:
commitments on every step, 10% spot checks, one canary to vet each new peer and one more per
session with probability 0.25) against the trust plane off, from one run.

    .venv/bin/python scripts/bench_trust.py [--tokens 64] [--repeats 4] [--dtype bf16]

A sentinel and two `diffuse join` peers (blocks 1:15 and 15:30) start on 127.0.0.1; the client
runs in this process with its default local block 0. Both clients share the node and alternate
session by session, so machine noise hits both alike. The trusted client is warmed up first
(its canaries and calibration are computed once per span and cached on disk; the referee's
weights load at the first spot check), since those are one-time costs, reported separately.
Each cell is the median over repeats of end-to-end tokens/s (prefill and session set-up,
canaries included, since a user waits for them). Greedy tokens must match; the script says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts

import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.cli.demo import Child  # noqa: E402
from diffuse.client.generate import stream_tokens  # noqa: E402
from diffuse.client.sampling import Sampler, SamplingParams  # noqa: E402
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of  # noqa: E402
from diffuse.control.node import open_node  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.load import parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.trust.guard import TrustOptions  # noqa: E402

LOCAL = "/ip4/127.0.0.1/tcp/0"
QUESTION = "Explain in a few sentences why the sky is blue."
SPANS = {"A": "1:15", "B": "15:30"}
TARGET = 0.90  # trust on must keep at least 90% of the tokens/s


async def generate(client: SwarmClient, prompt: list[int], tokens: int) -> tuple[list[int], float, dict]:
    t0 = time.perf_counter()
    pipe = await client.session(len(prompt) + tokens)
    ids = []
    try:
        async for t in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=tokens)), set()):
            ids.append(t)
    finally:
        await pipe.close()
    return ids, len(ids) / (time.perf_counter() - t0), {"failovers": len(remote_of(pipe).stats.failovers)}


async def bench(args, home: Path, boot: str) -> int:
    model_dir = store.resolve(home, None)
    prompt = Tokenizer.load(model_dir).encode_chat([{"role": "user", "content": QUESTION}])
    dtype = parse_dtype(args.dtype)
    async with open_node(create_new_key_pair(), listen=[LOCAL], bootstrap=[boot], server=False) as node:
        off = SwarmClient(node, model_dir, SwarmOptions(dtype=dtype, trust=None))
        on = SwarmClient(node, model_dir, SwarmOptions(dtype=dtype, trust=TrustOptions()))
        with trio.fail_after(120):
            while not await off.covered():
                await trio.sleep(0.5)
        t0 = time.perf_counter()
        await generate(on, prompt, 4)  # canary material for each span, computed or read from disk
        warm = time.perf_counter() - t0
        await generate(off, prompt, 4)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        answers: dict[str, set] = {"off": set(), "on": set()}
        failovers = 0
        for _ in range(args.repeats):
            for name, client in (("off", off), ("on", on)):
                ids, tps, info = await generate(client, prompt, args.tokens)
                rates[name].append(tps)
                answers[name].add(tuple(ids))
                failovers += info["failovers"]
        counts = on.guard.counts
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["on"] / med["off"]
    print(f"\n{args.tokens} tokens x {args.repeats} repeats, {args.dtype}, 2 hops; trusted client warm-up "
          f"(canaries + calibration for both spans) {warm:.1f} s")
    print("| trust plane | tokens/s (median) | all runs |")
    print("|---|---|---|")
    for k in ("off", "on"):
        print(f"| {k} | {med[k]:.2f} | {', '.join(f'{r:.2f}' for r in rates[k])} |")
    print(f"\nratio on/off: {ratio:.3f} (target >= {TARGET}); checks during the timed runs and warm-up: "
          f"{counts['canaries']} canary sessions, {counts['spot_checks']} spot checks, {counts['caught']} caught; "
          f"failovers {failovers}")
    same = len(answers["off"] | answers["on"]) == 1
    print("greedy tokens identical with and without the trust plane:", "yes" if same else "NO")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--home", type=Path, help="model store (default: $DIFFUSE_HOME or ~/.diffuse)")
    args = ap.parse_args()
    home = data_home(args.home)
    os.environ["DIFFUSE_HOME"] = str(home)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        procs = [Child("sentinel", ["sentinel", "--identity", str(t / "s.key"), "--listen", LOCAL], t / "s.log")]
        try:
            boot = procs[0].wait_for("/ip4/", 120)
            for name, span in SPANS.items():
                procs.append(Child(name, ["join", "--bootstrap", boot, "--blocks", span, "--dtype", args.dtype,
                                          "--identity", str(t / f"{name}.key"), "--listen", LOCAL], t / f"{name}.log"))
            for p in procs[1:]:
                p.wait_for("serving ", 300)
            return trio.run(bench, args, home, boot)
        finally:
            for p in procs:
                p.stop()


if __name__ == "__main__":
    sys.exit(main())
