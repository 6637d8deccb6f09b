"""A peer's compute, one slice at a time in the order slices were asked for.

A slice is one decode step, one candidate tree, or one chunk of a long prefill (at most
`engine.PREFILL_CHUNK` rows, as every engine computes a prefill). Slices run on a worker thread
while the event loop keeps reading every stream, answering PINGs and sending heartbeats, so a
step that arrives while a long prefill is being computed queues behind the slice in progress,
not behind the whole prefill; the FIFO limiter then serves it before the prefill's next chunk.
One slice at a time, so sessions never fight over the cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class Compute:
    """Slices in arrival order, each on the worker thread, with the time each took."""

    def __init__(self) -> None:
        self.limiter = trio.CapacityLimiter(1)
        self.slices = 0

    async def run(self, fn: Callable[[], T]) -> tuple[T, float]:
        """fn() as one slice; returns its result and its compute seconds (queueing excluded)."""
        async with self.limiter:
            def timed() -> tuple[T, float]:
                t0 = time.perf_counter()
                out = fn()
                return out, time.perf_counter() - t0

            self.slices += 1
            return await trio.to_thread.run_sync(timed)
