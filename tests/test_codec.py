"""Wire codec: round trips, malformed input, fuzzing (only ProtocolError may escape), sessions."""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffuse.data.codec import (
    HEADER_SIZE,
    MAX_ERROR_MESSAGE,
    MAX_FRAME,
    PROTOCOL_ID,
    Close,
    ErrorCode,
    ErrorMsg,
    Ext,
    Fp16Overflow,
    FrameDecoder,
    FrameTooLarge,
    NonFiniteTensor,
    Open,
    OpenOk,
    Ping,
    SMALL_TENSOR,
    VERSION_MINOR,
    Pong,
    SessionError,
    Step,
    StepOk,
    UnsupportedVersion,
    WireError,
    decode,
    encode,
    tensor_wire,
)
from diffuse.data.commitments import bind
from diffuse.data.session import Role, SessionRules, SessionState
from diffuse.errors import ProtocolError

SID = bytes(range(1, 17))
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same(a, b) -> bool:
    """Field-wise equality that compares tensors by dtype, shape and exact bits."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "wire_dtype":
            continue  # an encoding instruction; the decoded tensor's dtype says what was sent
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif isinstance(x, (list, tuple)):
            if tuple(x) != tuple(y):
                return False
        elif x != y:
            return False
    return True


def frame_with(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def step(**kw) -> Step:
    base = dict(session_id=SID, step=0, cache_len=0, positions=[0, 1, 2],
                hidden=torch.randn(1, 3, 8, dtype=torch.bfloat16))
    base.update(kw)
    return Step(**base)


# --------------------------------------------------------------------------- strategies

dtypes = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])
u16, u32 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF)
unknown_exts = st.dictionaries(st.integers(100, 0xFFFF), st.binary(max_size=12), max_size=2)
sids = st.binary(min_size=16, max_size=16)


@st.composite
def tensors(draw, t: int) -> torch.Tensor:
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return (torch.randn(b, t, h, generator=gen) * 100).to(draw(dtypes))


@st.composite
def steps(draw) -> Step:
    t = draw(st.integers(0, 12))
    mask = None
    if draw(st.booleans()):
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=t * t, max_size=t * t)),
                            dtype=torch.bool).reshape(t, t)
        mask.fill_diagonal_(True)
    return Step(draw(sids), draw(u32), draw(u32), draw(st.lists(st.integers(0, 2**31 - 1),
                min_size=t, max_size=t)), draw(tensors(t)),
                sorted(draw(st.sets(u16, max_size=5))), mask, draw(st.booleans()),
                draw(st.booleans()), draw(st.none() | st.binary(min_size=32, max_size=32)),
                extensions=draw(unknown_exts))


messages = st.one_of(
    st.builds(Open, sids.filter(any), st.text(min_size=1, max_size=60), st.integers(0, 100),
              st.integers(101, 200), st.integers(1, 2**32 - 1), st.integers(1, 0xFFFF), dtypes,
              st.booleans(), st.booleans(), st.integers(0, 255), unknown_exts),
    st.builds(OpenOk, sids, st.integers(1, 2**32 - 1), st.text(max_size=20), st.booleans(),
              st.integers(0, 255), unknown_exts),
    steps(),
    st.builds(lambda sid, s, t, c, us, e: StepOk(sid, s, t, c, us, extensions=e), sids, u32,
              st.integers(0, 5).flatmap(tensors), st.none() | st.binary(min_size=32, max_size=32),
              st.none() | u32, unknown_exts),
    st.builds(Close, sids, unknown_exts),
    st.builds(ErrorMsg, st.sampled_from(list(ErrorCode)) | u16, st.text(max_size=50), sids,
              unknown_exts),
    st.builds(Ping, st.integers(0, 2**64 - 1), sids, unknown_exts),
    st.builds(Pong, st.integers(0, 2**64 - 1), sids, unknown_exts),
)


# --------------------------------------------------------------------------- round trips


def test_protocol_id():
    assert PROTOCOL_ID == "/diffuse/inference/1.0.0"


@FUZZ
@given(messages)
def test_round_trip_any_message(msg):
    frame = encode(msg)
    assert isinstance(frame, bytes)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert frame[4:6] == b"DF" and frame[6] == 1
    back = decode(frame)
    if isinstance(msg, (Step, StepOk)):
        assert back.hidden.dtype == msg.hidden.dtype
    assert same(back, msg), (back, msg)


@FUZZ
@given(st.lists(messages, min_size=1, max_size=5), st.data())
def test_reads_split_anywhere(msgs, data):
    stream = b"".join(encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec, out = FrameDecoder(), []
    for a, b in zip([0, *cuts], [*cuts, len(stream)]):
        out += dec.feed(stream[a:b])
    assert dec.pending == 0
    assert len(out) == len(msgs) and all(same(x, y) for x, y in zip(out, msgs))


def test_step_all_fields_and_bytes():
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    s = step(step=7, cache_len=40, keep=[0, 2, 5], positions=[40, 41, 41], mask=mask,
             commit=False, replay=True, input_commitment=b"\xaa" * 32, extensions={4242: b"x"})
    back = decode(encode(s))
    assert (back.step, back.cache_len, back.keep, back.positions) == (7, 40, (0, 2, 5),
                                                                      (40, 41, 41))
    assert torch.equal(back.mask, mask) and not back.commit and back.replay
    assert back.input_commitment == b"\xaa" * 32 and back.extensions == {4242: b"x"}
    assert torch.equal(back.hidden, s.hidden)  # bf16 travels bit-exactly


def test_tensor_bytes_are_raw_little_endian_and_what_commitments_hash():
    """`tensor_bytes(t)` of protocols/inference.md (sections 5 and 12): the frame carries the raw
    little-endian values, and `tensor_wire`, which the commitments hash, returns those very bytes."""
    h = torch.tensor([[[1.0, -2.0]]], dtype=torch.float16)
    frame = encode(StepOk(SID, 1, h))
    # header, step u32, dtype code 1 (fp16), rank 3, shape 1,1,2, then 2 x fp16 LE
    header = struct.pack(">BB3I", 1, 3, 1, 1, 2)
    raw = h.numpy().astype("<f2").tobytes()
    assert frame[4 + HEADER_SIZE:] == struct.pack(">I", 1) + header + raw
    got_header, got_raw = tensor_wire(h)
    assert (bytes(got_header), bytes(memoryview(got_raw).cast("B"))) == (header, raw)
    binding, tree = bind(SID, 1, None, h)
    assert binding.header == header and bytes(tree.data) == raw and binding.n_bytes == len(raw)


def test_wire_dtype_conversion():
    h = torch.randn(2, 4, 16) * 1000
    back = decode(encode(step(positions=[0, 1, 2, 3], hidden=h, wire_dtype=torch.float16)))
    assert back.hidden.dtype == torch.float16
    assert torch.equal(back.hidden, h.to(torch.float16))
    big = torch.randn(1, 300, 64, dtype=torch.bfloat16)  # bf16->fp32->fp16 path (> 4096 values)
    back = decode(encode(StepOk(SID, 0, big, wire_dtype=torch.float16)))
    assert torch.equal(back.hidden, big.to(torch.float16))


def test_step_ok_extensions_and_unknown_minor_accepted():
    ok = StepOk(SID, 3, torch.ones(1, 2, 4), output_commitment=b"\x01" * 32, compute_us=1234)
    back = decode(encode(ok))
    assert back.output_commitment == b"\x01" * 32 and back.compute_us == 1234
    frame = bytearray(encode(ok))
    frame[7] = 99  # minor version 99: accepted
    assert decode(bytes(frame)).compute_us == 1234
    assert decode(encode(Open(SID, "m", 0, 1, 8, minor=7))).minor == 7


def test_error_message_truncated_on_a_character_boundary():
    back = decode(encode(ErrorMsg(ErrorCode.INTERNAL, "é" * 2000)))
    assert back.message == "é" * (MAX_ERROR_MESSAGE // 2) and back.code is ErrorCode.INTERNAL
    assert decode(encode(ErrorMsg(999, "future"))).code == 999


# --------------------------------------------------------------------------- numerics


def test_fp16_overflow_is_detected_and_bf16_is_fine():
    h = torch.tensor([[[1.0, 70000.0]]])
    with pytest.raises(Fp16Overflow, match="bfloat16"):
        encode(StepOk(SID, 0, h, wire_dtype=torch.float16))
    assert decode(encode(StepOk(SID, 0, h, wire_dtype=torch.bfloat16))).hidden[0, 0, 1] == 70144
    edge = torch.tensor([[[65504.0, -65504.0]]])
    assert decode(encode(StepOk(SID, 0, edge, wire_dtype=torch.float16))).hidden.isfinite().all()
    assert issubclass(Fp16Overflow, ProtocolError)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_non_finite_rejected_both_ways(bad, dtype):
    h = torch.tensor([[[1.0, bad]]], dtype=dtype)
    with pytest.raises(NonFiniteTensor):
        encode(StepOk(SID, 0, h))
    good = encode(StepOk(SID, 0, torch.tensor([[[1.0, 2.0]]], dtype=dtype)))
    raw = torch.tensor([bad], dtype=dtype).view(torch.uint8).numpy().tobytes()
    with pytest.raises(NonFiniteTensor):
        decode(good[: -len(raw)] + raw)


@pytest.mark.parametrize("dtype,bits", [(torch.float16, 16), (torch.bfloat16, 16), (torch.float32, 32)])
@pytest.mark.parametrize("numel", [1, 7, 577, SMALL_TENSOR])  # bytes check; SMALL_TENSOR values: numpy's
def test_both_finite_checks_agree_on_every_exponent_pattern(dtype, bits, numel):
    """Random bit patterns, with specials (every exponent-all-ones pattern is inf or NaN) planted at
    random places: whatever check a size takes, it rejects exactly the tensors torch calls non-finite."""
    g = torch.Generator().manual_seed(numel + bits)
    ints = torch.int16 if bits == 16 else torch.int32
    for trial in range(40):
        raw = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (numel,), generator=g, dtype=torch.int64)
        values = raw.to(ints).view(dtype).clone()
        values[~values.isfinite()] = 1.0  # a finite base, then 0-2 specials
        for _ in range(trial % 3):
            bad = [float("inf"), float("-inf"), float("nan")][trial % 3]
            values[int(torch.randint(numel, (1,), generator=g))] = bad
        h = values.view(1, 1, numel)
        if bool(values.isfinite().all()):
            assert torch.equal(decode(encode(StepOk(SID, 0, h))).hidden.view(ints), h.view(ints))
        else:
            with pytest.raises(NonFiniteTensor):
                encode(StepOk(SID, 0, h))


def test_decoded_tensor_goes_out_as_received():
    """A client hands a hop's output to the next hop: the bytes it received, and no others."""
    sent = torch.randn(1, 2, 576).to(torch.float16)
    frame = encode(StepOk(SID, 3, sent))
    received = decode(frame).hidden
    onward = encode(Step(SID, 4, 7, [7, 8], received))
    assert onward[-sent.numel() * 2:] == frame[-sent.numel() * 2:]
    assert torch.equal(decode(onward).hidden, sent)
    # The same tensor in another wire dtype, or a slice of it, is converted as any tensor is.
    assert torch.equal(decode(encode(Step(SID, 4, 7, [7, 8], received, wire_dtype=torch.bfloat16))).hidden,
                       sent.to(torch.bfloat16))
    assert torch.equal(decode(encode(Step(SID, 4, 7, [7], received[:, 1:]))).hidden, sent[:, 1:])
    received[0, 1, 5] = float("inf")  # changed in place after decoding: the bytes are checked again
    with pytest.raises(NonFiniteTensor):
        encode(Step(SID, 4, 7, [7, 8], received))


