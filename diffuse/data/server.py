"""Server side of inference sessions: one stream = one session = one KV cache in RAM.

The peer keeps serving whatever a client does: every protocol violation, bad request or
resource problem is answered with an ERROR frame naming it (after the replies to every message
that came before it), the stream is closed, and the session's cache is zeroed and released.

What a session may take is bounded per session, per remote peer and in total, in KV-cache
tokens (batch rows counted) and in bytes of unfinished frames; a stream that does not OPEN, or
an OPEN that does not STEP, within `first_step_timeout` is closed (a chained session's, whose
first STEP follows its upstream's prefill, within `chained_first_step_timeout`), so an idle
reservation expires fast (and costs nothing meanwhile: cache pages are touched only as tokens
arrive).
Compute is batched (scheduler.py): the steps of sessions that are ready together run as one
forward through the span, a long prefill in chunks, so a step waits behind one batch at most.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import trio

from diffuse.data.chain import DialPeer, Link, SignedAddrs, open_link, signed_addrs
from diffuse.data.codec import (
    HEADER_SIZE, MAX_FRAME, Attach, AttachOk, Close, ErrorCode, ErrorMsg, Ext, FrameDecoder, Message, Open, OpenOk,
    Ping, Pong, Step, StepOk, WireError, encode,
)
from diffuse.data.commitments import input_commitment, output_commitment
from diffuse.data import scheduler
from diffuse.data.admission import Admission, Books
from diffuse.data.session import Role, SessionRules, SessionState
from diffuse.data.stream import READ_CHUNK, ByteStream, close_quietly
from diffuse.model.engine import BlockSpan, KVCache
from diffuse.model.quant import compute_name

log = logging.getLogger(__name__)
OPEN_FRAME = 4096  # bytes a frame may have before OPEN_OK: an OPEN is under 300 (4096 with CHAIN_TO_RECORD), a PING 32
BARE_CHAIN_TO = ("not dialled: CHAIN_TO names bare addresses, and this peer dials only those the next peer "
                 "signed (CHAIN_TO_RECORD, protocol 1.3)")


@dataclass
class ServerLimits:
    max_session_tokens: int = 8192  # KV entries one session may hold (max_length x batch rows)
    max_total_tokens: int = 65536  # KV entries over all sessions of this peer
    max_sessions: int = 64
    peer_share: float = 0.5  # of the sessions and of the KV entries one remote peer may hold
    idle_timeout: float = 300.0  # seconds a session may sit between messages
    first_step_timeout: float = 10.0  # seconds from the stream's start to OPEN, and from OPEN_OK to a STEP
    # A chained session's first STEP comes after its upstream's prefill, or from the client once
    # that is late (after its step deadline: 30 s at most by default), so it may wait longer.
    chained_first_step_timeout: float = 60.0
    max_frame: int = MAX_FRAME  # bytes of one frame, however large a session is
    max_buffered: int = 256 << 20  # bytes of unfinished frames over all streams
    queue_wait: float = 2.0  # seconds an OPEN may wait for room (admission.py), under the client's OPEN deadline
    books: Books | None = None  # the peer's credit ledger, which orders waiting OPENs (trust/credits.py)


def frame_bound(m: Open, hidden_size: int, dtype_bytes: int, limit: int) -> int:
    """The largest frame the session `m` can legitimately send: one STEP of max_length tokens
    (positions, keep list, hidden states, mask), or `limit` if smaller."""
    t = m.max_length
    return min(limit, HEADER_SIZE + 16 + 2 * t + 4 * t + 2 + 4 * 3 + m.batch_size * t * hidden_size * dtype_bytes
               + (t * t + 7) // 8 + 4096)


class BlockServer:
    """Serves blocks [span.start, span.end) of `model_id` to any number of sessions."""

    def __init__(self, model_id: str, span: BlockSpan, limits: ServerLimits | None = None):
        self.model_id, self.span = model_id, span
        self.limits = limits or ServerLimits()
        self.batcher = scheduler.span_batcher()
        trace = os.environ.get(scheduler.TRACE_ENV)
        self.batcher.trace = os.path.join(trace, scheduler.trace_name(os.getpid(), model_id)) if trace else None
        self.tokens_reserved = 0
        self.sessions = 0
        self.by_peer: dict[str, list[int]] = {}  # remote peer -> [sessions, KV entries] it holds
        self.buffered = 0  # bytes of unfinished frames over all streams
        self.steps_served = 0
        self.tokens_served = 0
        self.in_flight = self.most_in_flight = 0  # sessions with a STEP taken and not yet answered (now, at most)
        self.accepting = True
        self.admission = Admission(self.limits.books, self.limits.queue_wait)
        self.conns: set[_Conn] = set()
        self.dtype = span.blocks[0].wo.weight.dtype
        self.device = span.blocks[0].wo.weight.device
        self.dial: DialPeer | None = None  # streams to other peers, for chained sessions' links
        self.addrs_of: SignedAddrs = signed_addrs  # where a link may go: what the next peer's record signs
        self.linkable: dict[bytes, _Conn] = {}  # open sessions that name an upstream peer, by id
        self.alter_forward = None  # TESTING ONLY (trust/tamper.py, kind "forward"): corrupts forwarded outputs

    @property
    def free_tokens(self) -> int:
        return self.limits.max_total_tokens - self.tokens_reserved

    def status(self) -> dict:
        b = self.batcher.stats
        return {"sessions": self.sessions, "free_cache_tokens": self.free_tokens,
                "steps_served": self.steps_served, "tokens_served": self.tokens_served,
                "most_in_flight": self.most_in_flight,
                "batches": b.batches, "batch_steps": b.steps, "batched_steps": b.shared, "largest_batch": b.largest}

    async def drain(self, timeout: float) -> int:
        """Stop taking sessions, let open ones finish for up to `timeout` s, then hand off the rest:
        each gets an ERROR (at a message boundary) and its client replays it into a replica.
        Returns how many were handed off."""
        self.accepting = False
        with trio.move_on_after(timeout):
            while self.sessions:
                await trio.sleep(0.05)
        busy = [c for c in self.conns if c.counted]
        for conn in busy:
            conn.hand_off()
        with trio.move_on_after(2.0):
            while self.sessions:
                await trio.sleep(0.05)
        return len(busy)

    async def handle(self, stream: ByteStream, remote: str = "") -> None:
        """Run one session to its end; never raises for anything the client did. `remote`
        names the peer at the other end (its share of this peer is bounded)."""
        conn = _Conn(self, stream, remote)
        self.conns.add(conn)
        try:
            # A chained session's link watcher and writes live here: a write stuck in a full socket
            # is written whole or times out (control/whole_writes.py), so the handler may outlive
            # its session by that long, its resources already released.
            async with trio.open_nursery() as nursery:
                conn.nursery = nursery
                await self._serve(conn)
                nursery.cancel_scope.cancel()
        finally:
            self.conns.discard(conn)
            if conn.link_out is not None:
                with trio.move_on_after(1.0, shield=True):
                    await conn.link_out.close()
            conn.release()
            await close_quietly(stream)

    async def _serve(self, conn: _Conn) -> None:
        try:
            try:
                await conn.run()
            finally:
                conn.release()  # at once: its client may read the last reply and look before we return
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
            log.info("session stream dropped by the client")
        except Exception as e:  # noqa: BLE001 - one session's bug must not take the peer down
            if _is_stream_error(e):
                log.info("session stream failed: %s", e)
            else:
                log.exception("internal error in a session")
                await conn.error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _is_stream_error(e: Exception) -> bool:
    # py-libp2p raises its own StreamError / MuxedStreamEOF family for resets and EOFs.
    return type(e).__module__.startswith("libp2p") or isinstance(e, (ConnectionError, OSError))


class _Conn:
    """One stream's session: protocol state, cache, and the resources it holds."""

    def __init__(self, server: BlockServer, stream: ByteStream, remote: str):
        self.server, self.stream, self.remote = server, stream, remote
        self.state = SessionRules(Role.SERVER, server.span.cfg.hidden_size)
        self.decoder = FrameDecoder(min(OPEN_FRAME, server.limits.max_frame))
        self.buffered = 0  # this stream's share of server.buffered
        self.cache: KVCache | None = None
        self.span: BlockSpan | None = None
        self.reserved = 0
        self.counted = False
        self.stepped = False
        self.last_input: bytes | None = None  # this session's input-commitment chain
        self.work = 0  # block-tokens computed for the client, for the peer's books
        self.waiting: trio.CancelScope | None = None  # the read between messages, while in it
        self.leaving = False
        self.nursery: trio.Nursery | None = None
        self.lock = trio.Lock()  # one message at a time, from the client's stream or the upstream link
        self.upstream: str | None = None  # the peer the client named to forward STEPs into this session
        self.link_in: _Conn | None = None  # the attached upstream link (a _Conn of its own)
        self.target: _Conn | None = None  # on a link's _Conn: the session its STEPs go into
        self.link_out: Link | None = None  # where this session's outputs are forwarded
        self.last_step: Step | None = None  # a STEP that comes again from the other source is ignored
        self.ended = False  # set from the link side: the session is over, the client's read loop ends
        self.active = trio.current_time()  # when a message last came, on this stream or the upstream link

    def hand_off(self) -> None:
        """The peer is shutting down: end this session at the next message boundary."""
        self.leaving = True
        if self.waiting is not None:
            self.waiting.cancel()

    async def run(self) -> None:
        limits = self.server.limits
        while True:
            data = b""
            first = limits.chained_first_step_timeout if self.upstream is not None else limits.first_step_timeout
            wait = limits.idle_timeout if self.stepped else min(first, limits.idle_timeout)
            # Idle since the session's last message, from this stream or (chained) its upstream link.
            with trio.move_on_after(max(0.0, wait - (trio.current_time() - self.active))) as idle:
                self.waiting = idle
                if not self.leaving:
                    data = await self.stream.read(READ_CHUNK)
            self.waiting = None
            if self.ended or (self.leaving and self.target is not None):  # a link, or ended from its side
                return
            if self.leaving:  # handed off between messages, so the client reads a clean ERROR
                await self.error(ErrorCode.OVERLOADED, "peer is shutting down: continue on a replica")
                return
            if idle.cancelled_caught and trio.current_time() - self.active < wait:
                continue  # the session steps through its upstream link meanwhile
            if idle.cancelled_caught:
                what = "" if self.stepped else (" without a STEP" if self.counted else " without an OPEN")
                await self.error(ErrorCode.TIMEOUT, f"session idle for {wait:g} s{what}: closed")
                return
            if not data:  # end of stream; an unfinished frame in the decoder is dropped with it
                return
            self.active = trio.current_time()
            try:
                self.decoder.receive(data)
                while (msg := self.decoder.next_message()) is not None:
                    if await self.on_message(msg):
                        return
            except WireError as e:
                await self.error(e.code, str(e))
                return
            if self._buffer_over():
                await self.error(ErrorCode.OVERLOADED, "this peer holds too many bytes of unfinished frames: "
                                 f"over {limits.max_buffered} over all sessions")
                return

    def _buffer_over(self) -> bool:
        """Account this stream's unfinished frame; True if all streams' together would pass the
        bound with it (then it is dropped at once, before others read on)."""
        srv = self.server
        srv.buffered += self.decoder.pending - self.buffered
        self.buffered = self.decoder.pending
        if srv.buffered <= srv.limits.max_buffered:
            return False
        srv.buffered -= self.buffered
        self.buffered = 0
        return True

    async def on_message(self, msg: Message) -> bool:
        """Handle one message; True ends the session (or the link, on a link's stream)."""
        if self.target is not None:
            return await self.target.forwarded(msg, self)
        if isinstance(msg, Attach) and self.state.state is SessionState.AWAIT_OPEN:
            return await self.on_attach(msg)
        async with self.lock:
            return await self._on_message(msg)

    async def _on_message(self, msg: Message) -> bool:
        if isinstance(msg, Ping):
            await self.stream.write(self.state.send(Pong(msg.nonce, msg.session_id)))
            return False
        if isinstance(msg, Pong):
            return False
        if isinstance(msg, Step):
            self.detach()  # the client steps this session itself: no more forwarded frames
            if self._duplicate(msg):
                return False
        self.state.receive(msg)
        if isinstance(msg, Open):
            return await self.on_open(msg)
        if isinstance(msg, (Close, ErrorMsg)):  # the client ended the session, with a reason or without
            return True
        if isinstance(msg, Step):
            self.stepped = True
            return await self.on_step(msg)
        return False

    def _refusal(self, m: Open) -> tuple[ErrorCode, str] | None:
        """Why this peer cannot take the session `m`, if it cannot."""
        srv, limits, span = self.server, self.server.limits, self.server.span
        if not srv.accepting:
            return ErrorCode.OVERLOADED, "peer is shutting down: use another replica"
        if m.model_id != srv.model_id:
            return ErrorCode.UNKNOWN_MODEL, f"this peer serves {srv.model_id!r}, not {m.model_id!r}"
        if not span.start <= m.start < m.end <= span.end:
            return (ErrorCode.BLOCKS_NOT_SERVED,
                    f"blocks [{m.start}, {m.end}) requested, this peer serves [{span.start}, {span.end})")
        tokens = m.max_length * m.batch_size
        if tokens > limits.max_session_tokens:
            return (ErrorCode.TOO_LONG, f"max_length {m.max_length} x batch {m.batch_size} = {tokens} KV entries "
                    f"exceed this peer's limit of {limits.max_session_tokens} per session")
        sessions, held = srv.by_peer.get(self.remote, [0, 0])
        peer_tokens = int(limits.max_total_tokens * limits.peer_share)
        peer_sessions = max(1, int(limits.max_sessions * limits.peer_share))
        if sessions >= peer_sessions or held + tokens > peer_tokens:
            return (ErrorCode.NO_CAPACITY, f"your share of this peer is full: {sessions} of {peer_sessions} sessions, "
                    f"{held} + {tokens} of {peer_tokens} KV entries")
        return None

    async def _admitted(self, tokens: int) -> tuple[ErrorCode, str] | None:
        """Wait in the admission queue for room for `tokens` KV entries, if the peer is full."""
        srv, limits = self.server, self.server.limits
        if await srv.admission.enter(self.remote, lambda: srv.sessions < limits.max_sessions
                                     and tokens <= srv.free_tokens) and srv.accepting:
            return None
        return (ErrorCode.NO_CAPACITY, f"no KV cache room: {tokens} entries asked, {srv.free_tokens} free, "
                f"{srv.sessions} of {limits.max_sessions} sessions open")

    async def on_attach(self, m: Attach) -> bool:
        """Another peer asks to forward STEPs into session `m.session_id`: only the peer the
        session's client named, once; anyone else is refused (the stream ends, the peer serves on)."""
        target = self.server.linkable.get(m.session_id)
        if target is None or target.upstream != self.remote or target.link_in is not None or target.ended:
            log.info("refused a link from %s into session %s", self.remote, m.session_id.hex()[:8])
            await self._say(ErrorMsg(int(ErrorCode.FORBIDDEN), "no session here takes forwarded frames from you",
                                     m.session_id))
            return True
        self.target, target.link_in, self.stepped = target, self, True
        self.decoder.max_frame = target.decoder.max_frame
        await self.stream.write(encode(AttachOk(m.session_id)))
        return False

    async def forwarded(self, msg: Message, link: _Conn) -> bool:
        """A message from the upstream link `link`; True ends the link (never the session: a bad
        upstream must not cost this hop its session), after telling the upstream why."""
        if isinstance(msg, Ping):
            await link.stream.write(encode(Pong(msg.nonce, msg.session_id)))
            return False
        async with self.lock:
            why = None
            if self.link_in is not link:
                why = "the client steps this session itself now"
            elif not isinstance(msg, Step) or msg.session_id != self.state.open.session_id:
                why = f"only STEPs of session {self.state.open.session_id.hex()[:8]} go on a forward link"
            elif self.state.state is not SessionState.OPEN:
                why = "the session has ended"
            elif self._duplicate(msg):
                return False
            else:
                msg.input_commitment = None  # the upstream cannot know this session's chain
                try:
                    self.state.receive(msg)
                except WireError as e:
                    why = str(e)
            if why is None:
                self.stepped, self.active = True, trio.current_time()
                try:
                    done = await self.on_step(msg)
                except Exception as e:  # noqa: BLE001 - the client's stream failed under us
                    log.info("session stream failed: %s", e)
                    done = True
                if done:
                    self.end()
                return False
        if self.link_in is link:
            self.detach()
        await link._say(ErrorMsg(int(ErrorCode.BAD_STEP), f"forwarded frame refused: {why}", msg.session_id))
        return True

    def _duplicate(self, m: Step) -> bool:
        """Whether `m` is the last STEP again, from the other source (the client stepped a hop itself
        while the upstream's copy was on its way): answered once already, so ignored."""
        p = self.last_step
        if p is None or m.step != p.step:
            self.last_step = m if p is None or m.step > p.step else p
            return False
        return (list(m.positions) == list(p.positions) and m.cache_len == p.cache_len and list(m.keep) == list(p.keep)
                and m.commit == p.commit and m.hidden.dtype == p.hidden.dtype and torch.equal(m.hidden, p.hidden)
                and ((m.mask is None and p.mask is None) or (m.mask is not None and p.mask is not None
                                                             and torch.equal(m.mask, p.mask))))

    def detach(self) -> None:
        """Take no more forwarded frames: the upstream link's stream ends."""
        link, self.link_in, self.upstream = self.link_in, None, None
        if link is not None:
            link.stop()

    def stop(self) -> None:
        """End this stream's read loop at the next message boundary, quietly."""
        self.leaving = self.ended = True
        if self.waiting is not None:
            self.waiting.cancel()

    def end(self) -> None:
        """The session ended from its link's side (its client's stream failed): stop its read loop."""
        self.stop()

    async def _say(self, msg: ErrorMsg) -> None:
        try:
            await self.stream.write(encode(msg))
        except Exception as e:  # noqa: BLE001 - the other side may be gone already
            log.debug("ERROR not delivered: %s", e)

    async def on_open(self, m: Open) -> bool:
        srv = self.server
        refused = self._refusal(m) or await self._admitted(m.max_length * m.batch_size) or self._refusal(m)
        if refused is not None:
            return await self.error(*refused)
        self.span = srv.span.view(m.start, m.end)
        # Batch-invariant kernels are checked for CPU BLAS only (kernels.exact_linear); a GPU declines.
        exact = m.exact and self.state.minor >= 1 and srv.device.type == "cpu"
        try:
            self.cache = self.span.new_cache(m.max_length, m.batch_size, exact)
        except (RuntimeError, MemoryError) as e:
            return await self.error(ErrorCode.NO_CAPACITY, f"cannot allocate the KV cache: {e}")
        tokens = m.max_length * m.batch_size
        srv.tokens_reserved += tokens
        srv.sessions += 1
        share = srv.by_peer.setdefault(self.remote, [0, 0])
        share[0] += 1
        share[1] += tokens
        self.reserved, self.counted = tokens, True
        self.decoder.max_frame = frame_bound(m, srv.span.cfg.hidden_size, m.dtype.itemsize, srv.limits.max_frame)
        computes = compute_name(srv.dtype, getattr(srv.span, "quant", "none"))  # "bfloat16+int4": a variant
        link_error = await self._chain(m)
        await self.stream.write(self.state.send(OpenOk(m.session_id, m.max_length, computes, exact,
                                                       chained=self.link_out is not None, link_error=link_error)))
        return False

    async def _chain(self, m: Open) -> str | None:
        """A 1.2 session's part in a chain: the upstream it accepts, the link to its downstream
        (data/chain.py); why that link is not up, when it was asked for and is not."""
        if self.state.minor < 2:
            return None
        if m.upstream:
            self.upstream = m.upstream
            self.server.linkable[m.session_id] = self
        if m.downstream is None:  # a 1.2 client's bare addresses (CHAIN_TO) are never dialled
            return BARE_CHAIN_TO if Ext.CHAIN_TO in m.extensions else None
        if self.state.minor < 3:
            return None
        self.link_out, why = await open_link(self.server.dial, m.downstream, self.nursery, self.server.addrs_of)
        return why

    async def on_step(self, m: Step) -> bool:
        """Run one STEP; True ends the session (its inputs disagree with the client's commitment)."""
        srv = self.server
        srv.in_flight += 1
        srv.most_in_flight = max(srv.most_in_flight, srv.in_flight)
        try:
            return await self._step(m)
        finally:
            srv.in_flight -= 1

    async def _step(self, m: Step) -> bool:
        opened = self.state.open
        if opened.want_commitments:
            # Chain our own view of the inputs; the output commitment binds it, never the client's claim.
            self.last_input = input_commitment(m.session_id, m.step, self.last_input, m.hidden, m.positions,
                                               m.cache_len, m.keep, m.mask, m.commit, opened.dtype)
            if m.input_commitment is not None and m.input_commitment != self.last_input:
                return await self.error(ErrorCode.BAD_STEP, f"STEP {m.step}: input commitment differs "
                                        "from this session's inputs as received")
        cache = self.cache
        if m.keep:
            cache.commit(m.keep)
        elif cache.pending:
            cache.rollback(cache.length)  # candidates nobody kept
        if m.cache_len < cache.length:
            cache.rollback(m.cache_len)
        out, seconds = await self._compute(m)
        self.server.steps_served += 1
        self.server.tokens_served += m.hidden.shape[1]
        self.work += m.hidden.shape[1] * (opened.end - opened.start)
        commitment = None
        if opened.want_commitments or self.link_out is not None:
            out = out.to(opened.dtype)  # commit to, and forward, exactly the bytes that go out
        if opened.want_commitments:
            commitment = output_commitment(m.session_id, m.step, self.last_input, out, opened.dtype)
        forwarded, link_error = await self._forward(m, out)
        await self.stream.write(self.state.send(StepOk(
            m.session_id, m.step, out, output_commitment=commitment,
            compute_us=min(math.ceil(seconds * 1e6), 2**32 - 1), forwarded=forwarded,
            input_commitment=self.last_input if self.state.minor >= 2 else None, link_error=link_error)))
        return False

    async def _forward(self, m: Step, out: torch.Tensor) -> tuple[bool, str | None]:
        """Send the output down the chain first (the client's copy is off the critical path): a
        replayed step never (the next hop has it), a dropped link never again."""
        link = self.link_out
        if link is None or m.replay:
            return False, None
        if link.error is None:
            alter = self.server.alter_forward
            ok = await link.forward(Step(link.downstream.session_id, m.step, m.cache_len, m.positions,
                                         alter(out) if alter else out, m.keep, m.mask, m.commit))
            if ok:
                return True, None
        self.link_out = None  # told once; the client steps the next hop itself from now on
        return False, link.error

    async def _compute(self, m: Step) -> tuple[torch.Tensor, float]:
        """The step's output and the seconds its batches computed; T = 0 computes nothing."""
        hidden = m.hidden.to(self.server.dtype)
        if hidden.shape[1] == 0:
            return hidden, 0.0
        positions = torch.tensor(m.positions, dtype=torch.long)
        tag = m.session_id.hex() if self.server.batcher.trace else ""  # only a trace names sessions
        return await scheduler.forward(self.server.batcher, self.span, hidden, positions, self.cache, m.mask, m.commit,
                                       tag)

    async def error(self, code: ErrorCode, message: str) -> bool:
        """Answer with ERROR (once: a closed session says nothing more) and end the session."""
        log.info("session error %s: %s", code.name, message)
        if self.state.state is SessionState.CLOSED:
            return True
        sid = self.state.open.session_id if self.state.open else bytes(16)
        try:
            await self.stream.write(self.state.send(ErrorMsg(int(code), message, sid)))
        except Exception as e:  # noqa: BLE001 - the client may be gone already
            log.debug("ERROR not delivered: %s", e)
        return True

    def release(self) -> None:
        srv = self.server
        srv.buffered -= self.buffered
        self.buffered = 0
        if self.state.open is not None and srv.linkable.get(self.state.open.session_id) is self:
            del srv.linkable[self.state.open.session_id]
        self.detach()
        if self.target is not None and self.target.link_in is self:  # a link that broke: it stays unused
            self.target.link_in = self.target.upstream = None
        if self.cache is not None:
            self.cache.wipe()
            srv.batcher.leave(id(self.cache))
            self.cache = None
        if self.counted:
            srv.tokens_reserved -= self.reserved
            srv.sessions -= 1
            share = srv.by_peer[self.remote]
            share[0] -= 1
            share[1] -= self.reserved
            if share[0] == 0:
                del srv.by_peer[self.remote]
            self.counted = False
            srv.admission.took(self.remote, self.work)
            srv.admission.changed()
