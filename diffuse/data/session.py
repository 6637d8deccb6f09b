"""The rules of one inference session (one stream), with no I/O, the same for both roles (as h11).

Each side keeps a `SessionRules(role)`: `send(msg)` checks that a message of its own is legal now
and returns its frame; `receive(msg)` checks a decoded message of the other side before it is
acted on. Both follow the same transitions (spec section 7 of protocols/inference.md): OPEN ->
OPEN_OK or ERROR, then STEPs each answered by a STEP_OK in order, until CLOSE or ERROR. A message
the other side may not send raises `SessionError` with the ErrorCode to answer it with; one of our
own raises it with INTERNAL (a bug here, never the peer's fault).

The rules mirror the KV bookkeeping both sides must agree on: `committed` entries and
`candidates` (tokens of the last step kept provisionally for the next STEP's `keep`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from enum import Enum
from typing import NoReturn

from diffuse.data.codec import (
    VERSION_MINOR, Close, ErrorCode, ErrorMsg, Message, Open, OpenOk, Ping, Pong, SessionError, Step, StepOk,
    encode,
)


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class SessionState(Enum):
    AWAIT_OPEN = "await_open"  # nothing exchanged yet
    OPENING = "opening"  # OPEN sent; the server must answer OPEN_OK or ERROR
    OPEN = "open"
    CLOSED = "closed"  # CLOSE or ERROR: terminal


_CLIENT_SENDS = (Open, Step, Close)
_SERVER_SENDS = (OpenOk, StepOk)


class SessionRules:
    """One session's state, advanced by every message either side sends."""

    def __init__(self, role: Role, hidden_size: int | None = None) -> None:
        """hidden_size: the model's, where this side knows it (a server does); otherwise the
        first STEP sets it for the session."""
        self.role = role
        self.state = SessionState.AWAIT_OPEN
        self.open: Open | None = None
        self.max_length = 0  # granted
        self.committed = 0
        self.candidates = 0
        self.last_step = -1
        self.hidden_size = hidden_size
        self.pending: deque[tuple[int, int]] = deque()  # (step, T) sent and not yet answered

    @property
    def minor(self) -> int:
        """The session's protocol minor version: min(client's, ours); features beyond it are off."""
        return min(self.open.minor, VERSION_MINOR) if self.open else VERSION_MINOR

    def send(self, msg: Message) -> bytes:
        """Check that `msg` is legal from us now, advance, and return its encoded frame. A message
        that cannot be encoded (an fp16 overflow, a field out of range) leaves the state as it was."""
        if isinstance(msg, StepOk) and msg.wire_dtype is None and self.open is not None:
            msg = replace(msg, wire_dtype=self.open.dtype)  # a server computes in its own dtype
        frame = encode(msg)
        self._advance(msg, self.role, ours=True)
        return frame

    def sent(self, msg: Message) -> None:
        """Advance as `send` would for a message of ours that another peer delivers (a STEP its
        upstream forwards down a chain, protocol 1.2): checked, never encoded."""
        self._advance(msg, self.role, ours=True)

    def receive(self, msg: Message) -> None:
        """Check a message from the other side before acting on it, and advance."""
        self._advance(msg, Role.SERVER if self.role is Role.CLIENT else Role.CLIENT, ours=False)

    def _advance(self, msg: Message, sender: Role, ours: bool) -> None:
        def fail(why: str, code: ErrorCode = ErrorCode.BAD_STEP) -> NoReturn:
            raise SessionError(f"session {self.state.value}: {why}", ErrorCode.INTERNAL if ours else code)

        if isinstance(msg, (Ping, Pong)):
            return
        if self.state is SessionState.CLOSED:
            fail(f"{type(msg).__name__} after the session ended")
        allowed = _CLIENT_SENDS if sender is Role.CLIENT else _SERVER_SENDS
        if not isinstance(msg, (*allowed, ErrorMsg)):
            fail(f"a {sender.value} may not send {type(msg).__name__}")
        if isinstance(msg, Open):
            if self.state is not SessionState.AWAIT_OPEN:
                fail("second OPEN on one stream")
            self.open, self.state = msg, SessionState.OPENING
            return
        if isinstance(msg, ErrorMsg):  # either side may end the session with a reason
            self.state = SessionState.CLOSED
            return
        if self.open is None or msg.session_id != self.open.session_id:
            fail(f"{type(msg).__name__} for a session that was not opened on this stream")
        if isinstance(msg, Close):
            self.state = SessionState.CLOSED
        elif isinstance(msg, OpenOk):
            if self.state is not SessionState.OPENING:
                fail("OPEN_OK without a pending OPEN")
            if msg.max_length > self.open.max_length:
                fail("OPEN_OK grants more than was requested")
            self.max_length, self.state = msg.max_length, SessionState.OPEN
        elif isinstance(msg, Step):
            self._step(msg, fail)
        else:
            self._step_ok(msg, fail)

    def _step(self, m: Step, fail) -> None:
        if self.state is not SessionState.OPEN:
            fail("STEP before OPEN_OK")
        if m.step <= self.last_step:
            fail(f"step {m.step} after step {self.last_step}: steps must increase")
        if m.keep and not self.candidates:
            fail(f"step {m.step}: keep given but the previous step had no candidates")
        if m.keep and m.keep[-1] >= self.candidates:
            fail(f"step {m.step}: keep index {m.keep[-1]} out of range for {self.candidates} candidate tokens")
        if m.cache_len > self.committed + len(m.keep):
            fail(f"step {m.step}: cache_len {m.cache_len} exceeds the {self.committed + len(m.keep)} "
                 "committed entries")
        b, t, h = m.hidden.shape
        if m.cache_len + t > self.max_length:
            fail(f"step {m.step}: {m.cache_len} + {t} tokens exceed max_length {self.max_length}",
                 ErrorCode.TOO_LONG)
        if b != self.open.batch_size or m.hidden.dtype != self.open.dtype:
            fail(f"step {m.step}: hidden is {m.hidden.dtype} batch {b}, session is "
                 f"{self.open.dtype} batch {self.open.batch_size}")
        if self.hidden_size not in (None, h):
            fail(f"step {m.step}: hidden size {h}, the session's is {self.hidden_size}")
        self.hidden_size, self.last_step = h, m.step
        self.committed = m.cache_len + (t if m.commit else 0)
        self.candidates = 0 if m.commit else t
        self.pending.append((m.step, t))

    def _step_ok(self, msg: StepOk, fail) -> None:
        if not self.pending or self.pending[0][0] != msg.step:
            fail(f"STEP_OK for step {msg.step} out of order")
        step, t = self.pending.popleft()
        if tuple(msg.hidden.shape[:2]) != (self.open.batch_size, t) or msg.hidden.shape[2] != self.hidden_size:
            fail(f"STEP_OK {step}: output shape {list(msg.hidden.shape)} for a step of {t} tokens")
        if (msg.wire_dtype or msg.hidden.dtype) != self.open.dtype:
            fail(f"STEP_OK in {msg.wire_dtype or msg.hidden.dtype}, session is {self.open.dtype}")
