"""`diffuse`: a thin command line over the library; each command group lives in its own module."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from diffuse import allocator
from diffuse.errors import DiffuseError


def build_parser() -> argparse.ArgumentParser:
    from diffuse.cli import api, ask, credits, daemon, demo, history, model, net, swarm

    parser = argparse.ArgumentParser(prog="diffuse", description=__doc__)
    parser.add_argument("--home", help="data directory (default: $DIFFUSE_HOME or ~/.diffuse)")
    parser.add_argument("--client-only", action="store_true", help="consume the swarm without serving any block")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (model, ask, demo, net, api, swarm, credits, history, daemon):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # idle OpenMP threads must not steal cores
    allocator.tune()
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # `daemon start` hands its options on
    logging.basicConfig(level=logging.WARNING - 10 * args.verbose, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args) or 0
    except DiffuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The `diffuse` executable: `main`, whose commands close what they open, then an exit that skips
    finalisation, which would stop daemon threads (a draft head's trainer, torch's workers) mid-call
    and run torch's static destructors ("terminate called without an active exception")."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
