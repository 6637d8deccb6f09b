"""One inference session on one peer, as the client sees it: the exchange and its committed inputs.

A `HopSession` speaks the wire protocol (data/codec.py) under the session rules (data/session.py)
over one stream, and keeps what failover needs: every committed step's input as it was sent
(`Sent`), so a replacement peer can be rebuilt with the same matmuls, or, in an exact session,
with the committed rows in a few long chunks (`rechunked`). commit/rollback never cost a round
trip: they ride on the next STEP (keep, cache_len).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import trio
from torch import Tensor

from diffuse.control.routing import Hop
from diffuse.data.chain import LINK_OPEN_S, link_write_s
from diffuse.data.codec import (
    Close, Downstream, ErrorMsg, FrameDecoder, Message, Open, OpenOk, Step, StepOk, WireError, encode,
)
from diffuse.data.commitments import StepBinding, bind, input_commitment
from diffuse.data.session import Role, SessionRules, SessionState
from diffuse.data.stream import READ_CHUNK, ByteStream, close_quietly
from diffuse.errors import DiffuseError
from diffuse.model.quant import split_name

log = logging.getLogger(__name__)
REPLAY_ROWS = 128  # rows per STEP when an exact session replays its history (bounds a step's attention)
# A step's deadline: the round trip twice, plus SLACK times the rows at the peer's announced
# throughput, never under FLOOR_S (a busy peer batches other sessions' steps before ours) nor over
# the session's cap (--step-timeout). A frozen peer is noticed in seconds, an honest prefill is not cut.
# An exact session's rows cost EXACT_COST times as much: the throughput a peer announces is its fast
# kernels', and the batch-invariant ones run at a fraction of it (docs/churn.md).
FLOOR_S = 3.0
SLACK = 4.0
EXACT_COST = 5.0
CHAIN_OPEN_S = LINK_OPEN_S + 0.5  # what a chained OPEN adds to its deadline: the peer links to the next one first
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")  # what a peer may declare it computes in (OPEN_OK)


def truncated(inputs: Sequence[Sent], length: int) -> list[Sent]:
    """The steps that hold the first `length` committed tokens of `inputs` (the last one cut)."""
    kept, total = [], 0
    for sent in inputs:
        if total >= length:
            break
        kept.append(sent.head(length - total))
        total += kept[-1].tokens
    return kept


class HopFailed(DiffuseError):
    """A hop failed a session: `cause` says how ("closed", "error", "protocol"), for the failover
    record; `code`, an ERROR reply's."""

    def __init__(self, hop: Hop, why: str, code: int | None = None, cause: str = "protocol",
                 link: str | None = None):
        super().__init__(f"peer {hop.peer_id[-8:]} (blocks {hop.start}-{hop.end - 1}): {why}")
        self.hop, self.code, self.cause = hop, code, cause
        self.link = link  # the upstream peer whose forwarded input this hop received, when it is in doubt


def deadline(hop: Hop, rows: int, cap: float, exact: bool = False) -> float:
    """Seconds to wait for `rows` rows through `hop` (see FLOOR_S); `cap` where its throughput is unknown."""
    if hop.throughput <= 0:
        return cap
    return min(cap, max(FLOOR_S, 2 * hop.rtt + SLACK * rows * (EXACT_COST if exact else 1.0) / hop.throughput))


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


class Session(Protocol):
    """What a remote span does with a hop session: a `HopSession`, or the wrapper a layer above
    puts around one (data/checks.py) to check its steps."""

    hop: Hop
    session_id: bytes
    chained: bool
    link_error: str | None
    upstream: str | None
    forwarded_steps: int

    @property
    def bytes_sent(self) -> int: ...
    async def open(self) -> None: ...
    async def step(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool) -> Tensor: ...
    async def replay(self, inputs: Sequence[Sent], timeout: float) -> list[Tensor]: ...
    def commit(self, keep: Sequence[int] | None) -> None: ...
    def rollback(self, length: int) -> None: ...
    def inputs(self) -> list[Sent]: ...
    async def close(self) -> None: ...
    def feed_from_upstream(self, fed: bool) -> None: ...
    def feeds(self, other: Session) -> bool: ...
    def silent_link_news(self) -> str | None: ...


