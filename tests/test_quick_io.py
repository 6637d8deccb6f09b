"""diffuse.control.quick_io: py-libp2p's stream path waits less, still moves every byte, and a
py-libp2p it was not written for is refused before anything changes."""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Awaitable, Callable, Iterator

import libp2p.io.trio as tcp_module
import libp2p.network.stream.net_stream as net_stream_module
import multiaddr
import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network.stream.net_stream import NetStream
from libp2p.stream_muxer import rw_lock
from libp2p.stream_muxer.yamux import yamux

from diffuse.control import quick_io
from diffuse.control.host import make_host, parse_peer_addr

pytestmark = pytest.mark.timeout(60)

LOCAL = "/ip4/127.0.0.1/tcp/0"
LOOPBACK = [multiaddr.Multiaddr(LOCAL)]
MODULES = [yamux, rw_lock, tcp_module, net_stream_module]  # the modules quick_io patches classes of
N = 100


def _state() -> dict[tuple[type, str], object]:
    """Every class attribute `apply` replaces, as it is now."""
    return {(owner, name): getattr(owner, name) for owner, name, _ in quick_io._plan()}


def _now(state: dict[tuple[type, str], object]) -> dict[tuple[type, str], object]:
    """The same attributes as `state`, as they are now (without asking quick_io)."""
    return {(owner, name): getattr(owner, name, None) for owner, name in state}


@pytest.fixture
def pristine(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[type, str], object]]:
    """py-libp2p as released for the test (whatever ran before), quick_io on unless a test says
    otherwise; yields that state."""
    monkeypatch.delenv(quick_io.ENV, raising=False)
    for (owner, name), value in _state().items():
        monkeypatch.setattr(owner, name, value.__wrapped__ if getattr(value, quick_io.MARK, False) else value)
    yield _state()


class _Steps(trio.abc.Instrument):
    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task, self.n = task, 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.n += task is self.task


async def _yields(body: Callable[[], Awaitable[object]]) -> int:
    """How many times the calling task yielded to the run loop while `body` ran."""
    steps = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        await body()
    finally:
        trio.lowlevel.remove_instrument(steps)
    return steps.n


def _before_and_after(measure: Callable[[], Awaitable[int]]) -> tuple[int, int]:
    """`measure` with py-libp2p as released, then with quick_io applied (needs `pristine`)."""
    before = trio.run(measure)
    quick_io.apply()
    return before, trio.run(measure)


async def _times(n: int, step: Callable[[], Awaitable[object]]) -> None:
    for _ in range(n):
        await step()


# --- Quick, the lock wrapper


def test_a_free_quick_lock_is_taken_without_yielding_a_trio_lock_yields():
    async def lock_n(lock: trio.Lock | quick_io.Quick) -> None:
        for _ in range(N):
            async with lock:
                pass

    async def main() -> None:
        assert await _yields(lambda: lock_n(quick_io.Quick(trio.Lock()))) == 0
        assert await _yields(lambda: lock_n(trio.Lock())) == N  # one per acquire: what it saves

    trio.run(main)


def test_a_held_quick_lock_makes_waiters_queue_in_order_and_only_its_owner_releases():
    async def main() -> None:
        lock, order = quick_io.Quick(trio.Lock()), []

        async def waiter(name: str) -> None:
            async with lock:
                order.append(name)

        await lock.acquire()
        async with trio.open_nursery() as nursery:
            for name in "abc":
                nursery.start_soon(waiter, name)
                await trio.testing.wait_all_tasks_blocked()
            assert lock.locked() and order == [] and lock.statistics().tasks_waiting == 3
            lock.release()
        assert order == ["a", "b", "c"] and not lock.locked()

        await lock.acquire()

        async def stranger() -> None:
            with pytest.raises(RuntimeError):
                lock.release()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stranger)
        lock.release()

    trio.run(main)


def test_a_quick_semaphore_counts_and_blocks_at_zero():
    async def main() -> None:
        sem = quick_io.Quick(trio.Semaphore(2))
        await sem.acquire()
        await sem.acquire()
        assert sem.value == 0
        with trio.move_on_after(0.05) as scope:
            await sem.acquire()
        assert scope.cancelled_caught
        sem.release()
        async with sem:
            assert sem.value == 0
        assert sem.value == 1

    trio.run(main)


