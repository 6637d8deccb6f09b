"""Client side of inference sessions: a remote block range as one pipeline stage, with failover.

The client talks to each hop of its route in turn (a star: every hop's output returns to the
client), which costs one extra transfer per hop but gives the client what failover needs: the
exact inputs every hop has committed. When a hop fails (connection lost, timeout, ERROR reply),
its peer is banned for a while, a new route for that hop's blocks is built from the replicas,
the committed inputs are replayed into the replacement to rebuild its KV cache (as first sent,
or in an exact session as a few long chunks), and the step is retried. commit/rollback never
cost a round trip: they ride on the next STEP (keep, cache_len).

A layer above (the trust plane) takes part through `HopChecks` (data/checks.py): it vets a new
hop before its session opens and wraps each hop session, so a step here is the same whether or
not anything checks it; a hop it rejects is replaced like one that failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
import trio
from torch import Tensor

from diffuse.control.records import PeerRecord
from diffuse.control.routing import Hop, NoRoute
from diffuse.data.checks import ChecksUnavailable, HopChecks, NoChecks, Rejected
from diffuse.data.codec import Downstream, ErrorCode, Fp16Overflow, WireError
from diffuse.data.hop import HopFailed, HopSession, Sent, Session, deadline, rechunked, truncated
from diffuse.data.stream import ByteStream
from diffuse.errors import DiffuseError, Rewind

log = logging.getLogger(__name__)

Dial = Callable[[Hop], Awaitable[ByteStream]]
Route = Callable[[int, int, set[str]], Awaitable[list[Hop]]]
DIAL_TIMEOUT_S = 15.0  # a stream to a peer, its connection included (dial bounds its own parts tighter)
ROUTES = ("auto", "chain", "star")  # how hops' outputs travel (RemoteSpan's `shape`)
# The largest signed record of a next peer an OPEN names (CHAIN_TO_RECORD): with the rest of the
# OPEN at most ~700 bytes it stays under a peer's limit on frames before OPEN_OK (4096 bytes). A
# larger record (a span of some 80 blocks or more) is not named: that hop returns through the client.
CHAIN_RECORD_BYTES = 3072


S = TypeVar("S", bound=Session)


class RouteShapeError(DiffuseError):
    """`--route chain` where some hop cannot forward to the next."""


@dataclass
class _Ban:
    until: float  # shunned until then (monotonic)
    strikes: int  # failures with no quiet `Bans.forget` seconds between them
    started: float  # the failed run's record start time: a newer one is a restart
    last: float  # when it last failed


class Bans:
    """Peers that failed a session, shunned no longer than their fault lasts.

    A failure bans a peer for `base` s, doubling on each repeat (Petals' back-off), but the ban
    lifts at once when the peer is seen back: a record with a newer start time (a restart; once
    per run, so a peer that fails again soon after is back on its doubled back-off) or an answer
    to a probe (`lift`, when it is needed: the client probes a span's banned replicas before it
    waits). Strikes are forgotten after `forget` s without a failure. Trust exclusions are kept
    elsewhere (the guard's) and never lifted by a restart."""

    def __init__(self, base: float = 15.0, forget: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.base, self.forget, self.clock = base, forget, clock
        self.bans: dict[str, _Ban] = {}

    def ban(self, peer_id: str, started: float = 0.0) -> None:
        now = self.clock()
        old = self.bans.get(peer_id)
        strikes = old.strikes if old is not None and now - old.last < self.forget else 0
        started = max(started, old.started) if old is not None else started
        self.bans[peer_id] = _Ban(now + self.base * 2 ** strikes, strikes + 1, started, now)

    def active(self) -> set[str]:
        now = self.clock()
        return {p for p, b in self.bans.items() if b.until > now}

    def seen(self, records: Iterable[PeerRecord]) -> list[str]:
        """Lift the bans of peers whose records show a run newer than the one that failed;
        returns them."""
        now, lifted = self.clock(), []
        for r in records:
            b = self.bans.get(r.peer_id)
            if b is not None and r.started > b.started:
                b.started = r.started
                if b.until > now:
                    b.until = now
                    lifted.append(r.peer_id)
        return lifted

    def lift(self, peer_id: str) -> None:
        """The peer answered a probe: usable again (its strikes stay)."""
        if peer_id in self.bans:
            self.bans[peer_id].until = self.clock()


def chain_target(after: Session) -> tuple[Downstream | None, str | None]:
    """What CHAIN_TO_RECORD names for a hop whose output goes to `after`'s session, or None and why
    not: its peer must accept links (1.2) and its signed record fit an OPEN."""
    signed = after.hop.signed
    if after.minor < 2:
        return None, "the next peer does not speak protocol 1.2"
    if signed is None or len(signed.payload) + len(signed.signature) > CHAIN_RECORD_BYTES:
        return None, "no signed record of the next peer small enough to name in an OPEN"
    return Downstream(after.hop.peer_id, after.session_id, signed.payload, signed.signature), None


def cause_of(error: BaseException) -> str:
    """How a hop failed, in one word, for failover records and tests: "timeout" (no answer in the
    step's deadline), "closed" (connection lost), "unreachable" (no stream could be opened),
    "error" (the peer answered ERROR), "protocol" (a bad frame or answer), "rejected" (a check),
    "numeric" (activations outgrew the wire dtype), "link" (on a chain: it received other bytes
    than its upstream committed to), "stale" (it computed a forwarded input its replaced upstream
    had sent)."""
    if isinstance(error, trio.TooSlowError):
        return "timeout"
    if isinstance(error, Rejected):
        return "rejected"
    if isinstance(error, Fp16Overflow) or (isinstance(error, (HopFailed, WireError)) and
                                           error.code == ErrorCode.NUMERIC):
        return "numeric"
    if isinstance(error, HopFailed):
        return error.cause
    return "closed"


@dataclass
class RemoteStats:
    failovers: list[dict] = field(default_factory=list)
    bytes_sent: int = 0
    links: list[dict] = field(default_factory=list)  # chain links that failed or never came up, and why


class RemoteSpan:
    """Blocks [start, end) computed by the swarm: a Stage for the client's Pipeline.

    `checks` (a layer above's; NoChecks by default) vets every new hop and wraps its session;
    `route` must leave out the peers that layer never trusts."""

    def __init__(self, model_id: str, start: int, end: int, dial: Dial, route: Route, bans: Bans,
                 max_len: int, batch: int = 1, dtype: torch.dtype = torch.float16,
                 timeout: float = 30.0, max_failovers: int = 8, route_wait: float = 5.0,
                 checks: HopChecks | None = None, exact: bool = False, shape: str = "auto"):
        if shape not in ROUTES:
            raise ValueError(f"route shape must be one of {', '.join(ROUTES)}, not {shape!r}")
        self.shape = shape  # auto: chain the links that come up, star the others; chain: all or fail; star
        self.model_id, self.start, self.end = model_id, start, end
        self.exact = exact  # every hop must compute with batch-invariant kernels
        self.checks: HopChecks = checks or NoChecks()
        self.dial, self.route, self.bans = dial, route, bans
        self.max_len, self.batch, self.dtype, self.timeout = max_len, batch, dtype, timeout
        self.max_failovers, self.route_wait = max_failovers, route_wait
        self.hops: list[Session] = []
        self.stats = RemoteStats()

    @property
    def route_taken(self) -> list[dict]:
        """The route's hops and how each one's output travelled: on to the next peer ("peer", for
        every step it forwarded) or back to this client ("client": star, the last hop, a link that
        never came up or failed: `link_error` says why)."""
        return [{"peer": h.hop.peer_id, "blocks": [h.hop.start, h.hop.end],
                 "output": "peer" if i + 1 < len(self.hops) and h.feeds(self.hops[i + 1]) else "client",
                 "forwarded_steps": h.forwarded_steps} | ({"link_error": h.link_error} if h.link_error else {})
                for i, h in enumerate(self.hops)]

    @property
    def chained_links(self) -> int:
        return sum(h.chained for h in self.hops[:-1])

    async def _build(self, start: int, end: int, inputs: list[Sent], wait: float | None = None) -> list[Session]:
        """Open sessions along a fresh route over [start, end) and replay `inputs` into them,
        routing around every peer that fails on the way; NoRoute when replicas run out (after
        `wait` seconds, default route_wait, of looking for one)."""
        while True:
            new: list[Session] = []
            hop = None
            try:
                route = await self._route(start, end, self.route_wait if wait is None else wait)
                for hop in route:  # canaries first: a peer's open session must not sit idle meanwhile
                    await self.checks.vet(hop, self._canary_session)
                if not inputs and self.shape != "star" and len(route) > 1:
                    for hop in reversed(route):  # the last first: each hop links to an open session
                        new.insert(0, await self._open_linked(route, hop, new[0] if new else None))
                    self._check_links(new)
                    return new
                feed = rechunked(inputs) if self.exact else inputs
                for hop in route:  # each hop opens when its inputs are ready: the last one's outputs
                    session = self.checks.wrap(HopSession(hop, await self._dial(hop), self.model_id, self.max_len,
                                                          self.batch, self.dtype, self.timeout,
                                                          self.checks.commitments, self.exact))
                    new.append(session)
                    await session.open()
                    rows = sum(sent.h.shape[0] * sent.h.shape[1] for sent in feed)
                    outs = await session.replay(feed, timeout=deadline(hop, rows, self.timeout * 4, self.exact)
                                                 + 0.05 * len(feed))
                    feed = [replace(sent, h=h) for sent, h in zip(feed, outs)]
                return new
            except BaseException as e:  # cancelled too: sessions opened so far must not outlive it
                await self._discard(new)
                if hop is None or not isinstance(e, Exception) or isinstance(e, (NoRoute, ChecksUnavailable,
                                                                                 RouteShapeError)):
                    raise
                self._failed(hop, e, "replay" if inputs else "open")

    async def _open_linked(self, route: list[Hop], hop: Hop, after: Session | None) -> Session:
        """A session on `hop` that takes its input from the hop before it in `route` and forwards
        its output to `after`'s session (a peer speaking 1.2), both where the peers manage."""
        i = route.index(hop)
        down, why = chain_target(after) if after is not None else (None, None)
        session = self.checks.wrap(HopSession(hop, await self._dial(hop), self.model_id, self.max_len, self.batch,
                                              self.dtype, self.timeout, self.checks.commitments,
                                              self.exact, upstream=route[i - 1].peer_id if i else None,
                                              downstream=down, unchained=why))
        return await _opened(session)

    def _check_links(self, hops: list[Session]) -> None:
        """Note the links that did not come up (those hops return through the client); with the
        shape "chain", refuse the route instead."""
        for a, b in zip(hops, hops[1:]):
            if not a.chained:
                why = a.link_error or "the peer does not speak protocol 1.3"
                self.stats.links.append({"link": [a.hop.peer_id, b.hop.peer_id], "when": "open", "error": why})
                if self.shape == "chain":
                    raise RouteShapeError(f"--route chain: peer {a.hop.peer_id[-8:]} does not forward to "
                                       f"{b.hop.peer_id[-8:]} ({why}); --route auto returns through this client there")

    async def _dial(self, hop: Hop) -> ByteStream:
        """A stream to the hop's peer; one that gives none fails as "unreachable" (or "timeout",
        when it took too long)."""
        try:
            with trio.fail_after(DIAL_TIMEOUT_S):
                return await self.dial(hop)
        except trio.TooSlowError:
            raise HopFailed(hop, "opened no stream in time", cause="timeout") from None
        except HopFailed:
            raise
        except Exception as e:  # noqa: BLE001 - py-libp2p's many dial failures
            raise HopFailed(hop, f"cannot reach it: {type(e).__name__}: {e}", cause="unreachable") from e

    async def _discard(self, sessions: Sequence[Session]) -> None:
        for session in sessions:
            await session.close()

    async def _route(self, start: int, end: int, wait: float) -> list[Hop]:
        """A route, waiting up to `wait` seconds for a replica to come back before NoRoute."""
        deadline = trio.current_time() + wait
        while True:
            try:
                return await self.route(start, end, self.bans.active())
            except NoRoute:
                if trio.current_time() >= deadline:
                    raise
                await trio.sleep(0.5)

    def _failed(self, hop: Hop, error: Exception, during: str) -> None:
        if len(self.stats.failovers) >= self.max_failovers:
            raise DiffuseError(f"giving up after {self.max_failovers} failovers; last: {error}") from error
        cause = cause_of(error)
        if cause == "numeric":
            self.dtype = torch.bfloat16  # activations outgrew fp16: same peers, wider wire dtype
        elif cause != "stale":  # "stale": an upstream replaced mid-step had fed it, no fault of its own
            self.bans.ban(hop.peer_id, hop.started)
        log.warning("peer %s failed during %s (%s): %s", hop.peer_id, during, cause, error)
        self.stats.failovers.append({"peer": hop.peer_id, "blocks": [hop.start, hop.end], "during": during,
                                     "cause": cause, "error": f"{type(error).__name__}: {error}"})
        upstream = getattr(error, "link", None)
        if upstream:  # the link delivered other bytes than the upstream committed to: either may lie
            self.bans.ban(upstream)
            self.stats.failovers[-1]["link"] = [upstream, hop.peer_id]
            self.stats.links.append({"link": [upstream, hop.peer_id], "when": during, "error": str(error)})

    async def open(self, wait: float | None = None) -> None:
        """Sessions on a route over the span, looking `wait` seconds (default route_wait) for one."""
        self.hops = await self._build(self.start, self.end, [], wait)

    async def _canary_session(self, hop: Hop, tokens: int) -> HopSession:
        """A session for a canary of `tokens` tokens: indistinguishable from this span's real
        sessions (their max_length, unless the canary would not fit)."""
        session = HopSession(hop, await self._dial(hop), self.model_id, max(self.max_len, tokens), self.batch,
                             self.dtype, self.timeout, True, self.exact)
        return await _opened(session)

    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor:
        """The step through every hop in turn, a failed or rejected hop replaced and the step
        redone there. A Rewind from a hop's wrapper passes through: the pipeline rolls back.
        On a chain a hop's input comes from the hop before it, which forwarded its output (the
        client holds a copy of it, so the step reads the same); elsewhere the client sends it.
        A span not yet opened opens first: with no hops the blocks would be skipped, not computed."""
        if not self.hops:
            await self.open()
        i = 0
        while i < len(self.hops):
            sent = time.perf_counter()
            session = self.hops[i]
            session.feed_from_upstream(i > 0 and self.hops[i - 1].feeds(session))
            try:
                h = await session.step(h, positions, tree_mask, commit)
                if session.link_error and i + 1 < len(self.hops):
                    self._note_link(session.hop.peer_id, self.hops[i + 1].hop.peer_id, session.link_error)
                silent = session.silent_link_news()  # the link into this hop, noticed at its end
                if silent:
                    self._note_link(session.upstream, session.hop.peer_id, silent)
                i += 1
            except (Rewind, ChecksUnavailable):
                raise
            except Rejected as e:  # its outputs from e.length on are wrong: rebuilt from its inputs before
                await self._failover(i, e, truncated(self.hops[i].inputs(), e.length),
                                     "check" if e.behind else "step")
            except Exception as e:  # noqa: BLE001 - trio.Cancelled is a BaseException and passes
                await self._failover(i, e, noticed_s=time.perf_counter() - sent)
        return h

    def _note_link(self, upstream: str, downstream: str, error: str) -> None:
        """Report a link between two peers that failed (once): neither peer is blamed."""
        entry = {"link": [upstream, downstream], "when": "step", "error": error}
        if entry not in self.stats.links:
            self.stats.links.append(entry)

    async def _failover(self, i: int, error: Exception, inputs: list[Sent] | None = None,
                        during: str = "step", noticed_s: float | None = None) -> None:
        """Replace hop i by fresh hops over the same blocks, rebuilt from its committed inputs
        (or from `inputs`: those before the output it was rejected for).
        `noticed_s`: how long after the step was sent its failure was known."""
        old = self.hops[i]
        t0 = time.perf_counter()
        self._failed(old.hop, error, during)
        record = self.stats.failovers[-1]
        if noticed_s is not None:
            record["noticed_s"] = round(noticed_s, 4)
        inputs = old.inputs() if inputs is None else inputs
        await self._discard([old])
        new = await self._build(old.hop.start, old.hop.end, inputs)
        self.hops[i:i + 1] = new
        record.update(
            replaced_by=[s.hop.peer_id for s in new],
            replayed_tokens=sum(s.tokens for s in inputs),
            recovery_s=round(time.perf_counter() - t0, 4))

    def committed_inputs(self, length: int) -> list[Sent]:
        """The span's first `length` committed input tokens as first sent (its first hop's
        inputs), to rebuild the whole span elsewhere."""
        return truncated(self.hops[0].inputs(), length) if self.hops else []

    async def commit(self, keep: Sequence[int] | None) -> None:
        for s in self.hops:
            s.commit(keep)

    async def rollback(self, length: int) -> None:
        for s in self.hops:
            s.rollback(length)

    async def close(self) -> None:
        self.stats.bytes_sent = sum(s.bytes_sent for s in self.hops)
        await self._discard(self.hops)
        await self.checks.closed([s.hop for s in self.hops], self._canary_session)


async def _opened(session: S) -> S:
    """`session`, opened; closed again when opening fails."""
    try:
        await session.open()
    except BaseException:
        await session.close()
        raise
    return session
