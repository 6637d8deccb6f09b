#!/usr/bin/env python
"""Where a decode token's time goes on a loopback swarm of 1, 2 or 3 hops (bench_swarm.py's spans).

    .venv/bin/python scripts/hop_breakdown.py [--hops 3] [--tokens 64] [--repeats 3]

Starts a sentinel and the path's `diffuse join` peers (as bench_swarm.py does), then alternates greedy
decoding through them with the in-process engine. Per hop it splits the client's wall time of a
decode STEP into the peer's own compute (STEP_OK's compute time) and the rest (transport, both
processes waking up, codec); what is left of a token beyond the hops is the client's own work
(embedding, LM head, sampling). Trust plane off, client holds no blocks.
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
os.environ["DIFFUSE_TRAIN_DRAFT"] = "0"  # the peers and APIs it starts train no draft head behind the measurement

import torch  # noqa: E402
import trio  # noqa: E402
from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import support.swarm as B  # noqa: E402

from diffuse.client.local import open_local  # noqa: E402
from diffuse.client.pipeline import Pipeline  # noqa: E402
from diffuse.client.swarm import SwarmClient, SwarmOptions  # noqa: E402
from diffuse.control.node import NodeConfig, open_node  # noqa: E402
from diffuse.data import client as data_client  # noqa: E402
from diffuse.home import data_home  # noqa: E402
from diffuse.model import store  # noqa: E402
from diffuse.model.tokenizer import Tokenizer  # noqa: E402

steps: list[tuple[int, float, float, int]] = []  # (hop start, wall s, peer compute s, tokens)


def record_steps() -> None:
    step = data_client.HopSession.step

    async def timed(self, h, positions, mask, commit, timeout=None):
        t0, c0 = time.perf_counter(), self.compute_s
        out = await step(self, h, positions, mask, commit, timeout)
        steps.append((self.hop.start, time.perf_counter() - t0, self.compute_s - c0, h.shape[1]))
        return out

    data_client.HopSession.step = timed


async def run(args, home: Path, peers: B.Peers) -> None:
    model_dir = store.resolve(home, None)
    prompt = Tokenizer.load(model_dir).encode(B.PROMPT)
    local, _ = open_local(home, None, "bf16")
    async with open_node(create_new_key_pair(), NodeConfig(listen=[B.LOCAL], bootstrap=[peers.boot],
                                                           server=False)) as node:
        client = SwarmClient(node, model_dir, SwarmOptions(local_blocks=(0, 0), dtype=torch.bfloat16, trust=None))
        with trio.fail_after(120):
            while not set(peers.ids.values()) <= {r.peer_id for r in await client.records()}:
                await trio.sleep(0.5)
        print("| repeat | in-process ms/token | swarm ms/token | per hop: wall / peer compute / rest (ms) "
              "| client's own ms/token |")
        print("|---|---|---|---|---|")
        for rep in range(args.repeats):
            span = data_client.RemoteSpan(client.model_id, 0, client.cfg.num_layers, client.dial, client.route,
                                          client.bans, len(prompt) + args.tokens, dtype=client.opts.wire_dtype)
            await span.open()
            steps.clear()
            _, stamps = await B.decode(Pipeline(client.head, [span]), prompt, args.tokens)
            _, local_stamps = await B.decode(local.session(len(prompt) + args.tokens), prompt, args.tokens)
            swarm_ms, local_ms = 1000 / B.decode_tps(stamps), 1000 / B.decode_tps(local_stamps)
            hops, walls = [], 0.0
            for start in sorted({s[0] for s in steps}):
                mine = [s for s in steps if s[0] == start and s[3] == 1]
                wall = statistics.median(s[1] for s in mine) * 1000
                compute = statistics.median(s[2] for s in mine) * 1000
                hops.append(f"{wall:.1f} / {compute:.1f} / {wall - compute:.1f}")
                walls += wall
            print(f"| {rep} | {local_ms:.1f} | {swarm_ms:.1f} | {'; '.join(hops)} | {swarm_ms - walls:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hops", type=int, choices=(1, 2, 3), default=3)
    args = ap.parse_args()
    home = data_home(args.home)
    path = "1 hop" if args.hops == 1 else f"{args.hops} hops"
    B.PATHS, B.REPLICA = {path: B.PATHS[path]}, {}
    record_steps()
    with tempfile.TemporaryDirectory() as tmp:
        peers = B.Peers(home, Path(tmp), "bf16")
        try:
            peers.launch()
            trio.run(run, args, home, peers)
        finally:
            peers.stop()


if __name__ == "__main__":
    main()
