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
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from diffuse.cli.reach import (
    add_discovery_options, add_hole_punch_option, add_relay_options, add_upnp_option, client_listen, use_mdns,
)
import diffuse.cli.draft_trainer as draft_trainer
from diffuse.cli.swarm import add_swarm_options, swarm_access
from diffuse.control.modes import SwarmAccess
from diffuse.data.serve import LEVELS, Contribution
from diffuse.errors import DiffuseError
from diffuse.trust import reputation

log = logging.getLogger("diffuse.net")

DEFAULT_SENTINEL_LISTEN = "/ip4/0.0.0.0/tcp/31330"
DEFAULT_PEER_LISTEN = "/ip4/0.0.0.0/tcp/0"
MDNS_WAIT_S = 5.0  # status with no bootstrap: how long the LAN gets to answer


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

    p = subparsers.add_parser("join", parents=parents, help="serve blocks of a model and announce them")
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
    p.add_argument("--replan", type=_positive, metavar="SECONDS",
                   help="with --model auto: how often to look whether the swarm needs this peer elsewhere "
                        "(default: 4 heartbeats)")
    p.add_argument("--blocks", default="auto", help="A:B serves blocks A..B-1; auto (default) picks "
                   "the least-served span that fits --num-blocks / --max-memory")
    p.add_argument("--num-blocks", type=int, help="with --blocks auto: how many blocks to serve")
    p.add_argument("--max-memory", help="with --blocks auto: weight memory budget, e.g. 800MiB, 2GB")
    p.add_argument("--throughput", type=_positive,
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
    draft_trainer.add_option(p)
    p.set_defaults(func=cmd_join)

    p = subparsers.add_parser("status", parents=parents, help="which peers serve which blocks, per model")
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

    key_pair = _key_pair(args, hold=True)
    boot = _bootstrap_addrs(args, required=False)
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
                               access.allow, args.relay, bool(args.mdns), started=_count_records)

    _trio_run(_until_signal, sentinel)
    return 0


def _count_records(node) -> None:
    """/metrics reports what the node's DHT store holds."""
    from diffuse.metrics import DHT_RECORDS

    DHT_RECORDS.set_function(node.stored_records)


def _describe(access: SwarmAccess) -> str:
    """One line on how a node joined: "private swarm, key FILE (fingerprint F)" or "public swarm"."""
    if access.key is None:
        return "public swarm"
    allow = f", serving allowed to the peers in {access.allow.path}" if access.allow else ""
    return f"private swarm, key {access.key_path} (fingerprint {access.key.fingerprint}){allow}"