# --- one test per patch: the path it covers, py-libp2p as released vs quick_io


class _Muxed:
    """A muxed stream whose reads and writes never yield."""

    muxed_conn = None

    async def read(self, n: int | None = None) -> bytes:
        return b"x"

    async def write(self, data: bytes) -> None:
        pass


def test_net_stream_reads_and_writes_do_not_yield_at_its_state_lock(pristine):
    async def measure() -> int:
        stream = NetStream(_Muxed(), None, None)
        return await _yields(lambda: _times(N, lambda: stream.write(b"x"))) + await _yields(
            lambda: _times(N, stream.read))

    assert _before_and_after(measure) == (2 * N, 0)


def test_the_yamux_read_write_lock_is_taken_for_writing_without_yielding(pristine):
    async def measure() -> int:
        lock = rw_lock.ReadWriteLock()

        async def write_locked() -> None:
            async with lock.write_lock():
                pass

        return await _yields(lambda: _times(N, write_locked))

    assert _before_and_after(measure) == (N, 0)


class _Conn:
    """What a YamuxStream writes through, writing frames without yielding."""

    async def _write_frame(self, frame: bytes) -> None:
        pass


def test_a_yamux_stream_write_does_not_yield_at_its_window_lock(pristine):
    async def measure() -> int:
        stream = yamux.YamuxStream(1, _Conn(), True)
        return await _yields(lambda: _times(N, lambda: stream.write(b"x" * 1200)))

    before, after = _before_and_after(measure)
    assert before == 2 * N and after == 0  # window_lock and the read-write lock, once each per write


class _Secured:
    """A secured connection whose write yields once, as a socket send does; keeps the frames."""

    is_initiator = True

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.frames.append(data)
        await trio.lowlevel.checkpoint()


def _muxer_with_stream() -> tuple[yamux.Yamux, yamux.YamuxStream]:
    muxer = yamux.Yamux(_Secured(), None, is_initiator=True)
    stream = yamux.YamuxStream(1, muxer, True)
    muxer.streams[1], muxer.stream_buffers[1], muxer.stream_events[1] = stream, bytearray(), trio.Event()
    return muxer, stream


def test_a_buffered_yamux_read_does_not_yield_at_the_streams_lock(pristine):
    async def measure() -> int:
        muxer, _ = _muxer_with_stream()
        muxer.stream_buffers[1] += b"x" * N
        return await _yields(lambda: _times(N, lambda: muxer.read_stream(1, 1)))

    assert _before_and_after(measure) == (N, 0)


def test_a_yamux_frame_write_yields_only_in_the_connection_write(pristine):
    """py-libp2p: the write lock, the send, and a checkpoint after it; quick_io: the send."""

    async def measure() -> int:
        muxer, _ = _muxer_with_stream()
        return await _yields(lambda: _times(N, lambda: muxer._write_frame(b"h" * yamux.HEADER_SIZE)))

    assert _before_and_after(measure) == (3 * N, N)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_yamux_frame_write_logged_at_debug_is_py_libp2ps_own(pristine):
    quick_io.apply()
    handler = _Records()
    level = yamux.logger.level
    yamux.logger.addHandler(handler)
    yamux.logger.setLevel(logging.DEBUG)
    try:
        async def measure() -> int:
            muxer, _ = _muxer_with_stream()
            header = struct.pack(yamux.YAMUX_HEADER_FORMAT, 0, yamux.TYPE_DATA, 0, 1, 0)
            return await _yields(lambda: muxer._write_frame(header))

        assert trio.run(measure) == 2  # its send and its checkpoint (the write lock is still quick)
    finally:
        yamux.logger.removeHandler(handler)
        yamux.logger.setLevel(level)
    assert any("YAMUX TX" in r.getMessage() for r in handler.records)


class _Socket:
    """A trio stream that never yields."""

    async def receive_some(self, n: int | None = None) -> bytes:
        return b"x"

    async def send_all(self, data: bytes) -> None:
        pass


