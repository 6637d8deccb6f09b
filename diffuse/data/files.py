"""Files by SHA-256 between peers: `/diffuse/files/1.0.0` (protocols/files.md).

A client asks for a byte range of the file whose SHA-256 it names; the server answers with one
RESPONSE (a status, the file's size, the range it sends) and the bytes in DATA frames of at most
1 MiB; since 1.2 the stream then takes the next GET, so a receiver keeps it (`Held`). The content
hash is the file's only name, so the receiver checks it over the whole file before anything uses
it, and a peer can serve whatever the swarm announces by hash (draft heads, a model's blocks).

The codec (`encode`, `decode_body`, `Decoder`, `AnswerDecoder`, `resolve`) does no I/O;
`FileServer.serve` and `get_range` run it over libp2p streams. Metadata is packed with `struct`,
never pickle.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO, Union

import trio

from diffuse.control.dial import connect, connected, open_stream
from diffuse.data.stream import READ_CHUNK, ByteStream, close_quietly
from diffuse.errors import DiffuseError, FetchError, ProtocolError

log = logging.getLogger(__name__)

PROTOCOL_ID = "/diffuse/files/1.0.0"
MAGIC = b"DF"
VERSION_MAJOR = 1
VERSION_MINOR = 2  # 1.1: blocks under their weight commitments (section 9); 1.2: GETs in turn on a stream
MAX_REQUEST_FRAME = 4096  # a GET is 54 bytes; the rest is room for extensions
MAX_CHUNK = 1 << 20  # bytes of one DATA frame, at most
CHUNK = MAX_CHUNK  # what the reference server puts in one DATA frame, read from disk at once (a hop to a thread)
MAX_RANGE = 64 << 20  # every server serves a range this long; a client asks for no more at once
MAX_MESSAGE = 1024  # bytes of utf-8 in a RESPONSE's message
REQUEST_TIMEOUT_S = 10.0  # a stream that sends no GET in this long is answered TIMEOUT
STALL_TIMEOUT_S = 30.0  # no byte through in this long, either way: the transfer is given up
# A range must be through within max(MIN_TRANSFER_S, its bytes / MIN_RATE), either way: a trickle
# (a frame every few seconds) resets no stall timer forever, holding a server's slot or a piece.
MIN_RATE, MIN_TRANSFER_S = 1 << 20, 30.0
SEND_RATE_ENV = "DIFFUSE_FILES_SEND_RATE"  # an owner's cap on upload: bytes/s per transfer (unset: none)


def send_rate_cap() -> float:
    """$DIFFUSE_FILES_SEND_RATE: bytes per second one transfer may send at most (0 or unset: no cap),
    for an owner whose upload link is lent too. Below MIN_RATE, fetchers drop this peer's pieces."""
    text = os.environ.get(SEND_RATE_ENV, "").strip()
    try:
        rate = float(text or 0)
    except ValueError:
        rate = -1.0
    if not (math.isfinite(rate) and rate >= 0):
        raise DiffuseError(f"{SEND_RATE_ENV} must be a number of bytes per second >= 0, not {text!r}")
    return rate


def transfer_limit(length: int, min_rate: float = MIN_RATE, least: float = MIN_TRANSFER_S) -> float:
    """Seconds a range of `length` bytes may take at most."""
    return max(least, length / min_rate)

_HEADER = struct.Struct(">2sBBBB")  # magic, major, minor, type, reserved
HEADER_SIZE = _HEADER.size  # 6
_GET = struct.Struct(">32sQQ")  # sha256, offset, length
_RESPONSE = struct.Struct(">HQQQH")  # status, total size, offset, length, message length
_U32 = struct.Struct(">I")
_TLV = struct.Struct(">HI")


class MsgType(IntEnum):
    GET = 1
    RESPONSE = 2
    DATA = 3


class Status(IntEnum):
    """RESPONSE status. Receivers accept codes they do not know and treat them like INTERNAL."""

    OK = 0
    BAD_REQUEST = 1  # undecodable request, or a range outside the file
    UNSUPPORTED_VERSION = 2
    NOT_FOUND = 3  # no file with that hash here (or it changed since it was hashed)
    TOO_LARGE = 4  # the range is longer than this server sends at once
    BUSY = 5  # too many transfers now: try another peer or later
    INTERNAL = 6
    TIMEOUT = 7  # no GET arrived in time


