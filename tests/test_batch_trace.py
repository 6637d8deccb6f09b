"""A batcher's trace (DIFFUSE_BATCH_TRACE) and its gathering knob (DIFFUSE_GATHER), in one process:
every pass is written with its interval, a trace that cannot be written stops without failing a
step, two traces' overlap is the time both computed, and with gathering off two sessions out of
phase keep alternating (each pass single), as the pipeline table of a chain has them; a bad
DIFFUSE_GATHER is refused; a peer's most_in_flight (and its gauge) is a high-water mark."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from support import batch_trace
from test_batching import two_sessions


def test_every_pass_is_traced_with_its_sessions_and_a_broken_trace_stops_quietly(tmp_path):
    from diffuse.data.scheduler import Batcher

    def compute(items: list[str]) -> list[str]:
        time.sleep(0.02)
        return items

    batcher = Batcher(compute)
    batcher.trace = str(batch_trace.trace_file(tmp_path, 1))
    two_sessions(batcher, 4)
    out = batcher._trace_out
    two_sessions(batcher, 1)
    assert batcher._trace_out is out  # kept open between passes
    path = batch_trace.trace_file(tmp_path, 1)
    passes = batch_trace.read(path)
    assert sum(p.steps for p in passes) == 10 and len(passes) == batcher.stats.batches
    assert all(p.start < p.end for p in passes) and all(a.end <= b.start for a, b in zip(passes, passes[1:]))
    assert all(len(p.sessions) == p.steps for p in passes)
    assert batch_trace.steps_of(passes, {"a"}) == batch_trace.steps_of(passes, {"b"}) == 5
    assert batch_trace.of_sessions(passes, {"z"}) == []
    end = batch_trace.size(path)
    assert batch_trace.read(path, end) == []
    with open(path, "a") as f:  # a line still being written: neither read nor counted as whole
        f.write("12.5 12.")
    assert batch_trace.read(path, end) == [] and batch_trace.size(path) == end
    with open(path, "a") as f:
        f.write("75 2 c,-\n")
    assert batch_trace.read(path, end) == [(12.5, 12.75, 2, ("c", "-"))]

    batcher.trace = str(tmp_path / "missing" / "1.trace")  # a directory that is not there

    async def one():
        return await batcher.run("k", 1, "x", "C")

    assert trio.run(one)[0] == "x" and batcher.trace is None


def test_overlap_is_the_time_two_traces_computed_at_once():
    Batch = batch_trace.Batch
    a = [Batch(0.0, 1.0, 1, ()), Batch(2.0, 3.0, 2, ())]
    b = [Batch(0.5, 2.5, 1, ()), Batch(3.0, 4.0, 1, ())]
    assert batch_trace.overlap(a, b) == 0.5 + 0.5
    assert batch_trace.overlap(a, []) == 0.0
    assert batch_trace.busy(a) == 2.0 and batch_trace.steps_per_pass(a) == 1.5


def test_with_gathering_off_sessions_out_of_phase_keep_alternating(monkeypatch):
    from diffuse.data.scheduler import GATHER_ENV, Batcher

    monkeypatch.setenv(GATHER_ENV, "0")
    sizes: list[int] = []

    def compute(items: list[str]) -> list[str]:
        sizes.append(len(items))
        time.sleep(0.1)
        return items

    two_sessions(Batcher(compute))
    # test_batching's gathering test puts them in step after a few passes; here most passes stay single
    assert sum(sizes) == 16 and sizes.count(1) >= 10, sizes


def test_a_gathering_factor_that_is_not_a_finite_number_above_zero_is_refused(monkeypatch):
    from diffuse.data.scheduler import GATHER, GATHER_ENV, Batcher
    from diffuse.errors import DiffuseError

    assert Batcher(lambda items: items).gather == GATHER
    monkeypatch.setenv(GATHER_ENV, "0.5")
    assert Batcher(lambda items: items).gather == 0.5
    for bad in ("abc", "-1", "inf", "nan", ""):
        monkeypatch.setenv(GATHER_ENV, bad)
        with pytest.raises(DiffuseError, match=GATHER_ENV):
            Batcher(lambda items: items)


def test_most_in_flight_is_the_high_water_mark_of_steps_taken_and_not_yet_answered():
    from types import SimpleNamespace

    from diffuse.data.server import _Conn
    from diffuse.metrics import _ServedCollector

    srv = SimpleNamespace(in_flight=0, most_in_flight=0)
    release = trio.Event()

    async def step(m) -> bool:
        await release.wait()
        return False

    def conn() -> _Conn:
        c = object.__new__(_Conn)
        c.server, c._step = srv, step
        return c

    async def main():
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(conn().on_step, None)
            await trio.testing.wait_all_tasks_blocked()
            assert srv.in_flight == 3
            release.set()
        await conn().on_step(None)  # alone, after the three: the mark stays

    trio.run(main)
    assert srv.in_flight == 0 and srv.most_in_flight == 3
    gauge = next(f for f in _ServedCollector(lambda: "m", lambda: {"most_in_flight": srv.most_in_flight}).collect()
                 if f.name == "diffuse_most_steps_in_flight")
    assert [(s.labels, s.value) for s in gauge.samples] == [({"model": "m"}, 3.0)]
    assert "high-water mark since the peer started" in gauge.documentation


def test_each_model_served_in_one_process_traces_to_a_file_of_its_own():
    from diffuse.data.scheduler import trace_name

    assert trace_name(7, "SmolLM2-135M-Instruct") == "7-SmolLM2-135M-Instruct.trace"
    assert trace_name(7, "org/model v2") == "7-org_model_v2.trace"
    assert len({trace_name(7, "a"), trace_name(7, "b"), trace_name(8, "a")}) == 3
