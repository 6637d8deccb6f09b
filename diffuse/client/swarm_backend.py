"""The swarm backend: every answer is an inference session of its own through the swarm.

One libp2p node (a DHT client with an ephemeral identity: nothing links two of a user's runs;
with `credit`, the member's serving identity, paying peers with receipts: client/credit.py) and
one `SwarmClient` per model offered, plus one made when first needed for each model that may
answer in an offered one's place. This process holds what a swarm client holds (tokenizer,
embeddings, head, its local blocks), so token ids never leave it. Coverage is read from the DHT
on every call (concurrent requests share one read, control/reads.py): the status page and
/v1/models show the swarm as it is, not as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from diffuse.client import draft_head
from diffuse.client.accept import accepted_hashes, explain
from diffuse.client.backend import LOCAL_PEER, Overloaded, UnknownModel, Unservable
from diffuse.client.credit import Payer
from diffuse.client.draft_fetch import drop_fetched, obtain_draft_head
from diffuse.client.draft_head import DraftHead
from diffuse.client.pipeline import Pipeline
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.client.swarm import RECORDS_TTL_S, SwarmBusy, SwarmClient, SwarmOptions, remotes_of, route_report
from diffuse.control.coverage import coverage
from diffuse.control.records import PeerRecord
from diffuse.control.routing import Hop, NoRoute
from diffuse.control.modes import SwarmAccess
from diffuse.control.node import open_node
from diffuse.control.node_config import NodeConfig
from diffuse.errors import DiffuseError, ModelError
from diffuse.metrics import DHT_RECORDS, FAILOVERS, MeteredStream
from diffuse.model.tokenizer import Tokenizer
from diffuse.trust import reputation
from diffuse.trust.guard import TrustOptions

log = logging.getLogger(__name__)
WARM_RETRY_S = 5.0  # start-up trust warm-up: how often to look again for a route while there is none


class _MeteredClient(SwarmClient):
    """A SwarmClient whose streams count their bytes for /metrics."""

    async def dial(self, hop: Hop):
        return MeteredStream(await super().dial(hop))


class _Session(Pipeline):
    """A swarm session that reports its failovers to /metrics when it closes, and pays its peers
    (in the background) when the client gives credit."""

    def __init__(self, pipeline: Pipeline, model: str, payer: Payer | None = None):
        super().__init__(pipeline.head, pipeline.stages, pipeline.exact, pipeline.logits, pipeline.behind)
        self.model, self.payer = model, payer

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            FAILOVERS.labels(self.model).inc(sum(len(r.stats.failovers) for r in remotes_of(self)))
            if self.payer is not None:
                self.payer.pay(self, self.model)


class SwarmBackend:
    """The Backend protocol over the swarm, for the models whose client side is in the store."""

    def __init__(self, clients: list[SwarmClient], speculate: bool = True,
                 drafts: dict[str, DraftHead] | None = None, home: Path | None = None,
                 spares: dict[str, str] | None = None, say: Callable[[str], None] = log.warning,
                 payer: Payer | None = None):
        self.clients = {c.model_id: c for c in clients}  # the models offered, then spares as they are used
        self.offered = list(self.clients)
        self.spares = dict(spares or {})  # model id -> store name: models that may answer in an offered one's place
        self.speculate = speculate  # answers speculate: the planner keeps a step plain where guessing does not pay
        self.drafts = drafts or {}  # per model: the draft head its speculation drafts with
        self.home = home  # the store, where a fetched draft head that guesses poorly is dropped from
        self.say = say  # notices for the user (a dropped draft head)
        self.judged: dict[str, SpecState] = {}  # per model: its draft head's first guesses over all answers
        self.seen: dict[str, int] = {}  # per model: the version of its head file last tried
        self.asked_peers: set[str] = set()  # spares whose draft head was looked for in the swarm
        self.tokenizers = {c.model_id: Tokenizer.load(c.model_dir) for c in clients}
        self.started = time.time()
        self.trust: dict[str, dict[str, Any]] = {}  # per model: the start-up trust warm-up, for status
        self.payer = payer  # signs and delivers receipts after each session (--credit), else None

    def _client(self, model_id: str) -> SwarmClient:
        if model_id not in self.clients and model_id in self.spares and self.home is not None:
            from diffuse.model import store

            first = next(iter(self.clients.values()))
            client = _MeteredClient(first.node, store.resolve(self.home, self.spares[model_id]), first.opts)
            self.clients[model_id] = client
            self.tokenizers[model_id] = Tokenizer.load(client.model_dir)
        if model_id not in self.clients:
            raise UnknownModel(model_id, self.offered)
        return self.clients[model_id]

    def tokenizer(self, model_id: str) -> Tokenizer:
        self._client(model_id)
        return self.tokenizers[model_id]

    async def covered(self, model_id: str) -> bool:
        """Whether the swarm covers every block the model needs from it (trusted records)."""
        return await self._client(model_id).covered()

    def context_length(self, model_id: str) -> int:
        return self._client(model_id).cfg.max_position_embeddings

    async def models(self) -> list[dict[str, Any]]:
        return [await self._coverage(self.clients[m]) for m in self.offered]

    async def _records(self, client: SwarmClient) -> list[PeerRecord]:
        """Online records (Node.records: one shared read, records kept to their expiry)."""
        return await client.node.records(client.model_id)

    async def _coverage(self, client: SwarmClient) -> dict[str, Any]:
        """The DHT's block map (trusted records only), with the blocks this API computes itself
        as the peer 'local', and each peer's standing with this client (banned, RTT)."""
        records = await self._records(client)
        known, failed = await accepted_hashes(records, client.accepted, client.variant_hashes)
        found = coverage(records, client.model_id, client.cfg.num_layers, expected_hashes=client.manifest.block_hashes,
                         variants=known)
        explain(found.excluded, records, failed)
        cov = found.to_dict()
        start, end = client.remote_range
        local = [b for b in range(cov["num_blocks"]) if not start <= b < end]
        for b in local:
            cov["blocks"][b]["peers"].append(LOCAL_PEER)
            cov["blocks"][b]["replicas"] += 1
        banned, now = client.bans.active(), time.monotonic()
        for p in cov["peers"]:
            rtt = client.rtt.get(p["peer_id"])
            p.update(banned=p["peer_id"] in banned,
                     rtt_ms=round(rtt[0] * 1e3, 2) if rtt and now - rtt[1] < 600 else None)
        runs = [(a, b) for a, b in ((0, start), (end, cov["num_blocks"])) if a < b]  # front and back blocks
        cov["peers"][:0] = [{"peer_id": LOCAL_PEER, "start": a, "end": b, "addrs": [], "throughput": 0.0,
                             "dtype": str(client.opts.dtype).removeprefix("torch."), "cache_tokens": 0,
                             "age_s": round(time.time() - self.started, 1), "last_heartbeat_s": 0.0,
                             "extra": {"runs": "in this API process"}} for a, b in runs]
        cov["missing"] = [b for b in range(start, end) if not cov["blocks"][b]["replicas"]]
        cov["servable"] = cov["num_blocks"] > 0 and not cov["missing"]
        cov["min_replicas"] = min((b["replicas"] for b in cov["blocks"]), default=0)
        if client.model_id in self.trust:
            cov["trust_warm_up"] = dict(self.trust[client.model_id])
        return cov

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        client = self._client(model_id)
        cov = await self._coverage(client)
        if not cov["servable"]:
            raise Unservable(model_id, cov["missing"])
        try:  # announced but no live replica: the client computes here or waits (client/swarm.py)
            return _Session(await client.session(max_len), model_id, self.payer)
        except SwarmBusy as e:
            raise Overloaded(f"the swarm cannot take another session right now ({e}); retry shortly", 5) from None

    async def speculation(self, model_id: str) -> SpecConfig | None:
        client = self._client(model_id)
        if not self.speculate:
            return None
        if model_id not in self.offered and model_id not in self.asked_peers and self.home is not None:
            self.asked_peers.add(model_id)  # a spare's first answer: its head from the store, else a peer's
            if (head := await _draft_head(client, self.home, self.say)) is not None:
                self.drafts[model_id] = head
        if model_id not in self.drafts and self.home is not None:
            self._pick_up(client)
        return SpecConfig(draft=self.drafts.get(model_id))

    def _pick_up(self, client: SwarmClient) -> None:
        """A head that appeared in the store since the start (trained in the background,
        client/draft_trainer.py): loaded once per version of the file."""
        file = draft_head.path(self.home, client.model_dir.name)
        try:
            version = file.stat().st_mtime_ns
        except OSError:
            return
        if self.seen.get(client.model_id) == version:
            return
        self.seen[client.model_id] = version
        try:
            head = draft_head.load(file, client.cfg.hidden_size, client.cfg.vocab_size)
        except ModelError as e:
            log.warning("%s", e)
            return
        if head is not None:
            self.drafts[client.model_id] = head
            log.info("speculating with the draft head of %s that appeared in %s", client.model_id, file)

    def speculated(self, model_id: str, state: SpecState) -> None:
        """Add up how the model's draft head guessed; a fetched head that guesses poorly is dropped
        (from the store too, and not fetched again) and answers go on without one."""
        if model_id not in self.drafts:
            return
        seen = self.judged.setdefault(model_id, SpecState())
        seen.draft_trials += state.draft_trials
        seen.draft_hits += state.draft_hits
        if seen.draft_is_poor() and self.home is not None and \
                drop_fetched(self.home, self.clients[model_id].model_dir.name):
            del self.drafts[model_id]
            self.say(f"the draft head of {model_id} fetched from the swarm guessed {seen.draft_hits} of "
                     f"{seen.draft_trials} first tokens right: dropped, and not fetched again")

    def describe(self, model_id: str, pipeline: Pipeline, tokens: int) -> dict[str, Any]:
        """The session's route report (client/swarm.py) with how each peer was reached, the blocks
        this process ran, the trust plane's checks and the bytes sent (once the session closed)."""
        client = self._client(model_id)
        report = route_report(pipeline, tokens) or {"route": [], "in_process": [], "tokens": {}, "failovers": []}
        rescued = [s.rescued_at for s in pipeline.stages if getattr(s, "rescued_at", None) is not None]
        return {"route": [dict(h) | {"reached": client.node.relaying.reached(h["peer"])} for h in report["route"]],
                "shape": report.get("shape"), "links": report.get("links", []),
                "in_process": report["in_process"], "computed": report["tokens"], "failovers": report["failovers"],
                "finished_here_from": min(rescued, default=None), "local_blocks": list(client.opts.local_blocks),
                "checks": client.guard.status() if client.guard else None,
                "bytes_sent": sum(r.stats.bytes_sent for r in remotes_of(pipeline))}

    async def warm_trust(self, client: SwarmClient, retry_s: float = WARM_RETRY_S) -> None:
        """Compute the trust plane's canary material (canaries, calibration for the dtypes peers
        declare, the fp32 referee) for the spans of the route a session would take now, so the
        first request does not pay it (seconds, more on a loaded machine). Runs beside the
        server; a request that needs a span meanwhile waits for the same computation (the bank
        computes each span once, under its lock). Spans of later routes are computed when used."""
        if client.guard is None:
            return
        state = self.trust[client.model_id] = {"state": "waiting for a route", "spans": []}
        start, end = client.remote_range
        while True:
            try:
                hops = await client.route(start, end, client.bans.active() | client.guard.excluded())
                break
            except NoRoute:
                await trio.sleep(retry_s)
        declared = {r.peer_id: r.dtype for r in await client.records(RECORDS_TTL_S)}
        bank = client.guard.bank
        state["state"] = "computing"
        t0 = time.perf_counter()
        try:
            for hop in hops:
                dtype = _torch_dtype_name(declared.get(hop.peer_id, ""))
                if dtype:  # calibrated for the peer's dtype, as its first canary will need
                    m = await trio.to_thread.run_sync(bank.judging, hop.start, hop.end, dtype, abandon_on_cancel=True)
                else:
                    m = await trio.to_thread.run_sync(bank.material, hop.start, hop.end, abandon_on_cancel=True)
                await trio.to_thread.run_sync(lambda m=m: m.referee, abandon_on_cancel=True)  # a spot check's fp32 span
                state["spans"].append([hop.start, hop.end])
        except Exception as e:  # noqa: BLE001 - the first session will try again and report it
            state["state"] = f"failed: {type(e).__name__}: {e}"
            log.warning("trust warm-up for %s failed (the first session will retry): %s", client.model_id, e)
            return
        state["state"] = "ready"
        log.info("trust: canary material for %s ready in %.1f s (blocks %s)", client.model_id,
                 time.perf_counter() - t0, ", ".join(f"{a}-{b - 1}" for a, b in state["spans"]))


