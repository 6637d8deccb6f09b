#!/usr/bin/env python
"""A peer under a long prefill: how much slower do another client's decode steps get?

One `diffuse join` peer (SmolLM2, all 30 blocks, bf16) and two clients in this process, each
with its own libp2p node. Client B decodes one token per step; its step latency (STEP written
to STEP_OK read) is measured undisturbed, then while client A sends one prefill of --prefill
tokens. The peer computes a long prefill in chunks (data/scheduler.py), so B's steps should
wait behind one chunk, not behind the prefill. Prints a table; the ratio is the figure.

    .venv/bin/python scripts/bench_flood.py                # 8192-token prefill
    .venv/bin/python scripts/bench_flood.py --prefill 2048 --steps 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio

os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers it starts train no draft head behind the measurement

from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.control.host import parse_peer_addr  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.control.routing import Hop  # noqa: E402
from diffuse.data.hop import HopSession  # noqa: E402
from diffuse.home import DEFAULT_MODEL, data_home, models_dir  # noqa: E402
from support.procs import Procs, swarm_key  # noqa: E402
from support.swarm import LOCAL, Swarm  # noqa: E402

H = 576


async def measure(boot: str, peer: Hop, prefill: int, steps: int) -> dict[str, list[float]]:
    model_dir = models_dir(data_home()) / DEFAULT_MODEL
    async with open_node(create_new_key_pair(), NodeConfig(listen=[LOCAL], bootstrap=[boot], server=False,
                                                                      swarm_key=swarm_key())) as node:
        client = SwarmClient(node, model_dir, SwarmOptions(trust=None, local_blocks=(0, 0)))

        async def session(max_len: int) -> HopSession:
            s = HopSession(peer, await client.dial(peer), client.model_id, max_len, 1, torch.bfloat16, 600.0)
            await s.open()
            return s

        b = await session(64 + 4 * steps)
        await b.step(torch.randn(1, 32, H), torch.arange(32), None, True)

        async def decode(n: int) -> list[float]:
            out = []
            for _ in range(n):
                pos = b.committed
                t0 = time.perf_counter()
                await b.step(torch.randn(1, 1, H), torch.tensor([pos]), None, True)
                out.append(time.perf_counter() - t0)
            return out

        alone = await decode(steps)
        a = await session(prefill + 8)
        during: list[float] = []
        done = trio.Event()

        async def flood() -> None:
            await a.step(torch.randn(1, prefill, H), torch.arange(prefill), None, True)
            done.set()

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await trio.sleep(0.2)  # the prefill is being computed
            while not done.is_set() and len(during) < 3 * steps:
                during += await decode(1)
            prefill_s = None
            await done.wait()
            prefill_s = time.perf_counter() - t0
        after = await decode(steps)
        for s in (a, b):
            await s.close()
    return {"alone": alone, "during": during, "after": after, "prefill_s": [prefill_s]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Procs(data_home()) as procs:
        sizes = ["--max-session-tokens", str(args.prefill + 64), "--cache-tokens", str(2 * args.prefill + 1024)]
        swarm = Swarm(procs, Path(tmp), {"p": "0:30"}, join=sizes, timeout=300)
        info = parse_peer_addr(swarm.addrs["p"])
        hop = Hop(info.peer_id.to_base58(), (str(info.addrs[0]),), 0, 30)
        r = trio.run(measure, swarm.boot, hop, args.prefill, args.steps)
    med = {k: statistics.median(v) for k, v in r.items() if k != "prefill_s"}
    print("| B's decode step | median ms | ratio to alone |\n|---|---|---|")
    for k in ("alone", "during", "after"):
        print(f"| {k} ({len(r[k])} steps) | {med[k] * 1e3:.1f} | {med[k] / med['alone']:.2f}x |")
    print(f"\nA's {args.prefill}-token prefill took {r['prefill_s'][0]:.1f} s; "
          f"B's slowest step during it: {max(r['during']) * 1e3:.0f} ms ({max(r['during']) / med['alone']:.2f}x)")


if __name__ == "__main__":
    main()
