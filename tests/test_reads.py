"""Node.records through control/reads.py: concurrent callers share one DHT read, and a read
that misses a peer does not drop its unexpired record (no processes: a fake DHT)."""

from __future__ import annotations

import trio
import trio.testing

from diffuse.control.reads import SharedReads
from test_api_swarm import _record


class FakeDHT:
    """A model's record set as DHT reads return it: `answers` (one list per read), each read
    taking `delay` s."""

    def __init__(self, answers: list[list], delay: float = 0.05):
        self.answers, self.delay, self.reads = answers, delay, 0

    async def read(self, model: str) -> list:
        self.reads += 1
        await trio.sleep(self.delay)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_concurrent_requests_share_one_dht_read():
    """Sixteen requests at once make one DHT read, not sixteen: py-libp2p resets inbound KAD
    streams past 12 per node, and the reads past the limit came back empty (bench_api's 503)."""
    node = FakeDHT([[_record("A")]])
    shared = SharedReads(node.read, share_s=1.0)
    got: list[int] = []

    async def main() -> None:
        async def one() -> None:
            got.append(len(await shared.records("m")))

        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(one)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got == [1] * 16 and node.reads == 1


def test_a_read_that_misses_a_peer_keeps_its_record_until_expiry():
    a, b = _record("A"), _record("B")
    b_gone = _record("B", state="offline")  # B's tombstone, newer than its online record
    node = FakeDHT([[a, b], [], [b_gone], []])
    shared = SharedReads(node.read, share_s=0.0)

    async def main() -> list[set[str]]:
        seen = [{r.peer_id for r in await shared.records("m")}]
        seen.append({r.peer_id for r in await shared.records("m")})  # an empty read: both kept
        seen.append({r.peer_id for r in await shared.records("m")})  # the tombstone removes B at once
        seen.append({r.peer_id for r in await shared.records("m", include_offline=True)})
        return seen

    seen = trio.run(main)
    assert seen[:3] == [{"A", "B"}, {"A", "B"}, {"A"}] and seen[3] == {"A", "B"}
    stale = SharedReads(FakeDHT([[_record("C", ago=40)]]).read, share_s=0.0)
    assert trio.run(stale.records, "m") == []  # expired records never come back


def test_a_cancelled_read_leaves_the_waiters_to_read_again():
    node = FakeDHT([[_record("A")]], delay=1.0)
    shared = SharedReads(node.read, share_s=1.0)

    async def main() -> list:
        out: list = []
        async with trio.open_nursery() as nursery:
            async def first() -> None:
                with trio.move_on_after(0.5):  # the reader's client hangs up mid-read
                    await shared.records("m")

            async def second() -> None:
                await trio.sleep(0.1)
                out.append(await shared.records("m"))

            nursery.start_soon(first)
            nursery.start_soon(second)
        return out

    out = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [len(x) for x in out] == [1] and node.reads == 2