def _torch_dtype_name(declared: str) -> str:
    """A record's dtype ("bf16") as the data plane names it ("bfloat16"); "" if unknown."""
    from diffuse.model.load import parse_dtype
    from diffuse.trust.canary import dtype_name

    try:
        return dtype_name(parse_dtype(declared))
    except Exception:  # noqa: BLE001 - an unknown name: the first canary will calibrate what it meets
        return ""


async def _draft_head(client: SwarmClient, home: Path, say: Callable[[str], None]) -> DraftHead | None:
    """The model's draft head from the store, else fetched from a peer that offers one (verified
    against its announced hash; refusals said)."""
    try:
        return await obtain_draft_head(client.node, await client.records(), home, client.model_dir, say=say)
    except ModelError as e:  # a broken file of our own: speculate without it, and say so
        say(str(e))
        return None


# The trust plane's forms (docs/trust.md): full and published in a public swarm, where a stranger
# passes two canaries before it carries traffic; fewer checks and nothing published in a private
# one, whose members are known; none among one's own peers.
TRUST_FORMS = {"public": {"vet_canaries": 2}, "private": {"spot_rate": 0.02, "canary_rate": 0.05, "publish": False},
               "off": None}


def trust_options(form: str, audit_rate: float | None = None) -> TrustOptions | None:
    """The trust plane's settings in the form `form` names (None: no checks), with each hop's
    sessions audited at `audit_rate` where given instead of the form's rate."""
    settings = TRUST_FORMS[form]
    if audit_rate is None:
        return None if settings is None else TrustOptions(**settings)
    if settings is None:
        raise DiffuseError("--audit-rate needs the trust plane: it audits nothing with --trust off")
    if not 0.0 <= audit_rate <= 1.0:
        raise DiffuseError(f"--audit-rate is a share of sessions, from 0 to 1, not {audit_rate:g}")
    return TrustOptions(**settings | {"spot_rate": audit_rate})


