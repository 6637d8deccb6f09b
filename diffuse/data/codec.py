"""Sans-IO wire codec for the inference protocol `/diffuse/inference/1.0.0`.

The normative description is protocols/inference.md; this module is its reference implementation.
Nothing here touches sockets or trio (h11-style): `encode` turns a message into ONE bytes object
(so the transport makes one write: a single write per message was measurably faster over yamux),
`FrameDecoder.feed` turns whatever bytes arrived into whole messages; session.py holds the rules
for the order in which they may come.  Metadata is packed with `struct` (big-endian);
tensors travel as raw little-endian bytes, never pickle (pickle is remote code execution).
Every problem with received bytes raises a `WireError` (a ProtocolError) carrying the ErrorCode a
server should put in its ERROR reply.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Union

import numpy as np
import torch

from diffuse.errors import ProtocolError

PROTOCOL_ID = "/diffuse/inference/1.0.0"
MAGIC = b"DF"
VERSION_MAJOR = 1
VERSION_MINOR = 3  # 1.1: OPEN/OPEN_OK flag EXACT (batch-invariant kernels); 1.2: chain routes; 1.3: CHAIN_TO_RECORD
MAX_FRAME = 64 * 1024 * 1024  # default bound on a frame body; checked from the length prefix
MAX_MODEL_ID = 255  # bytes of utf-8 (u8 length field)
MAX_DTYPE_NAME = 255  # bytes of utf-8 (u8 length field)
MAX_ERROR_MESSAGE = 1024  # bytes of utf-8; longer messages are truncated when encoding
MAX_RANK = 8
SESSION_ID_LEN = 16
ZERO_SESSION = bytes(SESSION_ID_LEN)

# magic, major, minor, type, reserved, flags, session id
_HEADER = struct.Struct(">2sBBBBH16s")
HEADER_SIZE = _HEADER.size  # 24
_U8, _U16, _U32, _U64 = (struct.Struct(f">{c}") for c in "BHIQ")
_TLV = struct.Struct(">HI")
_OPEN = struct.Struct(">IIIHBB")  # start, end, max_length, batch_size, dtype code, model_id length
_STEP_HEAD = struct.Struct(">IIH")  # step, cache_len, keep count
_ERROR = struct.Struct(">HH")  # code, message length
_TENSOR_HEAD = struct.Struct(">BB")  # dtype code, rank

# Flag bits (header `flags` field; meaning depends on the message type).
OPEN_WANT_COMMITMENTS = 0x0001
OPEN_EXACT = 0x0002  # since 1.1: the client asks for batch-invariant kernels
OPEN_OK_EXACT = 0x0001  # since 1.1: the server grants them for this session
STEP_COMMIT = 0x0001
STEP_HAS_MASK = 0x0002
STEP_REPLAY = 0x0004
OPEN_OK_CHAINED = 0x0002  # since 1.2: this hop forwards its outputs to the downstream its OPEN named
STEP_OK_FORWARDED = 0x0001  # since 1.2: this output also went to the downstream session
MAX_PEER_ID = 255  # bytes of a base58 peer id in a chain extension (u8 length)
MAX_CHAIN_RECORD = 16 * 1024  # bytes of the downstream's signed record in CHAIN_TO_RECORD (a record's own bound)
MAX_SIGNATURE = 255  # bytes of its signature (u8 length)


class MsgType(IntEnum):
    OPEN = 1
    OPEN_OK = 2
    STEP = 3
    STEP_OK = 4
    CLOSE = 5
    ERROR = 6
    PING = 7
    PONG = 8
    ATTACH = 9  # since 1.2: upstream peer -> downstream peer, on a stream of its own
    ATTACH_OK = 10


class ErrorCode(IntEnum):
    """ERROR codes. Receivers must accept codes they do not know (treat them like INTERNAL)."""

    BAD_FRAME = 1  # undecodable bytes: framing, magic, truncation, bad field values
    UNSUPPORTED_VERSION = 2  # protocol major version differs
    UNKNOWN_MODEL = 3
    BLOCKS_NOT_SERVED = 4
    TOO_LONG = 5  # session would exceed its (granted) max_length
    NO_CAPACITY = 6  # out of memory / KV cache capacity
    BAD_STEP = 7  # message out of order or inconsistent with the session state
    OVERLOADED = 8  # try another server or later
    INTERNAL = 9
    TIMEOUT = 10
    NUMERIC = 11  # a value is not finite or overflows the wire dtype (e.g. fp16): reopen in bf16
    FORBIDDEN = 12  # since 1.2: frames into a session from a peer its client did not name


class Ext(IntEnum):
    """Extension (TLV) types; unknown types are skipped by receivers."""

    INPUT_COMMITMENT = 1  # STEP: 32 bytes
    OUTPUT_COMMITMENT = 2  # STEP_OK: 32 bytes, Merkle root of the exact output tensor bytes
    COMPUTE_US = 3  # STEP_OK: u32, server compute time for this step in microseconds
    CHAIN_FROM = 4  # OPEN (1.2): the peer id that may forward STEPs into this session
    CHAIN_TO = 5  # OPEN (1.2): the downstream at bare addresses; since 1.3 never dialled (section 13)
    LINK_ERROR = 6  # OPEN_OK, STEP_OK (1.2): why this hop's outputs did not go downstream
    CHAIN_TO_RECORD = 7  # OPEN (1.3): where this hop forwards its outputs, with the next peer's signed record


class WireError(ProtocolError):
    """Bytes or a message that break the protocol; `code` is what an ERROR reply should carry."""

    code: ErrorCode = ErrorCode.BAD_FRAME

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class FrameTooLarge(WireError):
    """A length prefix exceeds the frame limit; raised before any of the body is buffered."""


class UnsupportedVersion(WireError):
    code = ErrorCode.UNSUPPORTED_VERSION


class NonFiniteTensor(WireError):
    code = ErrorCode.NUMERIC


class Fp16Overflow(WireError):
    """A finite value became inf in the wire dtype (fp16 tops out at 65504); use bf16 instead."""

    code = ErrorCode.NUMERIC


class SessionError(WireError):
    """A message that is well formed but illegal in the session's current state."""

    code = ErrorCode.BAD_STEP