def status_name(code: int) -> str:
    return Status(code).name if code in Status._value2member_map_ else f"status {code}"


class FrameError(ProtocolError):
    """Bytes that break the files protocol; `status` is what the server's RESPONSE carries."""

    def __init__(self, message: str, status: Status = Status.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Get:
    """Bytes [offset, offset + length) of the file with this SHA-256; length 0: to its end."""

    sha256: bytes
    offset: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        if len(self.sha256) != 32:
            raise ValueError("a SHA-256 is 32 bytes")


@dataclass(frozen=True)
class Response:
    """The answer to a GET. OK: `length` bytes from `offset` follow in DATA frames; `total` is
    the whole file's size (also on TOO_LARGE and BAD_REQUEST, where it is known). TOO_LARGE:
    `length` is the longest range this server sends at once."""

    status: int
    total: int = 0
    offset: int = 0
    length: int = 0
    message: str = ""


@dataclass(frozen=True)
class Data:
    data: bytes


Message = Union[Get, Response, Data]


def encode(msg: Message) -> bytes:
    """One whole frame (length prefix included), for one write."""
    if isinstance(msg, Get):
        kind, payload = MsgType.GET, _GET.pack(msg.sha256, msg.offset, msg.length)
    elif isinstance(msg, Response):
        text = msg.message.encode()[:MAX_MESSAGE].decode(errors="ignore").encode()  # cut at a character
        kind = MsgType.RESPONSE
        payload = _RESPONSE.pack(msg.status, msg.total, msg.offset, msg.length, len(text)) + text
    elif isinstance(msg, Data):
        if not 0 < len(msg.data) <= MAX_CHUNK:
            raise ValueError(f"a DATA frame carries 1..{MAX_CHUNK} bytes, not {len(msg.data)}")
        kind, payload = MsgType.DATA, msg.data
    else:
        raise TypeError(f"not a files-protocol message: {type(msg).__name__}")
    header = _HEADER.pack(MAGIC, VERSION_MAJOR, VERSION_MINOR, kind, 0)
    return b"".join((_U32.pack(len(header) + len(payload)), header, payload))  # one copy of the payload


def _kind(body: bytes | memoryview, size: int) -> int:
    """The message type in the first bytes of a body of `size` bytes, its header checked in the
    order section 3.3 gives (DATA: its payload's size too)."""
    if size < 4 or bytes(body[:2]) != MAGIC:
        raise FrameError("bad magic: not a files-protocol frame")
    if body[2] != VERSION_MAJOR:
        raise FrameError(f"peer speaks files protocol {body[2]}.{body[3]}, this peer speaks "
                         f"{VERSION_MAJOR}.{VERSION_MINOR}", Status.UNSUPPORTED_VERSION)
    if size < HEADER_SIZE:
        raise FrameError("truncated header")
    if body[4] == MsgType.DATA and not 0 < size - HEADER_SIZE <= MAX_CHUNK:
        raise FrameError(f"a DATA frame carries 1..{MAX_CHUNK} bytes, not {size - HEADER_SIZE}")
    return body[4]


def decode_body(body: bytes | memoryview) -> Message:
    """The message in one frame body; FrameError names what is wrong."""
    kind, payload = _kind(body, len(body)), memoryview(body)[HEADER_SIZE:]
    if kind == MsgType.DATA:
        return Data(bytes(payload))
    if kind == MsgType.GET:
        if len(payload) < _GET.size:
            raise FrameError("truncated GET")
        sha, offset, length = _GET.unpack_from(payload)
        _extensions(payload[_GET.size:])
        return Get(sha, offset, length)
    if kind == MsgType.RESPONSE:
        if len(payload) < _RESPONSE.size:
            raise FrameError("truncated RESPONSE")
        status, total, offset, length, n = _RESPONSE.unpack_from(payload)
        if n > MAX_MESSAGE or len(payload) < _RESPONSE.size + n:
            raise FrameError(f"RESPONSE message of {n} bytes does not fit (at most {MAX_MESSAGE})")
        try:
            text = bytes(payload[_RESPONSE.size:_RESPONSE.size + n]).decode()
        except UnicodeDecodeError:
            raise FrameError("RESPONSE message is not UTF-8") from None
        _extensions(payload[_RESPONSE.size + n:])
        return Response(status, total, offset, length, text)
    raise FrameError(f"unknown message type {kind}")


def _extensions(area: memoryview) -> None:
    """Check the extension area's framing; no type is registered in 1.0, so all are ignored."""
    seen: set[int] = set()
    while len(area):
        if len(area) < _TLV.size:
            raise FrameError("truncated extension entry")
        kind, n = _TLV.unpack_from(area)
        if kind == 0 or kind in seen or len(area) < _TLV.size + n:
            raise FrameError(f"bad extension entry (type {kind}, {n} bytes)")
        seen.add(kind)
        area = area[_TLV.size + n:]


class Decoder:
    """Frames from reads that split or join them anywhere; the length prefix is checked
    against `max_frame` before any of the body is held. After a FrameError every call raises."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self.failed: FrameError | None = None

    def feed(self, data: bytes) -> list[Message]:
        if self.failed is not None:
            raise FrameError(f"stream unusable after an earlier error: {self.failed}", self.failed.status)
        self._buf += data
        out: list[Message] = []
        at, view = 0, memoryview(self._buf)  # frames decoded in place; the buffer cut once, after
        try:
            while len(view) - at >= 4:
                (n,) = _U32.unpack_from(view, at)
                if n > self.max_frame:
                    raise FrameError(f"frame of {n} bytes exceeds the limit of {self.max_frame}")
                if len(view) - at < 4 + n:
                    break
                out.append(decode_body(view[at + 4:at + 4 + n]))
                at += 4 + n
        except FrameError as e:
            view.release()
            self.failed, self._buf = e, bytearray()
            raise
        view.release()
        del self._buf[:at]
        return out


class AnswerDecoder:
    """A server's answer as reads bring it: RESPONSE frames decoded whole, and each DATA frame's
    payload handed on as views of the bytes read, as they come (no copy), so a range goes from
    the socket to its file without being gathered first. The length prefix is checked against
    `max_frame`, and the header and DATA size as `decode_body` does, before any of the payload is
    passed on. After a FrameError every call raises."""

    def __init__(self, max_frame: int = HEADER_SIZE + MAX_CHUNK) -> None:
        self.max_frame = max_frame
        self._start = bytearray()  # the start of a frame that reads split
        self._left = 0  # bytes still to come of the current DATA payload
        self.minor = 0  # the minor version the last RESPONSE came in
        self.failed: FrameError | None = None

    def feed(self, data: bytes) -> list[Message | memoryview]:
        if self.failed is not None:
            raise FrameError(f"stream unusable after an earlier error: {self.failed}", self.failed.status)
        out: list[Message | memoryview] = []
        view = memoryview(data)
        try:
            while view:
                if self._left:  # payload: passed on as it is
                    n = min(self._left, len(view))
                    out.append(view[:n])
                    view, self._left = view[n:], self._left - n
                elif not self._start and len(view) >= (need := self._need(view)):
                    self._frame(view[:need], out)  # a frame start whole in this read: no copy
                    view = view[need:]
                else:  # gather a split frame start, then decode it
                    while len(self._start) < (need := self._need(self._start)) and view:
                        take = need - len(self._start)
                        self._start += view[:take]
                        view = view[take:]
                    if len(self._start) < need:
                        break
                    start, self._start = self._start, bytearray()
                    self._frame(memoryview(start), out)
        except FrameError as e:
            self.failed, self._start, self._left = e, bytearray(), 0
            raise
        return out

    def _need(self, start: bytes | memoryview) -> int:
        """Bytes of a frame's start to gather before it can be decoded: its length prefix, then
        its header, then (a DATA frame) nothing more, or (any other) the whole frame."""
        if len(start) < 4:
            return 4
        (n,) = _U32.unpack_from(start)
        if n > self.max_frame:
            raise FrameError(f"frame of {n} bytes exceeds the limit of {self.max_frame}")
        if len(start) < 4 + min(n, HEADER_SIZE):
            return 4 + min(n, HEADER_SIZE)
        return 4 + HEADER_SIZE if n > HEADER_SIZE and start[8] == MsgType.DATA else 4 + n

    def _frame(self, start: memoryview, out: list[Message | memoryview]) -> None:
        (n,) = _U32.unpack_from(start)
        if _kind(start[4:], n) == MsgType.DATA:
            self._left = n - HEADER_SIZE
        else:
            out.append(decode_body(start[4:4 + n]))
            self.minor = start[7]


def resolve(get: Get, size: int | None, max_range: int = MAX_RANGE) -> Response:
    """The RESPONSE to `get` for a file of `size` bytes here (None: no such file)."""
    if size is None:
        return Response(Status.NOT_FOUND, message=f"no file with sha256 {get.sha256.hex()} here")
    if get.offset > size:
        return Response(Status.BAD_REQUEST, size, message=f"offset {get.offset} is past the end ({size} bytes)")
    length = get.length or size - get.offset
    if get.offset + length > size:
        return Response(Status.BAD_REQUEST, size,
                        message=f"range {get.offset}+{length} runs past the end ({size} bytes)")
    if length > max_range:
        return Response(Status.TOO_LARGE, size, 0, max_range,
                        f"range of {length} bytes: this peer sends at most {max_range} at once")
    return Response(Status.OK, size, get.offset, length)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class FileServer:
    """Serves the files it was given by their SHA-256, a few transfers at a time.

    A file is hashed once, when added; a request finds it by hash and the server checks only its
    size before sending (re-hashing per request would cost a full read): a file damaged on disk
    afterwards goes out as it is now, and the receiver's hash check refuses it.
    """

    def __init__(self, *, max_transfers: int = 4, max_per_peer: int = 2, max_range: int = MAX_RANGE,
                 request_timeout: float = REQUEST_TIMEOUT_S, stall_timeout: float = STALL_TIMEOUT_S,
                 min_rate: float = MIN_RATE, min_transfer_s: float = MIN_TRANSFER_S, chunk: int = CHUNK) -> None:
        if not 0 < chunk <= MAX_CHUNK:
            raise ValueError(f"a DATA frame carries 1..{MAX_CHUNK} bytes, not {chunk}")
        self.chunk = chunk
        self.files: dict[str, tuple[Path | Composite, int]] = {}  # hex sha256 -> (file, size when hashed)
        self.max_transfers, self.max_per_peer, self.max_range = max_transfers, max_per_peer, max_range
        self.request_timeout, self.stall_timeout = request_timeout, stall_timeout
        self.min_rate, self.min_transfer_s = min_rate, min_transfer_s
        self.active: Counter[str] = Counter()  # remote peer -> transfers in progress
        self.send_rate = send_rate_cap()

    def add(self, path: Path) -> tuple[str, int]:
        """Hash `path` and serve it; returns (hex sha256, size)."""
        path = Path(path)
        size, sha = path.stat().st_size, sha256_file(path)
        self.files[sha] = (path, size)
        return sha, size

    def add_composite(self, sha256: str, parts: Sequence[Part]) -> int:
        """Serve, under `sha256`, the file made of `parts` (bytes, or (path, offset, length) of a
        file's bytes): a block in canonical form (model/blockfiles.py) whose hash the caller has
        checked. Served while each file it reads keeps its size now; returns the size."""
        whole = Composite(list(parts))
        self.files[sha256] = (whole, whole.size)
        return whole.size

    async def serve(self, stream: ByteStream, remote: str) -> None:
        """Answer the GETs on `stream` from peer `remote` (its id bounds its share of transfers) in
        turn, each after the last has gone out whole (1.2: a stream carries several), then close
        it: after any answer but a whole range, the end of the stream, or no next GET within the
        request timeout. Never raises for anything the peer did."""
        decoder, queued = Decoder(MAX_REQUEST_FRAME), []
        try:
            first = True
            while (get := await self._request(stream, decoder, queued, first)) is not None:
                if not await self._answer(stream, get, remote):
                    break
                first = False
        except FrameError as e:
            await self._reply(stream, Response(e.status, message=str(e)))
        except trio.TooSlowError:
            log.info("files stream to %s stalled for %g s: closed", remote, self.stall_timeout)
        except Exception as e:  # noqa: BLE001 - one stream's failure must not reach the others
            if type(e).__module__.startswith("libp2p") or isinstance(e, (OSError, trio.BrokenResourceError,
                                                                          trio.ClosedResourceError)):
                log.info("files stream from %s failed: %s", remote, e)
            else:
                log.exception("internal error serving a file to %s", remote)
                await self._reply(stream, Response(Status.INTERNAL, message=f"internal error: {type(e).__name__}"))
        finally:
            await close_quietly(stream)

    async def _request(self, stream: ByteStream, decoder: Decoder, queued: list[Message], first: bool) -> Get | None:
        """The stream's next GET (`queued`: messages a read brought with an earlier one); None if the
        stream ends before one, or a later one does not come within the request timeout."""
        with trio.move_on_after(self.request_timeout):
            while not queued:
                data = await _read(stream)
                if not data:
                    return None
                queued += decoder.feed(data)
            msg = queued.pop(0)
            if not isinstance(msg, Get):
                raise FrameError(f"expected a GET, got {type(msg).__name__.upper()}")
            return msg
        if not first:  # an idle reused stream: closed without a word (the receiver opens another)
            return None
        raise FrameError(f"no GET within {self.request_timeout:g} s", Status.TIMEOUT)

    async def _answer(self, stream: ByteStream, get: Get, remote: str) -> bool:
        """Answer `get`; True once a whole range went out (the stream may carry another GET)."""
        if sum(self.active.values()) >= self.max_transfers or self.active[remote] >= self.max_per_peer:
            await self._reply(stream, Response(Status.BUSY, message=f"{sum(self.active.values())} transfers "
                                                                    "in progress: try later or another peer"))
            return False
        entry = self.files.get(get.sha256.hex())
        try:
            f = (entry[0].open() if isinstance(entry[0], Composite) else open(entry[0], "rb")) if entry else None
        except OSError:
            f = None
        if f is None:
            await self._reply(stream, resolve(get, None))
            return False
        self.active[remote] += 1
        try:
            with f:
                size = f.size() if isinstance(f, _Reader) else os.fstat(f.fileno()).st_size
                if size != entry[1]:
                    log.warning("%s changed on disk since it was hashed: no longer served", entry[0])
                    await self._reply(stream, Response(Status.NOT_FOUND, message=f"file {get.sha256.hex()} "
                                                                                 "changed since it was announced"))
                    return False
                answer = resolve(get, size, self.max_range)
                await self._send(stream, answer)
                if answer.status != Status.OK:
                    return False
                limit = transfer_limit(answer.length, self.min_rate, self.min_transfer_s)
                with trio.move_on_after(limit) as slow:
                    await self._copy(f, stream, answer.offset, answer.length)
                if slow.cancelled_caught:  # its slot is freed; the stream is closed by serve
                    log.info("files stream to %s took over %g s for %d bytes: closed", remote, limit, answer.length)
                return not slow.cancelled_caught
        finally:
            self.active[remote] -= 1
            if not self.active[remote]:
                del self.active[remote]

    async def _copy(self, f: BinaryIO | _Reader, stream: ByteStream, offset: int, length: int) -> None:
        f.seek(offset)
        frame = bytearray(4 + HEADER_SIZE + min(self.chunk, length))  # one DATA frame, reused: a write
        while length:  # has copied it by the time it returns; each read, off the event loop, lands in it
            n = min(self.chunk, length)
            if n < len(frame) - 4 - HEADER_SIZE:
                frame = frame[:4 + HEADER_SIZE + n]
            _U32.pack_into(frame, 0, HEADER_SIZE + n)
            _HEADER.pack_into(frame, 4, MAGIC, VERSION_MAJOR, VERSION_MINOR, MsgType.DATA, 0)
            if await trio.to_thread.run_sync(_fill, f, memoryview(frame)[4 + HEADER_SIZE:]) < n:
                raise OSError(f"{f.name} shrank while it was being sent")  # the receiver sees a short range
            with trio.fail_after(self.stall_timeout):
                await stream.write(frame)
            length -= n
            if self.send_rate:
                await trio.sleep(n / self.send_rate)

    async def _send(self, stream: ByteStream, msg: Message) -> None:
        with trio.fail_after(self.stall_timeout):
            await stream.write(encode(msg))

    async def _reply(self, stream: ByteStream, msg: Response) -> None:
        """An error answer; the stream may be gone already."""
        try:
            await self._send(stream, msg)
        except Exception as e:  # noqa: BLE001 - nobody left to tell
            log.debug("could not send %s: %s", Status(msg.status).name, e)


def _fill(f: BinaryIO | _Reader, view: memoryview) -> int:
    """Read into `view` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(view) and (n := f.readinto(view[got:])):
        got += n
    return got


Part = Union[bytes, tuple[Path, int, int]]


class Composite:
    """A file made of literal bytes and ranges of files on disk, read in order."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.size = sum(len(p) if isinstance(p, bytes) else p[2] for p in parts)
        self.sizes = {p[0]: Path(p[0]).stat().st_size for p in parts if not isinstance(p, bytes)}

    def open(self) -> "_Reader":
        return _Reader(self)


class _Reader:
    """A Composite's reader with the calls `FileServer` makes of a file: `size` (its size, or -1
    once a file under it changed size: not served), `seek`, `readinto`."""

    def __init__(self, whole: Composite) -> None:
        self.whole, self.pos, self.name = whole, 0, "a composite file"
        self.handles = {path: open(path, "rb") for path in whole.sizes}

    def size(self) -> int:
        same = all(os.fstat(f.fileno()).st_size == self.whole.sizes[p] for p, f in self.handles.items())
        return self.whole.size if same else -1

    def seek(self, offset: int) -> None:
        self.pos = offset

    def readinto(self, view: memoryview) -> int:
        """Fill `view` from the current position; the bytes read (fewer only where a file under it
        came up short)."""
        at, end, got = 0, self.pos + len(view), 0
        for part in self.whole.parts:
            length = len(part) if isinstance(part, bytes) else part[2]
            lo, hi = max(self.pos, at), min(end, at + length)
            if lo < hi:
                if isinstance(part, bytes):
                    view[got:got + hi - lo] = part[lo - at:hi - at]
                    got += hi - lo
                else:
                    f = self.handles[part[0]]
                    f.seek(part[1] + lo - at)
                    n = _fill(f, view[got:got + hi - lo])
                    got += n
                    if n < hi - lo:
                        break
            at += length
            if at >= end:
                break
        self.pos += got
        return got

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.handles.values():
            f.close()


Opener = Callable[[], Awaitable[ByteStream]]


async def fetch(host: Any, peer_id: str, sha256: str, expected_size: int, dest: Path, limit: int,
                addrs: Sequence[str] = (), *, max_range: int = MAX_RANGE) -> Path:
    """Download the file with hex SHA-256 `sha256` and `expected_size` bytes (what the peer
    announced; refused above `limit`) from `peer_id` into `dest`, range by range, and return
    `dest`. It is written under a temporary name and renamed only once its size and hash are
    right: on any failure nothing is left and FetchError names the peer and what was wrong.
    `addrs`: the peer's announced addresses, dialled when no connection to it is open."""
    if addrs and not connected(host, peer_id):
        try:
            await connect(host, peer_id, addrs)
        except Exception as e:  # noqa: BLE001 - py-libp2p fails dials in many types of its own
            raise FetchError(f"cannot reach peer {peer_id}: {e}") from None

    async def opener() -> ByteStream:
        try:
            return await open_stream(host, peer_id, PROTOCOL_ID, ())
        except Exception as e:  # noqa: BLE001 - py-libp2p fails streams in many types of its own
            raise FetchError(f"cannot open a files stream to peer {peer_id}: {e}") from None

    return await fetch_with(opener, peer_id, sha256, expected_size, dest, limit, max_range=max_range)


async def fetch_with(open_stream: Opener, peer: str, sha256: str, expected_size: int, dest: Path, limit: int,
                     *, max_range: int = MAX_RANGE, stall_timeout: float = STALL_TIMEOUT_S) -> Path:
    """`fetch` over streams from `open_stream`: one, where the server takes several GETs on it."""
    try:
        want = bytes.fromhex(sha256)
    except ValueError:
        want = b""
    if len(want) != 32:
        raise FetchError(f"peer {peer} announces {sha256!r}, not a SHA-256 in hex")
    if not 0 < expected_size <= limit:
        raise FetchError(f"peer {peer} announces a file of {expected_size} bytes; 1 to {limit} are accepted")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    held = Held()
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            offset = 0
            while offset < expected_size:
                length = min(max_range, expected_size - offset)
                try:
                    offset += await get_range(open_stream, peer, want, offset, length, expected_size, out, digest,
                                              stall_timeout, held=held)
                except Smaller as e:  # the peer sends less per request, and said how much
                    if not 0 < e.length < length:
                        raise FetchError(f"peer {peer} refused {length} bytes as too large without naming "
                                         "a smaller range") from None
                    max_range = e.length
        if digest.hexdigest() != sha256:
            raise FetchError(f"peer {peer} sent {expected_size} bytes that hash to SHA-256 {digest.hexdigest()}, "
                             f"not the announced {sha256}: refused, nothing kept")
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        await held.close()
    return dest


class Busy(FetchError):
    """The peer answered BUSY: it serves the file, but not now."""


class Slow(FetchError):
    """The peer sent a range slower than the least rate a fetch accepts (not a lie: no ban)."""


class Smaller(Exception):
    """The peer answered TOO_LARGE: it sends at most `length` bytes per request."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length


class Held:
    """The stream a receiver keeps to one peer between GETs (a 1.2 server answers several on one),
    for at most `idle_s` unused: the server lets an idle stream go after its request timeout."""

    def __init__(self, idle_s: float = REQUEST_TIMEOUT_S / 2) -> None:
        self.stream: ByteStream | None = None
        self.since, self.idle_s = 0.0, idle_s

    async def take(self) -> ByteStream | None:
        """The kept stream, if it is fresh enough (a stale one is closed); None: open a new one."""
        stream, self.stream = self.stream, None
        if stream is not None and trio.current_time() - self.since > self.idle_s:
            await close_quietly(stream)
            stream = None
        return stream

    def keep(self, stream: ByteStream) -> None:
        self.stream, self.since = stream, trio.current_time()

    async def close(self) -> None:
        if self.stream is not None:
            await close_quietly(self.stream)
            self.stream = None


class _Gone(FetchError):
    """The stream ended before any answer: on a kept stream, the server let it go (no one's fault)."""


async def get_range(open_stream: Opener, peer: str, sha: bytes, offset: int, length: int, total: int,
                    out: BinaryIO, digest: Any, stall_timeout: float, deadline_s: float = math.inf,
                    held: Held | None = None) -> int:
    """Receive [offset, offset + length) into `out` and `digest` within `deadline_s` (else Slow);
    returns `length`. On the stream `held` keeps, if any (one that ended unanswered is replaced by
    a new one, nobody blamed); the stream is kept there after a whole range from a server of
    minor version 2 or later, else closed."""
    held = held or Held()
    stream, kept = await held.take(), True
    if stream is None:
        stream, kept = await open_stream(), False
    reusable = False
    try:
        try:
            received, reusable = await _receive(stream, peer, sha, offset, length, total, out, digest,
                                                stall_timeout, deadline_s)
        except _Gone:
            if not kept:
                raise
            await close_quietly(stream)
            stream = await open_stream()
            received, reusable = await _receive(stream, peer, sha, offset, length, total, out, digest,
                                                stall_timeout, deadline_s)
        return received
    finally:
        if reusable:
            held.keep(stream)
        else:
            await close_quietly(stream)


async def _receive(stream: ByteStream, peer: str, sha: bytes, offset: int, length: int, total: int, out: BinaryIO,
                   digest: Any, stall_timeout: float, deadline_s: float) -> tuple[int, bool]:
    """One GET and its answer on `stream`: the bytes received, and whether the server takes
    another GET on the stream (it speaks 1.2 or later)."""
    try:
        await stream.write(encode(Get(sha, offset, length)))
    except Exception as e:  # noqa: BLE001 - a reset stream, in py-libp2p's types
        raise _Gone(f"peer {peer} closed the files stream before the request: {e}") from None
    decoder = AnswerDecoder()
    head: Response | None = None
    received = 0
    with trio.move_on_after(deadline_s) as late:
        idle = trio.CancelScope()  # one scope for the whole range, its deadline moved per read
        with idle:
            while head is None or received < length:
                idle.deadline = trio.current_time() + stall_timeout
                data = await _read(stream, MAX_CHUNK)
                if not data:
                    if head is None:
                        raise _Gone(f"peer {peer} ended the transfer before answering")
                    raise FetchError(f"peer {peer} ended the transfer after {received} of {length} bytes from {offset}")
                try:
                    messages = decoder.feed(data)
                except FrameError as e:
                    raise FetchError(f"peer {peer} broke the files protocol: {e}") from None
                for msg in messages:
                    if head is None:
                        head = _check_head(msg, peer, offset, length, total)
                    elif isinstance(msg, memoryview) and received + len(msg) <= length:
                        out.write(msg)
                        digest.update(msg)
                        received += len(msg)
                    elif isinstance(msg, Response):
                        raise FetchError(f"peer {peer} broke off the transfer after {received} of {length} "
                                         f"bytes: {status_name(msg.status)}: {msg.message}")
                    else:
                        raise FetchError(f"peer {peer} sent more than the {length} bytes asked from {offset}")
        if idle.cancelled_caught:
            raise FetchError(f"peer {peer} sent nothing for {stall_timeout:g} s "
                             f"({received} of {length} bytes from {offset} received)")
    if late.cancelled_caught:
        raise Slow(f"peer {peer} sent {received} of {length} bytes from {offset} in {deadline_s:g} s")
    return received, decoder.minor >= 2


async def _read(stream: ByteStream, n: int = READ_CHUNK) -> bytes:
    """The next bytes (at most `n`); b"" at the end of the stream, however py-libp2p reports it."""
    try:
        return await stream.read(n)
    except EOFError:
        return b""
    except Exception as e:  # noqa: BLE001 - a reset, in py-libp2p's own types
        if type(e).__module__.startswith("libp2p") or isinstance(e, OSError):
            return b""
        raise


def _check_head(msg: Message | memoryview, peer: str, offset: int, length: int, total: int) -> Response:
    if not isinstance(msg, Response):
        kind = "DATA" if isinstance(msg, memoryview) else type(msg).__name__.upper()
        raise FetchError(f"peer {peer} sent {kind} before its RESPONSE")
    if msg.status == Status.TOO_LARGE:
        raise Smaller(msg.length)
    if msg.status != Status.OK:
        raise (Busy if msg.status == Status.BUSY else FetchError)(
            f"peer {peer} refused the file: {status_name(msg.status)}: {msg.message}")
    if msg.total != total:
        raise FetchError(f"peer {peer} serves a file of {msg.total} bytes under that hash; it announced {total}")
    if (msg.offset, msg.length) != (offset, length):
        raise FetchError(f"peer {peer} answered for {msg.length} bytes from {msg.offset}; "
                         f"{length} from {offset} were asked")
    return msg


__all__ = ["PROTOCOL_ID", "AnswerDecoder", "Busy", "Composite", "Data", "Decoder", "FileServer", "FrameError", "Get",
           "Held", "Response", "Slow", "Smaller", "Status", "decode_body", "encode", "fetch", "fetch_with", "get_range",
           "resolve", "sha256_file", "status_name", "transfer_limit"]
