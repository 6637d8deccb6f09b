"""`diffuse join` as a library call: a peer that serves a span of a model's blocks to its swarm.

`Peer(key_pair, JoinConfig(...))` validates the request and prepares what it can before the
network (the model's manifest, the span asked for, what the machine lends, the data plane's
handlers); `run()` starts the node, picks the span (or, with model "auto", lets the ladder pick
model and span, re-planned as peers come and go), loads and announces it, and serves until
cancelled; `drain()` is the graceful way out: withdraw, then let open sessions finish.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from diffuse.client import from_swarm
from diffuse.control import receipts
from diffuse.control.announce import Serving
from diffuse.control.coverage import coverage
from diffuse.control.identity import KeyPair, peer_id
from diffuse.control.ladder import Hosting, Offer, choose
from diffuse.control.node import Node, NodeConfig
from diffuse.control.windows import with_estimates
from diffuse.control.placement import DTYPE_BYTES, available_memory, block_bytes, choose_span, parse_size, \
    requested_blocks
from diffuse.data.serve import contribution
from diffuse.errors import DiffuseError
from diffuse.home import models_dir
from diffuse.http import parse_listen
from diffuse.metrics import DHT_RECORDS, serve_metrics
from diffuse.model import store, variants
from diffuse.model.config import ModelConfig
from diffuse.model.weights import load_manifest
from diffuse.peer.heads import DraftHeads
from diffuse.data.levels import AUTO
from diffuse.peer.auto import Auto
from diffuse.peer.hooks import ServeConfig, ServeHooks, data_plane_hooks, placed
from diffuse.trust import reputation
from diffuse.trust.credits import Ledger

log = logging.getLogger(__name__)
Say = Callable[[str], None]


@dataclass(frozen=True)
class JoinConfig:
    """What `join` is asked: the store (`home`), the node (control/node.py), the model (a store
    name, None for the default, "auto" for the one the swarm needs most, among `models` if given,
    re-planned every `replan` s), the span (`blocks` "A:B" or "auto", bounded by `num_blocks` or
    `max_memory`), how it serves, and where it exports /metrics (HOST:PORT, or None)."""

    home: Path
    node: NodeConfig = field(default_factory=NodeConfig)
    model: str | None = None
    models: tuple[str, ...] = ()
    replan: float | None = None
    blocks: str = "auto"
    num_blocks: int | None = None
    max_memory: str | None = None
    serve: ServeConfig = field(default_factory=ServeConfig)
    metrics: str | None = None
    from_swarm: bool = False  # first fetch what the store lacks from the peers (client/from_swarm.py)
    model_hash: str | None = None  # with from_swarm: the manifest (or model) hash to trust
    json_progress: bool = False  # with from_swarm: its progress as JSON lines on stderr (from_swarm.Progress)


class Peer:
    """One `join`: `show` gets what goes to stdout (addresses, what it serves), `say` notices."""

    def __init__(self, key_pair: KeyPair, config: JoinConfig, show: Say, say: Say) -> None:
        config = fetched_first(config, say) if config.from_swarm else config
        self.key_pair, self.config, self.show, self.say = key_pair, config, show, say
        self.auto = (config.model or "").lower() == "auto"
        if not self.auto and (config.models or config.replan):
            raise DiffuseError("--models and --replan only apply with --model auto")
        if config.serve.drain_timeout < 0:
            raise DiffuseError("--drain-timeout must be at least 0")
        self.offers, self.dirs, self.budget = plan_offers(config) if self.auto else ([], {}, 0)
        self.model_dir = self.dirs[self.offers[0].model] if self.auto else store.resolve(config.home, config.model)
        if self.auto and config.serve.quant != "none":
            raise DiffuseError("--quant applies to a named model, not to --model auto")
        # What it announces: the variant's hashes under its source's id, and which variant it is.
        resolved = variants.resolve(self.model_dir, config.serve.quant, say)
        self.manifest = load_manifest(resolved)
        self.variant = {} if self.manifest.quant == "none" else {"quant": self.manifest.quant,
                                                                 "variant": self.manifest.model_hash}
        self.variant_dir = resolved if self.variant else None  # its manifest and blocks offered as files
        self.span, self.length = (None, 0) if self.auto else requested_blocks(
            config.blocks, config.num_blocks, config.max_memory, ModelConfig.load(self.model_dir),
            self.manifest.dtype, self.manifest.quant)
        allow, me = config.node.allow, peer_id(key_pair).to_base58()
        if allow is not None and me not in allow:
            log.warning("this peer (%s) is not on the allow-list %s: the swarm will not store its record or route "
                        "through it until it is", me, allow.path)
        cores = len(os.sched_getaffinity(0))  # the CPUs this process may run on (taskset, a container's share)
        serve = config.serve
        level = "max" if serve.contribution == AUTO else serve.contribution  # auto lends all, or pauses
        self.lend = None if serve.client_only else contribution(level, serve.cache_tokens, cores)
        self.lending = Auto(serve.auto, config.home, self._pause, self._resume, say) \
            if self.lend and serve.contribution == AUTO else None
        if config.metrics:
            parse_listen(config.metrics)
        if self.lend is not None:
            import torch

            torch.set_num_threads(self.lend.threads)
        self.ledger = Ledger(config.home, me)  # credits earned and standing (trust/credits.py)
        self.hooks = ServeHooks() if serve.client_only else data_plane_hooks(
            serve, self.model_dir, self.manifest.model_id, self.lend, metered=bool(config.metrics), books=self.ledger)
        self.hooks.handlers[receipts.PROTOCOL] = receipts.handler(self.ledger.accept)
        self.files = DraftHeads(config.home, self.dirs or {self.manifest.model_id: self.model_dir}, say) \
            if self.lend else None
        self.node: Node | None = None
        self._printed = False
        self._held_serving: Serving | None = None  # loaded while paused: announced on resume

    def busy(self) -> bool:
        """Whether sessions are open now (a background draft-head training waits while they are)."""
        return bool((self.hooks.status_fn or dict)().get("sessions"))

    async def drain(self) -> None:
        """Leave gracefully: withdraw first (no new client picks us), then let sessions finish."""
        node, hooks = self.node, self.hooks
        if node is None or node.announcer is None or hooks.drain is None:
            return
        with trio.move_on_after(5.0):
            await node.withdraw()
        timeout = self.config.serve.drain_timeout
        self.say(f"draining: announcement withdrawn, {hooks.status_fn().get('sessions', 0)} sessions open "
                 f"(up to {timeout:g} s; signal again to stop now)")
        handed = await hooks.drain(timeout)
        if handed:
            self.say(f"handed {handed} sessions to replicas")

    async def _pause(self) -> None:
        """Contribution auto: the machine is in use; leave as on SIGTERM, but stay in the swarm."""
        assert self.node is not None and self.hooks.drain is not None
        with trio.move_on_after(5.0):
            await self.node.withdraw()
        handed = await self.hooks.drain(self.config.serve.drain_timeout)
        self.say(f"announcement withdrawn; handed {handed} sessions to replicas")

    async def _resume(self) -> None:
        """Take sessions again and announce what it holds: the span loaded while paused, else the
        one `_pause` withdrew (none if it paused before it announced anything)."""
        node = self.node
        assert node is not None
        held = self._held_serving
        self._held_serving = None
        self.hooks.resume()
        if held is None and node.announcer is not None and node.announcer.withdrawn:
            held = node.announcer.serving
        if held is not None:
            await node.serve(held)

    def _node(self) -> Node:
        hooks, files, client = self.hooks, self.files, self.config.serve.client_only
        # A client-only node is a DHT client that serves nothing: no handlers, no relay, no port mapping.
        config = dataclasses.replace(self.config.node, upnp=self.config.node.upnp and self.lend is not None,
                                     **({"server": False, "relay": False} if client else {}))
        handlers = {} if client else hooks.handlers | (files.handlers if files else {})
        return Node(self.key_pair, config, handlers=handlers,
                    status_fn=placed(hooks.status_fn) if self.auto else hooks.status_fn,
                    codecs=reputation.swarm_codecs())

    async def run(self) -> None:
        """Start the node, then serve (or, lending nothing, only take part in the DHT)."""
        node = self.node = self._node()
        self.hooks.use_host(node.host)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            nursery.start_soon(self.ledger.keep)  # the credit books, written off the event loop
            DHT_RECORDS.set_function(node.stored_records)  # /metrics: what its DHT store holds
            self.say(f"reachability: {node.reach.describe()}")
            if self.config.metrics:
                urls = await nursery.start(serve_metrics, self.config.metrics)
                self.say(f"metrics at {urls[0]}/metrics")
            if self.lend is None:
                self.show("\n".join(node.full_addrs()))
                why = "contribution pause" if self.config.serve.contribution == "pause" else "client-only"
                self.show(f"joined without serving (--{why})")
                return
            if self.files is not None:
                nursery.start_soon(self.files.watch, node)
            if self.lending is not None:
                nursery.start_soon(self.lending.run)
            if self.auto:
                hosting = Hosting(node, self.offers, self.budget, self._serve, self._leave,
                                  self.config.replan or 4 * self.config.node.heartbeat, self.say)
                await nursery.start(hosting.run)
                return
            manifest = self.manifest
            node.num_blocks[manifest.model_id] = manifest.num_layers  # which window keys hold the model
            start, end = self.span or choose_span(with_estimates(
                coverage(await node.records(manifest.model_id), manifest.model_id, manifest.num_layers,
                         expected_hashes=manifest.block_hashes, variants={manifest.quant: manifest.block_hashes}),
                node.samples.get(manifest.model_id, {})).counts, self.length)
            await self._serve(Offer(manifest.model_id, manifest.num_layers, 0, 0, tuple(manifest.block_hashes)),
                              start, end)

    async def _serve(self, offer: Offer, start: int, end: int) -> None:
        """Load blocks start:end of the offer's model, measure them, announce them."""
        node, hooks, files, serve = self.node, self.hooks, self.files, self.config.serve
        assert node is not None and self.lend is not None
        throughput = serve.throughput
        if hooks.prepare is not None:
            hooks.use(self.dirs.get(offer.model, self.model_dir), offer.model)
            throughput = await hooks.prepare(start, end) or throughput
        serving = Serving(
            model=offer.model, num_blocks=offer.num_blocks, start=start, end=end,
            block_hashes=offer.block_hashes[start:end], dtype=serve.dtype,
            throughput=throughput, cache_tokens=self.lend.cache_tokens,
            protocols=hooks.protocols + ((files.protocol,) if files else ()),  # its manifest, its draft head
            extra=(files.heads.get(offer.model, {}) | files.manifest(offer.model, (start, end), self.variant_dir)
                   if files else {}) | self.variant)
        if self.lending is not None and self.lending.paused:  # contribution auto paused: hold it until resume
            if hooks.drain is not None:
                await hooks.drain(0)  # the fresh server refuses sessions too
            self._held_serving = serving
            self.say(f"loaded {offer.model} blocks {start}:{end}; announced once contribution auto returns")
            return
        await node.serve(serving)
        if not self._printed:
            self._printed = True
            self.show("\n".join(node.full_addrs()))
        self.show(f"serving {offer.model} blocks {start}:{end} ({end - start} of {offer.num_blocks})")

    async def _leave(self) -> None:
        """The ladder moves this peer: withdraw, then drain, before it loads another span."""
        assert self.node is not None
        with trio.move_on_after(5.0):
            await self.node.withdraw()
        if self.hooks.drain is not None:
            await self.hooks.drain(self.config.serve.drain_timeout)


