"""Compute shared by many sessions: the steps that are ready together run as one batch.

A `Batcher` owns one computation (a peer's span, a client's local blocks, an LM head). A step
queues, then waits its turn (FIFO); the step whose turn it is takes itself and every compatible
step queued behind it (same key: same blocks, same kernels), up to `max_rows`, and computes them
in one call on a worker thread. Nobody waits for company: a lone session's step runs at once,
and a step waits behind at most one batch in progress, during which the event loop keeps
reading every stream, answering PINGs and sending heartbeats. A committed prefill goes through
in chunks of `engine.PREFILL_CHUNK` rows, one batch each, so other sessions' decode steps join
the batches of a long prompt instead of waiting for all of it.

A batch holds up to `max_rows` rows while any step of at most SMALL_ROWS rows (a decode step, a
speculation tree) waits for that computation, and up to `burst_rows` when only longer ones
(prompts arriving together) wait: a wider batch is cheaper per row, and no decode step is held
back by it. But every prompt in a batch waits for all of them, and past ~100 rows a row costs no
less, so wider bursts only delay simultaneous requests' first tokens (`scripts/bench_batching.py`;
figures: docs/measurements.md, 'Figures once quoted in module comments').

How many threads a batch computes with is measured, not assumed (`Threads`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TextIO, TypeVar

import torch
import trio
from torch import Tensor

from diffuse.data.cpu_share import OtherLoad
from diffuse.errors import DiffuseError
from diffuse.model.engine import PREFILL_CHUNK, BlockSpan, KVCache, SpanStep

log = logging.getLogger(__name__)
Item = TypeVar("Item")
Out = TypeVar("Out")


@dataclass(eq=False)
class _Job(Generic[Item, Out]):
    key: Hashable
    rows: int
    item: Item
    who: Hashable
    tag: str = ""  # the session's name in a batch trace
    out: Out | None = None
    error: BaseException | None = None
    done: bool = False


THREADS_ENV = "DIFFUSE_THREADS"  # "fixed": every batch on the configured thread count
# A directory where each span a peer serves appends "start end steps sessions" to its own file
# (trace_name) for every batch it computes: the system-wide monotonic clock, so two peers' traces on one
# machine show whether they computed at once; sessions: the batch's steps' tags, comma-separated, or "-".
TRACE_ENV = "DIFFUSE_BATCH_TRACE"


def trace_name(pid: int, model_id: str) -> str:
    """The trace file of process `pid`'s server of `model_id` (one per model: their batchers differ)."""
    return f"{pid}-{re.sub(r'[^A-Za-z0-9._-]', '_', model_id)}.trace"