# --------------------------------------------------------------------------- malformed input


def corrupt(frame: bytes, offset: int, new: bytes) -> bytes:
    return frame[:offset] + new + frame[offset + len(new):]


GOOD = encode(step())
B = 4  # body offset inside a frame


@pytest.mark.parametrize("frame,match", [
    (corrupt(GOOD, B, b"XX"), "bad magic"),
    (corrupt(GOOD, B + 4, b"\x63"), "unknown message type 99"),
    (frame_with(b"DF\x01\x00\x03"), "truncated header"),
    (frame_with(encode(step())[B:B + HEADER_SIZE + 6]), "truncated STEP header"),
    (frame_with(encode(Open(SID, "abc", 0, 1, 8))[B:-1]), "truncated OPEN model_id"),
    (corrupt(encode(Open(SID, "abc", 0, 1, 8)), B + HEADER_SIZE + 16, b"\xff\xfe"), "utf-8"),
    (corrupt(encode(Open(SID, "abc", 0, 1, 8)), B + HEADER_SIZE + 14, b"\x09"), "dtype code 9"),
    (corrupt(encode(Open(SID, "abc", 5, 6, 8)), B + HEADER_SIZE, b"\x00\x00\x00\x07"), "span"),
    (frame_with(GOOD[B:] + b"\x00"), "truncated extension header"),  # tensor bytes disagree
    (frame_with(GOOD[B:-2]), "needs 48 bytes"),  # shape says 3x8 bf16, fewer bytes follow
    (frame_with(GOOD[B:] + struct.pack(">HI", 5, 9) + b"abc"), "truncated extension value"),
    (frame_with(GOOD[B:] + struct.pack(">HI", Ext.INPUT_COMMITMENT, 3) + b"abc"), "32 bytes"),
    (frame_with(GOOD[B:] + 2 * (struct.pack(">HI", 500, 1) + b"a")), "twice"),
    (frame_with(encode(ErrorMsg(1, ""))[B:-2] + b"\x04\x01"), "exceeds 1024"),
])
def test_malformed_frames_name_the_problem(frame, match):
    with pytest.raises(WireError, match=match) as info:
        decode(frame)
    assert info.value.code is ErrorCode.BAD_FRAME


