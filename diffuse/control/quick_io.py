"""Cut py-libp2p's CPU per message on a long-lived stream: inference pays it on every token.

A 1.2 KB round trip over a Noise + yamux stream passed 21 times through trio's run loop on
each side (measured with a trio Instrument): 14 of them at uncontended `trio.Lock`s (trio
makes every acquire a checkpoint, which yields even when the lock is free), 1 at a
`trio.lowlevel.checkpoint()` yamux adds after every frame although the socket send before it
already yielded, and 1 at a second `recv` because Noise reads each message's 2-byte length
and its body separately. Each pass costs ~25 us of Python here, more on a cold cache. And every
other small read sent a yamux WINDOW_UPDATE the other side had to decrypt and parse: a
"partial slack" branch credits any consumed bytes while the window is below its target, where
go-yamux waits until half the window is used. `apply` makes four changes:

1. Its stream-path modules (yamux, the read-write lock, the TCP stream, the net stream) get a
   view of `trio` whose `Lock` and `Semaphore` take a free lock without yielding: mutual
   exclusion is unchanged (trio switches tasks only at an await), a contended acquire still
   waits in FIFO order, and the socket calls in the same path still yield, so no task starves.
2. That view's `lowlevel.checkpoint` is a no-op (only yamux's post-write checkpoint uses it).
3. `TrioTCPStream.read(n)` receives up to 64 KiB and keeps the rest for the next read, so a
   Noise message costs one `recv`, not two.
4. A read credits its bytes to the stream's pending release and sends no WINDOW_UPDATE while
   less than half the receive window (8 MiB of 16 at yamux's defaults) is owed, as go-yamux
   does; past that, or with `PY_YAMUX_RELEASE_ON_READ` on, py-libp2p's own logic runs.

Measured (`scripts/bench_transport.py`, both sides with and without, one run): passes through
the run loop per round trip 21 -> 3; round trip 0.64x back to back and 0.73x after 20 ms idle;
client CPU per round trip 0.52x and 0.69x. The changes are tied to py-libp2p's layout; `apply`
checks every name it relies on first and refuses to half-apply (py-libp2p changed: an error at
start-up, not mid-session).
"""

from __future__ import annotations

import importlib
import os
import types
from typing import Any

import trio

ENV = "DIFFUSE_QUICK_IO"  # "0": before/after comparisons, or a py-libp2p this was not written for
READ_AHEAD = 65536  # bytes a TCP read asks for: a whole 64 KiB Noise message at most
PATCHED_MODULES = ("libp2p.stream_muxer.yamux.yamux", "libp2p.stream_muxer.rw_lock", "libp2p.io.trio",
                   "libp2p.network.stream.net_stream")


class _Quick:
    """A trio Lock or Semaphore whose acquire does not yield while it is free (taken: trio's own
    FIFO wait); everything else is the primitive's own."""

    __slots__ = ("_p",)

    def __init__(self, primitive: trio.Lock | trio.Semaphore) -> None:
        self._p = primitive

    async def acquire(self) -> None:
        try:
            self._p.acquire_nowait()
        except trio.WouldBlock:
            await self._p.acquire()

    def release(self) -> None:
        self._p.release()

    def __getattr__(self, name: str) -> Any:  # acquire_nowait, locked, value, statistics, ...
        return getattr(self._p, name)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._p.release()


def QuickLock() -> _Quick:  # noqa: N802 - stands in for the class trio.Lock
    return _Quick(trio.Lock())


def QuickSemaphore(initial_value: int, *, max_value: int | None = None) -> _Quick:  # noqa: N802
    return _Quick(trio.Semaphore(initial_value, max_value=max_value))


async def _no_checkpoint() -> None:
    return None


class _View(types.ModuleType):
    """A module that is `base` except for the attributes set on it."""

    def __init__(self, name: str, base: types.ModuleType):
        super().__init__(name)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _trio_view() -> _View:
    lowlevel = _View("trio.lowlevel", trio.lowlevel)
    lowlevel.checkpoint = _no_checkpoint  # type: ignore[attr-defined]
    view = _View("trio", trio)
    view.Lock, view.Semaphore, view.lowlevel = QuickLock, QuickSemaphore, lowlevel  # type: ignore[attr-defined]
    return view


def _read_ahead(read):
    """`TrioTCPStream.read` that serves later reads from what one `recv` brought."""

    async def read_buffered(self, n: int | None = None) -> bytes:
        state = self.__dict__.get("_diffuse_ahead")
        if state is None:
            state = self._diffuse_ahead = [QuickLock(), b"", 0]  # lock, buffer, offset
        lock = state[0]
        async with lock:  # the buffer check and the recv that refills it, as one step
            if n == 0:
                return b""
            buf, off = state[1], state[2]
            if off < len(buf):
                end = len(buf) if n is None else min(len(buf), off + n)
                state[2] = end
                return buf[off:end]
            data = await read(self, READ_AHEAD if n is None else max(n, READ_AHEAD))
            if n is not None and len(data) > n:
                state[1], state[2] = data, n
                return data[:n]
            return data

    read_buffered.diffuse_read_ahead = True  # type: ignore[attr-defined]
    return read_buffered


def _lazy_window_updates(update):
    """yamux's window update after a read, skipped while less than the go-yamux threshold is owed."""
    from libp2p.stream_muxer.yamux import yamux

    async def update_when_owed(self, *, bytes_read: int = 0) -> None:
        if bytes_read > 0 and not yamux._yamux_release_on_read() and not self.window_lock.locked():
            threshold = self._grow_threshold()
            buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
            owed = self.target_recv_window - (self.recv_window + buffered)
            if owed < threshold and self._pending_recv_release + bytes_read < threshold:
                self._pending_recv_release += bytes_read  # credited by the update that comes later
                return
        await update(self, bytes_read=bytes_read)

    return update_when_owed


def apply() -> None:
    """Install the four changes (idempotent); `DIFFUSE_QUICK_IO=0` leaves py-libp2p as it is."""
    if os.environ.get(ENV, "1") == "0":
        return
    modules = [importlib.import_module(name) for name in PATCHED_MODULES]
    from libp2p.io.trio import TrioTCPStream
    from libp2p.stream_muxer.yamux import yamux

    YamuxStream = yamux.YamuxStream
    needed = [(TrioTCPStream, "read"), (YamuxStream, "_auto_tune_and_send_window_update"),
              (YamuxStream, "_grow_threshold"), (yamux, "_yamux_release_on_read")]
    missing = [f"{getattr(o, '__name__', o)}.{name}" for o, name in needed if not hasattr(o, name)]
    missing += [f"{m.__name__}.trio" for m in modules if not isinstance(getattr(m, "trio", None), types.ModuleType)]
    if missing:
        raise RuntimeError(f"py-libp2p no longer has {', '.join(missing)}: diffuse.control.quick_io needs "
                           f"updating for this version (or set {ENV}=0)")
    if getattr(TrioTCPStream.read, "diffuse_read_ahead", False):
        return
    view = _trio_view()
    for module in modules:
        module.trio = view  # type: ignore[attr-defined]
    TrioTCPStream.read = _read_ahead(TrioTCPStream.read)  # type: ignore[method-assign]
    YamuxStream._auto_tune_and_send_window_update = _lazy_window_updates(  # type: ignore[method-assign]
        YamuxStream._auto_tune_and_send_window_update)