class Threads:
    """How many torch threads compute a batch fastest now, learned from the batches themselves.

    With as many threads as cores, every parallel region waits for its slowest thread, and a core
    busy with anything else (the client's own work on a shared machine, its owner's programs on a
    lent one) stretches every wait, until one thread fewer is faster. So a batch of fewer than
    CHOOSE_BELOW rows (decode steps, trees: many short parallel regions) takes the count whose
    recent seconds per row, among batches of about its size (rows within a power of two), are lowest;
    every EXPLORE-th batch of a size tries another count, so a change of load is noticed. Longer
    batches (prompts: long products, which threads do speed up) are too rare to learn from, and a
    choice learnt from few of them can leave a burst on one thread: they leave a core to what
    other programs use of the machine now (`OtherLoad`) once that passes SPARE of a core, about
    where one thread less starts to win on a 2-core machine (`scripts/bench_threads.py`; figures:
    docs/measurements.md, 'Figures once quoted in module comments'). Batches whose kernels
    were checked for one thread count (exact sessions) keep the configured count, and so does
    every batch with DIFFUSE_THREADS=fixed (for before/after comparisons)."""

    EXPLORE = 16
    CHOOSE_BELOW = 64  # rows from which a batch is long products (prompts) that every thread speeds up
    SMOOTHING = 0.3  # weight of the newest batch in a count's seconds per row
    SPARE = 0.2  # cores' worth of other programs' load that a long batch still computes beside

    def __init__(self, most: int | None = None, others: OtherLoad | None = None) -> None:
        self.most = most or torch.get_num_threads()
        self.choices = [self.most] if os.environ.get(THREADS_ENV) == "fixed" else sorted({1, self.most})
        self.cost: dict[tuple[int, int], float] = {}  # (size class, threads) -> seconds per row
        self.seen: dict[int, int] = {}  # size class -> batches computed
        self.others = others or OtherLoad()

    def choose(self, rows: int, fixed: bool = False) -> int:
        others = self.others.cores()  # sampled at every batch, so that it is recent when a long one comes
        if fixed or len(self.choices) == 1:
            return self.most
        if rows >= self.CHOOSE_BELOW:
            return max(1, min(self.most, self.others.ncpus - math.ceil(others - self.SPARE)))
        size = rows.bit_length()
        n = self.seen[size] = self.seen.get(size, 0) + 1
        untried = [t for t in self.choices[::-1] if (size, t) not in self.cost]
        if untried:  # the configured count first
            return untried[0]
        ranked = sorted(self.choices, key=lambda t: self.cost[(size, t)])
        return ranked[-1] if n % self.EXPLORE == 0 else ranked[0]

    def record(self, rows: int, threads: int, seconds: float) -> None:
        key, per_row = (rows.bit_length(), threads), seconds / max(rows, 1)
        old = self.cost.get(key)
        self.cost[key] = per_row if old is None else (1 - self.SMOOTHING) * old + self.SMOOTHING * per_row


@dataclass
class BatchStats:
    batches: int = 0
    steps: int = 0  # steps computed, each in some batch
    shared: int = 0  # of them, steps that shared their batch with another session's
    largest: int = 0  # most steps in one batch

    def add(self, n: int) -> None:
        self.batches += 1
        self.steps += n
        self.shared += n if n > 1 else 0
        self.largest = max(self.largest, n)


GATHER = 1.5  # a session queued behind a batch arrives one batch late, plus the jitter of its trip
GATHER_ENV = "DIFFUSE_GATHER"  # another GATHER, 0 for none (for before/after comparisons)
SMALL_ROWS = 16  # a step this short (decoding, a speculation tree) keeps batches at max_rows


def gather_factor() -> float:
    """GATHER, or GATHER_ENV's value: a finite number >= 0."""
    text = os.environ.get(GATHER_ENV)
    if text is None:
        return GATHER
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise DiffuseError(f"{GATHER_ENV} must be a finite number >= 0 (0: no gathering), not {text!r}")
    return value