def test_bad_step_fields():
    s = encode(step(positions=[0, 1, 2], keep=[1, 4]))
    off = B + HEADER_SIZE + 10  # keep[0]
    with pytest.raises(WireError, match="strictly increasing"):
        decode(corrupt(s, off, b"\x00\x04"))
    with pytest.raises(WireError, match="positions must be >= 0"):
        decode(corrupt(s, off + 4 + 4, b"\xff\xff\xff\xff"))
    t_off = off + 4 - B  # within the body: T, then 3 positions
    body = s[B:]
    four = body[:t_off] + struct.pack(">I", 4) + body[t_off + 4:t_off + 16] + struct.pack(">i", 3)
    with pytest.raises(WireError, match=r"hidden must be \[batch, 4, hidden\] .* \[1, 3, 8\]"):
        decode(frame_with(four + body[t_off + 16:]))
    mask = torch.ones(3, 3, dtype=torch.bool)
    m = encode(step(mask=mask))
    with pytest.raises(WireError, match="padding bits"):
        decode(m[:-1] + b"\x03")  # 9 mask bits: byte 2 may only use bit 0
    with pytest.raises(WireError, match="attend to itself"):
        decode(m[:-2] + b"\xfe\x01")
    with pytest.raises(WireError, match="truncated STEP mask"):
        decode(frame_with(m[B:-1]))
    with pytest.raises(WireError, match="mask must be bool"):
        encode(step(mask=torch.ones(2, 2, dtype=torch.bool)))


