"""The swarm client: routes from DHT records, sessions whose middle blocks run on peers.

The client holds the tokenizer, embeddings, final norm and LM head, and by default the first
block too (`local_blocks=(1, 0)`), so what it sends out is a block's output, never a token id or
an embedding row. Routes are planned just in time, per session, from fresh signed records whose
block hashes match the manifest the client trusts, preferring peers with a low measured RTT.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from diffuse.client.accept import accepted_hashes, scheme_of
from diffuse.client.pipeline import LocalStage, Pipeline, head_batcher
from diffuse.client.rescue import Rescuable
from diffuse.control.dial import open_stream
from diffuse.control.node import Node
from diffuse.control.records import PeerRecord
from diffuse.control.routing import Hop, NoRoute, plan_route
from diffuse.data import scheduler
from diffuse.data.client import Bans, RemoteSpan
from diffuse.data.codec import PROTOCOL_ID, FrameDecoder, Ping, Pong, encode
from diffuse.errors import DiffuseError
from diffuse.home import data_home
from diffuse.model.config import ModelConfig
from diffuse.model.engine import BlockSpan, Head, block_parameters
from diffuse.model import variants
from diffuse.model.load import load_head, load_span
from diffuse.model.quant import parse_accept
from diffuse.model.weights import Manifest, load_manifest
from diffuse.trust import reputation
from diffuse.trust.bank import CanaryBank
from diffuse.trust.checked import SessionChecks
from diffuse.trust.guard import Guard, TrustOptions

log = logging.getLogger(__name__)
RTT_TTL_S = 60.0  # re-measure a peer's round trip after this long, as Petals refreshes routes
UNREACHABLE_S = 10.0  # the RTT a peer that did not answer a ping counts with (routes avoid it)
PROBE_WAVE = 16  # peers pinged at once while looking for a route
PROBE_REPLICAS = 2  # stop pinging once every block has this many reachable peers
# A session fetches records as it opens; its failovers reuse them while this young (and unexpired),
# so replacing a dead peer needs no DHT lookup (1.5 s on a loaded box, up to the query timeout per
# dead node on a WAN). A route they cannot give fetches fresh ones.
RECORDS_TTL_S = 30.0
MID_ANSWER_WAIT_S = 5.0  # how long a failover waits for a replica before finishing the answer here
STREAM_TIMEOUT_S = 3.0  # a new stream on a connection we hold: a peer that gives none is frozen
PROBE_EVERY_S = 1.0  # a banned peer is probed at most this often while it alone could serve


@dataclass
class SwarmOptions:
    local_blocks: tuple[int, int] = (1, 0)
    dtype: torch.dtype = torch.bfloat16  # local compute
    wire_dtype: torch.dtype = torch.float16
    step_timeout: float = 30.0
    device: str = "cpu"
    quant: str = "none"  # the variant of the blocks this client runs (model/variants.py)
    accept_quant: str | None = None  # variants of peers it routes through: "int4,none", "any"; None: its own and better
    exact: bool = False  # batch-invariant kernels on every hop: speculation = plain greedy, bit for bit
    trust: TrustOptions | None = field(default_factory=TrustOptions)  # None: no checks (private swarms)
    noise: float = 0.0  # secret Gaussian noise on what the swarm receives, x each row's RMS (client/privacy.py)
    rescue: bool = True  # compute here, from the store, blocks no peer can take now (memory allowing)
    route_wait: float = 60.0  # seconds a session waits for a replica where it cannot compute here
    max_waiting: int = 64  # sessions that may wait so at once; past them SwarmBusy
    route: str = "auto"  # how hops' outputs travel: chain (peer to peer), star (through here), auto (data/client.py)


class SwarmBusy(DiffuseError):
    """No replica can take a session now, this client cannot compute the blocks itself, and the
    queue of sessions waiting for a replica is full: come back later."""


class SwarmClient:
    """Everything a client process needs to open sessions on the swarm for one model."""

    def __init__(self, node: Node, model_dir: Path, options: SwarmOptions | None = None):
        self.node, self.model_dir = node, Path(model_dir)
        self.opts = options or SwarmOptions()
        self.cfg = ModelConfig.load(self.model_dir)
        self.manifest: Manifest = load_manifest(self.model_dir)
        self.model_id = self.manifest.model_id
        node.num_blocks[self.model_id] = self.cfg.num_layers  # which window keys hold the model
        front, back = self.opts.local_blocks
        n = self.cfg.num_layers
        if front < 0 or back < 0 or front + back >= n:
            raise DiffuseError(f"--local-blocks {front},{back} must leave some of the {n} blocks to the swarm")
        if front == 0:
            log.warning("no local front block: peers will receive embedding rows of your prompt")
        self.head: Head = load_head(self.model_dir, self.opts.dtype, self.opts.device)
        dtype, device = self.opts.dtype, self.opts.device
        quant, where = self.opts.quant, self.model_dir
        self.front: BlockSpan | None = load_span(where, 0, front, dtype, device, quant=quant) if front else None
        self.back: BlockSpan | None = load_span(where, n - back, n, dtype, device, quant=quant) if back else None
        self.accepted = parse_accept(self.opts.accept_quant, quant)
        self.variants: dict[str, list[str]] = {"none": self.manifest.block_hashes}  # scheme -> block hashes
        self.remote_range = (front, n - back)
        # Shared by this client's sessions (an API's users): their local rows compute together.
        lane = trio.CapacityLimiter(1)
        self.front_batcher, self.back_batcher = scheduler.span_batcher(lane=lane), scheduler.span_batcher(lane=lane)
        self.logits = head_batcher(self.head, lane)
        self.rescue_batcher = scheduler.span_batcher(lane=lane)  # spans finished here (client/rescue.py)
        self.bans = Bans()
        self.probed: dict[str, float] = {}  # banned peer -> when it was last probed
        self.runs: dict[str, float] = {}  # peer -> the start time of its run we last saw
        self.waiting = 0  # sessions waiting for a replica
        self._rescue_span: tuple[tuple[int, int], BlockSpan] | None = None  # the last span loaded to finish here
        self.rtt: dict[str, tuple[float, float]] = {}  # peer -> (seconds, measured at)
        self.rejected: dict[str, str] = {}  # peer -> why its record was refused
        self._records: tuple[float, list[PeerRecord]] = (-1e9, [])  # last fetch: (when, good ones)
        self.guard: Guard | None = None
        if self.opts.trust is not None:
            t = self.opts.trust
            if reputation.EVIDENCE_PREFIX not in node.codecs.by_prefix:
                raise DiffuseError("a client that checks its peers needs a node that stores evidence "
                                   "(open it with codecs=reputation.swarm_codecs())")
            # Canaries live in the store holding the model (home/models/NAME), else the default home.
            store_home = self.model_dir.parent.parent if self.model_dir.parent.name == "models" else data_home()
            bank = CanaryBank(self.model_dir, store_home, self.opts.wire_dtype, t.canaries, t.canary_tokens,
                              exact=self.opts.exact)
            # publishing needs only the node: a bound method would make client and guard a cycle that
            # keeps the client's weights alive until the garbage collector runs
            self.guard = Guard(self.model_id, bank, node.key_pair, t, publish=functools.partial(publish_evidence, node))
        self.suspects: dict[str, tuple[int, float]] = {}  # peer -> (others' reports, looked up at)

    async def records(self, max_age: float = 0.0) -> list[PeerRecord]:
        """Fresh online records that serve exactly the weights our manifest names, of peers the
        node's allow-list lets serve; fetched at most `max_age` seconds ago (0: from the DHT now)."""
        at, cached = self._records
        if time.monotonic() - at <= max_age:
            return [r for r in cached if r.fresh() and self.node.may_serve(r.peer_id)]
        good = []
        found = await self.node.records(self.model_id)
        known, failed = await accepted_hashes(found, self.accepted, self.variant_hashes)
        for r in found:
            scheme = scheme_of(r)
            if scheme not in self.accepted:
                self.rejected[r.peer_id] = f"serves the {scheme} variant, which this client does not accept"
                continue
            if scheme in failed:  # this model has no such variant here (a family int4 cannot take)
                self.rejected[r.peer_id] = failed[scheme]
                continue
            hashes = list(known[scheme])
            if r.num_blocks != self.cfg.num_layers or list(r.block_hashes) != hashes[r.start:r.end]:
                self.rejected[r.peer_id] = f"announced block hashes differ from the trusted manifest ({scheme})"
                continue
            if PROTOCOL_ID not in r.protocols:
                continue
            good.append(r)
        self._records = (time.monotonic(), good)
        for peer in self.bans.seen(good):
            log.info("peer %s restarted: its failure ban is lifted", peer)
        for r in good:  # a new run of a peer: what we measured of the old one says nothing
            if self.runs.setdefault(r.peer_id, r.started) != r.started:
                self.runs[r.peer_id] = r.started
                self.rtt.pop(r.peer_id, None)
        return good

    async def variant_hashes(self, scheme: str) -> list[str]:
        """The block hashes of this model's `scheme` variant, made here from our own weights the
        first time a peer announces it (so a peer's variant is checked against ours, bytes alike)."""
        if scheme not in self.variants:
            made = await trio.to_thread.run_sync(variants.resolve, self.model_dir, scheme)
            self.variants[scheme] = load_manifest(made).block_hashes
        return self.variants[scheme]

    async def covered(self) -> bool:
        """Whether live, trusted peers serve every block this client does not run itself."""
        records = await self.records()
        start, end = self.remote_range
        return all(any(r.serves(b) and r.fresh() for r in records) for b in range(start, end))

    async def uncovered(self) -> str:
        """What covered() lacks, in words: "no live peer serves blocks 3-9" ("" when covered)."""
        records = [r for r in await self.records(RECORDS_TTL_S) if r.fresh()]
        try:
            plan_route(records, *self.remote_range)
        except NoRoute as e:
            return str(e)
        return ""

    async def route(self, start: int, end: int, exclude: set[str]) -> list[Hop]:
        """The best route avoiding `exclude`, and avoiding peers others published evidence
        against while a route without them exists (evidence is a claim: we never ban on it)."""
        # Failure bans are this client's own and may lift while we look (a restart, a probe); the
        # rest of `exclude` (the trust plane's exclusions) never does.
        others = (exclude - self.bans.active()) | (self.guard.excluded() if self.guard is not None else set())
        try:
            return await self._plan(start, end, others | self.bans.active(), await self.records(RECORDS_TTL_S))
        except NoRoute:
            pass
        records = await self.records()  # fresh: restarted peers (new ports, bans lifted) show here
        try:
            return await self._plan(start, end, others | self.bans.active(), records)
        except NoRoute:
            if not await self._probe_banned(records, start, end, others):
                raise
        return await self._plan(start, end, others | self.bans.active(), records)

    async def _probe_banned(self, records: list[PeerRecord], start: int, end: int, others: set[str]) -> bool:
        """Only banned peers could serve [start, end): ping them (each at most every PROBE_EVERY_S)
        and lift the bans of those that answer, rather than wait their back-off out. Whether any did."""
        banned = self.bans.active()
        now = time.monotonic()
        todo = [r for r in records if r.peer_id in banned and r.peer_id not in others and r.start < end and
                r.end > start and now - self.probed.get(r.peer_id, -1e9) >= PROBE_EVERY_S]
        answered: list[str] = []

        async def one(r: PeerRecord) -> None:
            self.probed[r.peer_id] = time.monotonic()
            with trio.move_on_after(2.0):
                try:
                    self.rtt[r.peer_id] = (await self._ping(r), time.monotonic())
                except Exception as e:  # noqa: BLE001 - still down: the ban stands
                    log.info("banned peer %s still does not answer: %s", r.peer_id, e)
                    return
                self.bans.lift(r.peer_id)
                answered.append(r.peer_id)

        async with trio.open_nursery() as nursery:
            for r in todo:
                nursery.start_soon(one, r)
        if answered:
            log.info("banned peers answered a probe, usable again: %s", ", ".join(answered))
        return bool(answered)

    async def _plan(self, start: int, end: int, exclude: set[str], records: list[PeerRecord]) -> list[Hop]:
        """`_planned`'s route, each hop with its peer's record as signed (a chain names it to the
        hop before, which dials only the addresses it signs)."""
        hops = await self._planned(start, end, exclude, records)
        return [dataclasses.replace(h, signed=self.node.signed_record(h.peer_id)) for h in hops]

    async def _planned(self, start: int, end: int, exclude: set[str], records: list[PeerRecord]) -> list[Hop]:
        """A route over peers this client has pinged: valid records are not proof of a peer
        (anyone can sign records pointing anywhere), an answer to a ping is."""
        candidates = [r for r in records if r.peer_id not in exclude and r.start < end and r.end > start]
        await self._probe(candidates, start, end)
        now = time.monotonic()
        rtt = {p: s for p, (s, t) in self.rtt.items() if now - t < RTT_TTL_S}
        records = [r for r in candidates if r.peer_id in rtt]
        if self.guard is not None:
            suspects = await self._suspects(candidates)
            if suspects:
                try:
                    return plan_route(records, start, end, rtt=rtt, exclude=exclude | suspects)
                except NoRoute:
                    log.info("only routes through reported peers: using them, vetted by canaries")
        return plan_route(records, start, end, rtt=rtt, exclude=exclude)

    async def _suspects(self, records: list[PeerRecord]) -> set[str]:
        """Peers with evidence from reporters other than us in the DHT (cached for RTT_TTL_S)."""
        now = time.monotonic()
        todo = [r.peer_id for r in records if now - self.suspects.get(r.peer_id, (0, -1e9))[1] >= RTT_TTL_S]

        async def one(peer: str) -> None:
            with trio.move_on_after(5.0):
                found = await reputation.reports(self.node, peer)
                for ev in found:
                    self.guard.bans.add(ev)
                self.suspects[peer] = (self.guard.bans.reports(peer), time.monotonic())

        async with trio.open_nursery() as nursery:
            for peer in todo:
                nursery.start_soon(one, peer)
        return {p for p, (n, _) in self.suspects.items() if n > 0}

    async def _probe(self, records: list[PeerRecord], start: int, end: int) -> None:
        """Ping peers not measured lately, most supported first (those in the most DHT nodes'
        copies: a throwaway record flooded into the DHT is in few), PROBE_WAVE at a time, until
        every block of [start, end) has PROBE_REPLICAS reachable peers or none is left."""
        now = time.monotonic()
        support = self.node.support.get(self.model_id, {})
        fresh = {p for p, (_, t) in self.rtt.items() if now - t < RTT_TTL_S}
        todo = [r for r in records if r.peer_id not in fresh]
        random.shuffle(todo)  # ties in any order, not the records' (the attacker's) order
        todo.sort(key=lambda r: -support.get(r.peer_id, 0))

        async def one(r: PeerRecord) -> None:
            with trio.move_on_after(2.0):
                try:
                    self.rtt[r.peer_id] = (await self._ping(r), time.monotonic())
                    return
                except Exception as e:  # noqa: BLE001 - an unreachable peer just gets no route
                    log.info("cannot ping %s: %s", r.peer_id, e)
            self.rtt[r.peer_id] = (UNREACHABLE_S, time.monotonic())

        while todo and not self._reachable_cover(records, start, end):
            wave, todo = todo[:PROBE_WAVE], todo[PROBE_WAVE:]
            async with trio.open_nursery() as nursery:
                for r in wave:
                    nursery.start_soon(one, r)

    def _reachable_cover(self, records: list[PeerRecord], start: int, end: int) -> bool:
        now = time.monotonic()
        up = [r for r in records if (m := self.rtt.get(r.peer_id)) and m[0] < UNREACHABLE_S and now - m[1] < RTT_TTL_S]
        return all(sum(r.serves(b) for r in up) >= PROBE_REPLICAS for b in range(start, end))

    async def _ping(self, r: PeerRecord) -> float:
        stream = await self.dial(Hop(r.peer_id, tuple(r.addrs), r.start, r.end))
        try:
            dec = FrameDecoder()
            t0 = time.perf_counter()
            await stream.write(encode(Ping(int.from_bytes(os.urandom(4), "big"))))
            while not any(isinstance(m, Pong) for m in dec.feed(await stream.read(4096))):
                pass
            return time.perf_counter() - t0
        finally:
            await stream.close()

    async def dial(self, hop: Hop):
        return await open_stream(self.node.host, hop.peer_id, PROTOCOL_ID, hop.addrs, timeout=STREAM_TIMEOUT_S,
                                 fresh=lambda: self._fresh_addrs(hop))

    async def _fresh_addrs(self, hop: Hop) -> tuple[str, ...]:
        """The hop's peer's addresses in a record read now (the route may come from records cached
        before the peer restarted on new ports); the hop's own where none is found."""
        return next((tuple(r.addrs) for r in await self.records() if r.peer_id == hop.peer_id and r.addrs),
                    hop.addrs)

    async def session(self, max_len: int, batch: int = 1, exact: bool | None = None) -> Pipeline:
        """Open a session: local front blocks, the swarm's route, local back blocks; exact (default
        the options'): batch-invariant kernels here and on every hop."""
        start, end = self.remote_range
        exact = self.opts.exact if exact is None else exact
        await self.records()  # fresh, for this route and its failovers
        checks = SessionChecks(self.guard) if self.guard is not None else None
        middle = await self._middle(start, end, max_len, batch, exact, checks)
        stages = ([LocalStage(self.front, max_len, batch, exact, self.front_batcher)] if self.front else []) + [
            *middle] + ([LocalStage(self.back, max_len, batch, exact, self.back_batcher)] if self.back else [])
        if self.opts.noise:
            from diffuse.client import privacy  # a measured experiment, off by default: loaded only when on

            stages = privacy.wrap_front(stages, self.front is not None, self.opts.noise)
        return Pipeline(self.head, stages, exact, self.logits, behind=checks)

    def _span(self, start: int, end: int, max_len: int, batch: int, exact: bool,
              checks: SessionChecks | None) -> Rescuable:
        """Blocks [start, end) on peers (not opened yet), checked by the session's `checks`,
        finished here if the swarm loses them and the options allow it."""
        remote = RemoteSpan(self.model_id, start, end, self.dial, self.route, self.bans, max_len, batch,
                            self.opts.wire_dtype, self.opts.step_timeout, checks=checks, exact=exact,
                            shape=self.opts.route,
                            route_wait=MID_ANSWER_WAIT_S if self.opts.rescue else self.opts.route_wait)
        return Rescuable(remote, self._load_span, self._span_bytes(start, end), max_len, batch, exact,
                         self.rescue_batcher, enabled=self.opts.rescue,
                         unverified=checks.unverified_from if checks is not None else lambda: None)

    async def _middle(self, start: int, end: int, max_len: int, batch: int, exact: bool,
                      checks: SessionChecks | None) -> list[Rescuable]:
        """Blocks [start, end) opened on peers. Where no replica of some blocks can take the
        session now, never refuse what can be served: compute those blocks here, the rest on
        peers (the options allowing, and the store and memory), else wait for a replica, at most
        `route_wait`, in a queue of at most `max_waiting` sessions (SwarmBusy past it; NoRoute if
        none came back in time). Blocks no record announces are unservable, not down: NoRoute."""
        whole = self._span(start, end, max_len, batch, exact, checks)
        try:
            await whole.remote.open(wait=0.0)  # one look: fresh records, banned replicas probed
            return [whole]
        except NoRoute as e:
            if not await self._announced(start, end):
                raise  # unservable, not down: a --fallback model, or the caller's refusal
            if self.opts.rescue and (pieces := await self._split(start, end, e, max_len, batch, exact, checks)):
                return pieces
            if self.waiting >= self.opts.max_waiting:
                raise SwarmBusy(f"{e}; {self.waiting} sessions already wait for a replica") from None
        self.waiting += 1
        try:
            await whole.remote.open(wait=self.opts.route_wait)
        finally:
            self.waiting -= 1
        return [whole]

    async def _split(self, start: int, end: int, lost: NoRoute, max_len: int, batch: int,
                     exact: bool, checks: SessionChecks | None) -> list[Rescuable] | None:
        """[start, end) as pieces: the blocks `lost` names computed here, the others on peers;
        None where the store or memory cannot take the lost ones, or the swarm changed meanwhile."""
        bounds = sorted({start, end, *(a for a, _ in lost.runs), *(b for _, b in lost.runs)})
        pieces: list[Rescuable] = []
        try:
            for a, b in zip(bounds, bounds[1:]):
                pieces.append(self._span(a, b, max_len, batch, exact, checks))
                if any(x <= a and b <= y for x, y in lost.runs):
                    if not await pieces[-1].start_here(lost):
                        raise lost
                else:
                    await pieces[-1].remote.open(wait=0.0)
        except NoRoute:
            for piece in pieces:
                await piece.close()
            return None
        except BaseException:
            for piece in pieces:
                await piece.close()
            raise
        return pieces

    async def _announced(self, start: int, end: int) -> bool:
        """Whether fresh records announce every block of [start, end), live or not."""
        records = await self.records(RECORDS_TTL_S)
        return all(any(r.serves(b) for r in records) for b in range(start, end))

    def _load_span(self, start: int, end: int) -> BlockSpan:
        """Blocks the swarm lost, from the store (verified against the manifest), to finish here;
        the last span loaded is kept for the next session that needs it (an outage lasts)."""
        if self._rescue_span is None or self._rescue_span[0] != (start, end):
            self._rescue_span = ((start, end), load_span(self.model_dir, start, end, self.opts.dtype, self.opts.device,
                                                         quant=self.opts.quant))
        return self._rescue_span[1]

    def _span_bytes(self, start: int, end: int) -> int:
        per = torch.finfo(self.opts.dtype).bits // 8
        return per * sum(block_parameters(self.cfg, b) for b in range(start, end))