class Batcher(Generic[Item, Out]):
    """Batches of compatible items for `compute(items) -> outs` (in order), one at a time."""

    def __init__(self, compute: Callable[[list[Item]], list[Out]], max_rows: int = 64,
                 lane: trio.CapacityLimiter | None = None, burst_rows: int | None = None,
                 fixed: Callable[[Hashable], bool] = lambda key: True):
        """lane: a limiter shared by the batchers of one model (its spans, its head), so their
        batches take turns on the cores instead of two torch computations fighting over them.
        burst_rows (default max_rows): the cap while no short step waits (module docstring).
        fixed(key): whether batches of `key` keep the configured thread count (`Threads`)."""
        self.compute, self.max_rows, self.lane, self.fixed = compute, max_rows, lane, fixed
        self.burst_rows = max(max_rows, burst_rows or max_rows)
        self.threads = Threads()
        self.turn = trio.CapacityLimiter(1)  # FIFO: turns in the order steps queued
        self.queue: list[_Job[Item, Out]] = []
        self.stats = BatchStats()
        self.rhythm: dict[Hashable, _Rhythm] = {}  # per session: when it queued last, how often it does
        self.queued = trio.Event()  # set whenever a step queues
        self.last_seconds = 0.0  # the last batch's compute time: the longest a step waits for company
        self.gather = gather_factor()
        self.trace: str | None = None  # a file each batch appends its compute interval to (TRACE_ENV)
        self._trace_out: tuple[str, TextIO] | None = None  # the trace, open (line-buffered)

    async def run(self, key: Hashable, rows: int, item: Item, who: Hashable = None,
                  tag: str = "") -> tuple[Out, float]:
        """`item`'s output, computed in a batch with whatever compatible items are queued when
        its turn comes, and the seconds that batch computed. `who` names the session (None: no
        rhythm kept, nobody waits for it); `tag` names it in the trace."""
        job: _Job[Item, Out] = _Job(key, rows, item, who, tag)
        if who is not None:
            self.rhythm.setdefault(who, _Rhythm(key)).queued(trio.current_time(), key)
        self.queue.append(job)
        self.queued.set()
        seconds = 0.0
        try:
            async with self.turn:
                if not job.done:
                    await self._gather(job)
                    seconds = await self._batch(job)
        finally:
            if not job.done and job in self.queue:  # cancelled while waiting: leave no job behind
                self.queue.remove(job)
        if job.error is not None:
            raise job.error
        return job.out, seconds  # type: ignore[return-value]

    def company(self) -> int:
        """Sessions stepping through this computation now: those that queued a step lately and
        have not missed three of their own intervals since."""
        now = trio.current_time()
        return sum(not r.gone(now) for r in self.rhythm.values())

    def leave(self, who: Hashable) -> None:
        """`who` (a session) has closed: nobody waits for its next step, nor counts it as company."""
        self.rhythm.pop(who, None)

    async def _gather(self, first: _Job[Item, Out]) -> None:
        """Wait, for at most GATHER batches' compute time, for the sessions in a steady rhythm
        whose next step is due by then. Sessions drift into groups that alternate here, each
        paying for the weights; a session due that soon would have queued behind this batch and
        kept the span busy back to back anyway, so one batch for both costs less span time for
        about the same latency. A lone session, or one whose company is not due, waits for nobody."""
        deadline = trio.current_time() + self.gather * self.last_seconds
        while True:
            now = trio.current_time()
            here = {j.who for j in self.queue if j.key == first.key}
            rows = sum(j.rows for j in self.queue if j.key == first.key)
            for who in [w for w, r in self.rhythm.items() if r.gone(now)]:
                del self.rhythm[who]
            due = [w for w, r in self.rhythm.items() if r.key == first.key and w not in here and r.due(deadline)]
            if not due or rows >= self._cap(first.key) or now >= deadline:
                return
            self.queued = trio.Event()
            with trio.move_on_at(deadline):
                await self.queued.wait()

    def _cap(self, key: Hashable) -> int:
        """Rows a batch of `key` may hold now: max_rows while a short step waits for it."""
        short = any(j.rows <= SMALL_ROWS for j in self.queue if j.key == key)
        return self.max_rows if short else self.burst_rows

    async def _batch(self, first: _Job[Item, Out]) -> float:
        batch, rows, cap = [first], first.rows, self._cap(first.key)
        for job in self.queue:
            if job is not first and job.key == first.key and rows + job.rows <= cap:
                batch.append(job)
                rows += job.rows
        for job in batch:
            self.queue.remove(job)
        t0 = time.perf_counter()
        threads = self.threads.choose(rows, self.fixed(first.key))
        tags = [j.tag or "-" for j in batch] if self.trace else []
        outs, computing = await trio.to_thread.run_sync(self._compute, [j.item for j in batch], threads, tags,
                                                        limiter=self.lane)
        seconds = self.last_seconds = time.perf_counter() - t0
        self.threads.record(rows, threads, computing)
        for job, out in zip(batch, outs):
            if isinstance(out, BaseException):
                job.error = out
            else:
                job.out = out
            job.done = True
        self.stats.add(len(batch))
        return seconds

    def _compute(self, items: list[Item], threads: int,
                 tags: Sequence[str] = ()) -> tuple[Sequence[Out | BaseException], float]:
        """The batch's outputs on `threads` torch threads (a worker thread's own setting), and the
        seconds they took; traced with the steps' `tags`."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        t0, m0 = time.perf_counter(), time.monotonic()
        outs = self._outputs(items)
        seconds = time.perf_counter() - t0
        if self.trace:
            self._traced(m0, time.monotonic(), len(items), tags)
        return outs, seconds

    def _traced(self, start: float, end: float, steps: int, tags: Sequence[str]) -> None:
        """One line, one write, to the trace kept open (reopened if `trace` names another file)."""
        try:
            if self._trace_out is None or self._trace_out[0] != self.trace:
                if self._trace_out is not None:
                    self._trace_out[1].close()
                self._trace_out = (self.trace, open(self.trace, "a", buffering=1))
            self._trace_out[1].write(f"{start:.6f} {end:.6f} {steps} {','.join(tags) or '-'}\n")
        except OSError as e:  # a diagnostic: never a session's failure
            log.warning("batch trace %s stopped: %s", self.trace, e)
            self.trace = self._trace_out = None

    def _outputs(self, items: list[Item]) -> Sequence[Out | BaseException]:
        """The batch's outputs; if it fails, each item alone, so one bad step fails only its session."""
        try:
            return self.compute(items)
        except Exception as e:  # noqa: BLE001 - retried one by one below: the error goes to its own session
            if len(items) == 1:
                return [e]
        outs: list[Out | BaseException] = []
        for item in items:
            try:
                outs.append(self.compute([item])[0])
            except Exception as e:  # noqa: BLE001 - handed to the session whose step it was
                outs.append(e)
        return outs