# Wire dtype codes. A value is inf or NaN iff its exponent bits are all ones. Large tensors are
# checked through their integer view with numpy, far cheaper than torch.isfinite; a decode
# step's few KB with bytes.translate, which stays in the interpreter: right after a process
# wakes, every torch or numpy call pays for cold caches, several times the check itself
# (figures: docs/measurements.md, 'Figures once quoted in module comments').
_DTYPES: dict[int, torch.dtype] = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
_CODES = {dt: code for code, dt in _DTYPES.items()}
_ABS_MASK = {torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF, torch.float32: 0x7FFFFFFF}
_EXP_ONES = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000}
_NP_INT = {torch.float16: np.int16, torch.bfloat16: np.int16, torch.float32: np.int32}
SMALL_TENSOR = 16 << 10  # bytes: up to this size the check runs on bytes, without numpy
_WIRE = "_diffuse_wire_bytes"  # attribute of a decoded tensor: the bytearray it was made from


def _marks(hit) -> bytes:
    """A bytes.translate table: 1 for the byte values `hit` accepts, 0 for the others."""
    return bytes(int(bool(hit(b))) for b in range(256))


# Per dtype (little-endian): item size, offset and table of the byte holding the top exponent
# bits, and (bf16, fp32) offset and table of the byte holding the exponent's lowest bit.
_EXP_BYTES = {
    torch.float16: (2, 1, _marks(lambda b: b & 0x7C == 0x7C), None, None),
    torch.bfloat16: (2, 1, _marks(lambda b: b & 0x7F == 0x7F), 0, _marks(lambda b: b & 0x80)),
    torch.float32: (4, 3, _marks(lambda b: b & 0x7F == 0x7F), 2, _marks(lambda b: b & 0x80)),
}
_LITTLE = sys.byteorder == "little"
# Tensor header structs by rank: (dtype code, rank, dims...) and the dims alone.
_SHAPES = {rank: struct.Struct(f">BB{rank}I") for rank in range(1, MAX_RANK + 1)}
_DIMS = {rank: struct.Struct(f">{rank}I") for rank in range(1, MAX_RANK + 1)}


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Downstream:
    """Where a chained hop forwards its outputs (CHAIN_TO_RECORD): the next hop's peer, the session
    the client opened there, and that peer's signed record (payload and signature, as the DHT
    holds them), whose addresses are the only ones the hop may dial (data/chain.py)."""

    peer_id: str
    session_id: bytes
    record: bytes
    signature: bytes


@dataclass
class Open:
    """Client -> server: start a session on blocks [start, end) of `model_id`."""

    session_id: bytes
    model_id: str
    start: int
    end: int
    max_length: int  # KV cache tokens requested
    batch_size: int = 1
    dtype: torch.dtype = torch.bfloat16  # wire dtype of every hidden tensor in the session
    want_commitments: bool = False
    exact: bool = False  # every position's output bits independent of what shares its step
    minor: int = VERSION_MINOR  # sender's protocol minor version (frame header)
    extensions: dict[int, bytes] = field(default_factory=dict)
    upstream: str | None = None  # 1.2: the peer that may forward STEPs into this session
    downstream: Downstream | None = None  # 1.3: where this hop forwards its outputs (CHAIN_TO_RECORD)