def cmd_join(args: argparse.Namespace) -> int:
    from diffuse.control.announce import Serving
    from diffuse.control.coverage import coverage
    from diffuse.control.identity import peer_id as peer_id_of
    from diffuse.control.node import Node, NodeConfig
    from diffuse.control.ladder import Hosting, Offer
    from diffuse.control.placement import choose_span, requested_blocks
    from diffuse.data.serve import contribution
    from diffuse.home import data_home
    from diffuse.model import store
    from diffuse.model.config import ModelConfig
    from diffuse.model.weights import load_manifest

    key_pair = _key_pair(args, hold=True)
    boot = _bootstrap_addrs(args, required=False)
    mdns = use_mdns(args, boot)
    auto = (args.model or "").lower() == "auto"
    if not auto and (args.models or args.replan):
        raise DiffuseError("--models and --replan only apply with --model auto")
    offers, dirs, budget = _offers(args) if auto else ([], {}, 0)
    model_dir = dirs[offers[0].model] if auto else store.resolve(data_home(args.home), args.model)
    manifest = load_manifest(model_dir)
    n = manifest.num_layers
    span, length = None, 0
    if not auto:
        span, length = requested_blocks(args.blocks, args.num_blocks, args.max_memory, ModelConfig.load(model_dir),
                                        manifest.dtype)
    access = swarm_access(args)
    me = peer_id_of(key_pair).to_base58()
    if access.allow is not None and me not in access.allow:
        log.warning("this peer (%s) is not on the allow-list %s: the swarm will not store its record or route "
                    "through it until it is", me, access.allow.path)
    cores = len(os.sched_getaffinity(0))  # the CPUs this process may run on (taskset, a container's share)
    lend = None if args.client_only else contribution(args.contribution, args.cache_tokens, cores)
    if args.metrics:
        from diffuse.http import parse_listen

        parse_listen(args.metrics)
    if lend is not None:
        import torch

        torch.set_num_threads(lend.threads)
    hooks = data_plane_hooks(args, model_dir, manifest, lend)
    held = dirs or {manifest.model_id: model_dir}
    files = DraftHeads(data_home(args.home), held) if lend else None
    if args.drain_timeout < 0:
        raise DiffuseError("--drain-timeout must be at least 0")
    node: Node | None = None

    async def drain() -> None:
        """Leave gracefully: withdraw first (no new client picks us), then let sessions finish."""
        if node is None or node.announcer is None or hooks.drain is None:
            return
        with trio.move_on_after(5.0):
            await node.withdraw()
        print(f"draining: announcement withdrawn, {hooks.status_fn().get('sessions', 0)} sessions open "
              f"(up to {args.drain_timeout:g} s; signal again to stop now)", file=sys.stderr, flush=True)
        handed = await hooks.drain(args.drain_timeout)
        if handed:
            print(f"handed {handed} sessions to replicas", file=sys.stderr, flush=True)

    async def main() -> None:
        nonlocal node
        config = NodeConfig(listen=_listen(args), bootstrap=boot, heartbeat=args.heartbeat, ttl=args.ttl,
                            announce_addrs=args.announce, swarm_key=access.key, allow=access.allow, mdns=mdns,
                            relay=args.relay, hole_punch=args.hole_punch, upnp=args.upnp and lend is not None)
        node = Node(key_pair, config, handlers=hooks.handlers | (files.handlers if files else {}),
                    status_fn=_placed(hooks.status_fn) if auto else hooks.status_fn,
                    codecs=reputation.swarm_codecs())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            _count_records(node)
            print(f"reachability: {node.reach.describe()}", file=sys.stderr, flush=True)
            if args.metrics:
                from diffuse.metrics import serve_metrics

                urls = await nursery.start(serve_metrics, args.metrics)
                print(f"metrics at {urls[0]}/metrics", file=sys.stderr, flush=True)
            if lend is None:
                for a in node.full_addrs():
                    print(a, flush=True)
                why = "contribution pause" if args.contribution == "pause" else "client-only"
                print(f"joined without serving (--{why})",
                      flush=True)
                return
            printed: list[str] = []

            async def serve(offer: Offer, start: int, end: int) -> None:
                throughput = args.throughput
                if hooks.prepare is not None:
                    hooks.use(dirs.get(offer.model, model_dir), offer.model)
                    throughput = await hooks.prepare(start, end) or throughput
                await node.serve(Serving(
                    model=offer.model, num_blocks=offer.num_blocks, start=start, end=end,
                    block_hashes=offer.block_hashes[start:end], dtype=args.dtype,
                    throughput=throughput, cache_tokens=lend.cache_tokens,
                    protocols=hooks.protocols + ((files.protocol,) if files and offer.model in files.heads else ()),
                    extra=files.heads.get(offer.model, {}) if files else {}))  # its draft head (client/draft_fetch.py)
                if not printed:
                    printed.extend(node.full_addrs())
                    print("\n".join(printed), flush=True)
                print(f"serving {offer.model} blocks {start}:{end} ({end - start} of {offer.num_blocks})", flush=True)

            if files is not None:
                nursery.start_soon(files.watch, node)
            if auto:
                async def leave() -> None:
                    with trio.move_on_after(5.0):
                        await node.withdraw()
                    if hooks.drain is not None:
                        await hooks.drain(args.drain_timeout)

                hosting = Hosting(node, offers, budget, serve, leave, args.replan or 4 * args.heartbeat,
                                  lambda line: print(line, file=sys.stderr, flush=True))
                await nursery.start(hosting.run)
                return
            start, end = span or choose_span(
                coverage(await node.records(manifest.model_id), manifest.model_id, n,
                         expected_hashes=manifest.block_hashes).replicas, length)
            await serve(Offer(manifest.model_id, n, 0, 0, tuple(manifest.block_hashes)), start, end)

    with draft_trainer.background(args, model_dir, lambda: bool((hooks.status_fn or dict)().get("sessions"))):
        _trio_run(_until_signal, main, drain)
    print("stopped; announcement withdrawn", file=sys.stderr, flush=True)
    return 0


