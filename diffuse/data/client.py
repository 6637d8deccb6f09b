"""Client side of inference sessions: a remote block range as one pipeline stage, with failover.

The client talks to each hop of its route in turn (a star: every hop's output returns to the
client), which costs one extra transfer per hop but gives the client what failover needs: the
exact inputs every hop has committed. When a hop fails (connection lost, timeout, ERROR reply),
its peer is banned for a while, a new route for that hop's blocks is built from the replicas,
the committed inputs are replayed into the replacement to rebuild its KV cache (as first sent,
or in an exact session as a few long chunks), and the step is retried. commit/rollback never
cost a round trip: they ride on the next STEP (keep, cache_len).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Sequence

import torch
import trio
from torch import Tensor

from diffuse.control.routing import Hop, NoRoute
from diffuse.data.codec import (
    Close, ErrorCode, ErrorMsg, Fp16Overflow, FrameDecoder, Open, OpenOk, Step, StepOk, WireError,
    encode,
)
from diffuse.data.server import READ_CHUNK, ByteStream
from diffuse.errors import DiffuseError, Rewind
from diffuse.trust.commitments import StepBinding, bind, input_commitment
from diffuse.trust.guard import Caught, Guard, TrustUnavailable

log = logging.getLogger(__name__)

Dial = Callable[[Hop], Awaitable[ByteStream]]
Route = Callable[[int, int, set[str]], Awaitable[list[Hop]]]
REPLAY_ROWS = 128  # rows per STEP when an exact session replays its history (bounds a step's attention)


class HopFailed(DiffuseError):
    def __init__(self, hop: Hop, why: str, code: int | None = None):
        super().__init__(f"peer {hop.peer_id[-8:]} (blocks {hop.start}-{hop.end - 1}): {why}")
        self.hop, self.code = hop, code


class Bans:
    """Peers that failed, banned for 15 s, doubling on each repeat (Petals' back-off)."""

    def __init__(self, base: float = 15.0, clock: Callable[[], float] = time.monotonic):
        self.base, self.clock = base, clock
        self.until: dict[str, float] = {}
        self.strikes: dict[str, int] = {}

    def ban(self, peer_id: str) -> None:
        n = self.strikes.get(peer_id, 0)
        self.strikes[peer_id] = n + 1
        self.until[peer_id] = self.clock() + self.base * 2 ** n

    def active(self) -> set[str]:
        now = self.clock()
        return {p for p, t in self.until.items() if t > now}


@dataclass
class Sent:
    """A committed STEP's input as first sent: a plain chunk (keep None), or a candidate tree and
    the nodes kept from it. Replaying it as sent repeats the same matmuls, so a replacement peer
    rebuilds a bit-identical cache, speculative steps included."""

    h: Tensor
    positions: Tensor
    mask: Tensor | None = None
    keep: list[int] | None = None

    @property
    def tokens(self) -> int:
        return self.h.shape[1] if self.keep is None else len(self.keep)

    def head(self, n: int) -> "Sent":
        """The first n committed tokens of this step."""
        return replace(self, keep=self.keep[:n]) if self.keep is not None else Sent(self.h[:, :n], self.positions[:n])

    def committed(self) -> tuple[Tensor, Tensor]:
        """The rows this step committed and their positions: all of a plain chunk, or the kept
        path of a tree (a chain, so the rows in order attend causally as they did in the tree)."""
        if self.keep is None:
            return self.h, self.positions
        return self.h[:, self.keep], self.positions[self.keep]


def rechunked(inputs: Sequence[Sent], rows: int = REPLAY_ROWS) -> list[Sent]:
    """The committed rows of `inputs` as plain chunks of at most `rows`. Only for an exact session:
    its outputs and KV entries do not depend on how tokens share a step (spec 7.4), so a
    replacement rebuilds the same cache at prefill cost instead of one decode step per token."""
    if not inputs:
        return []
    parts = [sent.committed() for sent in inputs]
    h, positions = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts])
    return [Sent(h[:, i:i + rows], positions[i:i + rows]) for i in range(0, positions.shape[0], rows)]


