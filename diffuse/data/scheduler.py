"""Compute shared by many sessions: the steps that are ready together run as one batch.

A `Batcher` owns one computation (a peer's span, a client's local blocks, an LM head). A step
queues, then waits its turn (FIFO); the step whose turn it is takes itself and every compatible
step queued behind it (same key: same blocks, same kernels), up to `max_rows`, and computes them
in one call on a worker thread. Nobody waits for company: a lone session's step runs at once,
and a step waits behind at most one batch in progress, during which the event loop keeps
reading every stream, answering PINGs and sending heartbeats. A committed prefill goes through
in chunks of `engine.PREFILL_CHUNK` rows, one batch each, so other sessions' decode steps join
the batches of a long prompt instead of waiting for all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import trio
from torch import Tensor

from diffuse.model.engine import PREFILL_CHUNK, BlockSpan, KVCache, SpanStep

Item = TypeVar("Item")
Out = TypeVar("Out")


@dataclass(eq=False)
class _Job(Generic[Item, Out]):
    key: Hashable
    rows: int
    item: Item
    who: Hashable
    out: Out | None = None
    error: BaseException | None = None
    done: bool = False


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


class Batcher(Generic[Item, Out]):
    """Batches of compatible items for `compute(items) -> outs` (in order), one at a time."""

    def __init__(self, compute: Callable[[list[Item]], list[Out]], max_rows: int = 64,
                 lane: trio.CapacityLimiter | None = None):
        """lane: a limiter shared by the batchers of one model (its spans, its head), so their
        batches take turns on the cores instead of two torch computations fighting over them."""
        self.compute, self.max_rows, self.lane = compute, max_rows, lane
        self.turn = trio.CapacityLimiter(1)  # FIFO: turns in the order steps queued
        self.queue: list[_Job[Item, Out]] = []
        self.stats = BatchStats()
        self.rhythm: dict[Hashable, _Rhythm] = {}  # per session: when it queued last, how often it does
        self.queued = trio.Event()  # set whenever a step queues
        self.last_seconds = 0.0  # the last batch's compute time: the longest a step waits for company

    async def run(self, key: Hashable, rows: int, item: Item, who: Hashable = None) -> tuple[Out, float]:
        """`item`'s output, computed in a batch with whatever compatible items are queued when
        its turn comes, and the seconds that batch computed. `who` names the session (None: no
        rhythm kept, nobody waits for it)."""
        job: _Job[Item, Out] = _Job(key, rows, item, who)
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

    async def _gather(self, first: _Job[Item, Out]) -> None:
        """Wait, for at most GATHER batches' compute time, for the sessions in a steady rhythm
        whose next step is due by then. Sessions drift into groups that alternate here, each
        paying for the weights; a session due that soon would have queued behind this batch and
        kept the span busy back to back anyway, so one batch for both costs less span time for
        about the same latency. A lone session, or one whose company is not due, waits for nobody."""
        deadline = trio.current_time() + GATHER * self.last_seconds
        while True:
            now = trio.current_time()
            here = {j.who for j in self.queue if j.key == first.key}
            rows = sum(j.rows for j in self.queue if j.key == first.key)
            for who in [w for w, r in self.rhythm.items() if r.gone(now)]:
                del self.rhythm[who]
            due = [w for w, r in self.rhythm.items() if r.key == first.key and w not in here and r.due(deadline)]
            if not due or rows >= self.max_rows or now >= deadline:
                return
            self.queued = trio.Event()
            with trio.move_on_at(deadline):
                await self.queued.wait()

    async def _batch(self, first: _Job[Item, Out]) -> float:
        batch, rows = [first], first.rows
        for job in self.queue:
            if job is not first and job.key == first.key and rows + job.rows <= self.max_rows:
                batch.append(job)
                rows += job.rows
        for job in batch:
            self.queue.remove(job)
        t0 = time.perf_counter()
        outs = await trio.to_thread.run_sync(self._compute, [j.item for j in batch], limiter=self.lane)
        seconds = self.last_seconds = time.perf_counter() - t0
        for job, out in zip(batch, outs):
            if isinstance(out, BaseException):
                job.error = out
            else:
                job.out = out
            job.done = True
        self.stats.add(len(batch))
        return seconds

    def _compute(self, items: list[Item]) -> Sequence[Out | BaseException]:
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


def span_batcher(max_rows: int = 64, lane: trio.CapacityLimiter | None = None) -> Batcher[SpanWork, Tensor]:
    """A Batcher of steps through one model's blocks: items of one batch cover the same blocks
    with the same kernels (the key says so), so any of their span views computes them all."""
    return Batcher(lambda works: works[0].span.forward_batch([w.step for w in works]), max_rows, lane)


async def forward(batcher: Batcher[SpanWork, Tensor], span: BlockSpan, h: Tensor, positions: Tensor,
                  cache: KVCache, tree_mask: Tensor | None, commit: bool) -> tuple[Tensor, float]:
    """`span(h, positions, cache, tree_mask, commit)` through the batcher, and its compute
    seconds: a committed prefill as chunks of PREFILL_CHUNK rows, one batch each."""
    t = h.shape[1]
    key, who = (span.start, span.end, cache.exact), id(cache)  # a session's cache is its own
    if not (commit and tree_mask is None and t > PREFILL_CHUNK):
        step = SpanStep(h, positions, cache, tree_mask, commit)
        return await batcher.run(key, h.shape[0] * t, SpanWork(span, step), who)
    outs, seconds = [], 0.0
    for a in range(0, t, PREFILL_CHUNK):
        step = SpanStep(h[:, a:a + PREFILL_CHUNK], positions[a:a + PREFILL_CHUNK], cache)
        out, s = await batcher.run(key, step.h.shape[0] * step.h.shape[1], SpanWork(span, step), who)
        outs.append(out)
        seconds += s
    return torch.cat(outs, 1), seconds