def _placed(status_fn: Callable[[], Mapping[str, Any]] | None) -> Callable[[], Mapping[str, Any]]:
    """The data plane's status, and that this peer places itself (its record's ext["placement"]):
    other auto peers take turns with it to fill a gap (control/ladder.py)."""
    from diffuse.control.ladder import AUTO

    return lambda: {**(status_fn() if status_fn else {}), "placement": AUTO}


def _offers(args: argparse.Namespace) -> tuple[list, dict[str, Path], int]:
    """`join --model auto`: the models it may host (--models, else the store's), their
    directories, and the weight budget (--max-memory, else half the memory available now)."""
    from diffuse.control.ladder import Offer, choose
    from diffuse.control.placement import DTYPE_BYTES, available_memory, block_bytes, parse_size
    from diffuse.home import data_home, models_dir
    from diffuse.model import store

    if args.blocks.strip().lower() != "auto" or args.num_blocks is not None:
        raise DiffuseError("--model auto chooses the blocks too: give --blocks auto (the default) and, to bound "
                           "it, --max-memory rather than --num-blocks")
    home = data_home(args.home)
    models = store.list_models(home)
    if args.models:
        wanted = [m.strip() for m in args.models.split(",") if m.strip()]
        known = {m.name: m for m in models} | {m.manifest.model_id: m for m in models}
        missing = [w for w in wanted if w not in known]
        if missing:
            raise DiffuseError(f"--models names {', '.join(missing)}, not in the store {models_dir(home)} "
                               f"(it holds {', '.join(m.name for m in models) or 'nothing'})")
        models = list({known[w].name: known[w] for w in wanted}.values())
    if not models:
        raise DiffuseError(f"--model auto: the store {models_dir(home)} holds no model (`diffuse model pull`)")
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    # The ladder ranks models by all their weights (embeddings too: they are what "a larger model" means),
    # as they would be in the serving dtype.
    offers = [Offer(m.manifest.model_id, m.config.num_layers, block_bytes(m.config, dtype),
                    m.size_bytes * DTYPE_BYTES[dtype] // DTYPE_BYTES.get(m.manifest.dtype, 4),
                    tuple(m.manifest.block_hashes))
              for m in models]
    budget = parse_size(args.max_memory) if args.max_memory else available_memory() // 2
    choose(offers, {o.model: [0.0] * o.num_blocks for o in offers}, budget)  # refuses a budget that holds nothing
    return offers, {m.manifest.model_id: m.path for m in models}, budget


