"""Fuzzing a serving peer with what a client may send: frames of every kind, well formed and not,
in any split into reads (hypothesis over the codec and the session rules, against a real
BlockServer of a tiny model).

Whatever arrives, the peer must never answer INTERNAL, must answer every message that came
before a bad one, in order (OPEN with OPEN_OK or ERROR, STEP with STEP_OK or ERROR, PING with
PONG), say nothing after an ERROR, refuse a hidden state of the wrong width with BAD_STEP, and
hold no session, reservation or buffer afterwards. `FUZZ_EXAMPLES` sets the budget (the suite's
run is short; scripts/fuzz_peer.py runs it longer). The seed examples are the inputs of
findings this harness would have caught: a STEP of zero tokens, hidden states of the wrong
width, and an OPEN followed by a bad STEP in one read.
"""

from __future__ import annotations

import math
import os
import struct

import pytest
import torch
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from diffuse.data.codec import (
    Close, ErrorCode, ErrorMsg, FrameDecoder, Open, OpenOk, Ping, Pong, Step, StepOk, WireError, decode, encode,
)
from diffuse.data.server import BlockServer, ServerLimits
from diffuse.model.load import load_span
from test_sessions import MemStream
from tiny import make_tiny

MODEL, H = "tiny", 64
SID = bytes(range(1, 17))
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
_SERVER: list[BlockServer] = []


@pytest.fixture(scope="module", autouse=True)
def server(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_tiny(tmp_path_factory.mktemp("fuzz") / "t", layers=4)
    _SERVER[:] = [BlockServer(MODEL, load_span(path, 0, 4), ServerLimits(max_session_tokens=256,
                                                                        first_step_timeout=5.0))]
    yield _SERVER[0]


def frame(msg: Step) -> bytes:
    """A STEP's frame, even one the codec refuses to send (inf or NaN values): its hidden
    tensor's bytes are the frame's last (no mask, no extensions), so they are swapped in."""
    try:
        return encode(msg)
    except WireError:
        clean = encode(Step(msg.session_id, msg.step, msg.cache_len, msg.positions, torch.zeros_like(msg.hidden),
                            msg.keep, msg.mask, msg.commit))
        raw = msg.hidden.contiguous().view(torch.uint8).numpy().tobytes()
        return clean[:len(clean) - len(raw)] + raw


@st.composite
def steps(draw, max_length: int) -> list[bytes]:
    out, committed = [], 0
    for n in range(draw(st.integers(0, 4))):
        t = draw(st.integers(0, 4))
        width = draw(st.sampled_from([H] * 6 + [H - 1, 2 * H, 1]))
        h = torch.randn(1, t, width)
        if t and draw(st.integers(0, 9)) == 0:
            h[0, 0, 0] = draw(st.sampled_from([math.nan, math.inf]))
        cache_len = draw(st.integers(0, committed + 1))
        positions = list(range(cache_len, cache_len + t))
        out.append(frame(Step(SID, n, cache_len, positions, h, commit=True)))
        committed = min(cache_len, committed) + t
    return out


@st.composite
def session(draw) -> list[bytes]:
    """A session's bytes as reads: OPEN, STEPs, PINGs, maybe CLOSE, maybe a mangled frame."""
    max_length = draw(st.integers(1, 300))
    frames = [encode(Open(SID, MODEL, 0, 4, max_length, 1, torch.float32))] if draw(st.integers(0, 9)) else []
    frames += draw(steps(max_length))
    if draw(st.booleans()):
        frames.insert(draw(st.integers(0, len(frames))), encode(Ping(draw(st.integers(0, 2**64 - 1)))))
    if frames and draw(st.booleans()):
        i = draw(st.integers(0, len(frames) - 1))
        data = bytearray(frames[i])
        j = draw(st.integers(0, len(data) - 1))
        data[j] ^= draw(st.integers(1, 255))
        frames[i] = bytes(data)
    if draw(st.booleans()):
        frames.append(encode(Close(SID)))
    data = b"".join(frames) or encode(Ping(0))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if b > a]


