"""Finishing an answer in this process when the swarm loses a span mid-generation.

When every replica of some blocks dies and no route is left (NoRoute from a failover), a client
whose store holds the weights of the remote span computes it itself from then on; so does a
session that no replica can take when it opens (`start_here`). It rebuilds the
span's KV cache from what it had sent the swarm (the committed inputs failover keeps anyway),
then redoes the step that failed, so the generation continues where it was: the same model, the
same greedy answer. Outputs are rounded to the wire dtype, as a peer's reply is, so the stages
after it see what a peer of the same dtype would have sent. Without the weights (or the memory
for them) the NoRoute propagates and the answer stops, keeping what it has (client/generate.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio
from torch import Tensor

from diffuse.client.pipeline import LocalStage
from diffuse.control.placement import available_memory
from diffuse.control.routing import NoRoute
from diffuse.data.client import RemoteSpan
from diffuse.data.scheduler import Batcher, SpanWork
from diffuse.errors import Rewind
from diffuse.model.engine import BlockSpan

log = logging.getLogger(__name__)
MEMORY_SHARE = 0.5  # of the memory available now that a rescued span's weights may take

LoadSpan = Callable[[int, int], BlockSpan]


class Rescuable:
    """A remote span that becomes a local one when the swarm no longer covers it (the stage
    protocol of client/pipeline.py). `span_bytes` is what its weights would take here;
    `load(start, end)` loads them from the store (and raises if the store lacks them);
    `unverified()`, the length checks behind the generation could still rewind the session to
    (the pipeline's Behind.unverified_from; None: nothing pending)."""

    def __init__(self, remote: RemoteSpan, load: LoadSpan, span_bytes: int, max_len: int, batch: int = 1,
                 exact: bool = False, batcher: Batcher[SpanWork, Tensor] | None = None, enabled: bool = True,
                 unverified: Callable[[], int | None] = lambda: None):
        self.remote, self.load, self.span_bytes, self.enabled = remote, load, span_bytes, enabled
        self.unverified = unverified
        self.start, self.end = remote.start, remote.end
        self.max_len, self.batch, self.exact, self.batcher = max_len, batch, exact, batcher
        self.local: LocalStage | None = None
        self.rescued_at: int | None = None  # committed tokens when the span came here

    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor:
        if self.local is None:
            try:
                return await self.remote.forward(h, positions, tree_mask, commit)
            except NoRoute as e:
                if not self.enabled:
                    raise
                pending = self.unverified()
                await self._take_over(e, int(positions.min()))
                if pending is not None:  # steps no check has passed yet are recomputed here
                    raise Rewind(pending) from e
        out = await self.local.forward(h, positions, tree_mask, commit)
        return out.to(self.remote.dtype)

    async def start_here(self, error: NoRoute) -> bool:
        """A session no replica can take now starts here instead; whether it could."""
        try:
            await self._take_over(error, 0)
        except NoRoute:
            return False
        return True

    @property
    def in_process(self) -> list[list[int]]:
        """The blocks this session computes here instead of on peers ([] while on peers)."""
        return [[self.start, self.end]] if self.local is not None else []

    async def _take_over(self, error: NoRoute, length: int) -> None:
        """Load the span and replay its `length` committed input tokens into it (the failed
        step's first hops may have committed it already); re-raise `error` if we cannot."""
        room = MEMORY_SHARE * available_memory()
        if self.span_bytes > room:
            log.warning("cannot finish here: blocks %d-%d need %.0f MiB, %.0f MiB to spare", self.start,
                        self.end - 1, self.span_bytes / 2**20, room / 2**20)
            raise error
        try:
            span = await trio.to_thread.run_sync(self.load, self.start, self.end)
        except Exception as e:  # noqa: BLE001 - missing or corrupt weights: the swarm's error stands
            log.warning("cannot finish here: %s", e)
            raise error from None
        inputs = self.remote.committed_inputs(length)
        local = LocalStage(span, self.max_len, self.batch, self.exact, self.batcher)
        for sent in inputs:
            rows, positions = sent.committed()
            await local.forward(rows, positions, None, True)
        self.local, self.rescued_at = local, sum(s.tokens for s in inputs)
        log.warning("%s; computing blocks %d-%d in this process from here on (%d tokens replayed)",
                    error, self.start, self.end - 1, self.rescued_at)
        await self.remote.close()

    async def commit(self, keep: Sequence[int] | None) -> None:
        await (self.local or self.remote).commit(keep)

    async def rollback(self, length: int) -> None:
        await (self.local or self.remote).rollback(length)

    async def close(self) -> None:
        await (self.local or self.remote).close()
