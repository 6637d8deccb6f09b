"""A generation session as a chain of stages between the client's embeddings and its LM head.

The client always holds the head (embeddings, final norm, LM head), so token ids never leave it.
Between embedding and head run stages: block spans computed locally, or (data plane) remote
peers. Every stage speaks the same three verbs, so the generation loop and speculative decoding
do not care where a block runs: forward (with commit=False for candidates), commit, rollback.
The verbs are async because remote stages wait on the network (trio). Local blocks and the LM
head compute through batchers shared by every session of a model (data/scheduler.py), so an API
serving many users runs their rows together, on a worker thread, while the loop serves HTTP.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import trio
from torch import Tensor

from diffuse.data import scheduler
from diffuse.data.scheduler import Batcher, SpanWork
from diffuse.errors import Rewind
from diffuse.model.engine import BlockSpan, Head, KVCache

Logits = Batcher[tuple[Tensor, bool], Tensor]  # (final hidden states, exact) -> logits


def head_batcher(head: Head, lane: trio.CapacityLimiter | None = None, max_rows: int = 256) -> Logits:
    """Batches the LM head's rows across sessions (items of a batch share `exact`: the key)."""

    def logits(items: list[tuple[Tensor, bool]]) -> list[Tensor]:
        rows = [h.reshape(-1, h.shape[-1]) for h, _ in items]
        out = head.logits(torch.cat(rows) if len(rows) > 1 else rows[0], items[0][1])
        return [o.view(*h.shape[:-1], -1) for o, (h, _) in zip(out.split([r.shape[0] for r in rows]), items)]

    return Batcher(logits, max_rows, lane, fixed=lambda exact: exact)


class Stage(Protocol):
    """Blocks [start, end) for one session: the three verbs, and close. A remote stage's forward
    may raise Rewind (a check behind the generation failed: see Behind)."""

    start: int
    end: int

    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor: ...
    async def commit(self, keep: Sequence[int] | None) -> None: ...
    async def rollback(self, length: int) -> None: ...
    async def close(self) -> None: ...


class Behind(Protocol):
    """Checks of a session's remote steps that run behind the generation (the trust plane's
    audits): an output is used at once and judged later, and a failed judgement raises Rewind.
    Only a caller that handles Rewind may `defer` checks so."""

    def defer(self) -> None: ...
    def unverified_from(self) -> int | None: ...
    async def settle(self) -> None: ...


class LocalStage:
    """A block span computed in this process, with its own KV cache for one session."""

    def __init__(self, span: BlockSpan, max_len: int, batch: int = 1, exact: bool = False,
                 batcher: Batcher[SpanWork, Tensor] | None = None):
        self.span, self.start, self.end = span, span.start, span.end
        self.cache: KVCache = span.new_cache(max_len, batch, exact)
        self.batcher = batcher  # shared with the model's other sessions; None: compute here, now

    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor:
        h = h.to(self.cache.k.dtype)
        if self.batcher is None:
            return self.span(h, positions, self.cache, tree_mask, commit)
        return (await scheduler.forward(self.batcher, self.span, h, positions, self.cache, tree_mask, commit))[0]

    async def commit(self, keep: Sequence[int] | None) -> None:
        self.cache.commit(keep)

    async def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    async def close(self) -> None:
        self.cache.wipe()
        if self.batcher is not None:
            self.batcher.leave(id(self.cache))