@dataclass
class _Rhythm:
    """How often one session queues a step (an average of its intervals) and when it last did."""

    key: Hashable
    last: float | None = None
    interval: float | None = None

    def queued(self, now: float, key: Hashable) -> None:
        if self.last is not None:
            gap = now - self.last
            self.interval = gap if self.interval is None else 0.7 * self.interval + 0.3 * gap
        self.key, self.last = key, now

    def due(self, by: float) -> bool:
        return self.interval is not None and self.last is not None and self.last + self.interval <= by

    def gone(self, now: float) -> bool:
        """Missed three of its steps: closed, or thinking; nobody waits for it until it steps again."""
        return self.last is not None and now - self.last > 3 * (self.interval or 0.0) + 1.0


@dataclass(frozen=True)
class SpanWork:
    """One session's step through a span (a peer's, or a client's local blocks)."""

    span: BlockSpan
    step: SpanStep


def span_batcher(max_rows: int = 64, lane: trio.CapacityLimiter | None = None,
                 burst_rows: int = 128) -> Batcher[SpanWork, Tensor]:
    """A Batcher of steps through one model's blocks: items of one batch cover the same blocks
    with the same kernels (the key says so), so any of their span views computes them all."""
    return Batcher(lambda works: works[0].span.forward_batch([w.step for w in works]), max_rows, lane, burst_rows,
                   fixed=lambda key: key[2])  # the key's exact flag


async def forward(batcher: Batcher[SpanWork, Tensor], span: BlockSpan, h: Tensor, positions: Tensor,
                  cache: KVCache, tree_mask: Tensor | None, commit: bool, tag: str = "") -> tuple[Tensor, float]:
    """`span(h, positions, cache, tree_mask, commit)` through the batcher, and its compute
    seconds: a committed prefill as chunks of PREFILL_CHUNK rows, one batch each. `tag` names the
    session in the batcher's trace."""
    t = h.shape[1]
    key, who = (span.start, span.end, cache.exact), id(cache)  # a session's cache is its own
    if not (commit and tree_mask is None and t > PREFILL_CHUNK):
        step = SpanStep(h, positions, cache, tree_mask, commit)
        return await batcher.run(key, h.shape[0] * t, SpanWork(span, step), who, tag)
    outs, seconds = [], 0.0
    for a in range(0, t, PREFILL_CHUNK):
        step = SpanStep(h[:, a:a + PREFILL_CHUNK], positions[a:a + PREFILL_CHUNK], cache)
        out, s = await batcher.run(key, step.h.shape[0] * step.h.shape[1], SpanWork(span, step), who, tag)
        outs.append(out)
        seconds += s
    return torch.cat(outs, 1), seconds