@dataclass(frozen=True)
class SwarmConfig:
    """How a client joins its swarm: where to find it, its access (private swarm key, who may
    serve), how sessions route (`options`), and how long to wait for full coverage at start."""

    bootstrap: tuple[str, ...]
    access: SwarmAccess
    options: SwarmOptions = field(default_factory=SwarmOptions)
    mdns: bool = False  # find the swarm on the LAN (control/mdns.py)
    hole_punch: bool = False  # try DCUtR towards peers reached through a relay
    wait: float = 10.0  # seconds to wait for the offered models' coverage (a client that starts with its swarm)
    trust: str = "public"  # the trust plane's form (TRUST_FORMS) `options` carry, for reports
    credit: bool = False  # run as the member's identity and pay peers with receipts (client/credit.py)

    def node_config(self) -> NodeConfig:
        # Punching holes, our dials must leave from a port our router maps: listen on every interface.
        listen = ["/ip4/0.0.0.0/tcp/0" if self.hole_punch else "/ip4/127.0.0.1/tcp/0"]
        return NodeConfig(listen=listen, bootstrap=list(self.bootstrap), server=False, swarm_key=self.access.key,
                          allow=self.access.allow, mdns=self.mdns, hole_punch=self.hole_punch)


@asynccontextmanager
async def open_swarm_backend(home: Path, names: list[str | None], config: SwarmConfig, speculate: bool = True,
                             spares: dict[str, str] | None = None, say: Callable[[str], None] = log.warning
                             ) -> AsyncIterator[SwarmBackend]:
    """Join the swarm as a client and load each offered model's client side; wait up to
    `config.wait` seconds for their full coverage, then warm the trust plane's material in the
    background while the caller serves. `speculate`: answers speculate (with each model's draft
    head from the store, else a peer's); `spares`: models (id -> store name) that may answer in
    an offered one's place, loaded when first used. With `config.credit`, the node runs as the
    member's serving identity (locked, as a `join` locks it) and receipts are delivered before the
    backend closes, each within credit.DELIVER_S."""
    from diffuse.control.identity import ephemeral
    from diffuse.model import store

    key_pair = _member_key(home) if config.credit else ephemeral()
    async with open_node(key_pair, config.node_config(), codecs=reputation.swarm_codecs()) as node, \
            trio.open_nursery() as paying, trio.open_nursery() as background:
        DHT_RECORDS.set_function(node.stored_records)
        clients = [_MeteredClient(node, store.resolve(home, name), config.options) for name in names]
        deadline = trio.current_time() + config.wait
        for client in clients:
            while not await client.covered() and trio.current_time() < deadline:
                await trio.sleep(0.25)
        drafts = {c.model_id: d for c in clients if speculate and (d := await _draft_head(c, home, say)) is not None}
        payer = Payer(key_pair, node.host, home, paying) if config.credit else None
        backend = SwarmBackend(clients, speculate, drafts, home, spares, say, payer)
        for client in clients:
            background.start_soon(backend.warm_trust, client)
        try:
            yield backend
        finally:
            background.cancel_scope.cancel()


def _member_key(home: Path):
    """The home's serving identity, locked for this process: two running nodes with one peer id
    (this client and the home's `join`) would corrupt everyone's routing tables."""
    from diffuse.control.identity import IdentityError, node_key

    try:
        return node_key(None, home, hold=True)
    except IdentityError as e:
        if "in use" not in str(e):
            raise
        raise IdentityError("--credit asks as this home's serving identity, which a running node of it (a "
                            "`diffuse join`) holds: ask without --credit, or stop that node first") from None