def remotes_of(pipeline: Pipeline) -> list[RemoteSpan]:
    """The session's remote spans, in block order: one, or several where it opened while some
    blocks had no replica (also once a Rescuable finished one here: its stats, its route)."""
    stages = [getattr(s, "remote", s) for s in pipeline.stages]
    return [s for s in stages if isinstance(s, RemoteSpan)]


def remote_of(pipeline: Pipeline) -> RemoteSpan:
    """The session's first remote span."""
    return remotes_of(pipeline)[0]


def route_report(pipeline: Pipeline, tokens: int) -> dict | None:
    """Where a session's `tokens` went: the peers of its route, the blocks it computed here
    instead (besides the client's own local blocks), its failovers, and how many tokens went
    through peers alone and how many also through blocks computed here. None for a session that
    never used the swarm."""
    remotes = remotes_of(pipeline)
    if not remotes:
        return None
    pieces = [s for s in pipeline.stages if isinstance(s, Rescuable)]
    here_from = min((p.rescued_at for p in pieces if p.rescued_at is not None), default=None)
    on_peers = tokens if here_from is None else min(here_from, tokens)
    hops = [h for r in remotes for h in r.route_taken]
    linked = sum(h["output"] == "peer" for h in hops)
    shape = "single" if len(hops) == 1 else "chain" if linked == len(hops) - 1 else "mixed" if linked else "star"
    return {"route": hops, "shape": shape,
            "links": [link for r in remotes for link in r.stats.links],
            "in_process": [b for p in pieces for b in p.in_process],
            "failovers": [f for r in remotes for f in r.stats.failovers],
            "tokens": {"peers": on_peers, "here": tokens - on_peers}}


__all__ = ["SwarmBusy", "SwarmClient", "SwarmOptions", "NoRoute", "remote_of", "remotes_of", "route_report"]


async def publish_evidence(node: Node, evidence: reputation.SignedEvidence) -> None:
    acks = await reputation.publish(node, evidence)
    log.info("evidence against %s published to %d DHT nodes", evidence.evidence.accused, acks)
