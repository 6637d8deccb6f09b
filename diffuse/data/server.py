"""Server side of inference sessions: one stream = one session = one KV cache in RAM.

The peer keeps serving whatever a client does: every protocol violation, bad request or
resource problem is answered with an ERROR frame naming it, the stream is closed, and the
session's cache is zeroed and released. Compute runs behind a limiter of one, so two sessions
never fight over the same cores, on the event loop's own thread: torch computed 20-25% slower in
worker threads on these machines, and the price - heartbeats and other sessions' frames wait
for the step in progress, at most a long prefill - is smaller.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import trio

from diffuse.data.codec import (
    Close, ErrorCode, ErrorMsg, FrameDecoder, Message, Open, OpenOk, Ping, Pong, Step, StepOk, WireError,
)
from diffuse.data.commitments import input_commitment, output_commitment
from diffuse.data.session import Role, SessionRules, SessionState
from diffuse.data.stream import READ_CHUNK, ByteStream, close_quietly
from diffuse.model.engine import BlockSpan, KVCache

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    max_session_tokens: int = 8192  # KV entries one session may hold
    max_total_tokens: int = 65536  # KV entries over all sessions of this peer
    max_sessions: int = 64
    idle_timeout: float = 300.0  # seconds a session may sit without a message
    max_frame: int = 64 << 20


class BlockServer:
    """Serves blocks [span.start, span.end) of `model_id` to any number of sessions."""

    def __init__(self, model_id: str, span: BlockSpan, limits: ServerLimits | None = None):
        self.model_id, self.span = model_id, span
        self.limits = limits or ServerLimits()
        self.compute = trio.CapacityLimiter(1)
        self.tokens_reserved = 0
        self.sessions = 0
        self.steps_served = 0
        self.tokens_served = 0
        self.accepting = True
        self.conns: set[_Conn] = set()
        self.dtype = span.blocks[0].wo.weight.dtype
        self.device = span.blocks[0].wo.weight.device

    @property
    def free_tokens(self) -> int:
        return self.limits.max_total_tokens - self.tokens_reserved

    def status(self) -> dict:
        return {"sessions": self.sessions, "free_cache_tokens": self.free_tokens,
                "steps_served": self.steps_served, "tokens_served": self.tokens_served}

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

    async def handle(self, stream: ByteStream) -> None:
        """Run one session to its end; never raises for anything the client did."""
        conn = _Conn(self, stream)
        self.conns.add(conn)
        try:
            await conn.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
            log.info("session stream dropped by the client")
        except Exception as e:  # noqa: BLE001 - one session's bug must not take the peer down
            if _is_stream_error(e):
                log.info("session stream failed: %s", e)
            else:
                log.exception("internal error in a session")
                await conn.error(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        finally:
            self.conns.discard(conn)
            conn.release()
            await close_quietly(stream)


def _is_stream_error(e: Exception) -> bool:
    # py-libp2p raises its own StreamError / MuxedStreamEOF family for resets and EOFs.
    return type(e).__module__.startswith("libp2p") or isinstance(e, (ConnectionError, OSError))


class _Conn:
    """One stream's session: protocol state, cache, and the resources it holds."""

    def __init__(self, server: BlockServer, stream: ByteStream):
        self.server, self.stream = server, stream
        self.state = SessionRules(Role.SERVER)
        self.decoder = FrameDecoder(server.limits.max_frame)
        self.cache: KVCache | None = None
        self.span: BlockSpan | None = None
        self.reserved = 0
        self.counted = False
        self.last_input: bytes | None = None  # this session's input-commitment chain
        self.waiting: trio.CancelScope | None = None  # the read between messages, while in it
        self.leaving = False

    def hand_off(self) -> None:
        """The peer is shutting down: end this session at the next message boundary."""
        self.leaving = True
        if self.waiting is not None:
            self.waiting.cancel()

    async def run(self) -> None:
        limits = self.server.limits
        while True:
            data = b""
            with trio.move_on_after(limits.idle_timeout) as idle:
                self.waiting = idle
                if not self.leaving:
                    data = await self.stream.read(READ_CHUNK)
            self.waiting = None
            if self.leaving:  # handed off between messages, so the client reads a clean ERROR
                await self.error(ErrorCode.OVERLOADED, "peer is shutting down: continue on a replica")
                return
            if idle.cancelled_caught:
                await self.error(ErrorCode.TIMEOUT, f"session idle for {limits.idle_timeout:g} s: closed")
                return
            if not data:
                return
            try:
                for msg in self.decoder.feed(data):
                    if await self.on_message(msg):
                        return
            except WireError as e:
                await self.error(e.code, str(e))
                return

    async def on_message(self, msg: Message) -> bool:
        """Handle one message; True ends the session."""
        if isinstance(msg, Ping):
            await self.stream.write(self.state.send(Pong(msg.nonce, msg.session_id)))
            return False
        if isinstance(msg, Pong):
            return False
        self.state.receive(msg)
        if isinstance(msg, Open):
            return await self.on_open(msg)
        if isinstance(msg, Close):
            return True
        if isinstance(msg, Step):
            return await self.on_step(msg)
        return False

    async def on_open(self, m: Open) -> bool:
        srv = self.server
        span = srv.span
        if not srv.accepting:
            return await self.error(ErrorCode.OVERLOADED, "peer is shutting down: use another replica")
        if m.model_id != srv.model_id:
            return await self.error(ErrorCode.UNKNOWN_MODEL,
                                    f"this peer serves {srv.model_id!r}, not {m.model_id!r}")
        if not span.start <= m.start < m.end <= span.end:
            return await self.error(ErrorCode.BLOCKS_NOT_SERVED,
                                    f"blocks [{m.start}, {m.end}) requested, this peer serves "
                                    f"[{span.start}, {span.end})")
        if m.max_length > srv.limits.max_session_tokens:
            return await self.error(ErrorCode.TOO_LONG,
                                    f"max_length {m.max_length} exceeds this peer's limit of "
                                    f"{srv.limits.max_session_tokens} tokens per session")
        tokens = m.max_length * m.batch_size
        if srv.sessions >= srv.limits.max_sessions or tokens > srv.free_tokens:
            return await self.error(ErrorCode.NO_CAPACITY,
                                    f"no KV cache room: {tokens} tokens asked, {srv.free_tokens} free, "
                                    f"{srv.sessions} sessions open")
        self.span = span.view(m.start, m.end)
        # Batch-invariant kernels are checked for CPU BLAS only (kernels.exact_linear); a GPU declines.
        exact = m.exact and self.state.minor >= 1 and srv.device.type == "cpu"
        try:
            self.cache = self.span.new_cache(m.max_length, m.batch_size, exact)
        except (RuntimeError, MemoryError) as e:
            return await self.error(ErrorCode.NO_CAPACITY, f"cannot allocate the KV cache: {e}")
        srv.tokens_reserved += tokens
        srv.sessions += 1
        self.reserved, self.counted = tokens, True
        await self.stream.write(self.state.send(OpenOk(m.session_id, m.max_length,
                                                       str(srv.dtype).removeprefix("torch."), exact)))
        return False

    async def on_step(self, m: Step) -> bool:
        """Run one STEP; True ends the session (its inputs disagree with the client's commitment)."""
        opened = self.state.open
        if opened.want_commitments:
            # Chain our own view of the inputs; the output commitment binds it, never the client's claim.
            self.last_input = input_commitment(m.session_id, m.step, self.last_input, m.hidden, m.positions,
                                               m.cache_len, m.keep, m.mask, m.commit, opened.dtype)
            if m.input_commitment is not None and m.input_commitment != self.last_input:
                return await self.error(ErrorCode.BAD_STEP, f"STEP {m.step}: input commitment differs "
                                        "from this session's inputs as received")
        cache, span = self.cache, self.span
        if m.keep:
            cache.commit(m.keep)
        elif cache.pending:
            cache.rollback(cache.length)  # candidates nobody kept
        if m.cache_len < cache.length:
            cache.rollback(m.cache_len)
        positions = torch.tensor(m.positions, dtype=torch.long)
        hidden = m.hidden

        def compute() -> tuple[torch.Tensor, float]:
            t0 = time.perf_counter()
            out = span(hidden.to(self.server.dtype), positions, cache, m.mask, m.commit)
            return out, time.perf_counter() - t0

        # On the loop's own thread: torch ran 20-25% slower in worker threads here (44 vs 55 ms per
        # 30-block decode step), and computes one step at a time anyway; the loop waits meanwhile.
        # A free limiter is taken without trio's checkpoint (one pass through the run loop, on
        # every token); a busy one is waited for in order, and release hands it to the next.
        try:
            self.server.compute.acquire_nowait()
        except trio.WouldBlock:
            await self.server.compute.acquire()
        try:
            out, seconds = compute()
        finally:
            self.server.compute.release()
        self.server.steps_served += 1
        self.server.tokens_served += hidden.shape[1]
        commitment = None
        if opened.want_commitments:
            out = out.to(opened.dtype)  # commit to exactly the bytes that go out
            commitment = output_commitment(m.session_id, m.step, self.last_input, out, opened.dtype)
        await self.stream.write(self.state.send(StepOk(m.session_id, m.step, out, output_commitment=commitment,
                                                       compute_us=min(math.ceil(seconds * 1e6), 2**32 - 1))))
        return False

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
        if self.cache is not None:
            self.cache.wipe()
            self.cache = None
        if self.counted:
            self.server.tokens_reserved -= self.reserved
            self.server.sessions -= 1
            self.counted = False
