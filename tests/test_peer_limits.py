"""A peer under hostile but well-formed load: bounded reservations, bounded buffers, fair compute.

In-process (a BlockServer over trio memory streams, a real 4-block span of SmolLM2), so orders
and byte counts are exact; the same server runs behind libp2p in test_hostile_peer.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import trio
import trio.testing

from diffuse.data.codec import (
    MAX_FRAME, ErrorCode, ErrorMsg, FrameDecoder, Open, OpenOk, Ping, Pong, Step, StepOk, encode,
)
from diffuse.data.server import BlockServer, ServerLimits
from diffuse.model.load import load_span
from test_sessions import MemStream

MODEL = "SmolLM2-135M-Instruct"
H = 576


@pytest.fixture(scope="module")
def span(smollm2):
    return load_span(smollm2, 0, 4, torch.bfloat16)


class Client:
    """One stream to the server, with the frames it has received so far."""

    def __init__(self, nursery: trio.Nursery, server: BlockServer, remote: str = "client"):
        a, b = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle, MemStream(b), remote)
        self.stream, self.decoder, self.got = MemStream(a), FrameDecoder(), []
        self.sid = os.urandom(16)

    async def send(self, *msgs) -> None:
        await self.stream.write(b"".join(m if isinstance(m, bytes) else encode(m) for m in msgs))

    async def receive(self, n: int = 1, timeout: float = 30) -> list:
        with trio.fail_after(timeout):
            while len(self.got) < n:
                data = await self.stream.read(1 << 16)
                if not data:
                    break
                self.got += self.decoder.feed(data)
        return self.got

    async def open(self, max_length: int = 64, batch: int = 1) -> None:
        await self.send(Open(self.sid, MODEL, 0, 4, max_length, batch, torch.bfloat16))
        (ok,) = await self.receive(1)
        assert isinstance(ok, OpenOk), ok
        self.got.clear()


def rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serve(span, **limits) -> BlockServer:
    return BlockServer(MODEL, span, ServerLimits(**limits))


def test_an_open_counts_its_batch_rows_against_the_session_bound(span):
    server = serve(span, max_session_tokens=4096)

    async def main():
        async with trio.open_nursery() as nursery:
            c = Client(nursery, server)
            await c.send(Open(c.sid, MODEL, 0, 4, 1, 65535, torch.bfloat16))  # 65535 rows x 1 token
            (err,) = await c.receive(1)
            nursery.cancel_scope.cancel()
        return err

    err = trio.run(main)
    assert isinstance(err, ErrorMsg) and err.code == ErrorCode.TOO_LONG
    assert "x batch 65535" in err.message and "4096" in err.message
    assert server.sessions == 0 and server.tokens_reserved == 0


def test_one_remote_peer_gets_its_share_and_idle_reservations_expire(span):
    """8 OPENs of the largest session from one client: it gets half the cache, not all of it;
    another client still opens; the reservations that never STEP end at the first-step timeout,
    and reserving touched no cache memory meanwhile."""
    server = serve(span, max_session_tokens=8192, max_total_tokens=65536, first_step_timeout=1.0)

    async def main():
        async with trio.open_nursery() as nursery:
            hog = [Client(nursery, server, "hog") for _ in range(8)]
            before = rss()
            for c in hog:
                await c.send(Open(c.sid, MODEL, 0, 4, 8192, 1, torch.bfloat16))
            first = [(await c.receive(1))[0] for c in hog]
            grown = rss() - before
            held = server.tokens_reserved
            caches = [conn.cache for conn in server.conns if conn.cache is not None]
            other = Client(nursery, server, "someone else")
            await other.open(max_length=8192)  # room is left for others
            await other.send(Step(other.sid, 0, 0, [0], torch.randn(1, 1, H, dtype=torch.bfloat16)))
            assert isinstance((await other.receive(1))[0], StepOk)
            last = [(await c.receive(2, timeout=10))[-1] for c, f in zip(hog, first) if isinstance(f, OpenOk)]
            nursery.cancel_scope.cancel()
        return first, held, caches, last, grown

    first, held, caches, last, grown = trio.run(main)
    granted = [m for m in first if isinstance(m, OpenOk)]
    refused = [m for m in first if isinstance(m, ErrorMsg)]
    assert len(granted) == 4 and held == 4 * 8192  # half of the 65536 entries
    assert all(m.code == ErrorCode.NO_CAPACITY and "your share" in m.message for m in refused)
    assert all(c.touched == 0 for c in caches)  # an OPEN reserves entries, it writes none
    assert sum(c.nbytes for c in caches) == 4 * 2 * 4 * 3 * 8192 * 64 * 2  # 100 MiB of bf16 reserved ...
    assert grown < 20 << 20  # ... and not resident
    assert all(isinstance(m, ErrorMsg) and m.code == ErrorCode.TIMEOUT and "without a STEP" in m.message
               for m in last)
    assert server.sessions == 0 and server.tokens_reserved == 0 and not server.by_peer


def test_a_chained_session_waits_longer_for_its_first_step(span):
    """A chained session's first STEP follows its upstream's prefill (or comes from the client once
    that is late), so its OPEN is kept past first_step_timeout, up to chained_first_step_timeout;
    a plain OPEN is closed at first_step_timeout."""
    server = serve(span, first_step_timeout=0.5, chained_first_step_timeout=30.0)

    async def main():
        async with trio.open_nursery() as nursery:
            plain, chained = Client(nursery, server, "plain"), Client(nursery, server, "chained")
            await plain.send(Open(plain.sid, MODEL, 0, 4, 64, 1, torch.bfloat16))
            await chained.send(Open(chained.sid, MODEL, 0, 4, 64, 1, torch.bfloat16, upstream="upstream-peer"))
            got = [(await c.receive(1))[0] for c in (plain, chained)]
            closed = (await plain.receive(2, timeout=10))[-1]
            await trio.sleep(1.0)  # twice the plain timeout
            await chained.send(Step(chained.sid, 0, 0, [0], torch.randn(1, 1, H, dtype=torch.bfloat16)))
            stepped = (await chained.receive(2))[-1]
            nursery.cancel_scope.cancel()
        return got, closed, stepped

    got, closed, stepped = trio.run(main)
    assert all(isinstance(m, OpenOk) for m in got), got
    assert isinstance(closed, ErrorMsg) and closed.code == ErrorCode.TIMEOUT and "without a STEP" in closed.message
    assert isinstance(stepped, StepOk), stepped


def test_frames_are_bounded_by_what_the_session_can_send_before_they_are_buffered(span):
    server = serve(span, max_buffered=2 << 20)

    async def main():
        async with trio.open_nursery() as nursery:
            before = Client(nursery, server)
            await before.send((MAX_FRAME).to_bytes(4, "big"))  # 64 MiB announced before any OPEN
            pre = (await before.receive(1))[0]
            small = Client(nursery, server)
            await small.open(max_length=8)
            await small.send((1 << 20).to_bytes(4, "big"))  # 1 MiB: more than 8 tokens can take
            post = (await small.receive(1))[0]
            # Unfinished frames within each session's bound, but over the peer's total.
            big = [Client(nursery, server, f"peer{i}") for i in range(3)]
            for c in big:
                await c.open(max_length=1024)  # a STEP of 1024 tokens may take ~1.3 MB
                await c.send((1 << 20).to_bytes(4, "big") + bytes((1 << 20) - 1024))
            await trio.testing.wait_all_tasks_blocked()
            held = server.buffered
            over = []
            for c in big:
                with trio.move_on_after(0.5):
                    await c.receive(1)
                over.append(list(c.got))
            nursery.cancel_scope.cancel()
        return pre, post, over, held

    pre, post, over, held = trio.run(main)
    assert isinstance(pre, ErrorMsg) and pre.code == ErrorCode.BAD_FRAME and "4096" in pre.message
    assert isinstance(post, ErrorMsg) and post.code == ErrorCode.BAD_FRAME and "exceeds the limit" in post.message
    errors = [g[0] for g in over if g]
    assert len(errors) == 1 and errors[0].code == ErrorCode.OVERLOADED and "unfinished frames" in errors[0].message
    assert held <= 2 << 20


def test_a_long_prefill_does_not_hold_other_sessions_steps_or_pings(span):
    """Session A sends a 2048-token prefill; while it computes, session B's decode step and a
    PING on a third stream are answered, before A's STEP_OK: an order, not a time."""
    server = serve(span)
    order: list[str] = []

    async def main():
        async with trio.open_nursery() as nursery:
            a, b, p = Client(nursery, server), Client(nursery, server), Client(nursery, server)
            await a.open(max_length=2100)
            await b.open(max_length=64)
            await b.send(Step(b.sid, 0, 0, list(range(8)), torch.randn(1, 8, H, dtype=torch.bfloat16)))
            await b.receive(1)
            b.got.clear()

            async def long() -> None:
                await a.send(Step(a.sid, 0, 0, list(range(2048)), torch.randn(1, 2048, H, dtype=torch.bfloat16)))
                await a.receive(1)
                order.append("A prefill")

            async def short() -> None:
                while server.batcher.stats.batches < 3:  # A's prefill is being computed, chunk by chunk
                    await trio.sleep(0.001)
                await p.send(Ping(7))
                await b.send(Step(b.sid, 1, 8, [8], torch.randn(1, 1, H, dtype=torch.bfloat16)))
                await p.receive(1)
                order.append("PING")
                await b.receive(1)
                order.append("B step")

            async with trio.open_nursery() as inner:
                inner.start_soon(long)
                inner.start_soon(short)
            assert isinstance(p.got[0], Pong) and isinstance(b.got[0], StepOk)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert order.index("B step") < order.index("A prefill") and order.index("PING") < order.index("A prefill")
