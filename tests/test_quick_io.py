"""diffuse.control.quick_io: py-libp2p's stream path waits less, and still moves every byte."""

from __future__ import annotations

import os

import multiaddr
import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.stream_muxer.yamux import yamux

from diffuse.control import quick_io
from diffuse.control.host import make_host, parse_peer_addr

LOCAL = "/ip4/127.0.0.1/tcp/0"
LOOPBACK = [multiaddr.Multiaddr(LOCAL)]


async def _switches_while(body) -> int:
    """How many times another task ran while `body` did."""
    ran = 0
    stop = False

    async def watcher() -> None:
        nonlocal ran
        while not stop:
            ran += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher)
        await trio.sleep(0)
        ran = 0
        await body()
        seen = ran
        stop = True
    return seen


def test_a_free_quick_lock_is_taken_without_yielding_a_trio_lock_yields():
    trio.run(_a_free_quick_lock_is_taken_without_yielding_a_trio_lock_yields)


async def _a_free_quick_lock_is_taken_without_yielding_a_trio_lock_yields():
    async def lock_100(lock) -> None:
        for _ in range(100):
            async with lock:
                pass

    assert await _switches_while(lambda: lock_100(quick_io.QuickLock())) == 0
    assert await _switches_while(lambda: lock_100(trio.Lock())) >= 50  # ~one per acquire: what it saves


def test_a_held_quick_lock_makes_waiters_queue_in_order_and_only_its_owner_releases():
    trio.run(_a_held_quick_lock_makes_waiters_queue_in_order_and_only_its_owner_releases)


async def _a_held_quick_lock_makes_waiters_queue_in_order_and_only_its_owner_releases():
    lock, order = quick_io.QuickLock(), []

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
    async with trio.open_nursery() as nursery:
        async def stranger() -> None:
            with pytest.raises(RuntimeError):
                lock.release()
        nursery.start_soon(stranger)
    lock.release()


def test_a_quick_semaphore_counts_and_blocks_at_zero():
    trio.run(_a_quick_semaphore_counts_and_blocks_at_zero)


async def _a_quick_semaphore_counts_and_blocks_at_zero():
    sem = quick_io.QuickSemaphore(2)
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


class _CountingStream:
    """A trio stream that counts receive_some calls."""

    def __init__(self, stream):
        self.stream, self.receives = stream, 0

    async def receive_some(self, n=None):
        self.receives += 1
        return await self.stream.receive_some(n)

    async def send_all(self, data):
        await self.stream.send_all(data)

    async def aclose(self):
        await self.stream.aclose()


def test_tcp_reads_are_served_from_one_receive_in_order():
    trio.run(_tcp_reads_are_served_from_one_receive_in_order)


async def _tcp_reads_are_served_from_one_receive_in_order():
    quick_io.apply()
    left, right = trio.testing.memory_stream_pair()
    reader = TrioTCPStream(_CountingStream(right))
    payload = bytes(range(256)) * 40  # 10 KiB in one send
    await left.send_all(payload)
    got = [await reader.read(2), await reader.read(1000), await reader.read(5000), await reader.read()]
    assert b"".join(got) == payload
    assert [len(g) for g in got] == [2, 1000, 5000, len(payload) - 6002]
    assert reader.stream.receives == 1
    assert await reader.read(0) == b""

    # Two readers racing for 1 KiB pieces: each piece is appended as its read returns, so the
    # pieces in that order must be the stream, nothing lost, nothing repeated.
    await left.send_all(payload)
    pieces: list[bytes] = []

    async def take() -> None:
        for _ in range(5):
            piece = await reader.read(1024)
            pieces.append(piece)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        nursery.start_soon(take)
    assert b"".join(pieces) == payload

    await left.aclose()
    assert await reader.read(10) == b""


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
    assert getattr(TrioTCPStream.read, "diffuse_read_ahead", False)

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


def test_apply_names_what_a_changed_py_libp2p_lacks_instead_of_half_applying(monkeypatch):
    monkeypatch.delenv(quick_io.ENV, raising=False)
    monkeypatch.delattr(yamux.YamuxStream, "_grow_threshold")
    with pytest.raises(RuntimeError, match="YamuxStream._grow_threshold"):
        quick_io.apply()
