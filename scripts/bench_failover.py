#!/usr/bin/env python
"""Recovery from a SIGKILLed peer as the session grows: replay as first sent against one-chunk
replay of an exact session, from one run.

    .venv/bin/python scripts/bench_failover.py [--tokens 160] [--kills 3] [--dtype bf16]

A sentinel and two `diffuse join` peers holding every block (A and B) start on 127.0.0.1; the
client runs in this process and keeps embeddings, final norm and LM head. Each greedy generation
SIGKILLs the peer on its route after a chosen token, so the next step fails over to the other
peer, which must first rebuild the session's KV cache. Three kinds of session, alternated at each
kill point:
- plain: fast kernels; the committed steps are replayed as first sent (one STEP per decoded token,
  the only way to rebuild bit-identical KV entries with shape-dependent kernels);
- exact, as sent: an exact session (what `ask` opens when it speculates) replayed the same way:
  the baseline, `data.client.rechunked` patched out in this process;
- exact, chunked: the committed rows in STEPs of up to REPLAY_ROWS (spec 7.4: an exact peer's
  bits do not depend on how tokens share a step).
Recovery is the time from the peer's death to the next token minus a normal token interval.
Each answer must equal the same kind's answer without a kill.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `diffuse` sets it; before torch starts
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers and APIs it starts train no draft head behind the measurement

import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.data import client as data_client  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.load import parse_dtype  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402
from support.swarm import LOCAL, PROMPT, Peers, decode  # noqa: E402

SPANS = {"A": "0:30", "B": "0:30"}
KINDS = ("plain", "exact, as sent", "exact, chunked")
CHUNKED = data_client.rechunked


def as_sent(inputs, rows=0):
    return list(inputs)


async def bench(args, home: Path, peers: Peers) -> list[dict]:
    model_dir = store.resolve(home, None)
    prompt = Tokenizer.load(model_dir).encode(PROMPT)
    max_len = len(prompt) + args.tokens
    results = []
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[peers.boot],
                                                           server=False)) as node:
        clients = {exact: SwarmClient(node, model_dir, SwarmOptions(local_blocks=(0, 0), dtype=parse_dtype(args.dtype),
                                                                   trust=None, exact=exact))
                   for exact in (False, True)}
        client = clients[False]
        with trio.fail_after(120):
            while set(peers.ids.values()) - {r.peer_id for r in await client.records()}:
                await trio.sleep(0.5)

        async def generate(kind: str, kill_at: int | None) -> dict:
            data_client.rechunked = CHUNKED if kind == "exact, chunked" else as_sent
            c = clients[kind != "plain"]
            pipe = await c.session(max_len)
            span = next(s for s in pipe.stages if isinstance(s, data_client.RemoteSpan))
            victim = next(n for n, p in peers.ids.items() if p == span.route_taken[0]["peer"])
            died: list[float] = []

            def on_token(i: int) -> None:
                if i == kill_at:
                    peers.kill(victim)
                    died.append(time.perf_counter())

            ids, stamps = await decode(pipe, prompt, args.tokens, on_token)
            if kill_at is None:
                return {"ids": ids}
            normal = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
            record = span.stats.failovers[0] if span.stats.failovers else {}
            peers.start(victim)
            peers.wait(victim)
            for each in clients.values():
                each.bans.bans.clear()
            with trio.fail_after(120):  # its fresh record (new port) must be what routes read
                while peers.ids[victim] not in {r.peer_id for r in await c.records()}:
                    await trio.sleep(0.5)
            return {"ids": ids, "gap_s": stamps[kill_at + 1] - died[0] - normal, "normal_s": normal,
                    "client_s": record.get("recovery_s", float("nan")), "failovers": len(span.stats.failovers),
                    "replayed": record.get("replayed_tokens", 0)}

        want = {kind: (await generate(kind, None))["ids"] for kind in KINDS}  # also warms every path
        for k in range(args.kills):
            kill_at = args.tokens // (2 * args.kills) + k * args.tokens // args.kills
            for kind in KINDS:
                r = await generate(kind, kill_at)
                r.update(kind=kind, kill_at=kill_at, same=r.pop("ids") == want[kind])
                results.append(r)
                print(f"kill at {kill_at}: {r}", file=sys.stderr, flush=True)
    data_client.rechunked = CHUNKED
    return results


def report(args, results: list[dict]) -> None:
    load = os.getloadavg()
    print(f"\nSmolLM2-135M {args.dtype}, greedy decode of {args.tokens} tokens after a {PROMPT!r} prompt; one hop "
          f"of 30 blocks, SIGKILLed after a token, failover to its replica; client keeps embeddings and head")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores\n")
    print("| kill after token | replayed tokens | session | token ms | recovery s | client failover s "
          "| ratio to exact, as sent | same answer |")
    print("|---|---|---|---|---|---|---|---|")
    base = {r["kill_at"]: r["gap_s"] for r in results if r["kind"] == "exact, as sent"}
    for r in results:
        ok = r["same"] and r["failovers"] == 1
        print(f"| {r['kill_at']} | {r['replayed']} | {r['kind']} | {r['normal_s'] * 1e3:.1f} | {r['gap_s']:.3f} | "
              f"{r['client_s']:.3f} | {r['gap_s'] / base[r['kill_at']]:.2f}x | {'yes' if ok else 'NO'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", help="data directory (default: $DIFFUSE_HOME or ~/.diffuse)")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    args = ap.parse_args()
    if args.tokens < 8 or args.kills < 1 or args.kills > args.tokens // 4:
        ap.error("need --tokens >= 8 and 1 <= --kills <= tokens / 4")
    logging.basicConfig(level=logging.ERROR)  # failovers are expected here; the table reports them
    home = data_home(args.home)
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        print("starting a sentinel and 2 peers...", file=sys.stderr, flush=True)
        peers = Peers(home, Path(tmp), args.dtype)
        peers.spans = SPANS
        try:
            peers.launch()
            results = trio.run(bench, args, home, peers)
        finally:
            peers.stop()
    report(args, results)


if __name__ == "__main__":
    main()