def cmd_status(args: argparse.Namespace) -> int:
    from diffuse.control.identity import ephemeral

    from diffuse.control.coverage import format_text
    from diffuse.control.node import NodeConfig, open_node
    from diffuse.home import data_home
    from diffuse.model import store
    from diffuse.model.weights import load_manifest

    boot = _bootstrap_addrs(args, required=False)
    mdns = use_mdns(args, boot)
    access = swarm_access(args)
    home = data_home(args.home)
    if args.model:
        manifests = [load_manifest(store.resolve(home, name)) for name in args.model]
    else:  # every model in the store (the swarm's other models have no manifest to judge them by)
        manifests = [m.manifest for m in store.list_models(home)] or [load_manifest(store.resolve(home, None))]
    result: list = []
    lan: list[str] = []

    async def main() -> None:
        # An ephemeral identity: a status query must never impersonate a running peer.
        config = NodeConfig(listen=client_listen(args), bootstrap=boot, server=False, swarm_key=access.key,
                            allow=access.allow, mdns=mdns, hole_punch=args.hole_punch)
        async with open_node(ephemeral(), config, codecs=reputation.swarm_codecs()) as node:
            if mdns and not boot:  # the swarm is whoever answers on the LAN: give them a moment
                with trio.move_on_after(max(args.wait, MDNS_WAIT_S)):
                    while not node.lan_peers:
                        await trio.sleep(0.1)
            deadline = trio.current_time() + max(0.0, args.wait)
            while True:
                covs = [await node.coverage(m.model_id, m.num_layers, m.block_hashes) for m in manifests]
                if all(c.servable for c in covs) or trio.current_time() >= deadline:
                    break
                await trio.sleep(0.5)
            reached = await node.reach_peers([r for c in covs for r in c.peers.values()]) if args.reach else {}
            result.extend([replace(c, evidence=await _evidence(node, c.peers), reached=reached) for c in covs])
            lan.extend(node.lan_peers)

    _trio_run(main)
    if args.json:
        print(json.dumps({"time": time.time(), "mode": access.mode, "models": [c.to_dict() for c in result]}
                         | ({"lan_peers": lan} if mdns else {}), indent=1))
    else:
        found = [f"found on the LAN by mDNS: {len(lan)} node(s) of this swarm"] if mdns else []
        print("\n\n".join([_describe(access), *found, *(format_text(c) for c in result)]))
    return 0


async def _evidence(node, peers) -> dict[str, list[dict]]:
    """Verified evidence published against each peer, summarised for people and --json."""
    found: dict[str, list[dict]] = {}

    async def one(pid: str) -> None:
        with trio.move_on_after(5.0):
            reports = await reputation.reports(node, pid)
            if reports:
                found[pid] = [{"reporter": e.evidence.reporter, "kind": e.evidence.kind, "start": e.evidence.start,
                               "end": e.evidence.end, "dtype": e.evidence.dtype, "statistic": e.evidence.statistic,
                               "threshold": e.evidence.threshold, "time": e.evidence.timestamp,
                               "detail": dict(e.evidence.detail)} for e in reports]

    async with trio.open_nursery() as nursery:
        for pid in peers:
            nursery.start_soon(one, pid)
    return dict(sorted(found.items()))


# ---- the data plane's plug ----

@dataclass
class ServeHooks:
    """What the data plane adds to `join`: stream handlers (registered before the host listens),
    a status callback read at every heartbeat ({"cache_tokens": .., "throughput": .., ...}), the
    protocols it serves, and `prepare(start, end)`, awaited once the span is chosen and before it
    is announced (load and verify the blocks; return measured tokens/s or None)."""

    handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = field(default_factory=dict)
    status_fn: Callable[[], Mapping[str, Any]] | None = None
    protocols: tuple[str, ...] = ()
    prepare: Callable[[int, int], Awaitable[float | None]] | None = None
    drain: Callable[[float], Awaitable[int]] | None = None
    use: Callable[[Path, str], None] = lambda model_dir, model_id: None  # serve this model from the next prepare


def data_plane_hooks(args: argparse.Namespace, model_dir: Path, manifest: Any, lend: Contribution | None) -> ServeHooks:
    """The inference service: blocks are loaded (and checked against the manifest) once the span
    is chosen, measured, and served on /diffuse/inference/1.0.0."""
    from diffuse.data.serve import PeerService
    from diffuse.data.server import ServerLimits
    from diffuse.model.load import parse_dtype

    limits = ServerLimits(max_session_tokens=args.max_session_tokens,
                          max_total_tokens=lend.cache_tokens if lend else args.cache_tokens,
                          idle_timeout=args.session_timeout, max_sessions=lend.max_sessions if lend else 0)
    wrap = None
    if args.tamper is not None:
        from diffuse.trust.tamper import Tamper  # the test double loads only with --tamper

        kind, strength = args.tamper
        wrap = Tamper(kind, strength, args.tamper_rate).wrap
        log.warning("TESTING ONLY: this peer tampers with %s of its outputs (%s, strength %g)",
                    f"{args.tamper_rate:.0%}", kind, strength)
    service = PeerService(model_dir, manifest.model_id, parse_dtype(args.dtype), args.device, limits, wrap,
                          args.throughput)
    handle = service.handle
    if args.metrics:
        from diffuse.metrics import watch_peer

        handle = watch_peer(lambda: service.model_id, lambda: service.server.status() if service.server else {},
                            handle)
    return ServeHooks(handlers={p: handle for p in service.protocols}, status_fn=service.status,
                      protocols=service.protocols, prepare=service.prepare, drain=service.drain, use=service.use)


