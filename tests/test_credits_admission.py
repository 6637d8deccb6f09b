"""A full peer queues OPENs and admits them in order of standing, within a bounded wait.

In-process (a BlockServer over memory streams, a real 4-block span of SmolLM2) with a real
Ledger as the peer's books: a member holding receipts from two peers this member has seen work
is admitted before a pure consumer who asked first, and the consumer still gets in."""

from __future__ import annotations

import os

import torch
import trio

from diffuse.control.identity import ephemeral, peer_id
from diffuse.control.receipts import issue
from diffuse.data.codec import Close, ErrorCode, ErrorMsg, Open, OpenOk
from diffuse.data.server import BlockServer, ServerLimits
from diffuse.trust.credits import Ledger, Spent
from test_peer_limits import MODEL, Client, span  # noqa: F401 - span is a fixture

IDS = {name: ephemeral() for name in ("peer", "member", "w1", "w2", "consumer", "first")}


def pid(name: str) -> str:
    return peer_id(IDS[name]).to_base58()


def books(tmp_path) -> Ledger:
    """The peer's books: its member's client paid w1 and w2; the member presents receipts they signed."""
    Spent(tmp_path).record([issue(IDS["peer"], pid(w), MODEL, 0, 4, 8, 0.1, os.urandom(16)) for w in ("w1", "w2")])
    ledger = Ledger(tmp_path, pid("peer"))
    held = [issue(IDS[w], pid("member"), MODEL, 0, 4, 64, 0.5, os.urandom(16)).wire() for w in ("w1", "w2")]
    assert ledger.accept(held, pid("member")) == (2, [])
    return ledger


def test_a_member_with_standing_is_admitted_before_a_pure_consumer(span, tmp_path):  # noqa: F811
    server = BlockServer(MODEL, span, ServerLimits(max_sessions=1, peer_share=1.0, queue_wait=20.0,
                                                   books=books(tmp_path)))
    order: list[str] = []

    async def ask(nursery, name: str, c: Client) -> None:
        await c.send(_open(c))
        (ok,) = await c.receive(1)
        assert isinstance(ok, OpenOk), ok
        order.append(name)
        c.got.clear()
        await c.send(Close(c.sid))

    async def main():
        async with trio.open_nursery() as nursery:
            first = Client(nursery, server, pid("first"))
            await first.open()  # the peer is now full
            consumer = Client(nursery, server, pid("consumer"))
            nursery.start_soon(ask, nursery, "consumer", consumer)
            await _queued(server, 1)
            member = Client(nursery, server, pid("member"))
            nursery.start_soon(ask, nursery, "member", member)
            await _queued(server, 2)
            await first.send(Close(first.sid))  # room for one: the member, though it asked second
            with trio.fail_after(30):
                while len(order) < 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert order == ["member", "consumer"]


def test_an_exposed_identity_is_not_queued_and_a_wait_is_bounded(span, tmp_path):  # noqa: F811
    ledger = books(tmp_path)
    ledger.took(pid("consumer"), 10**9)
    server = BlockServer(MODEL, span, ServerLimits(max_sessions=1, peer_share=1.0, queue_wait=0.5, books=ledger))

    async def main():
        async with trio.open_nursery() as nursery:
            first = Client(nursery, server, pid("first"))
            await first.open()
            got = []
            for name in ("consumer", "member"):  # exposed: refused at once; member: after the bounded wait
                c = Client(nursery, server, pid(name))
                await c.send(_open(c))
                got.append((await c.receive(1))[0])
                got.append(len(server.admission.queue))
            nursery.cancel_scope.cancel()
        return got

    got = trio.run(main)
    assert all(isinstance(e, ErrorMsg) and e.code == ErrorCode.NO_CAPACITY for e in got[::2])
    assert got[1::2] == [0, 0] and ledger.served[pid("consumer")] == 10**9


def _open(c: Client) -> Open:
    return Open(c.sid, MODEL, 0, 4, 64, 1, torch.bfloat16)


async def _queued(server: BlockServer, n: int) -> None:
    with trio.fail_after(30):
        while len(server.admission.queue) < n:
            await trio.sleep(0.01)
