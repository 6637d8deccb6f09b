"""Files protocol 1.2 and the fetcher's crew, over in-memory streams and a mock clock.

A receiver takes a server's answer without gathering DATA frames (`AnswerDecoder`: payloads as
views of the reads, whatever the reads split), with the same refusals as the frame decoder. A
1.2 server answers GETs in turn on one stream, so a fetcher opens one stream per worker, and
keeps them for its next file; a server of before 1.2 gets a stream per range; a kept stream
the server let go is replaced with nobody blamed. The crew (data/crew.py) lets sources go while
the rate holds without them and calls them up while they add to it.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import trio
import trio.testing

from diffuse.data import crew as C
from diffuse.data import files as F
from diffuse.data.fetcher import Fetcher
from test_sessions import MemStream


def payloads(items: list) -> list:
    """Decoded items with each run of DATA views joined into one bytes."""
    out: list = []
    for item in items:
        if isinstance(item, memoryview):
            if out and isinstance(out[-1], bytearray):
                out[-1] += item
            else:
                out.append(bytearray(item))
        else:
            out.append(item)
    return out


@pytest.mark.parametrize("step", [1, 3, 7, 10, 4093, 1 << 20])
def test_an_answer_decodes_the_same_however_reads_split_it(step):
    cut = F.MAX_CHUNK if step > 4096 else 3000  # a whole frame where reads are long
    data = os.urandom(cut + 5)
    wire = F.encode(F.Response(F.Status.OK, 99, 0, len(data))) + F.encode(F.Data(data[:cut])) + \
        F.encode(F.Data(data[cut:])) + F.encode(F.Response(F.Status.BUSY, message="then no more"))
    dec, got = F.AnswerDecoder(), []
    for at in range(0, len(wire), step):
        got += dec.feed(wire[at:at + step])
    assert payloads(got) == [F.Response(F.Status.OK, 99, 0, len(data)), data,
                             F.Response(F.Status.BUSY, message="then no more")]
    assert dec.minor == F.VERSION_MINOR


@pytest.mark.parametrize("wire, why", [
    ((F.HEADER_SIZE + F.MAX_CHUNK + 1).to_bytes(4, "big"), "exceeds the limit"),
    (b"\x00\x00\x00\x06DF\x01\x02\x03\x00", "DATA frame carries 1.."),
    (b"\x00\x00\x00\x07XX\x01\x02\x03\x00z", "bad magic"),
    (b"\x00\x00\x00\x07DF\x05\x00\x03\x00z", "peer speaks files protocol 5.0"),
])
def test_an_answer_s_bad_frames_are_refused_before_any_payload_passes(wire, why):
    dec = F.AnswerDecoder()
    with pytest.raises(F.FrameError, match=why):
        for at in range(len(wire)):  # byte by byte: the refusal comes before a payload byte is handed on
            assert dec.feed(wire[at:at + 1]) == []
    with pytest.raises(F.FrameError, match="unusable"):
        dec.feed(b"")


def old_server(server: F.FileServer):
    """A server of files protocol 1.1: one GET per stream, RESPONSE frames saying minor 1."""
    async def serve(stream) -> None:
        write, asked = stream.write, []

        async def as_1_1(data) -> None:
            data = bytearray(data)
            data[7] = 1  # each frame goes out in one write; byte 7 is its minor version
            await write(bytes(data))

        async def one_get(n: int = -1) -> bytes:
            if asked:
                return b""  # the stream ends after the first GET, as a 1.1 server reads no more
            asked.append(1)
            return await read(n)

        read, stream.write, stream.read = stream.read, as_1_1, one_get
        await server.serve(stream, "me")
    return serve


def fetch_twice(tmp_path, handler, blob: bytes, pause: float = 0.0, **kw) -> tuple[Fetcher, list[str]]:
    """Two files (the same bytes, two names) with one Fetcher from one source; the streams it opened."""
    sha, opened = hashlib.sha256(blob).hexdigest(), []

    async def main():
        async with trio.open_nursery() as nursery:
            async def open_stream(peer: str):
                a, b = trio.testing.memory_stream_pair()
                opened.append(peer)
                nursery.start_soon(handler, MemStream(b))
                return MemStream(a)

            fetcher = Fetcher(open_stream, piece=65536, stall_timeout=5, **kw)
            with trio.fail_after(30):
                try:
                    for name in ("one", "two"):
                        path = await fetcher.fetch(sha, len(blob), tmp_path / name, ["src"], name)
                        assert path.read_bytes() == blob
                        await trio.sleep(pause)
                finally:
                    await fetcher.close()
            return fetcher

    return trio.run(main), opened


def served(tmp_path, blob: bytes, **kw) -> F.FileServer:
    (tmp_path / "src.bin").write_bytes(blob)
    server = F.FileServer(**kw)
    server.add(tmp_path / "src.bin")
    return server


def test_a_1_2_server_answers_every_range_of_both_files_on_the_workers_streams(tmp_path):
    blob = os.urandom(16 * 65536 + 7)  # 4 ranges per file (two per worker, fetcher._piece)
    server = served(tmp_path, blob)
    fetcher, opened = fetch_twice(tmp_path, lambda s: server.serve(s, "me"), blob, per_source=2)
    assert len(opened) <= 2 and not fetcher.banned  # a stream per worker, kept from the first file for the second
    assert fetcher.stats.received == 2 * len(blob)


def test_a_server_of_before_1_2_gets_a_stream_per_range(tmp_path):
    blob = os.urandom(4 * 65536)
    server = served(tmp_path, blob)
    fetcher, opened = fetch_twice(tmp_path, old_server(server), blob, per_source=1)
    assert len(opened) >= 4 and not fetcher.banned and fetcher.stats.received == 2 * len(blob)  # 2+ ranges a file


def test_a_kept_stream_the_server_let_go_is_replaced_and_nobody_blamed(tmp_path, caplog):
    blob = os.urandom(3 * 65536)
    server = served(tmp_path, blob, request_timeout=0.1)  # lets an idle stream go long before the fetcher would
    fetcher, opened = fetch_twice(tmp_path, lambda s: server.serve(s, "me"), blob, pause=0.5, per_source=1)
    assert len(opened) == 2 and not fetcher.banned and fetcher.stats.received == 2 * len(blob)
    assert "strike" not in caplog.text  # the closed stream was replaced at once, not counted against the source


class Simulated:
    """Sources whose rates together follow `total(k)` for k at work, on trio's clock."""

    def __init__(self, total, size: float = 1e12) -> None:
        self.total, self.left, self.count, self.at = total, size, 0.0, 0.0
        self.by_peer: dict[str, int] = {}
        self.crew: C.Crew
        self.started: list[str] = []

    def received(self) -> int:
        now, working = trio.current_time(), self.crew.working
        got = self.total(len(working)) * (now - self.at)
        for i, p in enumerate(working):  # the later a source in the list, the slower
            self.by_peer[p] = self.by_peer.get(p, 0) + int(got * (len(working) - i) / sum(range(len(working) + 1)))
        self.count, self.left, self.at = self.count + got, self.left - got, now
        return int(self.count)