@dataclass
class OpenOk:
    session_id: bytes
    max_length: int  # granted, <= requested
    compute_dtype: str = ""  # e.g. "bfloat16": what the server computes in
    exact: bool = False  # the server computes this session with batch-invariant kernels
    minor: int = VERSION_MINOR  # sender's protocol minor version (frame header)
    extensions: dict[int, bytes] = field(default_factory=dict)
    chained: bool = False  # 1.2: the link to the downstream is up
    link_error: str | None = None  # 1.2: why it is not


@dataclass(eq=False)  # tensors do not compare with ==
class Step:
    """Client -> server: commit `keep`, roll back to `cache_len`, run T new tokens.

    `mask[i, j]` (bool [T, T]) says new token i attends to new token j; None means causal.
    Every new token also attends to all `cache_len` committed entries.
    """

    session_id: bytes
    step: int
    cache_len: int
    positions: Sequence[int]
    hidden: torch.Tensor  # [batch, T, hidden]
    keep: Sequence[int] = ()
    mask: torch.Tensor | None = None
    commit: bool = True  # False: keep this step's tokens as candidates for the next `keep`
    replay: bool = False
    input_commitment: bytes | None = None
    wire_dtype: torch.dtype | None = None  # encode as this dtype; None: hidden's own dtype
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass(eq=False)
class StepOk:
    session_id: bytes
    step: int
    hidden: torch.Tensor  # [batch, T, hidden]
    output_commitment: bytes | None = None
    compute_us: int | None = None
    wire_dtype: torch.dtype | None = None
    forwarded: bool = False  # 1.2: this output also went to the downstream session
    input_commitment: bytes | None = None  # 1.2: the server's commitment to the input it received
    link_error: str | None = None  # 1.2: why it did not go downstream (the link is dropped)
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass
class Close:
    session_id: bytes
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass
class ErrorMsg:
    code: int  # an ErrorCode, or an unknown code from a newer peer
    message: str
    session_id: bytes = ZERO_SESSION
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass
class Attach:
    """Upstream peer -> downstream peer (1.2): the STEPs that follow on this stream are forwarded
    into `session_id`, which a client opened here naming the sender as its upstream."""

    session_id: bytes
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass
class AttachOk:
    session_id: bytes
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass
class Ping:
    nonce: int
    session_id: bytes = ZERO_SESSION
    extensions: dict[int, bytes] = field(default_factory=dict)


@dataclass
class Pong:
    nonce: int
    session_id: bytes = ZERO_SESSION
    extensions: dict[int, bytes] = field(default_factory=dict)


Message = Union[Open, OpenOk, Step, StepOk, Close, ErrorMsg, Ping, Pong, Attach, AttachOk]

def _pack_downstream(d: Downstream) -> bytes:
    """CHAIN_TO_RECORD's value: session id (16), u8 n + peer id, u16 n + record, u8 n + signature."""
    pid = d.peer_id.encode()
    if not (0 < len(pid) <= MAX_PEER_ID and 0 < len(d.record) <= MAX_CHAIN_RECORD
            and 0 < len(d.signature) <= MAX_SIGNATURE):
        raise WireError("CHAIN_TO_RECORD: peer id 1..255 bytes, record 1..16384, signature 1..255")
    return b"".join([bytes(d.session_id), _U8.pack(len(pid)), pid, _U16.pack(len(d.record)), bytes(d.record),
                     _U8.pack(len(d.signature)), bytes(d.signature)])


def _read_downstream(value: bytes) -> Downstream:
    r = _Reader(memoryview(value), 0)
    sid = bytes(r.take(SESSION_ID_LEN, "CHAIN_TO_RECORD session id"))
    pid = r.text(r.unpack(_U8, "CHAIN_TO_RECORD peer id length")[0], "CHAIN_TO_RECORD peer id")
    record = bytes(r.take(r.unpack(_U16, "CHAIN_TO_RECORD record length")[0], "CHAIN_TO_RECORD record"))
    signature = bytes(r.take(r.unpack(_U8, "CHAIN_TO_RECORD signature length")[0], "CHAIN_TO_RECORD signature"))
    if r.left() or not pid or not record or len(record) > MAX_CHAIN_RECORD or not signature or sid == ZERO_SESSION:
        raise WireError("CHAIN_TO_RECORD: bad value (stray bytes, empty peer id, record or signature, "
                        "or zero session)")
    return Downstream(pid, sid, record, signature)


def _text_value(name: str, limit: int):
    def pack(text: str) -> bytes:
        return text.encode()[:limit].decode(errors="ignore").encode()

    def read(value: bytes) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"{name} is not valid utf-8") from None

    return pack, read


