"""`diffuse id | sentinel | join | status`: the control plane on the command line.

Each joins a swarm in the mode --mode says (private by default: the swarm key is required;
cli/swarm.py, control/modes.py).

Errors that are the user's fault (bad multiaddr, unreachable bootstrap, bad --blocks) are
DiffuseErrors: the top-level `main` prints `error: ...` and exits 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import trio

from diffuse.cli.common import add_train_draft_option, bootstrap_addrs, positive, trio_run, until_signal
from diffuse.cli.reach import (
    add_discovery_options, add_hole_punch_option, add_relay_options, add_upnp_option, use_mdns,
)
from diffuse.cli.swarm import add_swarm_options, swarm_access
from diffuse.control.modes import SwarmAccess
from diffuse.data.serve import LEVELS
from diffuse.trust import reputation

log = logging.getLogger("diffuse.net")

DEFAULT_SENTINEL_LISTEN = "/ip4/0.0.0.0/tcp/31330"
DEFAULT_PEER_LISTEN = "/ip4/0.0.0.0/tcp/0"


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser | None = None) -> None:
    parents = [common] if common is not None else []

    p = subparsers.add_parser("id", parents=parents, help="print this node's peer id (creates its key)")
    _identity_arg(p)
    p.set_defaults(func=cmd_id)

    p = subparsers.add_parser("sentinel", parents=parents,
                              help="run a DHT bootstrap node that serves no blocks")
    _identity_arg(p)
    _net_args(p, listen_default=DEFAULT_SENTINEL_LISTEN)
    add_swarm_options(p)
    add_relay_options(p, default=True)
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics")
    p.set_defaults(func=cmd_sentinel)

    _register_join(subparsers.add_parser("join", parents=parents, help="serve blocks of a model and announce them"))
    _register_status(subparsers.add_parser("status", parents=parents,
                                           help="which peers serve which blocks, per model"))


def _register_join(p: argparse.ArgumentParser) -> None:
    _identity_arg(p)
    _net_args(p, listen_default=DEFAULT_PEER_LISTEN)
    add_swarm_options(p)
    add_relay_options(p, default=False)
    add_hole_punch_option(p)
    add_upnp_option(p)
    p.add_argument("--model", help="model in the store (default: the embedded default model); auto: the model "
                   "the swarm needs most, re-planned as peers come and go (control/ladder.py)")
    p.add_argument("--models", metavar="A,B", help="with --model auto: the models it may choose from "
                   "(default: every model in the store)")
    p.add_argument("--replan", type=positive, metavar="SECONDS",
                   help="with --model auto: how often to look whether the swarm needs this peer elsewhere "
                        "(default: 4 heartbeats)")
    p.add_argument("--blocks", default="auto", help="A:B serves blocks A..B-1; auto (default) picks "
                   "the least-served span that fits --num-blocks / --max-memory")
    p.add_argument("--num-blocks", type=int, help="with --blocks auto: how many blocks to serve")
    p.add_argument("--max-memory", help="with --blocks auto: weight memory budget, e.g. 800MiB, 2GB")
    p.add_argument("--throughput", type=positive,
                   help="tokens/s to announce (default: measured once the span is loaded)")
    p.add_argument("--cache-tokens", type=int, default=65536,
                   help="KV-cache tokens this peer lends to all sessions together")
    p.add_argument("--max-session-tokens", type=int, default=8192, help="KV-cache tokens one session may hold")
    p.add_argument("--session-timeout", type=float, default=300.0,
                   help="seconds a session may idle before its cache is freed")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="compute dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--tamper", metavar="KIND[:STRENGTH]", type=_tamper_arg,
                   help="TESTING ONLY: serve corrupted outputs to exercise the trust plane "
                        "(trust/tamper.py; an unknown KIND lists the kinds)")
    p.add_argument("--tamper-rate", type=float, default=1.0, metavar="P",
                   help="TESTING ONLY: fraction of requests --tamper corrupts (default 1)")
    p.add_argument("--contribution", default="max", choices=list(LEVELS),
                   help="how much of this machine to lend: max (all cores, 64 sessions, --cache-tokens), "
                        "moderate (half), min (1 thread, 8 sessions, 1/8 of the cache), pause (serve nothing)")
    p.add_argument("--client-only", action="store_true", default=argparse.SUPPRESS,
                   help="stay in the swarm's DHT without serving blocks (as does --contribution pause)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM: seconds open sessions get to finish before they are handed "
                        "to replicas (a second signal stops at once)")
    add_train_draft_option(p)
    p.set_defaults(func=cmd_join)


def _register_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", action="append", default=[], metavar="ADDR",
                   help="a sentinel or peer multiaddr with /p2p/ (repeatable)")
    p.add_argument("--bootstrap-file", type=Path, help="file with one bootstrap multiaddr per line")
    p.add_argument("--model", action="append", default=[],
                   help="model in the store (repeatable; default: every model in the store): its manifest says "
                        "how many blocks it has and which weights they hold")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="poll until every model is servable or SECONDS pass")
    p.add_argument("--reach", action=argparse.BooleanOptionalAction, default=True,
                   help="connect to every peer listed and say how this machine reaches it: direct, relayed via a "
                        "relay, hole-punched, or unreachable (default: on; --no-reach reads the records only)")
    add_swarm_options(p)
    add_discovery_options(p)
    add_hole_punch_option(p)
    p.set_defaults(func=cmd_status)


def _identity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--identity", type=Path, metavar="KEYFILE",
                   help="Ed25519 key file (default: <home>/identity.key; created mode 0600 if absent)")


def _net_args(p: argparse.ArgumentParser, listen_default: str) -> None:
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                   help=f"listen address (repeatable; default {listen_default})")
    p.set_defaults(listen_default=listen_default)
    p.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="address to advertise instead of the listen addresses (repeatable)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="ADDR",
                   help="a sentinel or peer multiaddr with /p2p/ (repeatable; the others are "
                        "tried when one is down)")
    p.add_argument("--bootstrap-file", type=Path, help="file with one bootstrap multiaddr per line")
    p.add_argument("--heartbeat", type=float, default=15.0, metavar="SECONDS",
                   help="re-announce period (default 15)")
    p.add_argument("--ttl", type=float, metavar="SECONDS",
                   help="record lifetime (default 3 heartbeats)")
    add_discovery_options(p)


# ---- commands ----

def cmd_id(args: argparse.Namespace) -> int:
    from diffuse.control.identity import peer_id

    print(peer_id(_key_pair(args)).to_base58())
    return 0


def cmd_sentinel(args: argparse.Namespace) -> int:
    from diffuse.control.sentinel import run_sentinel
    from diffuse.metrics import DHT_RECORDS

    key_pair = _key_pair(args, hold=True)
    boot = bootstrap_addrs(args, required=False)
    listen = _listen(args)
    access = swarm_access(args, create=True)
    if access.created:
        print(f"no swarm key given: made one for a new private swarm at {access.key_path}; every node that joins "
              "needs a copy (`diffuse swarm new --help` says how to share it), or run --mode public",
              file=sys.stderr, flush=True)

    def ready(addrs: list[str]) -> None:
        for a in addrs:
            print(a, flush=True)
        print(f"sentinel ready ({_describe(access)}); stop with Ctrl-C", file=sys.stderr, flush=True)

    if args.metrics:
        from diffuse.http import parse_listen

        parse_listen(args.metrics)

    async def sentinel() -> None:
        async with trio.open_nursery() as nursery:
            if args.metrics:
                from diffuse.metrics import serve_metrics

                urls = await nursery.start(serve_metrics, args.metrics)
                print(f"metrics at {urls[0]}/metrics", file=sys.stderr, flush=True)
            await run_sentinel(key_pair, listen, boot, ready, args.announce, reputation.swarm_codecs(), access.key,
                               access.allow, args.relay, bool(args.mdns),
                               started=lambda node: DHT_RECORDS.set_function(node.stored_records))  # for /metrics

    trio_run(until_signal, sentinel)
    return 0


def _describe(access: SwarmAccess) -> str:
    """One line on how a node joined: "private swarm, key FILE (fingerprint F)" or "public swarm"."""
    if access.key is None:
        return "public swarm"
    allow = f", serving allowed to the peers in {access.allow.path}" if access.allow else ""
    return f"private swarm, key {access.key_path} (fingerprint {access.key.fingerprint}){allow}"


def cmd_join(args: argparse.Namespace) -> int:
    from diffuse.control.node_config import NodeConfig
    from diffuse.home import data_home
    from diffuse.peer.hooks import ServeConfig
    from diffuse.peer.join import JoinConfig, Peer

    boot = bootstrap_addrs(args, required=False)
    access = swarm_access(args)
    node = NodeConfig(listen=_listen(args), bootstrap=boot, heartbeat=args.heartbeat, ttl=args.ttl,
                      announce_addrs=args.announce, swarm_key=access.key, allow=access.allow,
                      mdns=use_mdns(args, boot), relay=args.relay, hole_punch=args.hole_punch, upnp=args.upnp)
    serve = ServeConfig(dtype=args.dtype, device=args.device, throughput=args.throughput,
                        cache_tokens=args.cache_tokens, max_session_tokens=args.max_session_tokens,
                        session_timeout=args.session_timeout, contribution=args.contribution,
                        client_only=args.client_only, tamper=args.tamper, tamper_rate=args.tamper_rate,
                        drain_timeout=args.drain_timeout)
    models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip())
    config = JoinConfig(home=data_home(args.home), node=node, model=args.model, models=models, replan=args.replan,
                        blocks=args.blocks, num_blocks=args.num_blocks, max_memory=args.max_memory, serve=serve,
                        metrics=args.metrics)
    peer = Peer(_key_pair(args, hold=True), config, show=lambda text: print(text, flush=True),
                say=lambda text: print(text, file=sys.stderr, flush=True))
    from diffuse.client.draft_trainer import background

    with background(config.home, peer.model_dir, peer.busy, args.train_draft):
        trio_run(until_signal, peer.run, peer.drain)
    print("stopped; announcement withdrawn", file=sys.stderr, flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from diffuse.client.survey import manifests, survey
    from diffuse.client.swarm_backend import SwarmConfig
    from diffuse.control.coverage import format_text
    from diffuse.home import data_home

    boot = bootstrap_addrs(args, required=False)
    access = swarm_access(args)
    swarm = SwarmConfig(tuple(boot), access, mdns=use_mdns(args, boot), hole_punch=args.hole_punch, wait=args.wait)
    found = trio_run(survey, swarm, manifests(data_home(args.home), args.model), args.reach)
    if args.json:
        print(json.dumps({"time": time.time(), "mode": access.mode, "models": [c.to_dict() for c in found.coverages]}
                         | ({"lan_peers": found.lan} if swarm.mdns else {}), indent=1))
    else:
        lan = [f"found on the LAN by mDNS: {len(found.lan)} node(s) of this swarm"] if swarm.mdns else []
        print("\n\n".join([_describe(access), *lan, *(format_text(c) for c in found.coverages)]))
    return 0


# ---- helpers ----

def _tamper_arg(text: str) -> tuple[str, float]:
    """--tamper's value (argparse calls this only when the option is given)."""
    from diffuse.trust.tamper import parse_spec

    try:
        return parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _key_pair(args: argparse.Namespace, hold: bool = False):
    """The node's key; hold=True keeps its file locked for the life of the process, so a second
    node cannot run with the same identity."""
    from diffuse.control.identity import default_identity_path, load_or_create, lock

    path = args.identity or default_identity_path(args.home)
    key_pair = load_or_create(path)
    if hold:
        _held.append(lock(path))
    return key_pair


_held: list = []  # identity locks held until exit


def _listen(args: argparse.Namespace) -> list[str]:
    from diffuse.control.host import parse_multiaddr

    addrs = args.listen or [args.listen_default]
    for a in addrs:
        parse_multiaddr(a)
    return addrs