class HopSession:
    """One session on one peer: the protocol exchange plus the inputs it has committed."""

    def __init__(self, hop: Hop, stream: ByteStream, model_id: str, max_len: int, batch: int,
                 dtype: torch.dtype, timeout: float, commitments: bool = False, exact: bool = False):
        self.hop, self.stream, self.model_id = hop, stream, model_id
        self.commitments = commitments  # ask for, and check, per-step output commitments
        self.exact = exact  # require batch-invariant kernels (protocol 1.1 OPEN flag EXACT)
        self.peer_dtype = ""  # the compute dtype the peer declared in OPEN_OK
        self.last_input: bytes | None = None  # input-commitment chain, as the server computes it
        self.receipt: tuple[StepBinding, bytes] | None = None  # last step's output binding, commitment
        self.receipt_context: tuple[int, bytes | None] = (0, None)  # its step number and input commitment
        self.max_len, self.batch, self.dtype, self.timeout = max_len, batch, dtype, timeout
        self.session_id = os.urandom(16)
        self.decoder = FrameDecoder()
        self.inbox: deque = deque()  # frames read but not yet consumed
        self.step_no = 0
        self.history: list[Sent] = []  # committed inputs, in order, as sent
        self.committed = 0
        self.pending: Sent | None = None  # last step's candidate inputs
        self.keep: list[int] = []  # deferred commit, sent with the next STEP
        self.bytes_sent = 0
        self.compute_s = 0.0
        self.audited = False  # trust plane: every plain step of this session is spot-checked

    async def _send(self, msg) -> None:
        data = encode(msg)
        self.bytes_sent += len(data)
        await self.stream.write(data)

    async def _receive(self):
        """The next frame (replayed steps are pipelined: one read may bring several)."""
        while not self.inbox:
            data = await self.stream.read(READ_CHUNK)
            if not data:
                raise HopFailed(self.hop, "connection closed")
            try:
                self.inbox.extend(self.decoder.feed(data))
            except WireError as e:
                raise HopFailed(self.hop, f"sent a bad frame: {e}") from None
        msg = self.inbox.popleft()
        if isinstance(msg, ErrorMsg):
            raise HopFailed(self.hop, f"error {msg.code}: {msg.message}", msg.code)
        return msg

    async def open(self) -> None:
        with trio.fail_after(self.timeout):
            await self._send(Open(self.session_id, self.model_id, self.hop.start, self.hop.end,
                                  self.max_len, self.batch, self.dtype, self.commitments, self.exact))
            ok = await self._receive()
        if not isinstance(ok, OpenOk) or ok.max_length < self.max_len:
            raise HopFailed(self.hop, f"bad answer to OPEN: {ok!r}")
        if self.exact and not (ok.exact and ok.minor >= 1):
            raise HopFailed(self.hop, "peer does not grant exact (batch-invariant) computation: it "
                            f"speaks protocol 1.{ok.minor} or computes on a GPU")
        self.peer_dtype = ok.compute_dtype

    async def step(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool,
                   timeout: float | None = None) -> Tensor:
        msg = self._message(h, positions, mask, commit)
        with trio.fail_after(timeout or self.timeout):
            await self._send(msg)
            reply = await self._receive()
        out = self._accept(msg, reply)
        self._advance(msg, positions)
        return out

    async def replay(self, inputs: Sequence[Sent], timeout: float) -> list[Tensor]:
        """Send every step of `inputs` as first sent, then read the replies while writing, so a
        replacement peer's cache is rebuilt in one round trip, not one per step (on a WAN the
        round trips are most of a failover). A failure leaves this session unusable."""
        msgs = []
        for sent in inputs:
            msgs.append(self._message(sent.h, sent.positions, sent.mask, sent.keep is None, replay=True))
            self._advance(msgs[-1], sent.positions)
            if sent.keep is not None:
                self.commit(sent.keep)  # rides on the next STEP, as it first did
        frames = [encode(m) for m in msgs]  # an fp16 overflow surfaces here, unwrapped
        outs: list[Tensor] = []

        async def write_all() -> None:
            for data in frames:
                self.bytes_sent += len(data)
                await self.stream.write(data)

        failed: BaseException | None = None
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write_all)
                try:
                    for msg in msgs:
                        outs.append(self._accept(msg, await self._receive()))
                except Exception as e:  # noqa: BLE001 - re-raised bare below, not in a group
                    failed = e
                    nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        return outs

    def _message(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool,
                 replay: bool = False) -> Step:
        if h.dtype != self.dtype:  # a hop's output usually is in the wire dtype: sent on as received
            h = h.to(self.dtype)
        # cache_len counts the kept candidates: the server appends them before it truncates (spec 7.2).
        msg = Step(self.session_id, self.step_no, self.committed + len(self.keep), positions.tolist(), h,
                   keep=self.keep, mask=mask, commit=commit, replay=replay)
        if self.commitments:
            msg.input_commitment = input_commitment(self.session_id, self.step_no, self.last_input, h,
                                                    msg.positions, msg.cache_len, msg.keep, mask, commit,
                                                    self.dtype)
        return msg

    def _accept(self, msg: Step, reply) -> Tensor:
        """A reply's hidden states, once it answers `msg` (and, asked for, commits to its bytes)."""
        if not isinstance(reply, StepOk) or reply.step != msg.step:
            raise HopFailed(self.hop, f"bad answer to STEP {msg.step}")
        if self.commitments:
            self._check_commitment(msg, reply)
        self.compute_s += (reply.compute_us or 0) / 1e6
        return reply.hidden

    def _advance(self, msg: Step, positions: Tensor) -> None:
        """The session's state once `msg` has been answered (or, replaying, is on its way)."""
        self.last_input = msg.input_commitment
        self.step_no += 1
        if self.keep:
            self._commit_pending(self.keep)
        self.keep, self.pending = [], None
        if msg.commit:
            self.history.append(Sent(msg.hidden, positions))
            self.committed += msg.hidden.shape[1]
        else:
            self.pending = Sent(msg.hidden, positions, msg.mask)

    def _check_commitment(self, msg: Step, reply: StepOk) -> None:
        """The output commitment must name exactly the bytes received, bound to our inputs: what a
        spot check or canary later holds the peer to."""
        binding, tree = bind(self.session_id, msg.step, msg.input_commitment, reply.hidden, self.dtype)
        commitment = binding.commit(tree.root)
        if reply.output_commitment != commitment:
            raise HopFailed(self.hop, f"STEP {msg.step}: output commitment missing or not over the bytes sent")
        self.receipt, self.receipt_context = (binding, commitment), (msg.step, msg.input_commitment)

    def _commit_pending(self, keep: Sequence[int]) -> None:
        self.history.append(replace(self.pending, keep=list(keep)))
        self.committed += len(keep)

    def commit(self, keep: Sequence[int] | None) -> None:
        if self.pending is None:
            return
        if keep is None:
            keep = range(self.pending.h.shape[1])
        self.keep = list(keep)

    def rollback(self, length: int) -> None:
        if self.keep:
            self._commit_pending(self.keep)
        self.keep, self.pending = [], None
        kept, total = [], 0
        for sent in self.history:
            if total >= length:
                break
            kept.append(sent.head(length - total))
            total += kept[-1].tokens
        self.history, self.committed = kept, length

    def inputs(self) -> list[Sent]:
        """Everything committed so far, as it was first sent (plus a kept-but-not-yet-sent
        commit). Replaying the same chunks makes the same matmuls, so a replacement peer
        rebuilds a bit-identical KV cache: one batched replay would differ in low-order bits,
        enough to flip a near-tie in bf16, except in an exact session (`rechunked`)."""
        return self.history + ([replace(self.pending, keep=self.keep)] if self.keep else [])

    async def close(self) -> None:
        with trio.move_on_after(1.0):
            try:
                await self._send(Close(self.session_id))
                await self.stream.close()
            except Exception:  # noqa: BLE001 - closing a dead stream is fine
                pass