# Extensions with a typed field: (attribute, fixed length or None for any, Struct for integers,
# None for bytes, or a (pack, read) pair for structured values).
_KNOWN_EXT: dict[type, dict[int, tuple[str, int | None, object]]] = {
    Step: {Ext.INPUT_COMMITMENT: ("input_commitment", 32, None)},
    StepOk: {
        Ext.INPUT_COMMITMENT: ("input_commitment", 32, None),
        Ext.OUTPUT_COMMITMENT: ("output_commitment", 32, None),
        Ext.COMPUTE_US: ("compute_us", 4, _U32),
        Ext.LINK_ERROR: ("link_error", None, _text_value("LINK_ERROR", MAX_ERROR_MESSAGE)),
    },
    Open: {
        Ext.CHAIN_FROM: ("upstream", None, _text_value("CHAIN_FROM", MAX_PEER_ID)),
        Ext.CHAIN_TO_RECORD: ("downstream", None, (_pack_downstream, _read_downstream)),
    },
    OpenOk: {Ext.LINK_ERROR: ("link_error", None, _text_value("LINK_ERROR", MAX_ERROR_MESSAGE))},
}


def _pack_ext(value, st) -> bytes:
    if st is None:
        return bytes(value)
    return st.pack(value) if isinstance(st, struct.Struct) else st[0](value)


def _read_ext(value: bytes, st):
    if st is None:
        return value
    return st.unpack(value)[0] if isinstance(st, struct.Struct) else st[1](value)


# --------------------------------------------------------------------------- tensors


def _check_finite(ints: np.ndarray, dtype: torch.dtype) -> bool:
    """True if no element of the integer view of a float tensor is inf or NaN."""
    if ints.size == 0:
        return True
    return int((ints & _ABS_MASK[dtype]).max()) < _EXP_ONES[dtype]


def _bytes_finite(raw: bytes | bytearray, dtype: torch.dtype) -> bool:
    """True if no value in the little-endian bytes `raw` of `dtype` is inf or NaN."""
    size, hi, hi_marks, lo, lo_marks = _EXP_BYTES[dtype]
    top = raw[hi::size].translate(hi_marks)
    if lo is None:
        return 1 not in top
    return not int.from_bytes(top, "little") & int.from_bytes(raw[lo::size].translate(lo_marks), "little")