def steer(total, live: list[str], width: int = C.START_WIDTH, started: list | None = None,
          busy: float = 0.0) -> list[str]:
    """The sources at work once the crew settles; `busy`: the share of each window the receiving
    loop computed."""
    sim = Simulated(total)
    sim.started = started if started is not None else []

    async def main():
        sim.crew = C.Crew(live, width, {}, sim.started.append, cpu=lambda: busy * trio.current_time())
        sim.crew.begin()
        sim.at = trio.current_time()
        with trio.fail_after(60):
            await sim.crew.steer(sim.received, sim.by_peer, lambda: int(sim.left))
        return sim.crew.working

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_where_more_sources_cost_rate_the_crew_settles_on_one(width):
    assert steer(lambda k: 300e6 * (1 - 0.15 * (k - 1)), ["a", "b", "c", "d"], width) == ["a"]


def test_once_a_source_could_go_none_is_called_up():
    started: list[str] = []
    assert steer(lambda k: 300e6, ["a", "b", "c", "d"], width=2, started=started) == ["a"]
    assert started == ["a", "b"]  # b let go without loss: the sources do not bound it, c and d never tried


@pytest.mark.parametrize("width", [1, 2])
def test_a_busy_receiver_keeps_one_source_and_calls_none_up(width):
    """The receiving loop busy for most of the first window: the receiver bounds the fetch, so the
    fastest source is kept alone at once and no trial is spent on a source that could add nothing
    (even where, as simulated here, sources would add their links); below that, they are taken."""
    started: list[str] = []
    assert steer(lambda k: 10e6 * k, ["a", "b", "c", "d"], width, started, busy=1.0) == ["a"]
    assert started == ["a", "b"][:width]
    started = []
    assert sorted(steer(lambda k: 10e6 * k, ["a", "b", "c", "d"], width, started, busy=C.BUSY - 0.1)) == \
        ["a", "b", "c", "d"]
    assert set(started) == {"a", "b", "c", "d"}


