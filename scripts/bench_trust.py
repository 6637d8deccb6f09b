#!/usr/bin/env python
"""Tokens/s of greedy decoding through a loopback swarm with the trust plane on (public, the default:
commitments on every step, 10% of hop sessions audited by spot checks, one canary to vet each new peer and one more per
session with probability 0.25; also without spot checks, and the private mode) against the trust
plane off, from one run.

    .venv/bin/python scripts/bench_trust.py [--tokens 64] [--repeats 12] [--dtype bf16]

A sentinel and two `diffuse join` peers (blocks 1:15 and 15:30) start on 127.0.0.1 as a public
swarm (no swarm key: the client's trust settings are all that differ between its clients); the
client runs in this process with its default local block 0. The clients share the node and alternate
session by session, so machine noise hits all alike. They are warmed up first (canaries and
calibration are computed once per span and cached on disk; the referee's weights load once per
process), since those are one-time costs, reported separately. On this loopback box the
client's fp32 referee competes with the peers for the same cores; on a real network it runs
in the time the client waits for round trips.
Each cell is tokens/s pooled over the repeats (all tokens / all time) from opening the session to
the last token shown (prefill, vetting and every spot check's verdict included; the extra
canaries run after the session closes): audits pick whole hop sessions at random, so their cost
is an expectation over many sessions. The referee's CPU time is reported as a share of the
sessions' time. Greedy tokens must match; the script says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers and APIs it starts train no draft head behind the measurement

import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.peer.loopback import Child  # noqa: E402
from diffuse.client.generate import stream_tokens  # noqa: E402
from diffuse.client.sampling import Sampler, SamplingParams  # noqa: E402
from diffuse.client.swarm import SwarmClient, SwarmOptions, remote_of  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.load import parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from diffuse.trust import reputation  # noqa: E402
from diffuse.trust.guard import TrustOptions  # noqa: E402

LOCAL = "/ip4/127.0.0.1/tcp/0"
QUESTION = "Explain in a few sentences why the sky is blue."
SPANS = {"A": "1:15", "B": "15:30"}
TARGET = 0.90  # trust on must keep at least 90% of the tokens/s
CONFIGS = {  # alternated session by session
    "off": None,
    "commitments+canaries": TrustOptions(spot_rate=0.0),
    "private": TrustOptions(spot_rate=0.02, canary_rate=0.05, publish=False),
    "public": TrustOptions(),
}


async def generate(client: SwarmClient, prompt: list[int], tokens: int) -> tuple[list[int], float, dict]:
    """Tokens/s from asking for a session to the last token (what the user waits for; the
    session's close, where extra canaries run, comes after)."""
    t0 = time.perf_counter()
    pipe = await client.session(len(prompt) + tokens)
    ids = []
    try:
        async for t in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=tokens)), set()):
            ids.append(t)
        tps = len(ids) / (time.perf_counter() - t0)
    finally:
        await pipe.close()
    return ids, tps, {"failovers": len(remote_of(pipe).stats.failovers)}


async def bench(args, home: Path, boot: str) -> int:
    model_dir = store.resolve(home, None)
    prompt = Tokenizer.load(model_dir).encode_chat([{"role": "user", "content": QUESTION}])
    dtype = parse_dtype(args.dtype)
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False),
                         codecs=reputation.swarm_codecs()) as node:
        clients = {name: SwarmClient(node, model_dir, SwarmOptions(dtype=dtype, trust=trust))
                   for name, trust in CONFIGS.items()}
        with trio.fail_after(120):
            while not await clients["off"].covered():
                await trio.sleep(0.5)
        t0 = time.perf_counter()
        for client in clients.values():  # canary material per span (computed or read from disk), vetting
            await generate(client, prompt, 4)
            if client.guard is not None:
                for m in client.guard.bank.spans.values():
                    m.referee  # noqa: B018 - the spot-check referee's weights, loaded once per process
        warm = time.perf_counter() - t0
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        answers: set = set()
        failovers = 0
        for _ in range(args.repeats):
            for name, client in clients.items():
                ids, tps, info = await generate(client, prompt, args.tokens)
                rates[name].append(tps)
                answers.add(tuple(ids))
                failovers += info["failovers"]
        counts = {name: c.guard.status() for name, c in clients.items() if c.guard is not None}
    # Pooled: all tokens over all time. Spot checks audit whole hop sessions with probability
    # spot_rate, so the expected cost shows only over many sessions, not in a median of a few.
    med = {k: len(v) * args.tokens / sum(args.tokens / r for r in v) for k, v in rates.items()}
    print(f"\n{args.tokens} tokens x {args.repeats} repeats, {args.dtype}, 2 hops; warm-up (canaries, calibration "
          f"and referees for both spans, vetting) {warm:.1f} s")
    print("| trust plane | tokens/s (pooled) | ratio to off | all runs | canaries / spot checks / caught "
          "| deferred referee CPU / session time |")
    print("|---|---|---|---|---|---|")
    for k in CONFIGS:
        c = counts.get(k)
        checks = f"{c['canaries']} / {c['spot_checks']} / {c['caught']}" if c else "-"
        busy = f"{c['referee_cpu_s'] / sum(args.tokens / r for r in rates[k]):.1%}" if c else "-"
        print(f"| {k} | {med[k]:.2f} | {med[k] / med['off']:.3f} | {', '.join(f'{r:.2f}' for r in rates[k])} "
              f"| {checks} | {busy} |")
    print(f"\npublic (default) on/off: {med['public'] / med['off']:.3f} (target >= {TARGET}); failovers {failovers}")
    same = len(answers) == 1
    print("greedy tokens identical with and without the trust plane:", "yes" if same else "NO")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--home", type=Path, help="model store (default: $DIFFUSE_HOME or ~/.diffuse)")
    args = ap.parse_args()
    home = data_home(args.home)
    os.environ["DIFFUSE_HOME"] = str(home)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        public = ["--mode", "public"]  # no swarm key for the client to hold: the trust plane is what differs
        procs = [Child("sentinel", ["sentinel", "--identity", str(t / "s.key"), "--listen", LOCAL, *public],
                       t / "s.log")]
        try:
            boot = procs[0].wait_for("/ip4/", 120)
            for name, span in SPANS.items():
                procs.append(Child(name, ["join", "--bootstrap", boot, "--blocks", span, "--dtype", args.dtype,
                                          "--identity", str(t / f"{name}.key"), "--listen", LOCAL, *public],
                                   t / f"{name}.log"))
            for p in procs[1:]:
                p.wait_for("serving ", 300)
            return trio.run(bench, args, home, boot)
        finally:
            for p in procs:
                p.stop()


if __name__ == "__main__":
    sys.exit(main())