def tensor_wire(t: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[bytes, bytes | memoryview]:
    """The tensor header (dtype code, rank, dims) and the raw little-endian bytes this codec
    sends for `t` in `dtype` (default its own): also what activation commitments hash.

    Written for small tensors, where each avoidable torch call's fixed cost counts, the more so
    right after the process woke (figures: docs/measurements.md, 'Figures once quoted in module comments'). A tensor
    this codec decoded goes out as the bytes it came in (a client hands each hop's output to
    the next hop untouched), checked again on the bytes.
    """
    dtype = t.dtype if dtype is None else dtype
    code = _CODES.get(dtype)
    if code is None:
        raise WireError(f"wire dtype must be float16, bfloat16 or float32, not {dtype}")
    shape = t.shape
    if not 1 <= len(shape) <= MAX_RANK:
        raise WireError(f"tensor rank must be 1..{MAX_RANK}, got {len(shape)}")
    raw = getattr(t, _WIRE, None) if t.dtype == dtype else None
    if raw is None or len(raw) != t.nbytes:
        w = t.detach() if t.requires_grad else t
        if w.dtype != dtype:
            if w.dtype == torch.bfloat16 and dtype == torch.float16 and w.is_cpu and w.numel() > 4096:
                w = w.float()  # on CPU bf16->fp32->fp16 is faster than bf16->fp16 directly
            w = w.to(dtype)  # on the GPU if it lives there: fewer bytes to copy
        if not w.is_cpu:
            w = w.cpu()
        if not w.is_contiguous():
            w = w.contiguous()
        raw = (w.view(torch.int16) if dtype == torch.bfloat16 else w).numpy()  # numpy has no bf16
        if _LITTLE and raw.nbytes <= SMALL_TENSOR:
            raw = raw.tobytes()
    if isinstance(raw, np.ndarray):
        ints = raw.view(_NP_INT[dtype])
        finite = _check_finite(ints, dtype)
        raw = memoryview(ints if _LITTLE else ints.byteswap())
    else:
        finite = _bytes_finite(raw, dtype)
    if not finite:
        if not bool(torch.isfinite(t.detach()).all()):
            raise NonFiniteTensor("tensor contains inf or NaN; it cannot be sent")
        raise Fp16Overflow(
            f"tensor values up to {float(t.detach().abs().max()):.6g} overflow {dtype}; "
            "use bfloat16 on the wire for this session"
        )
    return _SHAPES[len(shape)].pack(code, len(shape), *shape), raw


def wire_dtype(code: int) -> torch.dtype:
    """The torch dtype of a wire dtype code."""
    try:
        return _DTYPES[code]
    except KeyError:
        raise WireError(f"unknown wire dtype code {code}") from None


# --------------------------------------------------------------------------- encoding


def _tlvs(msg: Message) -> list[bytes]:
    parts = []
    for typ, (attr, _, st) in _KNOWN_EXT.get(type(msg), {}).items():
        value = getattr(msg, attr)
        if value is not None:
            data = _pack_ext(value, st)
            parts.append(_TLV.pack(typ, len(data)) + data)
    for typ, data in msg.extensions.items():
        if typ in _KNOWN_EXT.get(type(msg), {}):
            raise WireError(f"extension {typ} must be set through its field, not `extensions`")
        parts.append(_TLV.pack(typ, len(data)) + bytes(data))
    return parts


def encode(msg: Message, max_frame: int = MAX_FRAME) -> bytes:
    """One whole frame (length prefix + header + payload) as ONE bytes object."""
    validate(msg)
    try:
        flags, parts = _payload(msg)
        parts += _tlvs(msg)
        minor = msg.minor if isinstance(msg, (Open, OpenOk)) else VERSION_MINOR
        header = _HEADER.pack(MAGIC, VERSION_MAJOR, minor, _TYPE_OF[type(msg)], 0, flags,
                              msg.session_id)
    except struct.error as e:  # an integer field out of its range
        raise WireError(f"cannot encode {type(msg).__name__}: {e}") from None
    body_len = HEADER_SIZE + sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    if body_len > max_frame:
        raise FrameTooLarge(f"message needs a {body_len}-byte frame; the limit is {max_frame}")
    return b"".join([_U32.pack(body_len), header, *parts])


def _payload(msg: Message) -> tuple[int, list]:
    """Header flags and the type-specific payload parts of `msg`."""
    flags = 0
    if isinstance(msg, Open):
        mid = msg.model_id.encode()
        flags = (OPEN_WANT_COMMITMENTS if msg.want_commitments else 0) | (OPEN_EXACT if msg.exact else 0)
        code = _CODES[msg.dtype]
        fixed = _OPEN.pack(msg.start, msg.end, msg.max_length, msg.batch_size, code, len(mid))
        parts = [fixed, mid]
    elif isinstance(msg, OpenOk):
        name = msg.compute_dtype.encode()
        flags = (OPEN_OK_EXACT if msg.exact else 0) | (OPEN_OK_CHAINED if msg.chained else 0)
        parts = [_U32.pack(msg.max_length), _U8.pack(len(name)), name]
    elif isinstance(msg, Step):
        keep, pos = msg.keep, msg.positions
        flags = (STEP_COMMIT if msg.commit else 0) | (STEP_REPLAY if msg.replay else 0)
        parts = [
            struct.pack(f">IIH{len(keep)}HI{len(pos)}i", msg.step, msg.cache_len, len(keep), *keep,
                        len(pos), *pos),
            *tensor_wire(msg.hidden, msg.wire_dtype),
        ]
        if msg.mask is not None:
            flags |= STEP_HAS_MASK
            bits = msg.mask.detach().cpu().contiguous().numpy().reshape(-1)
            parts.append(np.packbits(bits, bitorder="little").tobytes())
    elif isinstance(msg, StepOk):
        flags = STEP_OK_FORWARDED if msg.forwarded else 0
        parts = [_U32.pack(msg.step), *tensor_wire(msg.hidden, msg.wire_dtype)]
    elif isinstance(msg, (Close, Attach, AttachOk)):
        parts = []
    elif isinstance(msg, ErrorMsg):
        text = msg.message.encode()[:MAX_ERROR_MESSAGE].decode(errors="ignore").encode()
        parts = [_ERROR.pack(msg.code, len(text)), text]
    else:  # Ping, Pong
        parts = [_U64.pack(msg.nonce)]
    return flags, parts


# --------------------------------------------------------------------------- decoding


class _Reader:
    """Cursor over a frame body that names what was truncated instead of raising struct.error."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        start, end = self.pos, self.pos + n
        if end > len(self.buf):
            raise WireError(f"truncated {what}: needs {n} bytes, {self.left()} left in the frame")
        self.pos = end
        return self.buf[start:end]

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))

    def text(self, n: int, what: str) -> str:
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"{what} is not valid utf-8: {e}") from None

    def tensor(self, what: str) -> torch.Tensor:
        code, rank = self.unpack(_TENSOR_HEAD, what)
        dtype = _DTYPES.get(code)
        if dtype is None:
            raise WireError(f"{what}: unknown dtype code {code}")
        if not 1 <= rank <= MAX_RANK:
            raise WireError(f"{what}: tensor rank must be 1..{MAX_RANK}, got {rank}")
        shape = _DIMS[rank].unpack(self.take(4 * rank, what))
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize  # exact int: a lying shape fails here, before allocating
        if nbytes > self.left():
            raise WireError(f"{what}: shape {list(shape)} of {dtype} needs {nbytes} bytes, "
                            f"{self.left()} left in the frame")
        raw = bytearray(self.take(nbytes, what))
        if not raw:
            return torch.empty(shape, dtype=dtype)
        if _LITTLE and nbytes <= SMALL_TENSOR:
            finite = _bytes_finite(raw, dtype)
        else:
            ints = np.frombuffer(raw, _NP_INT[dtype])
            if not _LITTLE:
                raw = bytearray(ints.byteswap().tobytes())
                ints = np.frombuffer(raw, _NP_INT[dtype])
            finite = _check_finite(ints, dtype)
        if not finite:
            raise NonFiniteTensor(f"{what} contains inf or NaN")
        t = torch.frombuffer(raw, dtype=dtype).view(shape)
        if _LITTLE:
            setattr(t, _WIRE, raw)  # the tensor's own memory, in wire order: see tensor_wire
        return t


def _read_step(r: _Reader, flags: int, sid: bytes) -> Step:
    step, cache_len, n_keep = r.unpack(_STEP_HEAD, "STEP header")
    keep = struct.unpack(f">{n_keep}H", r.take(2 * n_keep, "STEP keep list"))
    (t,) = r.unpack(_U32, "STEP token count")
    positions = struct.unpack(f">{t}i", r.take(4 * t, "STEP positions"))
    hidden = r.tensor("STEP hidden")
    mask = None
    if flags & STEP_HAS_MASK:
        raw = r.take((t * t + 7) // 8, "STEP mask")
        packed = np.frombuffer(raw, dtype=np.uint8)
        if t * t % 8 and packed[-1] >> (t * t % 8):
            raise WireError("STEP mask: padding bits after the T*T mask bits must be zero")
        bits = np.unpackbits(packed, count=t * t, bitorder="little").astype(bool)
        mask = torch.from_numpy(bits.reshape(t, t))
    return Step(sid, step, cache_len, positions, hidden, keep, mask, bool(flags & STEP_COMMIT),
                bool(flags & STEP_REPLAY))


def _read_open(r: _Reader, flags: int, sid: bytes) -> Open:
    start, end, max_length, batch, code, n = r.unpack(_OPEN, "OPEN fields")
    if code not in _DTYPES:
        raise WireError(f"OPEN: unknown wire dtype code {code}")
    model_id = r.text(n, "OPEN model_id")
    return Open(sid, model_id, start, end, max_length, batch, _DTYPES[code],
                bool(flags & OPEN_WANT_COMMITMENTS), bool(flags & OPEN_EXACT))


def _read_open_ok(r: _Reader, flags: int, sid: bytes) -> OpenOk:
    (max_length,) = r.unpack(_U32, "OPEN_OK max_length")
    (n,) = r.unpack(_U8, "OPEN_OK compute_dtype length")
    return OpenOk(sid, max_length, r.text(n, "OPEN_OK compute_dtype"), bool(flags & OPEN_OK_EXACT),
                  chained=bool(flags & OPEN_OK_CHAINED))


def _read_error(r: _Reader, flags: int, sid: bytes) -> ErrorMsg:
    code, n = r.unpack(_ERROR, "ERROR fields")
    if n > MAX_ERROR_MESSAGE:
        raise WireError(f"ERROR message of {n} bytes exceeds {MAX_ERROR_MESSAGE}")
    try:
        code = ErrorCode(code)
    except ValueError:
        pass  # a code from a newer peer: kept as a plain int
    return ErrorMsg(code, r.text(n, "ERROR message"), sid)


_READERS = {
    MsgType.OPEN: _read_open,
    MsgType.OPEN_OK: _read_open_ok,
    MsgType.STEP: _read_step,
    MsgType.STEP_OK: lambda r, f, sid: StepOk(sid, r.unpack(_U32, "STEP_OK step")[0],
                                              r.tensor("STEP_OK hidden"), forwarded=bool(f & STEP_OK_FORWARDED)),
    MsgType.CLOSE: lambda r, f, sid: Close(sid),
    MsgType.ATTACH: lambda r, f, sid: Attach(sid),
    MsgType.ATTACH_OK: lambda r, f, sid: AttachOk(sid),
    MsgType.ERROR: _read_error,
    MsgType.PING: lambda r, f, sid: Ping(r.unpack(_U64, "PING nonce")[0], sid),
    MsgType.PONG: lambda r, f, sid: Pong(r.unpack(_U64, "PONG nonce")[0], sid),
}
_TYPE_OF = {Open: MsgType.OPEN, OpenOk: MsgType.OPEN_OK, Step: MsgType.STEP,
            StepOk: MsgType.STEP_OK, Close: MsgType.CLOSE, ErrorMsg: MsgType.ERROR,
            Ping: MsgType.PING, Pong: MsgType.PONG, Attach: MsgType.ATTACH, AttachOk: MsgType.ATTACH_OK}


def decode_body(body: bytes | bytearray | memoryview) -> Message:
    """Decode one frame body (the bytes after the length prefix)."""
    body = memoryview(body)
    if len(body) < 4 or body[:2] != MAGIC:
        raise WireError(f"bad magic {bytes(body[:2])!r}: not a Diffuse inference frame")
    if body[2] != VERSION_MAJOR:
        raise UnsupportedVersion(
            f"peer speaks Diffuse inference protocol {body[2]}.{body[3]}, this peer speaks "
            f"{VERSION_MAJOR}.{VERSION_MINOR}: major versions must match"
        )
    if len(body) < HEADER_SIZE:
        raise WireError(f"truncated header: {len(body)} of {HEADER_SIZE} bytes")
    _, _, minor, mtype, _, flags, sid = _HEADER.unpack_from(body)
    read = _READERS.get(mtype)
    if read is None:
        raise WireError(f"unknown message type {mtype}")
    r = _Reader(body, HEADER_SIZE)
    msg = read(r, flags, sid)
    if isinstance(msg, (Open, OpenOk)):
        msg.minor = minor  # other minors are accepted; the session uses min(client, server)
    known = _KNOWN_EXT.get(type(msg), {})
    while r.left():
        typ, n = r.unpack(_TLV, "extension header")
        value = bytes(r.take(n, "extension value"))
        if typ in msg.extensions or (typ in known and getattr(msg, known[typ][0]) is not None):
            raise WireError(f"extension {typ} appears twice")
        if typ in known:
            attr, size, st = known[typ]
            if size is not None and n != size:
                raise WireError(f"extension {typ} ({attr}) must be {size} bytes, got {n}")
            setattr(msg, attr, _read_ext(value, st))
        else:
            msg.extensions[typ] = value  # unknown: kept for the curious, otherwise ignored
    validate(msg)
    return msg


def peek(frame: bytes | bytearray | memoryview) -> tuple[int, int | None] | None:
    """The message type of one encoded frame (length prefix included) and, for an ERROR, its
    code, read from the header alone; None if the bytes do not start a Diffuse frame. For
    observers of a stream (metrics) that must not decode every message."""
    if len(frame) < 4 + HEADER_SIZE or frame[4:6] != MAGIC:
        return None
    mtype = _HEADER.unpack_from(frame, 4)[3]
    if mtype == MsgType.ERROR and len(frame) >= 4 + HEADER_SIZE + _ERROR.size:
        return mtype, _ERROR.unpack_from(frame, 4 + HEADER_SIZE)[0]
    return mtype, None


def decode(frame: bytes, max_frame: int = MAX_FRAME) -> Message:
    """Decode exactly one whole frame (length prefix included)."""
    dec = FrameDecoder(max_frame)
    messages = dec.feed(frame)
    if len(messages) != 1 or dec.pending or dec.failed:
        raise WireError(f"expected one whole frame, got {len(messages)} and {dec.pending} bytes")
    return messages[0]


class FrameDecoder:
    """Reassembles frames from reads that may split anywhere (h11-style: no I/O).

    `receive(data)` adds bytes; `next_message()` returns the next whole message, None while it is
    incomplete, or raises WireError for a bad frame. One message at a time, so a receiver acts on
    each (and may change `max_frame`, as a session's state allows) before the next is judged, and
    answers a bad frame after every message that came before it. After a bad frame the stream is
    out of sync: every later call raises. `feed(data)` does both for receivers that take every
    message a read completes at once.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf: bytes | bytearray = b""
        self._off = 0  # bytes of _buf already decoded
        self.failed: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back; non-zero at end of stream means truncation."""
        return len(self._buf) - self._off

    def receive(self, data: bytes | bytearray | memoryview) -> None:
        if self.failed is not None:
            raise WireError(f"stream unusable after an earlier error: {self.failed}")
        if self._off == len(self._buf):  # nothing held back: decode straight from these bytes
            self._buf, self._off = data if isinstance(data, bytes) else bytes(data), 0
            return
        if isinstance(self._buf, bytes):
            self._buf = bytearray(memoryview(self._buf)[self._off:])
        else:
            del self._buf[:self._off]
        self._buf += data
        self._off = 0

    def next_message(self) -> Message | None:
        if self.failed is not None:
            raise WireError(f"stream unusable after an earlier error: {self.failed}")
        buf, pos = self._buf, self._off
        if len(buf) - pos < 4:
            return None
        (n,) = _U32.unpack_from(buf, pos)
        try:
            if n > self.max_frame:
                raise FrameTooLarge(f"frame length {n} exceeds the limit of {self.max_frame} bytes")
            if len(buf) - pos - 4 < n:
                return None
            # A bytearray buffer is resized later, so decode a copy rather than a view of it.
            body = memoryview(buf)[pos + 4:pos + 4 + n] if isinstance(buf, bytes) else bytes(buf[pos + 4:pos + 4 + n])
            msg = decode_body(body)
        except ProtocolError as e:
            self.failed, self._buf, self._off = e, b"", 0
            raise
        self._off = pos + 4 + n
        return msg

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Every whole message `data` completes. A bad frame after some of them ends the list
        (it is in `failed`, and raised by the next call); one before any of them is raised now."""
        self.receive(data)
        out: list[Message] = []
        while True:
            try:
                msg = self.next_message()
            except ProtocolError:
                if not out:
                    raise
                return out
            if msg is None:
                return out
            out.append(msg)


# --------------------------------------------------------------------------- validation


def _validate_step(msg: Step) -> None:
    t, keep, shape = len(msg.positions), msg.keep, msg.hidden.shape
    if len(keep) > 1 and not all(a < b for a, b in zip(keep, keep[1:])):
        raise WireError(f"STEP: keep indices must be strictly increasing, got {list(keep)}")
    if t and min(msg.positions) < 0:
        raise WireError("STEP: positions must be >= 0")
    if len(shape) != 3 or shape[1] != t or shape[0] < 1 or shape[2] < 1:
        raise WireError(f"STEP: hidden must be [batch, {t}, hidden] for {t} positions, got {list(shape)}")
    m = msg.mask
    if m is not None:
        if m.dtype != torch.bool or tuple(m.shape) != (t, t):
            raise WireError(f"STEP: mask must be bool [{t}, {t}], got {m.dtype} {list(m.shape)}")
        if not bool(m.diagonal().all()):
            raise WireError("STEP: mask must let every token attend to itself")
    if msg.input_commitment is not None and len(msg.input_commitment) != 32:
        raise WireError("STEP: input_commitment must be 32 bytes")


def validate(msg: Message) -> None:
    """Field checks shared by encode and decode, so a peer never sends what it would reject.

    Plain `if`s rather than a helper taking the message: formatting messages eagerly cost
    microseconds on every step.
    """
    sid = msg.session_id
    if not isinstance(sid, (bytes, bytearray)) or len(sid) != SESSION_ID_LEN:
        raise WireError(f"session_id must be {SESSION_ID_LEN} bytes")
    for typ, data in msg.extensions.items():
        if not 0 < typ <= 0xFFFF or len(data) > 0xFFFFFFFF:
            raise WireError(f"bad extension type {typ} or length")
    if isinstance(msg, Step):
        _validate_step(msg)
    elif isinstance(msg, StepOk):
        shape = msg.hidden.shape
        if len(shape) != 3 or shape[0] < 1 or shape[2] < 1:
            raise WireError(f"STEP_OK: hidden must be [batch, T, hidden], got {list(shape)}")
        if msg.output_commitment is not None and len(msg.output_commitment) != 32:
            raise WireError("STEP_OK: output_commitment must be 32 bytes")
    elif isinstance(msg, (Attach, AttachOk)):
        if sid == ZERO_SESSION:
            raise WireError("ATTACH: session_id must not be all zeros")
    elif isinstance(msg, Open):
        if sid == ZERO_SESSION:
            raise WireError("OPEN: session_id must not be all zeros")
        if not 0 < len(msg.model_id.encode()) <= MAX_MODEL_ID:
            raise WireError(f"OPEN: model_id must be 1..{MAX_MODEL_ID} utf-8 bytes")
        if not 0 <= msg.start < msg.end:
            raise WireError(f"OPEN: bad block span [{msg.start}, {msg.end})")
        if msg.max_length < 1 or msg.batch_size < 1:
            raise WireError("OPEN: max_length and batch_size must be >= 1")
        if msg.dtype not in _CODES:
            raise WireError("OPEN: wire dtype must be float16, bfloat16 or float32")
    elif isinstance(msg, OpenOk):
        if msg.max_length < 1:
            raise WireError("OPEN_OK: max_length must be >= 1")
        if len(msg.compute_dtype.encode()) > MAX_DTYPE_NAME:
            raise WireError(f"OPEN_OK: compute_dtype over {MAX_DTYPE_NAME} bytes")