def test_unsupported_major_names_both_versions():
    frame = corrupt(GOOD, B + 2, b"\x02\x05")
    with pytest.raises(UnsupportedVersion, match=rf"2\.5.*1\.{VERSION_MINOR}") as info:
        decode(frame)
    assert info.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_encoder_refuses_what_decoder_would_reject():
    with pytest.raises(WireError, match="session_id"):
        encode(Close(b"short"))
    with pytest.raises(WireError, match="all zeros"):
        encode(Open(bytes(16), "m", 0, 1, 8))
    with pytest.raises(WireError, match="model_id"):
        encode(Open(SID, "x" * 256, 0, 1, 8))
    with pytest.raises(WireError, match="cannot encode"):
        encode(step(step=2**32))
    with pytest.raises(WireError, match="cannot encode"):
        encode(Ping(-1))
    with pytest.raises(WireError, match="through its field"):
        encode(step(extensions={int(Ext.INPUT_COMMITMENT): b"x" * 32}))
    with pytest.raises(WireError, match="wire dtype"):
        encode(step(hidden=torch.zeros(1, 3, 2, dtype=torch.float64)))
    with pytest.raises(FrameTooLarge):
        encode(StepOk(SID, 0, torch.zeros(1, 100, 100)), max_frame=1000)


def test_decoder_stays_broken_after_an_error():
    dec = FrameDecoder()
    with pytest.raises(WireError):
        dec.feed(corrupt(GOOD, B, b"XX"))
    with pytest.raises(WireError, match="earlier error"):
        dec.feed(GOOD)


# --------------------------------------------------------------------------- lying lengths


