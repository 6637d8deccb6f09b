"""Cut py-libp2p's CPU per message on a long-lived stream: inference pays it on every token.

py-libp2p 0.8.1 passes through trio's run loop ~20 times per 1.2 KB round trip on a Noise +
yamux stream, where 3 suffice (`scripts/bench_transport.py` counts them). Most passes are
uncontended `trio.Lock`s and `trio.Semaphore`s on the stream path: trio makes every acquire
yield, even of a free lock. One is a checkpoint yamux adds after each frame although the socket
send before it has just yielded, and one is the second `recv` of each Noise message (its 2-byte
length and its body are read separately). And with `PY_YAMUX_RELEASE_ON_READ=0` a "partial
slack" branch still sends a WINDOW_UPDATE on every other small read, where go-yamux waits until
half the window is owed. `apply` changes exactly those places, nothing else in those modules:

1. The locks the stream path takes per message (`NetStream._state_lock`, `YamuxStream.
   window_lock`, `Yamux.streams_lock` and `._write_lock`, `ReadWriteLock._writer_lock`,
   `TrioTCPStream.read_lock` and `.write_lock`) are wrapped as each `__init__` makes them, in a
   `Quick` that takes a free lock without yielding. Mutual exclusion is unchanged (trio switches
   tasks only at an await), a contended acquire still waits in FIFO order, and the socket calls
   on the same path still yield, so no task starves.
2. `Yamux._write_frame` writes without the checkpoint after the write (py-libp2p's own runs
   while the yamux logger is at DEBUG, for its per-frame log line).
3. `TrioTCPStream.read(n)` receives up to 64 KiB and keeps the rest for the next read.
4. A yamux read credits its bytes to the stream's pending release and sends no WINDOW_UPDATE
   while less than half the receive window (8 MiB of 16 at yamux's defaults) is owed; past
   that, or with `PY_YAMUX_RELEASE_ON_READ` on, py-libp2p's own logic runs.

These are tied to py-libp2p's layout, so `apply` first checks the version and every class and
instance attribute it relies on, and refuses (an error at start-up, never mid-session) before
changing anything. `DIFFUSE_QUICK_IO=0` leaves py-libp2p as released.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any

import trio

ENV = "DIFFUSE_QUICK_IO"  # "0": before/after comparisons, or a py-libp2p this was not written for
WRITTEN_FOR = "0.8.1"  # the py-libp2p version whose code the patches below mirror
READ_AHEAD = 65536  # bytes a TCP read asks for: a whole 64 KiB Noise message at most
MARK = "_diffuse_quick_io"  # set on every function `apply` installs

YAMUX, RW_LOCK, TCP, NET_STREAM = ("libp2p.stream_muxer.yamux.yamux", "libp2p.stream_muxer.rw_lock",
                                   "libp2p.io.trio", "libp2p.network.stream.net_stream")
# The locks each class's __init__ makes that the stream path takes on every message, by type.
QUICK_LOCKS: dict[tuple[str, str], dict[str, type]] = {
    (NET_STREAM, "NetStream"): {"_state_lock": trio.Lock},
    (YAMUX, "YamuxStream"): {"window_lock": trio.Lock},
    (YAMUX, "Yamux"): {"streams_lock": trio.Lock, "_write_lock": trio.Lock},
    (RW_LOCK, "ReadWriteLock"): {"_writer_lock": trio.Semaphore},
    (TCP, "TrioTCPStream"): {"read_lock": trio.Lock, "write_lock": trio.Lock},
}
# Other instance attributes the installed functions read.
READS: dict[str, tuple[str, ...]] = {
    "YamuxStream": ("conn", "stream_id", "target_recv_window", "recv_window", "_pending_recv_release"),
    "Yamux": ("secured_conn", "stream_buffers"),
}


class Quick:
    """A trio Lock or Semaphore whose acquire does not yield while it is free (taken: trio's own
    FIFO wait); everything else is the primitive's own."""

    __slots__ = ("primitive",)

    def __init__(self, primitive: trio.Lock | trio.Semaphore) -> None:
        self.primitive = primitive

    async def acquire(self) -> None:
        try:
            self.primitive.acquire_nowait()
        except trio.WouldBlock:
            await self.primitive.acquire()

    def release(self) -> None:
        self.primitive.release()

    def __getattr__(self, name: str) -> Any:  # acquire_nowait, locked, value, statistics, ...
        return getattr(self.primitive, name)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.primitive.release()


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, MARK, True)
    return fn


