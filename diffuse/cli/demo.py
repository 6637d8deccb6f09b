"""`diffuse demo`: a whole swarm on this machine, one question through it, then shut down
(peer/loopback.py): a sentinel and four peers as separate processes, every remote block served
twice, private by default with a key made for the run."""

from __future__ import annotations

import argparse
import sys

from diffuse.cli.common import add_compute_options
from diffuse.control.mode_names import MODES, PRIVATE
from diffuse.home import data_home


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a loopback swarm, ask one question through it, stop it")
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--peers", type=int, default=4, help="peers (even; each remote block is served twice)")
    p.add_argument("--max-tokens", type=int, default=64)
    add_compute_options(p, device=False)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for the swarm to start")
    p.add_argument("--mode", default=PRIVATE, choices=MODES,
                   help="private (default: a swarm key made for this demo) or public (no key, the full trust plane)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from diffuse.peer.loopback import LoopbackConfig, ask_loopback

    config = LoopbackConfig(data_home(args.home), args.peers, args.mode, args.dtype, args.max_tokens, args.timeout)
    result = ask_loopback(config, args.question, lambda text: print(text, file=sys.stderr, flush=True))
    print(result["text"])
    print(f"\nroute: client blocks 0:{result['local_blocks'][0]} (local), then " + ", ".join(
        f"peer …{hop['peer'][-8:]} blocks {hop['blocks'][0]}:{hop['blocks'][1]}" for hop in result["route"]))
    print(f"{result['completion_tokens']} tokens at {result['tokens_per_s']:.1f} tokens/s, "
          f"{len(result['failovers'])} failovers; a {result['swarm_mode']} swarm, trust plane {result['trust']}")
    return 0