def test_where_each_source_adds_its_link_the_crew_takes_every_one():
    assert sorted(steer(lambda k: 10e6 * k, ["a", "b", "c", "d"])) == ["a", "b", "c", "d"]


def test_the_crew_stops_calling_up_once_another_source_adds_too_little():
    assert sorted(steer(lambda k: 10e6 * min(k, 3), ["a", "b", "c", "d", "e"])) == ["a", "b", "c"]


def test_a_failed_source_is_replaced_from_the_reserve_at_once():
    started: list[str] = []
    crew = C.Crew(["a", "b", "c"], 1, {"c": 5.0, "b": 1.0}, started.append)  # the untried first, then the fastest
    crew.begin()
    assert started == ["a"]
    crew.drop("a")
    assert crew.working == ["c"] and started == ["a", "c"] and crew.reserve == ["b"]


def test_a_source_let_go_whose_piece_fails_is_not_called_up_again():
    started: list[str] = []
    crew = C.Crew(["a", "b", "c"], 2, {}, started.append)
    crew.begin()
    crew.let_go("b")  # on trial without it, b's last piece fails: b is done for this file
    crew.drop("b")
    crew.drop("a")  # then a fails: the healthy c takes its place, not b
    assert crew.working == ["c"] and crew.reserve == [] and started == ["a", "b", "c"]


def test_steering_waits_for_the_first_bytes_however_long_they_take():
    late = lambda k: 10e6 * k if trio.current_time() > 0.5 else 0.0  # noqa: E731 - a stream and GET round trip
    assert sorted(steer(late, ["a", "b", "c", "d"])) == ["a", "b", "c", "d"]


@pytest.mark.alone  # the crew's verdict rests on rates over 0.15 s windows: nothing beside it
def test_two_capped_sources_that_each_add_their_rate_both_stay_at_work(tmp_path):
    """Each server sends at most `cap` per transfer: two give twice one's rate. A trial without one
    must not count the bytes of the piece it still finishes (that made the rate look unchanged)."""
    blob, cap = os.urandom(32 << 20), 4e6
    sha, servers = hashlib.sha256(blob).hexdigest(), {}
    for name in ("p", "q"):
        (tmp_path / name).mkdir()
        servers[name] = served(tmp_path / name, blob, chunk=65536)
        servers[name].send_rate = cap

    async def main():
        async with trio.open_nursery() as nursery:
            async def open_stream(peer: str):
                a, b = trio.testing.memory_stream_pair()
                nursery.start_soon(servers[peer].serve, MemStream(b), "me")
                return MemStream(a)

            fetcher = Fetcher(open_stream)
            with trio.fail_after(60):
                try:
                    assert (await fetcher.fetch(sha, len(blob), tmp_path / "out", ["p", "q"])).read_bytes() == blob
                finally:
                    await fetcher.close()
            return fetcher

    fetcher = trio.run(main)
    assert fetcher.width == 2  # carried to the next file
    assert min(fetcher.stats.by_peer.values()) >= 0.35 * len(blob), fetcher.stats.by_peer


def test_a_banned_source_s_kept_streams_are_closed(tmp_path):
    blob = os.urandom(4 * 65536)
    sha, honest, liar = hashlib.sha256(blob).hexdigest(), served(tmp_path, blob), F.FileServer()
    liar.add_composite(sha, [os.urandom(len(blob))])  # other bytes under the hash
    opened: dict[str, list] = {"liar": [], "honest": []}

    class Closing(MemStream):
        closed = False

        async def close(self) -> None:
            self.closed = True
            await super().close()

    async def main():
        async with trio.open_nursery() as nursery:
            async def open_stream(peer: str):
                a, b = trio.testing.memory_stream_pair()
                nursery.start_soon({"liar": liar, "honest": honest}[peer].serve, MemStream(b), "me")
                opened[peer].append(Closing(a))
                return opened[peer][-1]

            fetcher = Fetcher(open_stream, piece=65536, stall_timeout=5)
            with trio.fail_after(30):
                try:
                    path = await fetcher.fetch(sha, len(blob), tmp_path / "out", ["liar", "honest"])
                    assert path.read_bytes() == blob
                    assert list(fetcher.banned) == ["liar"] and "liar" not in fetcher.spare and opened["liar"]
                    assert all(s.closed for s in opened["liar"])  # none left open to a peer never asked again
                    assert not all(s.closed for s in opened["honest"])  # kept for a next file
                finally:
                    await fetcher.close()

    trio.run(main)
