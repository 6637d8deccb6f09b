#!/usr/bin/env python
"""Many announcing DHT nodes in one process: each a libp2p host of its own (real TCP, Noise,
yamux, the private swarm's key from $DIFFUSE_SWARM_KEY) that announces a span of a model with the
manifest's block hashes and serves no blocks. Prints one line per node, `announcing <peer id>
<start>:<end>`, then `ready`, and runs until killed.

    python scripts/support/announcers.py --bootstrap ADDR --model-dir DIR --spans 0:8,4:12,...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402

from diffuse.control.announce import Serving  # noqa: E402
from diffuse.control.modes import KEY_ENV  # noqa: E402
from diffuse.control.node import Node, NodeConfig  # noqa: E402
from diffuse.control.swarm_key import read_key  # noqa: E402
from diffuse.model.weights import load_manifest  # noqa: E402


async def main(args: argparse.Namespace) -> None:
    manifest = load_manifest(Path(args.model_dir))
    key = read_key(Path(os.environ[KEY_ENV]))
    spans = [tuple(int(x) for x in s.split(":")) for s in args.spans.split(",")]
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[args.bootstrap], swarm_key=key,
                        heartbeat=args.heartbeat, ttl=args.ttl)

    async def one(start: int, end: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        node = await nursery.start(Node(create_new_key_pair(), config).run)
        await node.serve(Serving(manifest.model_id, manifest.num_layers, start, end,
                                 manifest.block_hashes[start:end], manifest.dtype))
        print(f"announcing {node.record.peer_id} {start}:{end}", flush=True)
        task_status.started()

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as starting:  # all at once: a slow bootstrap holds no other node back
            for start, end in spans:
                starting.start_soon(nursery.start, one, start, end)
        print("ready", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--spans", required=True, help="comma-separated start:end spans, one node each")
    ap.add_argument("--heartbeat", type=float, default=5.0)
    ap.add_argument("--ttl", type=float, default=60.0)
    trio.run(main, ap.parse_args())
