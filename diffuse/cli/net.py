"""`diffuse id | sentinel | join | status`: the control plane on the command line, each in the
swarm --mode says (private by default: cli/swarm.py). A user's mistake is a DiffuseError: `main`
prints `error: ...` and exits 2."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

from diffuse.cli.ask import swarm_of
from diffuse.cli.common import (add_bootstrap_options, add_compute_options, add_train_draft_option, bootstrap_addrs,
                                from_args, positive, trio_run)
from diffuse.cli.reach import add_discovery_options, add_hole_punch_option, add_relay_options, add_upnp_option
from diffuse.cli.swarm import add_swarm_options, swarm_access
from diffuse.data.levels import AUTO, LEVELS, AutoLimits, parse_limits
from diffuse.home import data_home


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("id", help="print this node's peer id (creates its key)")
    _identity_arg(p)
    p.set_defaults(func=cmd_id)
    p = subparsers.add_parser("sentinel", help="run a DHT bootstrap node that serves no blocks")
    _node_args(p, listen_default="/ip4/0.0.0.0/tcp/31330")
    add_relay_options(p, default=True)
    p.add_argument("--model-hash", action="append", default=[], metavar="MODEL=SHA256", help="the manifest (or "
                   "model) hash this private swarm's nodes trust when they fetch MODEL from peers (repeatable)")
    p.set_defaults(func=cmd_sentinel)
    register_join(subparsers.add_parser("join", help="serve blocks of a model and announce them"))
    _register_status(subparsers.add_parser("status", help="which peers serve which blocks, per model"))


def register_join(p: argparse.ArgumentParser) -> None:
    _node_args(p, listen_default="/ip4/0.0.0.0/tcp/0")
    add_relay_options(p, default=False)
    add_hole_punch_option(p)
    add_upnp_option(p)
    p.add_argument("--model", help="model in the store (default: the embedded one); auto: the one the swarm needs most")
    p.add_argument("--models", metavar="A,B", help="with --model auto: the models it may choose (default: the store)")
    p.add_argument("--replan", type=positive, metavar="SECONDS", help="with --model auto: how often to look again "
                   "where the swarm needs this peer (default: 4 heartbeats)")
    p.add_argument("--blocks", default="auto", help="A:B serves blocks A..B-1; auto (default): the least-served "
                   "span that fits --num-blocks / --max-memory")
    p.add_argument("--num-blocks", type=int, help="with --blocks auto: how many blocks to serve")
    p.add_argument("--from-swarm", action="store_true", help="first fetch what the store lacks from peers, by hash")
    p.add_argument("--model-hash", metavar="SHA256", help="with --from-swarm: the manifest (or model) hash to trust")
    p.add_argument("--json", dest="json_progress", action="store_true", help="with --from-swarm: JSON progress lines")
    p.add_argument("--max-memory", help="with --blocks auto: weight memory budget, e.g. 800MiB, 2GB")
    p.add_argument("--throughput", type=positive, help="tokens/s to announce (default: measured once loaded)")
    p.add_argument("--cache-tokens", type=int, default=65536, help="KV-cache tokens lent to all sessions together")
    p.add_argument("--max-session-tokens", type=int, default=8192, help="KV-cache tokens one session may hold")
    p.add_argument("--session-timeout", type=float, default=300.0, help="idle seconds before a session is freed")
    add_compute_options(p)
    p.add_argument("--tamper", metavar="KIND[:STRENGTH]", type=_tamper_arg, help="TESTING ONLY: serve corrupted "
                   "outputs to exercise the trust plane (trust/tamper.py; an unknown KIND lists the kinds)")
    p.add_argument("--tamper-rate", type=float, default=1.0, metavar="P",
                   help="TESTING ONLY: fraction of requests --tamper corrupts (default 1)")
    p.add_argument("--tamper-after", type=int, default=0, metavar="N", help="TESTING ONLY: spare steps that start < N")
    p.add_argument("--contribution", default="max", choices=[*LEVELS, AUTO], help="how much of this machine to "
                   "lend: max (all cores, 64 sessions, --cache-tokens), moderate (half), min (1 thread, 8 sessions, "
                   "1/8 of the cache), pause (serve nothing), auto (max while the machine is otherwise idle)")
    p.add_argument("--auto-limits", dest="auto", type=parse_limits, default=AutoLimits(), metavar="K=V,..", help=(
        "with auto: cpu=25,memory=10,gpu=25 (%% others use) busy=60,idle=180 (s before pausing / returning)"))
    p.add_argument("--client-only", action="store_true", default=argparse.SUPPRESS,
                   help="stay in the swarm's DHT without serving blocks (as does --contribution pause)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS", help="on SIGINT/SIGTERM: seconds "
                   "open sessions get before they are handed to replicas (a second signal stops at once)")
    add_train_draft_option(p)
    p.set_defaults(func=cmd_join)


def _register_status(p: argparse.ArgumentParser) -> None:
    add_bootstrap_options(p)
    p.add_argument("--model", action="append", default=[], help="model in the store (repeatable; default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--accept-quant", metavar="LIST|any", help="variants counted (default: any held; named: made)")
    p.add_argument("--model-hash", action="append", default=[], metavar="MODEL=SHA256", help="the manifest to trust")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="poll until servable, up to SECONDS")
    p.add_argument("--reach", action=argparse.BooleanOptionalAction, default=True,
                   help="connect to each peer listed and say how it is reached: direct, relayed via a relay, "
                        "hole-punched or unreachable (default: on; --no-reach reads the records only)")
    add_swarm_options(p)
    add_discovery_options(p)
    add_hole_punch_option(p)
    p.add_argument("--no-daemon", action="store_true", help="read the swarm from this process even while a daemon runs")
    p.set_defaults(func=cmd_status)


def _identity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--identity", type=Path, metavar="KEYFILE",
                   help="Ed25519 key file (default: <home>/identity.key; created mode 0600 if absent)")


def _node_args(p: argparse.ArgumentParser, listen_default: str) -> None:
    _identity_arg(p)
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                   help=f"listen address (repeatable; default {listen_default})")
    p.set_defaults(listen_default=listen_default)
    p.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                   help="address to advertise instead of the listen addresses (repeatable)")
    add_bootstrap_options(p)
    p.add_argument("--heartbeat", type=float, default=15.0, metavar="SECONDS", help="re-announce period (default 15)")
    p.add_argument("--ttl", type=float, metavar="SECONDS", help="record lifetime (default 3 heartbeats)")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics")
    add_discovery_options(p)
    add_swarm_options(p)


def cmd_id(args: argparse.Namespace) -> int:
    from diffuse.control.identity import node_key, peer_id
    print(peer_id(node_key(args.identity, args.home)).to_base58())
    return 0


def cmd_sentinel(args: argparse.Namespace) -> int:
    boot = bootstrap_addrs(args, required=False)  # a bad address is said before any heavy import
    from diffuse.control.identity import node_key
    from diffuse.peer.sentinel import SentinelConfig, serve_sentinel
    from diffuse.peer.signals import until_signal
    key_pair = node_key(args.identity, args.home, hold=True)
    access = swarm_access(args, create=True)
    if access.created:
        _say(f"no swarm key given: made one for a new private swarm at {access.key_path}; every node that joins "
             "needs a copy (`diffuse swarm new --help` says how to share it), or run --mode public")
    config = from_args(SentinelConfig, args, access=access, listen=_listen(args), bootstrap=boot, mdns=bool(args.mdns))
    trio_run(until_signal, lambda: serve_sentinel(key_pair, config, lambda a: print(a, flush=True), _say))
    return 0


def make_peer(args: argparse.Namespace):  # -> peer.join.Peer
    boot = bootstrap_addrs(args, required=False)  # a bad address is said before torch is imported
    from diffuse.control.bootstrap import mdns_wanted
    from diffuse.control.identity import node_key
    from diffuse.control.node_config import NodeConfig
    from diffuse.peer.hooks import ServeConfig
    from diffuse.peer.join import JoinConfig, Peer

    access = swarm_access(args)
    node = from_args(NodeConfig, args, listen=_listen(args), bootstrap=boot, announce_addrs=args.announce,
                     swarm_key=access.key, allow=access.allow, mdns=mdns_wanted(args.mdns, boot))
    models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip())
    config = from_args(JoinConfig, args, home=data_home(args.home), node=node, models=models,
                       serve=from_args(ServeConfig, args))
    return Peer(node_key(args.identity, args.home, hold=True), config, lambda text: print(text, flush=True), _say)


def run_node(args: argparse.Namespace, peer, body=None) -> None:
    """Serve until a signal (a peer drains first), its draft head training in the background."""
    from diffuse.client.draft_trainer import background
    from diffuse.peer.signals import until_signal

    with background(peer.config.home, peer.model_dir, peer.busy, args.train_draft) if peer else nullcontext():
        trio_run(until_signal, body or peer.run, peer and peer.drain)


def cmd_join(args: argparse.Namespace) -> int:
    run_node(args, make_peer(args))
    _say("stopped; announcement withdrawn")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from diffuse.daemon.client import call, notice, survey_request

    found = None if args.no_daemon else call(data_home(args.home), survey_request(vars(args)), say=notice)
    if found is None:
        boot, access, mdns = swarm_of(args)  # a bad address is said before torch is imported
        from diffuse.client.survey import status
        from diffuse.client.swarm_backend import SwarmConfig

        swarm = SwarmConfig(tuple(boot), access, mdns=mdns, hole_punch=args.hole_punch, wait=args.wait)
        found = trio_run(status, data_home(args.home), args.model, swarm, args.reach, args.accept_quant,
                         args.model_hash)
    print(json.dumps(found["json"], indent=1) if args.json else found["text"])
    return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _tamper_arg(text: str) -> tuple[str, float]:  # argparse calls it only when --tamper is given
    from diffuse.trust.tamper import parse_spec
    try:
        return parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _listen(args: argparse.Namespace) -> list[str]:
    from diffuse.control.bootstrap import listen_list
    return listen_list(args.listen, args.listen_default)