def _with_quick_locks(init: Callable[..., None], names: tuple[str, ...]) -> Callable[..., None]:
    """`init`, then each lock in `names` wrapped in a `Quick`."""

    @functools.wraps(init)
    def init_with_quick_locks(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for name in names:
            setattr(self, name, Quick(getattr(self, name)))

    return _marked(init_with_quick_locks)


def _without_trailing_checkpoint(write_frame: Callable[..., Any], logger: logging.Logger) -> Callable[..., Any]:
    """`Yamux._write_frame` less its checkpoint after the write (the socket send yielded)."""

    @functools.wraps(write_frame)
    async def write_frame_once(self: Any, data: bytes) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            await write_frame(self, data)
            return
        async with self._write_lock:
            await self.secured_conn.write(data)

    return _marked(write_frame_once)


class _Ahead:
    """What one TCP `recv` brought beyond the read that asked for it."""

    __slots__ = ("buf", "lock", "off")

    def __init__(self) -> None:
        self.lock, self.buf, self.off = Quick(trio.Lock()), b"", 0


def _read_ahead(read: Callable[..., Any]) -> Callable[..., Any]:
    """`TrioTCPStream.read` that serves later reads from what one `recv` brought."""

    @functools.wraps(read)
    async def read_buffered(self: Any, n: int | None = None) -> bytes:
        ahead = self.__dict__.get("_diffuse_ahead")
        if ahead is None:
            ahead = self._diffuse_ahead = _Ahead()
        async with ahead.lock:  # the buffer check and the recv that refills it, as one step
            if n == 0:
                return b""
            if ahead.off < len(ahead.buf):
                end = len(ahead.buf) if n is None else min(len(ahead.buf), ahead.off + n)
                data, ahead.off = ahead.buf[ahead.off:end], end
                return data
            data = await read(self, READ_AHEAD if n is None else max(n, READ_AHEAD))
            if n is not None and len(data) > n:
                ahead.buf, ahead.off = data, n
                return data[:n]
            return data

    return _marked(read_buffered)


def _lazy_window_updates(update: Callable[..., Any], release_on_read: Callable[[], bool]) -> Callable[..., Any]:
    """yamux's window update after a read, skipped while less than the go-yamux threshold is owed."""

    @functools.wraps(update)
    async def update_when_owed(self: Any, *, bytes_read: int = 0) -> None:
        # What py-libp2p does under window_lock with no await in between: only while it is free.
        if bytes_read > 0 and not release_on_read() and not self.window_lock.locked():
            threshold = self._grow_threshold()
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            owed = self.target_recv_window - (self.recv_window + buffered)
            if owed < threshold and self._pending_recv_release + bytes_read < threshold:
                self._pending_recv_release += bytes_read  # credited by the update that comes later
                return
        await update(self, bytes_read=bytes_read)

    return _marked(update_when_owed)


def _samples(classes: dict[str, Any]) -> dict[str, object]:
    """One instance of each class, built as cheaply as its __init__ allows."""
    muxer = classes["Yamux"](None, None, is_initiator=True)
    stream = classes["YamuxStream"](1, muxer, True)
    return {"Yamux": muxer, "YamuxStream": stream, "NetStream": classes["NetStream"](stream, None, None),
            "ReadWriteLock": classes["ReadWriteLock"](), "TrioTCPStream": classes["TrioTCPStream"](None)}


def _check(classes: dict[str, Any]) -> list[str]:
    """The instance attributes (locks of the right type included) that instances lack."""
    try:
        samples = _samples(classes)
    except (TypeError, AttributeError, ValueError) as e:  # their signatures or what they read changed
        return [f"the constructors it calls ({e!r})"]
    missing = []
    for (_, cls), locks in QUICK_LOCKS.items():
        for name, kind in locks.items():
            lock = getattr(samples[cls], name, None)
            if not isinstance(lock.primitive if isinstance(lock, Quick) else lock, kind):
                missing.append(f"{cls}().{name} (a trio.{kind.__name__})")
    for cls, names in READS.items():
        missing += [f"{cls}().{name}" for name in names if not hasattr(samples[cls], name)]
    return missing


def _plan() -> list[tuple[type, str, Callable[..., Any]]]:
    """Each change as (class, attribute, replacement), after checking that py-libp2p is the
    version they were written for and has everything they use: RuntimeError if not."""
    installed = metadata.version("libp2p")
    if installed != WRITTEN_FOR:
        raise RuntimeError(f"diffuse.control.quick_io was written for py-libp2p {WRITTEN_FOR}, and "
                           f"{installed} is installed: update it for {installed} or set {ENV}=0")
    modules = {name: importlib.import_module(name) for name in (YAMUX, RW_LOCK, TCP, NET_STREAM)}
    yamux = modules[YAMUX]
    classes = {cls: getattr(modules[module], cls, None) for module, cls in QUICK_LOCKS}
    missing = [f"{module}.{cls}" for module, cls in QUICK_LOCKS if classes[cls] is None]
    used = [(yamux, "_yamux_release_on_read"), (yamux, "logger"), (classes["Yamux"], "_write_frame"),
            (classes["TrioTCPStream"], "read"), (classes["YamuxStream"], "_auto_tune_and_send_window_update"),
            (classes["YamuxStream"], "_grow_threshold")]
    missing += [f"{owner.__name__}.{name}" for owner, name in used if owner is not None and not hasattr(owner, name)]
    if not missing:
        missing = _check(classes)
    if missing:
        raise RuntimeError(f"py-libp2p {installed} lacks {', '.join(missing)}: diffuse.control.quick_io "
                           f"needs updating for it (or set {ENV}=0)")
    found = {name: getattr(owner, name) for owner, name in used}
    return [(classes[cls], "__init__", _with_quick_locks(classes[cls].__init__, tuple(locks)))
            for (_, cls), locks in QUICK_LOCKS.items()] + [
        (classes["Yamux"], "_write_frame", _without_trailing_checkpoint(found["_write_frame"], found["logger"])),
        (classes["TrioTCPStream"], "read", _read_ahead(found["read"])),
        (classes["YamuxStream"], "_auto_tune_and_send_window_update",
         _lazy_window_updates(found["_auto_tune_and_send_window_update"], found["_yamux_release_on_read"])),
    ]


def apply() -> None:
    """Install the four changes (idempotent); `DIFFUSE_QUICK_IO=0` leaves py-libp2p as it is."""
    if os.environ.get(ENV, "1") == "0":
        return
    for owner, name, replacement in _plan():
        if not getattr(getattr(owner, name), MARK, False):
            setattr(owner, name, replacement)