async def exchange(server: BlockServer, reads: list[bytes]) -> list:
    a, b = trio.testing.memory_stream_pair()
    replies: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle, MemStream(b), "fuzzer")
        client, dec = MemStream(a), FrameDecoder()
        try:
            for data in reads:
                await client.write(data)
            await b_side_eof(a)
        except trio.BrokenResourceError:
            pass  # the peer ended the session before reading everything (a frame too large)
        with trio.fail_after(30):
            while data := await client.read(1 << 16):
                replies += dec.feed(data)
        nursery.cancel_scope.cancel()
    return replies


async def b_side_eof(stream) -> None:
    """The client has sent everything: end its direction, as a client that hangs up does."""
    await stream.send_eof()


def expected_answers(reads: list[bytes]) -> tuple[list, bool]:
    """The client's messages a peer must answer, in order, and whether a bad frame follows:
    decoded frame by frame from the bytes (not by a FrameDecoder, whose batching is under test)."""
    data, msgs, bad = b"".join(reads), [], False
    while len(data) >= 4:
        n = int.from_bytes(data[:4], "big")
        if len(data) < 4 + n:
            break  # an unfinished frame: the stream ends first
        try:
            msgs.append(decode(data[:4 + n]))
        except WireError:
            bad = True
            break
        data = data[4 + n:]
    answered = []
    for m in msgs:
        if isinstance(m, Close):
            break
        answered.append(m)
    return answered, bad and len(answered) == len(msgs)


def check(reads: list[bytes]) -> None:
    server = _SERVER[0]
    replies = trio.run(exchange, server, reads)
    asked, bad_after = expected_answers(reads)
    assert not any(isinstance(r, ErrorMsg) and r.code == ErrorCode.INTERNAL for r in replies), replies
    errors = [i for i, r in enumerate(replies) if isinstance(r, ErrorMsg)]
    assert errors in ([], [len(replies) - 1]), f"replies after an ERROR: {replies}"
    answered = replies[:-1] if errors else replies
    assert len(answered) <= len(asked), (replies, asked)
    for msg, reply in zip(asked, answered):
        want = {Open: OpenOk, Step: StepOk, Ping: Pong}[type(msg)]
        assert isinstance(reply, want), (msg, reply)
        if isinstance(reply, StepOk):  # a hidden state of another width is never computed
            assert msg.hidden.shape[2] == H and tuple(reply.hidden.shape) == (1, msg.hidden.shape[1], H)
    if not errors:  # every message was answered (none was refused, no bad frame came)
        assert len(answered) == len(asked) and not bad_after, (replies, asked)
    elif len(answered) < len(asked):  # the ERROR answers the next message
        opened = [m.session_id for m in asked[:len(answered) + 1] if isinstance(m, Open)]
        assert replies[-1].session_id == (opened[0] if opened else bytes(16))
    assert server.sessions == 0 and server.tokens_reserved == 0 and server.buffered == 0


def _open(n: int = 64) -> bytes:
    return encode(Open(SID, MODEL, 0, 4, n, 1, torch.float32))


def _step(n: int, cache_len: int, t: int, width: int = H, poison: float | None = None) -> bytes:
    h = torch.randn(1, t, width)
    if poison is not None:
        h[0, 0, 0] = poison
    return frame(Step(SID, n, cache_len, list(range(cache_len, cache_len + t)), h))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
@given(session())
@example([_open() + _step(0, 0, 0)])  # a STEP of zero tokens, fresh
@example([_open() + _step(0, 0, 5) + _step(1, 3, 0)])  # ... and a rollback with no new token
@example([_open() + _step(0, 0, 2, width=H - 1)])  # a hidden state one too narrow
@example([_open() + _step(0, 0, 2, width=2 * H)])  # twice too wide
@example([_open() + _step(0, 0, 2, width=1)])  # one wide: broadcast against the weights
@example([_open() + _step(0, 0, 2, poison=math.nan)])  # OPEN and a NaN STEP in one read
@example([_open(), struct.pack(">I", 9) + b"DF\x01\x01\x03garbage"])  # a truncated STEP after OPEN
def test_a_peer_answers_whatever_a_client_sends_in_order_and_never_internal(reads):
    check(reads)