class Pipeline:
    """One session: embed -> stages -> logits, tracking how many tokens are committed; `behind`,
    the checks of its remote steps that may run behind the generation (None: nothing checked so)."""

    def __init__(self, head: Head, stages: list[Stage], exact: bool = False, logits: Logits | None = None,
                 behind: Behind | None = None):
        self.head, self.stages, self.behind = head, stages, behind
        self.exact = exact  # batch-invariant LM head (the stages were opened exact too)
        self.logits = logits  # the head's batcher, shared with the model's other sessions
        self.length = 0  # committed tokens, identical in every stage's cache
        self.pending = 0  # candidate tokens of the last forward(commit=False)
        self.hidden: Tensor | None = None  # final hidden states of the rows the last forward returned

    @property
    def company(self) -> int:
        """Sessions of this model stepping through its shared LM head now, this one included (1 when
        it has none): every row a session adds to a shared batch, the others wait for too."""
        return max(1, self.logits.company()) if self.logits is not None else 1

    async def forward(self, ids: Tensor, positions: Tensor | None = None, tree_mask: Tensor | None = None,
                commit: bool = True, rows: Tensor | slice | None = None) -> Tensor:
        """Logits [B, T', V] for ids [B, T]; `rows` picks which of the T positions need logits
        (the LM head is the costliest matmul of a small model, so prefill asks only for the last)."""
        if positions is None:
            positions = torch.arange(self.length, self.length + ids.shape[1])
        h = self.head.embed_tokens(ids)
        try:
            for stage in self.stages:
                h = await stage.forward(h, positions, tree_mask, commit)
        except Rewind as r:
            await self.rollback(r.length)
            raise
        if commit:
            self.length += ids.shape[1]
        else:
            self.pending = ids.shape[1]
        h = h.to(self.head.norm.weight.dtype)
        self.hidden = h if rows is None else h[:, rows]  # the rows' final hidden states (draft heads read them)
        if self.logits is None:
            return self.head.logits(self.hidden, self.exact)
        rows_n = self.hidden.shape[0] * self.hidden.shape[1]
        return (await self.logits.run(self.exact, rows_n, (self.hidden, self.exact), id(self)))[0]

    async def commit(self, keep: Sequence[int] | None = None) -> None:
        for stage in self.stages:
            await stage.commit(keep)
        self.length += len(keep) if keep is not None else self.pending
        self.pending = 0

    async def rollback(self, length: int) -> None:
        for stage in self.stages:
            await stage.rollback(length)
        self.length, self.pending = length, 0

    async def close(self) -> None:
        if self.logits is not None:
            self.logits.leave(id(self))
        for stage in self.stages:
            await stage.close()

    # Checks behind the generation (the trust plane's, on remote steps).

    def defer_checks(self) -> None:
        """The caller handles Rewind (stream_tokens and speculative_tokens do): steps may be checked
        behind it."""
        if self.behind is not None:
            self.behind.defer()

    def unverified_from(self) -> int | None:
        """Tokens past this committed length may still be rewound (None: nothing pending)."""
        return self.behind.unverified_from() if self.behind is not None else None

    async def settle(self) -> None:
        """Wait for every pending check; Rewind (after rolling back) if one fails."""
        if self.behind is None:
            return
        try:
            await self.behind.settle()
        except Rewind as r:
            await self.rollback(r.length)
            raise


def showable(pipeline: Pipeline, tokens: int, done: bool) -> int:
    """How many of a generation's `tokens` (prompt included) may be shown: a token once no pending
    check can rewind past the step that produced it, every one once the answer is settled."""
    pending = None if done else pipeline.unverified_from()
    return tokens if pending is None else min(tokens, pending + 1)


class LocalModel:
    """The whole model in one process: the reference every distributed answer must equal. Its
    sessions share batchers, so concurrent ones (the API's users) compute their rows together."""

    def __init__(self, head: Head, spans: list[BlockSpan]):
        self.head, self.spans = head, spans
        lane = trio.CapacityLimiter(1)  # one batch at a time on the cores, whichever part of the model
        self.batchers = [scheduler.span_batcher(lane=lane) for _ in spans]
        self.logits = head_batcher(head, lane)

    def session(self, max_len: int, batch: int = 1, exact: bool = False) -> Pipeline:
        """exact: batch-invariant kernels, so that speculative and plain greedy decoding (and a
        replay, and any batch) compute every position to the same bits (kernels.exact_linear)."""
        stages: list[Stage] = [LocalStage(s, max_len, batch, exact, b) for s, b in zip(self.spans, self.batchers)]
        return Pipeline(self.head, stages, exact, self.logits)