def test_tcp_stream_reads_and_writes_do_not_yield_at_its_locks(pristine):
    async def measure() -> int:
        tcp = TrioTCPStream(_Socket())
        return await _yields(lambda: _times(N, lambda: tcp.write(b"x"))) + await _yields(
            lambda: _times(N, lambda: tcp.read(1)))

    assert _before_and_after(measure) == (2 * N, 0)


class _CountingStream:
    """A trio stream that counts receive_some calls."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream, self.receives = stream, 0

    async def receive_some(self, n: int | None = None) -> bytes:
        self.receives += 1
        return await self.stream.receive_some(n)

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


def test_tcp_reads_are_served_from_one_receive_in_order(pristine):
    quick_io.apply()

    async def main() -> None:
        left, right = trio.testing.memory_stream_pair()
        socket = _CountingStream(right)
        reader = TrioTCPStream(socket)
        payload = bytes(range(256)) * 40  # 10 KiB in one send
        await left.send_all(payload)
        got = [await reader.read(2), await reader.read(1000), await reader.read(5000), await reader.read()]
        assert b"".join(got) == payload
        assert [len(g) for g in got] == [2, 1000, 5000, len(payload) - 6002]
        assert socket.receives == 1
        assert await reader.read(0) == b""

        # Two readers racing for 1 KiB pieces: each piece is appended as its read returns, so the
        # pieces in that order must be the stream, nothing lost, nothing repeated.
        await left.send_all(payload)
        pieces: list[bytes] = []

        async def take() -> None:
            for _ in range(5):
                pieces.append(await reader.read(1024))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take)
            nursery.start_soon(take)
        assert b"".join(pieces) == payload

        await left.aclose()
        assert await reader.read(10) == b""

    trio.run(main)


def test_small_yamux_reads_send_window_updates_only_when_half_the_window_is_owed(pristine, monkeypatch):
    monkeypatch.setenv("PY_YAMUX_RELEASE_ON_READ", "0")  # as make_host sets it
    msg = b"x" * 1200

    async def measure() -> int:
        muxer, stream = _muxer_with_stream()
        window = lowest = stream.send_window  # the peer's view of this stream's receive window
        updates = 0
        for _ in range(500):  # 600 KB in small reads
            muxer.stream_buffers[1] += msg
            stream.recv_window -= len(msg)
            window -= len(msg)
            assert await stream.read(65536) == msg
            for frame in muxer.secured_conn.frames:
                _, kind, _, _, increment = struct.unpack(yamux.YAMUX_HEADER_FORMAT, frame[:yamux.HEADER_SIZE])
                assert kind == yamux.TYPE_WINDOW_UPDATE
                window += increment
                updates += 1
            muxer.secured_conn.frames.clear()
            lowest = min(lowest, window)
        assert lowest >= yamux.DEFAULT_WINDOW_SIZE // 2 - len(msg)  # credit still comes at half
        return updates

    before, after = _before_and_after(measure)
    assert before >= 200 and after <= 5, (before, after)


# --- what quick_io must leave alone, and what it must refuse


def test_checkpoints_and_other_locks_in_the_patched_modules_are_still_trios(pristine):
    quick_io.apply()

    async def main() -> None:
        for module in MODULES:
            assert await _yields(module.trio.lowlevel.checkpoint) == 1, module.__name__
            assert module.trio is trio
        muxer, stream = _muxer_with_stream()
        others = [stream.close_lock, muxer.stream_backlog_semaphore, stream.rw_lock._readers_lock]
        assert [type(lock) for lock in others] == [trio.Lock, trio.Semaphore, trio.Lock]

        async def close_locked() -> None:
            async with stream.close_lock:
                pass

        assert await _yields(lambda: _times(N, close_locked)) == N

    trio.run(main)


def test_quick_io_off_leaves_py_libp2p_as_released(pristine, monkeypatch):
    monkeypatch.setenv(quick_io.ENV, "0")
    quick_io.apply()
    assert _state() == pristine


def test_apply_is_idempotent(pristine):
    quick_io.apply()
    applied = _state()
    quick_io.apply()
    assert _state() == applied != pristine
    lock = yamux.YamuxStream(1, None, True).window_lock
    assert isinstance(lock, quick_io.Quick) and type(lock.primitive) is trio.Lock


def test_apply_refuses_a_py_libp2p_missing_a_method_and_changes_nothing(pristine, monkeypatch):
    monkeypatch.delattr(yamux.YamuxStream, "_grow_threshold")
    with pytest.raises(RuntimeError, match=r"YamuxStream\._grow_threshold.*DIFFUSE_QUICK_IO=0"):
        quick_io.apply()
    assert _now(pristine) == pristine


def test_apply_refuses_instances_missing_an_attribute_and_changes_nothing(pristine, monkeypatch):
    init = yamux.YamuxStream.__init__

    def init_without_window_lock(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        del self.window_lock, self._pending_recv_release

    monkeypatch.setattr(yamux.YamuxStream, "__init__", init_without_window_lock)
    before = _now(pristine)
    with pytest.raises(RuntimeError, match=r"YamuxStream\(\)\.window_lock .*YamuxStream\(\)\._pending_recv_release"):
        quick_io.apply()
    assert _now(pristine) == before


def test_apply_refuses_another_py_libp2p_version_and_changes_nothing(pristine, monkeypatch):
    monkeypatch.setattr(quick_io.metadata, "version", lambda name: "0.9.0")
    refused = r"written for py-libp2p 0\.8\.1, and 0\.9\.0 is installed.*DIFFUSE_QUICK_IO=0"
    with pytest.raises(RuntimeError, match=refused):
        quick_io.apply()
    assert _now(pristine) == pristine


# --- end to end


@pytest.mark.timeout(120)
def test_quick_io_hosts_move_every_byte_and_still_update_the_window(monkeypatch):
    """Messages of every size both ways, then 40 MiB one way: more than twice yamux's 16 MiB
    window, which stalls (and fails after 5 s) unless reads still send WINDOW_UPDATEs when owed."""
    monkeypatch.delenv(quick_io.ENV, raising=False)
    proto = TProtocol("/diffuse/test-echo/1")
    updates = 0
    send_update = yamux.YamuxStream.send_window_update

    async def counted(self, *a, **kw):
        nonlocal updates
        updates += 1
        await send_update(self, *a, **kw)

    monkeypatch.setattr(yamux.YamuxStream, "send_window_update", counted)
    server, client = make_host(create_new_key_pair(), [LOCAL]), make_host(create_new_key_pair(), [LOCAL])
    assert getattr(TrioTCPStream.read, quick_io.MARK, False)

    async def echo(stream) -> None:
        while data := await stream.read(65536):
            await stream.write(data)

    server.set_stream_handler(proto, echo)
    trio.run(_exchange, server, client, proto, lambda: updates)


async def _exchange(server, client, proto, updates) -> None:
    with trio.fail_after(60):
        async with server.run(LOOPBACK), client.run(LOOPBACK):
            info = parse_peer_addr(f"{server.get_addrs()[0]}")
            await client.connect(info)
            stream = await client.new_stream(info.peer_id, [proto])
            for size in (1, 1200, 65535, 65536, 70000, 300_000):
                msg = os.urandom(size)
                await stream.write(msg)
                back = bytearray()
                while len(back) < size:
                    back += await stream.read(65536)
                assert bytes(back) == msg
            small = updates()
            for _ in range(500):  # 600 KB each way in small reads: py-libp2p alone updates every other read
                await stream.write(b"x" * 1200)
                assert len(await stream.read(65536)) == 1200
            assert updates() - small <= 20

            sink_done = trio.Event()
            total = 40 << 20

            async def sink(s) -> None:
                got = 0
                while got < total:
                    got += len(await s.read(65536))
                sink_done.set()

            bulk = TProtocol("/diffuse/test-sink/1")
            server.set_stream_handler(bulk, sink)
            out = await client.new_stream(info.peer_id, [bulk])
            chunk = os.urandom(1 << 20)
            for _ in range(total >> 20):
                await out.write(chunk)
            await sink_done.wait()
            assert updates() - small >= 2  # the 40 MiB needed credit back twice at least