def fetched_first(config: JoinConfig, say: Say) -> JoinConfig:
    """`--from-swarm`: fetch what the store lacks (client/from_swarm.py; with --quant, the span's
    blocks of that variant, as its peers store them); then the join as if the store had held the
    model all along: named, with its span."""
    want = from_swarm.Wanted(config.model, config.blocks, num_blocks=config.num_blocks, max_memory=config.max_memory,
                             model_hash=config.model_hash, json_progress=config.json_progress,
                             quant=config.serve.quant)
    return dataclasses.replace(config, from_swarm=False, **from_swarm.for_join(config.home, config.node, want, say))


def plan_offers(config: JoinConfig) -> tuple[list[Offer], dict[str, Path], int]:
    """`--model auto`: the models it may host (`models`, else the store's), their directories, and
    the weight budget (`max_memory`, else half the memory available now)."""
    if config.blocks.strip().lower() != "auto" or config.num_blocks is not None:
        raise DiffuseError("--model auto chooses the blocks too: give --blocks auto (the default) and, to bound "
                           "it, --max-memory rather than --num-blocks")
    home = config.home
    models = store.list_models(home)
    if config.models:
        known = {m.name: m for m in models} | {m.manifest.model_id: m for m in models}
        missing = [w for w in config.models if w not in known]
        if missing:
            raise DiffuseError(f"--models names {', '.join(missing)}, not in the store {models_dir(home)} "
                               f"(it holds {', '.join(m.name for m in models) or 'nothing'})")
        models = list({known[w].name: known[w] for w in config.models}.values())
    if not models:
        raise DiffuseError(f"--model auto: the store {models_dir(home)} holds no model (`diffuse model pull`)")
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[config.serve.dtype]
    # The ladder ranks models by all their weights (embeddings too: they are what "a larger model" means),
    # as they would be in the serving dtype.
    offers = [Offer(m.manifest.model_id, m.config.num_layers, block_bytes(m.config, dtype),
                    m.size_bytes * DTYPE_BYTES[dtype] // DTYPE_BYTES.get(m.manifest.dtype, 4),
                    tuple(m.manifest.block_hashes))
              for m in models]
    budget = parse_size(config.max_memory) if config.max_memory else available_memory() // 2
    choose(offers, {o.model: [0.0] * o.num_blocks for o in offers}, budget)  # refuses a budget that holds nothing
    return offers, {m.manifest.model_id: m.path for m in models}, budget