@dataclass
class RemoteStats:
    failovers: list[dict] = field(default_factory=list)
    bytes_sent: int = 0


class RemoteSpan:
    """Blocks [start, end) computed by the swarm: a Stage for the client's Pipeline."""

    def __init__(self, model_id: str, start: int, end: int, dial: Dial, route: Route, bans: Bans,
                 max_len: int, batch: int = 1, dtype: torch.dtype = torch.float16,
                 timeout: float = 30.0, max_failovers: int = 8, route_wait: float = 5.0,
                 guard: Guard | None = None, exact: bool = False):
        self.model_id, self.start, self.end = model_id, start, end
        self.exact = exact  # every hop must compute with batch-invariant kernels
        self.guard = guard  # the trust plane: vets new hops, spot-checks steps
        self.dial, self.route, self.bans = dial, route, bans
        self.max_len, self.batch, self.dtype, self.timeout = max_len, batch, dtype, timeout
        self.max_failovers, self.route_wait = max_failovers, route_wait
        self.hops: list[HopSession] = []
        self.stats = RemoteStats()
        self.deferred = False  # spot checks of plain steps verified behind the generation (may Rewind)

    @property
    def route_taken(self) -> list[dict]:
        return [{"peer": h.hop.peer_id, "blocks": [h.hop.start, h.hop.end]} for h in self.hops]

    async def _build(self, start: int, end: int, inputs: list[Sent]) -> list[HopSession]:
        """Open sessions along a fresh route over [start, end) and replay `inputs` into them,
        routing around every peer that fails on the way; NoRoute when replicas run out."""
        while True:
            new: list[HopSession] = []
            hop = None
            try:
                for hop in await self._route(start, end):
                    if self.guard is not None:
                        await self.guard.vet(hop, self._canary_session)
                    session = HopSession(hop, await self.dial(hop), self.model_id, self.max_len,
                                         self.batch, self.dtype, self.timeout, self.guard is not None, self.exact)
                    session.audited = self.guard is not None and self.guard.pick()
                    new.append(session)
                    await session.open()
                feed = rechunked(inputs) if self.exact else inputs
                for session in new:  # each hop's outputs are the next one's inputs
                    hop = session.hop
                    outs = await session.replay(feed, timeout=self.timeout * 4 + 0.5 * len(feed))
                    feed = [replace(sent, h=h) for sent, h in zip(feed, outs)]
                return new
            except (NoRoute, TrustUnavailable):
                for session in new:
                    await session.close()
                raise
            except Exception as e:  # noqa: BLE001 - trio.Cancelled is a BaseException and passes
                for session in new:
                    await session.close()
                if hop is None:
                    raise
                self._failed(hop, e, "replay" if inputs else "open")

    async def _route(self, start: int, end: int) -> list[Hop]:
        """A route, waiting up to route_wait for a replica to (re)announce before NoRoute."""
        deadline = trio.current_time() + self.route_wait
        while True:
            try:
                banned = self.bans.active() | (self.guard.excluded() if self.guard else set())
                return await self.route(start, end, banned)
            except NoRoute:
                if trio.current_time() >= deadline:
                    raise
                await trio.sleep(0.5)

    def _failed(self, hop: Hop, error: Exception, during: str) -> None:
        if len(self.stats.failovers) >= self.max_failovers:
            raise DiffuseError(f"giving up after {self.max_failovers} failovers; last: {error}") from error
        if isinstance(error, Fp16Overflow) or getattr(error, "code", None) == ErrorCode.NUMERIC:
            self.dtype = torch.bfloat16  # activations outgrew fp16: same peers, wider wire dtype
        else:
            self.bans.ban(hop.peer_id)
        log.warning("peer %s failed during %s: %s", hop.peer_id, during, error)
        self.stats.failovers.append({"peer": hop.peer_id, "blocks": [hop.start, hop.end],
                                     "during": during, "error": f"{type(error).__name__}: {error}"})

    async def open(self) -> None:
        self.hops = await self._build(self.start, self.end, [])

    async def _canary_session(self, hop: Hop, tokens: int) -> HopSession:
        """A session for a canary of `tokens` tokens: indistinguishable from this span's real
        sessions (their max_length, unless the canary would not fit)."""
        session = HopSession(hop, await self.dial(hop), self.model_id, max(self.max_len, tokens), self.batch,
                             self.dtype, self.timeout, True, self.exact)
        try:
            await session.open()
        except BaseException:
            await session.close()
            raise
        return session

    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor:
        if self.deferred and self.guard is not None:  # judge what the referee has done; wait if it trails
            pending = self.unverified_from()
            await self.settle(wait=pending is not None and int(positions.min()) - pending > self.guard.opts.max_lag)
        i, t0 = 0, time.perf_counter()
        while i < len(self.hops):
            hop = self.hops[i]
            # Spot checks: behind the generation, every plain step of an audited session (its
            # history is recomputed anyway, so checking all of it costs no more than one step);
            # otherwise each step with probability spot_rate, before its output is used.
            behind = self.deferred and commit and tree_mask is None
            picked = self.guard is not None and (hop.audited if behind else self.guard.pick())
            context = hop.inputs() if picked else None
            try:
                if context is None:
                    h = await hop.step(h, positions, tree_mask, commit)
                elif behind:
                    h = await hop.step(h, positions, tree_mask, commit)
                    await self.guard.defer(hop, context, h)
                else:
                    h = await self.guard.checked_step(hop, context, h, positions, tree_mask, commit)
                i += 1
            except Caught as e:
                await self._failover(i, e, context)  # the step it failed is redone on a replica
            except Exception as e:  # noqa: BLE001 - trio.Cancelled is a BaseException and passes
                await self._failover(i, e)
        if self.guard is not None and h.shape[1] <= 8:
            self.guard.note_step(time.perf_counter() - t0)
        return h

    def unverified_from(self) -> int | None:
        """Committed length a pending deferred check could still rewind to (None: all verified)."""
        return self.guard.unverified_from(self.hops) if self.guard is not None else None

    async def settle(self, wait: bool = True) -> None:
        """Judge deferred spot checks (all of them with `wait`). On a failure: replace the
        caught hop by a replica rebuilt from the inputs it had committed before the bad step,
        roll every other hop back to that length, and raise Rewind."""
        if self.guard is None:
            return
        try:
            await self.guard.settle(self.hops, wait)
        except Caught as e:
            check = e.check
            await self._failover(self.hops.index(check.session), e, check.context, "check")
            for s in self.hops:
                s.rollback(check.length)
            raise Rewind(check.length) from e

    async def _failover(self, i: int, error: Exception, inputs: list[Sent] | None = None,
                        during: str = "step") -> None:
        """Replace hop i by fresh hops over the same blocks, rebuilt from its committed inputs
        (or from `inputs`, what it had committed before a step it was caught cheating on)."""
        old = self.hops[i]
        t0 = time.perf_counter()
        self._failed(old.hop, error, during)
        record = self.stats.failovers[-1]
        await old.close()
        if self.guard is not None:
            self.guard.forget(old)
        inputs = old.inputs() if inputs is None else inputs
        new = await self._build(old.hop.start, old.hop.end, inputs)
        self.hops[i:i + 1] = new
        record.update(
            replaced_by=[s.hop.peer_id for s in new],
            replayed_tokens=sum(s.tokens for s in inputs),
            recovery_s=round(time.perf_counter() - t0, 4))

    async def commit(self, keep: Sequence[int] | None) -> None:
        for s in self.hops:
            s.commit(keep)

    async def rollback(self, length: int) -> None:
        for s in self.hops:
            s.rollback(length)

    async def close(self) -> None:
        self.stats.bytes_sent = sum(s.bytes_sent for s in self.hops)
        for s in self.hops:
            await s.close()
            if self.guard is not None:
                self.guard.forget(s)
        if self.guard is not None:
            await self.guard.after_session([s.hop for s in self.hops], self._canary_session)