def test_oversized_length_prefix_fails_before_the_body():
    dec = FrameDecoder()
    with pytest.raises(FrameTooLarge, match=str(MAX_FRAME)):
        dec.feed(struct.pack(">I", MAX_FRAME + 1))
    small = FrameDecoder(max_frame=100)
    with pytest.raises(FrameTooLarge):
        small.feed(encode(StepOk(SID, 0, torch.zeros(1, 1, 64))))


def test_lying_lengths_allocate_nothing_big():
    huge_shape = struct.pack(">IBB3I", 0, 3, 3, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    lies = [
        struct.pack(">I", MAX_FRAME) + GOOD[B:B + 40],  # announced 64 MiB, 40 bytes sent
        frame_with(encode(StepOk(SID, 0, torch.zeros(1, 1, 1)))[B:B + HEADER_SIZE] + huge_shape),
        frame_with(GOOD[B:] + struct.pack(">HI", 777, 0xFFFFFFFF)),  # TLV claims 4 GiB
        frame_with(GOOD[B:B + HEADER_SIZE] + struct.pack(">IIH", 0, 0, 0xFFFF)),  # 65535 keeps
        frame_with(GOOD[B:B + HEADER_SIZE] + struct.pack(">IIHI", 0, 0, 0, 0xFFFFFFFF)),  # T
    ]
    tracemalloc.start()
    try:
        for frame in lies:
            dec = FrameDecoder()
            try:
                dec.feed(frame)
            except WireError:
                pass
            else:
                assert dec.pending == len(frame)  # waiting for bytes, not allocating
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


# --------------------------------------------------------------------------- fuzzing


def feed_all(data: bytes, chunk: int) -> None:
    """Feed `data` in chunks; anything but ProtocolError escaping is a bug."""
    dec = FrameDecoder(max_frame=1 << 20)
    for i in range(0, len(data), max(chunk, 1)):
        try:
            dec.feed(data[i:i + chunk])
        except ProtocolError:
            return


@FUZZ
@given(st.binary(max_size=300), st.integers(1, 64))
def test_fuzz_random_bytes(data, chunk):
    feed_all(data, chunk)
    feed_all(b"\x00\x00\x00" + bytes([len(data) & 0xFF]) + data, chunk)  # plausible length
    feed_all(struct.pack(">I", len(data) + 4) + b"DF\x01\x00" + data, chunk)


@FUZZ
@given(messages, st.data())
def test_fuzz_mutated_frames(msg, data):
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        i = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if kind == "flip" and frame:
            frame[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and frame:
            frame[i] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del frame[i:i + data.draw(st.integers(1, 8))]
        else:
            frame[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    feed_all(bytes(frame), data.draw(st.integers(1, 256)))
    if len(frame) >= 4:  # keep the length prefix honest so the body parser gets the mutation
        feed_all(struct.pack(">I", len(frame) - 4) + bytes(frame[4:]), 1 << 20)


# --------------------------------------------------------------------------- session rules


def opened(max_length: int = 100, **kw) -> SessionRules:
    s = SessionRules(Role.SERVER)
    s.receive(Open(SID, "m", 0, 4, max_length, **kw))
    assert s.state is SessionState.OPENING
    s.send(OpenOk(SID, max_length, "bfloat16"))
    assert s.state is SessionState.OPEN
    return s


def h(t: int, b: int = 1) -> torch.Tensor:
    return torch.zeros(b, t, 8, dtype=torch.bfloat16)


def test_session_speculative_flow():
    s = opened()
    s.receive(step(step=0, cache_len=0, positions=range(10), hidden=h(10)))  # prefill
    assert decode(s.send(StepOk(SID, 0, h(10)))).hidden.dtype == torch.bfloat16
    assert (s.committed, s.candidates) == (10, 0)
    s.receive(step(step=1, cache_len=10, positions=[10, 11, 11, 12], hidden=h(4), commit=False))
    s.send(StepOk(SID, 1, h(4)))
    assert (s.committed, s.candidates) == (10, 4)
    s.receive(step(step=2, cache_len=12, keep=[0, 2], positions=[12], hidden=h(1)))
    assert (s.committed, s.candidates) == (13, 0)
    s.receive(step(step=5, cache_len=11, positions=[11], hidden=h(1)))  # roll back, gap ok
    assert s.committed == 12
    s.send(StepOk(SID, 2, h(1)))
    s.send(StepOk(SID, 5, h(1)))
    s.receive(Ping(1))
    s.send(Pong(1))
    s.receive(Close(SID))
    assert s.state is SessionState.CLOSED


@pytest.mark.parametrize("prepare,bad,match,code", [
    (None, step(), "before OPEN_OK", ErrorCode.BAD_STEP),
    ([step(step=3, positions=[0], hidden=h(1))], step(step=3, positions=[1], cache_len=1,
     hidden=h(1)), "steps must increase", ErrorCode.BAD_STEP),
    ([step(step=0, positions=[0], hidden=h(1))], step(step=1, keep=[0], cache_len=1,
     positions=[1], hidden=h(1)), "no candidates", ErrorCode.BAD_STEP),
    ([step(step=0, positions=[0, 1], hidden=h(2), commit=False)], step(step=1, keep=[0, 2],
     cache_len=2, positions=[2], hidden=h(1)), "out of range for 2", ErrorCode.BAD_STEP),
    ([step(step=0, positions=[0, 1], hidden=h(2), commit=False)], step(step=1, keep=[1],
     cache_len=2, positions=[2], hidden=h(1)), "exceeds the 1 committed", ErrorCode.BAD_STEP),
    (None, step(step=0, positions=range(101), hidden=h(101)), "max_length", ErrorCode.TOO_LONG),
    (None, step(step=0, positions=[0], hidden=h(1, b=2)), "batch 2", ErrorCode.BAD_STEP),
    (None, step(session_id=bytes(16), positions=[0], hidden=h(1)), "not opened",
     ErrorCode.BAD_STEP),
    ([Close(SID)], step(), "after the session ended", ErrorCode.BAD_STEP),
    (None, Open(SID, "m", 0, 1, 8), "second OPEN", ErrorCode.BAD_STEP),
    (None, OpenOk(SID, 8), "client may not send", ErrorCode.BAD_STEP),
])
def test_session_rejects(prepare, bad, match, code):
    s = SessionRules(Role.SERVER)
    s.receive(Open(SID, "m", 0, 4, 100))
    if prepare is not None or match != "before OPEN_OK":
        s.send(OpenOk(SID, 100))
    for m in prepare or []:
        s.receive(m)
    with pytest.raises(SessionError, match=match) as info:
        s.receive(bad)
    assert info.value.code is code


def test_session_checks_dtype_hidden_size_and_replies():
    s = opened()
    with pytest.raises(SessionError, match="float32"):
        s.receive(step(positions=[0], hidden=torch.zeros(1, 1, 8)))
    s.receive(step(step=0, positions=[0], hidden=h(1)))
    with pytest.raises(SessionError, match="hidden size 4"):
        s.receive(step(step=1, positions=[1], cache_len=1,
                       hidden=torch.zeros(1, 1, 4, dtype=torch.bfloat16)))
    with pytest.raises(SessionError, match="out of order"):
        s.send(StepOk(SID, 9, h(1)))
    with pytest.raises(SessionError, match="output shape"):
        s.send(StepOk(SID, 0, h(2)))
    with pytest.raises(SessionError, match="not opened|OPEN_OK without"):
        SessionRules(Role.SERVER).send(OpenOk(SID, 8))
    t = SessionRules(Role.SERVER)
    t.receive(Open(SID, "m", 0, 4, 100))
    with pytest.raises(SessionError, match="more than was requested"):
        t.send(OpenOk(SID, 101))
    assert decode(t.send(ErrorMsg(ErrorCode.NO_CAPACITY, "full", SID))).code == 6
    assert t.state is SessionState.CLOSED
    with pytest.raises(SessionError):
        SessionRules(Role.SERVER).receive(step())


def test_session_minor_and_client_error():
    s = SessionRules(Role.SERVER)
    assert s.minor == 3
    s.receive(Open(SID, "m", 0, 4, 100, minor=0))
    assert s.minor == 0  # min(client 0, ours 3): a 1.0 client gets no 1.1 feature
    s.send(OpenOk(SID, 100))
    s.receive(ErrorMsg(ErrorCode.INTERNAL, "client gave up", SID))
    assert s.state is SessionState.CLOSED


def test_a_bad_frame_ends_a_read_after_the_messages_before_it():
    good, bad = encode(Ping(1)), b"\x00\x00\x00\x05hello"
    dec = FrameDecoder()
    assert [m.nonce for m in dec.feed(good + encode(Ping(2)) + bad)] == [1, 2]
    assert isinstance(dec.failed, WireError) and "magic" in str(dec.failed)
    with pytest.raises(WireError, match="unusable"):
        dec.feed(good)
    one = FrameDecoder(max_frame=64)
    one.receive(encode(Ping(3)) + encode(StepOk(SID, 0, torch.zeros(1, 4, 8))))
    assert one.next_message().nonce == 3
    one.max_frame = MAX_FRAME  # a receiver may raise the bound between messages
    assert isinstance(one.next_message(), StepOk) and one.next_message() is None and one.pending == 0


def test_client_rules_mirror_the_server_and_blame_the_right_side():
    """The client keeps the same rules: it may not send what the server would refuse (INTERNAL:
    its own bug), and a reply the server may not send is refused with the code to answer it."""
    c = SessionRules(Role.CLIENT)
    with pytest.raises(SessionError, match="client may not send OpenOk") as info:
        c.send(OpenOk(SID, 8))
    assert info.value.code is ErrorCode.INTERNAL
    c.send(Open(SID, "m", 0, 4, 100))
    with pytest.raises(SessionError, match="before OPEN_OK") as info:
        c.send(step(step=0, positions=[0], hidden=h(1)))
    assert info.value.code is ErrorCode.INTERNAL
    c.receive(OpenOk(SID, 100, "bfloat16"))
    frames = [c.send(step(step=i, cache_len=i, positions=[i], hidden=h(1))) for i in range(3)]  # pipelined
    assert [decode(f).step for f in frames] == [0, 1, 2] and c.committed == 3
    with pytest.raises(SessionError, match="out of order") as info:
        c.receive(StepOk(SID, 1, h(1)))
    assert info.value.code is ErrorCode.BAD_STEP
    c.receive(StepOk(SID, 0, h(1)))
    with pytest.raises(SessionError, match="output shape"):
        c.receive(StepOk(SID, 1, h(2)))
    d = SessionRules(Role.CLIENT)
    d.send(Open(SID, "m", 0, 4, 100))
    d.receive(OpenOk(SID, 100))
    d.send(step(step=0, positions=[0], hidden=h(1)))
    with pytest.raises(SessionError, match="float32, session is"):  # a reply in another dtype than asked
        d.receive(StepOk(SID, 0, torch.zeros(1, 1, 8)))
    with pytest.raises(SessionError, match="server may not send Step"):
        SessionRules(Role.CLIENT).receive(step())
    e = SessionRules(Role.CLIENT)
    e.send(Open(SID, "m", 0, 4, 100))
    e.receive(ErrorMsg(ErrorCode.NO_CAPACITY, "full", SID))
    assert e.state is SessionState.CLOSED
    with pytest.raises(SessionError, match="after the session ended"):
        e.send(Close(SID))


def test_exact_flags_travel_on_their_bits():
    """1.1's EXACT: OPEN flag bit 1 (asked), OPEN_OK flag bit 0 (granted); header flags sit at
    frame bytes 10-11 (after the length prefix, magic, versions, type and reserved byte)."""
    frame = encode(Open(SID, "m", 0, 4, 100, exact=True))
    assert struct.unpack(">H", frame[10:12])[0] == 0x0002 and frame[7] == VERSION_MINOR
    assert decode(frame).exact and not decode(encode(Open(SID, "m", 0, 4, 100))).exact
    both = decode(encode(Open(SID, "m", 0, 4, 100, want_commitments=True, exact=True)))
    assert both.want_commitments and both.exact
    ok = encode(OpenOk(SID, 100, "float32", exact=True))
    assert struct.unpack(">H", ok[10:12])[0] == 0x0001 and decode(ok).exact
    assert not decode(encode(OpenOk(SID, 100, "float32"))).exact


def test_large_frame_in_64k_reads():
    big = torch.randn(1, 2048, 576, dtype=torch.bfloat16)  # 2.4 MB prefill
    frame = encode(step(positions=range(2048), hidden=big))
    dec, out = FrameDecoder(), []
    for i in range(0, len(frame), 65536):
        out += dec.feed(frame[i:i + 65536])
    assert len(out) == 1 and dec.pending == 0 and torch.equal(out[0].hidden, big)