class HopSession:
    """One session on one peer: the protocol exchange plus the inputs it has committed."""

    def __init__(self, hop: Hop, stream: ByteStream, model_id: str, max_len: int, batch: int,
                 dtype: torch.dtype, timeout: float, commitments: bool = False, exact: bool = False,
                 upstream: str | None = None, downstream: Downstream | None = None, unchained: str | None = None):
        self.hop, self.stream, self.model_id = hop, stream, model_id
        # A chain (protocol 1.2): the peer that may forward our STEPs here, where outputs go on.
        self.upstream, self.downstream = upstream, downstream
        self.chained = False  # the peer's link to `downstream` is up (OPEN_OK CHAINED)
        self.link_error: str | None = unchained  # why it is not, or no longer (or why none was named)
        self.minor = 0  # the peer's protocol minor version
        self.fed = False  # this step's input arrives from the upstream peer, not from us
        self.silent_link: str | None = None  # why the upstream's link stopped feeding us: we step it ourselves
        self._silent_told = False
        self.forwarded = False  # the last step's output went on to `downstream`
        self.forwarded_steps = 0
        self.commitments = commitments  # ask for, and check, per-step output commitments
        self.exact = exact  # require batch-invariant kernels (protocol 1.1 OPEN flag EXACT)
        self.peer_dtype = ""  # the compute dtype the peer declared in OPEN_OK
        self.last_input: bytes | None = None  # input-commitment chain, as the server computes it
        self.receipt: tuple[StepBinding, bytes] | None = None  # last step's output binding, commitment
        self.receipt_context: tuple[int, bytes | None] = (0, None)  # its step number and input commitment
        self.max_len, self.batch, self.dtype, self.timeout = max_len, batch, dtype, timeout
        self.session_id = os.urandom(16)
        self.rules = SessionRules(Role.CLIENT)
        self.decoder = FrameDecoder()
        self.inbox: deque[Message] = deque()  # frames read but not yet consumed
        self.step_no = 0
        self.history: list[Sent] = []  # committed inputs, in order, as sent
        self.committed = 0
        self.pending: Sent | None = None  # last step's candidate inputs
        self.kept: Sent | None = None  # their deferred commit, sent with the next STEP (then in history)
        self.bytes_sent = 0
        self.compute_s = 0.0

    async def _send(self, msg: Message) -> None:
        data = self.rules.send(msg)
        self.bytes_sent += len(data)
        await self._write(data)

    async def _receive(self) -> Message:
        """The next frame, once the session's rules allow it (replayed steps are pipelined: one
        read may bring several)."""
        while not self.inbox:
            if self.decoder.failed is not None:  # a bad frame after the good ones of a read
                raise HopFailed(self.hop, f"sent a bad frame: {self.decoder.failed}")
            try:
                data = await self.stream.read(READ_CHUNK)
            except (trio.Cancelled, trio.TooSlowError):
                raise
            except Exception as e:  # noqa: BLE001 - py-libp2p's many ways of a stream ending (reset, EOF)
                raise HopFailed(self.hop, f"connection lost: {type(e).__name__}: {e}", cause="closed") from e
            if not data:
                raise HopFailed(self.hop, "connection closed", cause="closed")
            try:
                self.inbox.extend(self.decoder.feed(data))
            except WireError as e:
                raise HopFailed(self.hop, f"sent a bad frame: {e}") from None
        msg = self.inbox.popleft()
        try:
            self.rules.receive(msg)
        except WireError as e:
            raise HopFailed(self.hop, f"broke the protocol: {e}") from None
        if isinstance(msg, ErrorMsg):
            raise HopFailed(self.hop, f"error {msg.code}: {msg.message}", msg.code, cause="error")
        return msg

    async def _write(self, data: bytes) -> None:
        try:
            await self.stream.write(data)
        except (trio.Cancelled, trio.TooSlowError):
            raise
        except Exception as e:  # noqa: BLE001 - as in _receive
            raise HopFailed(self.hop, f"connection lost: {type(e).__name__}: {e}", cause="closed") from e

    @contextmanager
    def _within(self, seconds: float, what: str) -> Iterator[None]:
        """`what` must be answered within `seconds`, else the hop failed with cause "timeout"."""
        try:
            with trio.fail_after(seconds):
                yield
        except trio.TooSlowError:
            raise HopFailed(self.hop, f"no answer to {what} in {seconds:.1f} s", cause="timeout") from None

    async def open(self) -> None:
        extra = CHAIN_OPEN_S if self.downstream is not None else 0.0
        with self._within(deadline(self.hop, 0, self.timeout) + extra, "OPEN"):
            await self._send(Open(self.session_id, self.model_id, self.hop.start, self.hop.end,
                                  self.max_len, self.batch, self.dtype, self.commitments, self.exact,
                                  upstream=self.upstream, downstream=self.downstream))
            ok = await self._receive()
        if not isinstance(ok, OpenOk) or ok.max_length < self.max_len:
            raise HopFailed(self.hop, f"bad answer to OPEN: {ok!r}")
        if self.exact and not (ok.exact and ok.minor >= 1):
            raise HopFailed(self.hop, "peer does not grant exact (batch-invariant) computation: it "
                            f"speaks protocol 1.{ok.minor} or computes on a GPU")
        self._check_variant(ok.compute_dtype)
        self.peer_dtype, self.minor = ok.compute_dtype, ok.minor
        if self.downstream is not None:
            self.chained, self.link_error = ok.chained, ok.link_error

    def _check_variant(self, name: str) -> None:
        """The variant a peer declares must be the one its record announced (which this client
        accepted), computed in a float dtype: checks then only meet variants the client chose,
        and a peer naming another or a made-up one broke the protocol (it is banned)."""
        dtype, scheme = split_name(name)
        if scheme != self.hop.quant or dtype not in COMPUTE_DTYPES:
            raise HopFailed(self.hop, f"declares it computes in {name!r}, but its record announces the "
                            f"{self.hop.quant} variant in one of {', '.join(COMPUTE_DTYPES)}")

    def feed_from_upstream(self, fed: bool) -> None:
        """Whether the next step's input comes from the upstream peer (it forwarded the previous
        hop's output here) rather than from this client (star); never again once its link fell silent."""
        self.fed = fed and self.silent_link is None

    def feeds(self, other: Session) -> bool:
        """Whether this hop's last output went on to `other`'s session (its peer took it)."""
        return self.forwarded and self.downstream is not None and self.downstream.session_id == other.session_id

    async def step(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool,
                   timeout: float | None = None) -> Tensor:
        msg = self._message(h, positions, mask, commit)
        limit = timeout or deadline(self.hop, h.shape[0] * h.shape[1], self.timeout, self.exact)
        if self.chained:  # the peer writes its output to the next peer before ours goes out
            limit += link_write_s(msg.hidden.numel() * msg.hidden.element_size())
        if self.fed:
            self.rules.sent(msg)  # the upstream peer delivers it
            reply = await self._fed_reply(msg, limit)
        else:
            with self._within(limit, f"STEP {msg.step}"):
                await self._send(msg)
                reply = await self._receive()
        out = self._accept(msg, reply)  # still judged as fed: a late forward of other bytes bans both
        self.fed = self.fed and self.silent_link is None
        self._advance(msg, positions)
        return out

    async def _fed_reply(self, msg: Step, limit: float) -> Message:
        """The reply to a STEP the upstream peer forwards here. None within `limit` may be a silent
        link (packets dropped between the two peers: the upstream's writes still succeed) as well
        as a frozen peer, so the client then sends the STEP itself (the peer answers it once and
        drops the link) and waits as long again: an answer then blames the link, not this peer,
        and the client steps this session itself from then on. The read is never cancelled
        before the end (a cancelled read may lose bytes the stream then lacks)."""

        async def send_when_late() -> None:
            await trio.sleep(limit)
            self.silent_link = f"no input forwarded by {self.upstream} in {limit:.1f} s"
            data = encode(msg)
            self.bytes_sent += len(data)
            await self._write(data)

        with self._within(2 * limit, f"STEP {msg.step} (forwarded, then sent by the client)"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_when_late)
                reply = await self._receive()
                if self.silent_link is None:  # still asleep: a write once begun is left to finish
                    nursery.cancel_scope.cancel()
        return reply

    def silent_link_news(self) -> str | None:
        """Why the link into this hop fell silent, the first time it is asked after it did."""
        if self.silent_link is None or self._silent_told:
            return None
        self._silent_told = True
        return self.silent_link

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
        frames = [self.rules.send(m) for m in msgs]  # an fp16 overflow surfaces here, unwrapped
        outs: list[Tensor] = []

        async def write_all() -> None:
            for data in frames:
                self.bytes_sent += len(data)
                await self._write(data)

        failed: BaseException | None = None
        with self._within(timeout, f"a replay of {len(msgs)} steps"):
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
        keep = self.kept.keep if self.kept is not None else []
        msg = Step(self.session_id, self.step_no, self.committed + len(keep), positions.tolist(), h,
                   keep=keep, mask=mask, commit=commit, replay=replay)
        if self.commitments:
            msg.input_commitment = input_commitment(self.session_id, self.step_no, self.last_input, h,
                                                    msg.positions, msg.cache_len, msg.keep, mask, commit,
                                                    self.dtype)
        return msg

    def _accept(self, msg: Step, reply) -> Tensor:
        """A reply's hidden states, once it answers `msg` (and, asked for, commits to its bytes)."""
        if not isinstance(reply, StepOk) or reply.step != msg.step:
            raise HopFailed(self.hop, f"bad answer to STEP {msg.step}")
        if self.commitments and reply.input_commitment not in (None, msg.input_commitment):
            if self.fed:
                raise HopFailed(self.hop, f"STEP {msg.step}: the input it received from {self.upstream[-8:]} is "
                                "not the output that peer committed to", cause="link", link=self.upstream)
            raise HopFailed(self.hop, f"STEP {msg.step}: computed on a forwarded input its replaced upstream "
                            "sent, not on this client's", cause="stale")
        if self.commitments:
            self._check_commitment(msg, reply)
        self.forwarded = reply.forwarded and self.chained
        self.forwarded_steps += self.forwarded
        if reply.link_error:
            self.chained, self.link_error = False, reply.link_error
        self.compute_s += (reply.compute_us or 0) / 1e6
        return reply.hidden

    def _advance(self, msg: Step, positions: Tensor) -> None:
        """The session's state once `msg` has been answered (or, replaying, is on its way)."""
        self.last_input = msg.input_commitment
        self.step_no += 1
        self._commit_kept()
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

    def _commit_kept(self) -> None:
        """The kept candidates into the history, as the very object `inputs()` handed out (the
        referee follows a session's inputs by identity)."""
        if self.kept is not None:
            self.history.append(self.kept)
            self.committed += self.kept.tokens
        self.kept, self.pending = None, None

    def commit(self, keep: Sequence[int] | None) -> None:
        if self.pending is None:
            return
        self.kept = replace(self.pending, keep=list(range(self.pending.h.shape[1]) if keep is None else keep))

    def rollback(self, length: int) -> None:
        self._commit_kept()
        self.history, self.committed = truncated(self.history, length), length

    def inputs(self) -> list[Sent]:
        """Everything committed so far, as it was first sent (plus a kept-but-not-yet-sent
        commit). Replaying the same chunks makes the same matmuls, so a replacement peer
        rebuilds a bit-identical KV cache: one batched replay would differ in low-order bits,
        enough to flip a near-tie in bf16, except in an exact session (`rechunked`)."""
        return self.history + ([self.kept] if self.kept is not None else [])

    async def close(self) -> None:
        """CLOSE and end the stream, also when the caller is being cancelled (a client that hung
        up): shielded for at most a second, so the peer frees the cache now rather than at its
        idle timeout."""
        with trio.move_on_after(1.0, shield=True):
            try:
                if self.rules.state is not SessionState.CLOSED and self.rules.open is not None:
                    await self._send(Close(self.session_id))
            except Exception as e:  # noqa: BLE001 - a dead stream fails in py-libp2p's own ways
                log.debug("CLOSE to %s not sent: %s", self.hop.peer_id, e)
            finally:
                await close_quietly(self.stream)