class DraftHeads:
    """The files protocol serving this peer's draft heads (client/draft_fetch.py), and per model id
    the record fields announcing its head (`heads`; none: nothing to offer for it yet). Its handler
    is always set (handlers go on before the host runs), so that a head trained after the start
    (in the background, cli/draft_trainer.py) is served and announced without a restart."""

    def __init__(self, home: Path, models: Mapping[str, Path]) -> None:
        from diffuse.client import draft_fetch
        from diffuse.data.files import PROTOCOL_ID, FileServer

        self.home, self.models = home, models
        self.server, self.protocol = FileServer(), PROTOCOL_ID
        self.handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = {PROTOCOL_ID: self.server.serve}
        self.heads = draft_fetch.offer(self.server, home, models)

    async def watch(self, node: Any, every: float = 15.0) -> None:
        """Every `every` seconds, offer a head that appeared for the model being served, and
        amend the announcement to say so."""
        from diffuse.client import draft_fetch

        while True:
            await trio.sleep(every)
            serving = node.announcer.serving if node.announcer is not None else None
            if serving is None or serving.model in self.heads or serving.model not in self.models:
                continue
            found = draft_fetch.offer(self.server, self.home, {serving.model: self.models[serving.model]})
            if found:
                self.heads.update(found)
                node.amend(protocols=tuple(serving.protocols) + (self.protocol,),
                           extra=dict(serving.extra) | found[serving.model])
                print(f"offering the draft head of {serving.model} trained since the start", file=sys.stderr,
                      flush=True)


# ---- helpers ----

def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


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


def _bootstrap_addrs(args: argparse.Namespace, required: bool) -> list[str]:
    """--bootstrap values plus the lines of --bootstrap-file, validated now (exit 2 if bad)."""
    from diffuse.control.host import parse_peer_addr

    addrs = list(args.bootstrap)
    if args.bootstrap_file is not None:
        try:
            text = args.bootstrap_file.read_text()
        except OSError as e:
            raise DiffuseError(f"cannot read {args.bootstrap_file}: {e.strerror or e}") from None
        addrs += [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        addrs = [a for a in addrs if a]
    if required and not addrs:
        raise DiffuseError("no bootstrap peer: give --bootstrap ADDR (a sentinel's full multiaddr)")
    for a in addrs:
        parse_peer_addr(a)
    return addrs


async def _until_signal(body: Callable[[], Awaitable[None]],
                        leave: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run `body`, then keep running until SIGINT/SIGTERM; then `leave()` (a peer drains its
    sessions), unless a second signal comes first. Cancellation unwinds every node, whose `run`
    withdraws its announcement on the way out."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async def leave_then_stop() -> None:
                if leave is not None:
                    await leave()
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                leaving = False
                async for _ in signals:
                    if leave is None or leaving:
                        nursery.cancel_scope.cancel()
                        return
                    leaving = True
                    nursery.start_soon(leave_then_stop)

            nursery.start_soon(watch)
            await body()


def _trio_run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """trio.run, with a DiffuseError buried in exception groups re-raised bare (so `main` prints
    `error: ...`), and Ctrl-C before the signal handler is installed exiting quietly."""
    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as eg:
        match, _ = eg.split(DiffuseError)
        if match is not None:
            raise _first_leaf(match) from None
        raise


def _first_leaf(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup):
        eg = eg.exceptions[0]
    return eg
