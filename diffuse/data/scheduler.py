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

    async def run(self, key: Hashable, rows: int, item: Item) -> tuple[Out, float]:
        """`item`'s output, computed in a batch with whatever compatible items are queued when
        its turn comes, and the seconds that batch computed."""
        job: _Job[Item, Out] = _Job(key, rows, item)
        self.queue.append(job)
        seconds = 0.0
        try:
            async with self.turn:
                if not job.done:
                    seconds = await self._batch(job)
        finally:
            if not job.done:  # cancelled while waiting: leave no job for a later batch to compute
                self.queue.remove(job)
        if job.error is not None:
            raise job.error
        return job.out, seconds  # type: ignore[return-value]

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
        seconds = time.perf_counter() - t0
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
        except Exception:  # noqa: BLE001 - retried one by one below: the error goes to its own session
            if len(items) == 1:
                raise
        outs: list[Out | BaseException] = []
        for item in items:
            try:
                outs.append(self.compute([item])[0])
            except Exception as e:  # noqa: BLE001 - handed to the session whose step it was
                outs.append(e)
        return outs


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
    key = (span.start, span.end, cache.exact)
    if not (commit and tree_mask is None and t > PREFILL_CHUNK):
        return await batcher.run(key, h.shape[0] * t, SpanWork(span, SpanStep(h, positions, cache, tree_mask, commit)))
    outs, seconds = [], 0.0
    for a in range(0, t, PREFILL_CHUNK):
        step = SpanStep(h[:, a:a + PREFILL_CHUNK], positions[a:a + PREFILL_CHUNK], cache)
        out, s = await batcher.run(key, step.h.shape[0] * step.h.shape[1], SpanWork(span, step))
        outs.append(out)
        seconds += s
    return torch.cat(outs, 1), seconds

