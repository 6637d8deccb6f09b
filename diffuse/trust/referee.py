"""The client's referee: its own fp32 copy of a span recomputes steps that peers claim to have computed.

For each checked hop session the referee keeps a shadow KV cache built from the inputs the hop
has committed, caught up in one causal chunk at each check (a prefill's cost, not one decode
step per token). Two ways to use it:

- `recompute`: one step, now, on a worker thread of trio's, while the peer computes the same
  step (a check before the output is used).
- `queue`: checks behind the generation. A dedicated thread takes every check queued so far
  from a trio channel and verifies each session's batch in one forward, at the lowest OS
  priority with one torch thread, so it only uses what the client leaves idle. It is a thread
  of its own, not trio.to_thread's: niceness and OpenMP's thread count are per thread and
  cannot be raised back without privileges, and trio's worker threads are shared with every
  other to_thread call of the process.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio
from torch import Tensor

from diffuse.data.hop import HopSession, Sent
from diffuse.model.engine import BlockSpan, KVCache
from diffuse.trust.bank import SpanMaterial


class Shadow:
    """The referee's KV cache for one hop session: the hop's committed inputs, caught up at each check."""

    def __init__(self, span: BlockSpan, max_len: int):
        self.span: BlockSpan = span
        self.cache: KVCache = span.new_cache(max_len)
        self.done: list[Sent] = []  # the committed inputs already in the cache (compared by identity)

    def replay(self, context: Sequence[Sent], wanted: Sequence[Sent] = ()) -> list[Tensor]:
        """Bring the cache to `context`: what is new since the last call goes in as one causal
        chunk of the committed rows (a kept tree path is a chain), equal to the peer's cache up
        to fp32 rounding. Returns the outputs of the `wanted` items, which must be new."""
        same = 0
        while same < min(len(self.done), len(context)) and self.done[same] is context[same]:
            same += 1
        if same < len(self.done):
            self.cache.rollback(sum(x.tokens for x in self.done[:same]))
            del self.done[same:]
        new = list(context[same:])
        if not new:
            return []
        rows = [sent.committed() for sent in new]
        y = self.span(torch.cat([r[0] for r in rows], 1).float(), torch.cat([r[1] for r in rows]), self.cache)
        self.done.extend(new)
        bounds, at = [], 0
        for h, _ in rows:
            bounds.append((at, at + h.shape[1]))
            at += h.shape[1]
        return [y[:, slice(*bounds[next(i for i, x in enumerate(new) if x is w)])] for w in wanted]

    def step(self, h: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        """The step's output as the referee computes it; leaves no trace in the cache."""
        out = self.span(h.float(), positions, self.cache, mask, False)
        self.cache.rollback(self.cache.length)
        return out


@dataclass(eq=False)
class Check:
    """A check behind the generation of one committed step of one hop session: a plain chunk, or
    the kept path of a candidate tree (`step.keep`; `out` is the whole tree as received)."""

    session: HopSession
    length: int  # tokens the session held before the step: where a failed check rewinds to
    context: list[Sent]  # the session's committed inputs before the step
    step: Sent  # the step's input as sent
    out: Tensor  # the peer's output as received
    receipt: tuple[int, bytes | None]  # the step's number and input commitment
    material: SpanMaterial
    done: trio.Event = field(default_factory=trio.Event)
    reference: Tensor | None = None  # the referee's output, once done
    error: BaseException | None = None
    cancelled: bool = False  # read by the referee thread: skip it

    def finish(self, reference: Tensor | None, error: BaseException | None) -> None:
        self.reference, self.error = reference, error
        self.done.set()


@dataclass(frozen=True)
class _Drop:
    """A session was closed: its shadow goes, after every check of it queued before."""

    session_id: bytes


class Referee:
    """Shadow caches per hop session and the thread that runs checks behind the generation."""

    def __init__(self) -> None:
        self.shadows: dict[bytes, Shadow] = {}  # checks before use, by session id (trio's worker threads)
        self.pending: list[Check] = []  # checks behind the generation not yet judged, in order
        self.cpu_s = 0.0  # the referee thread's CPU time
        self._behind: dict[bytes, Shadow] = {}  # checks behind: the referee thread's alone
        self._send, self._receive = trio.open_memory_channel[Check | _Drop](math.inf)
        self._thread: threading.Thread | None = None

    async def recompute(self, session: HopSession, material: SpanMaterial, context: Sequence[Sent], h: Tensor,
                        positions: Tensor, mask: Tensor | None) -> Tensor:
        """The step as the referee computes it from the session's committed `context`."""
        shadow = self.shadows.get(session.session_id)
        if shadow is None:
            shadow = self.shadows[session.session_id] = Shadow(material.referee_for(session.peer_dtype),
                                                                        session.max_len)

        def run() -> Tensor:
            shadow.replay(context)
            return shadow.step(h, positions, mask)

        return await trio.to_thread.run_sync(run)

    def queue(self, check: Check) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, args=(trio.lowlevel.current_trio_token(),),
                                            name="diffuse-referee", daemon=True)
            self._thread.start()
        self.pending.append(check)
        self._send.send_nowait(check)

    def cancel(self, checks: Sequence[Check]) -> None:
        for c in checks:
            c.cancelled = True
            self.pending.remove(c)

    def forget(self, session: HopSession) -> None:
        self.cancel([c for c in self.pending if c.session is session])
        shadow = self.shadows.pop(session.session_id, None)
        if shadow is not None:
            shadow.cache.wipe()
        if self._thread is not None:
            self._send.send_nowait(_Drop(session.session_id))

    def _take(self) -> list[Check | _Drop]:
        """Everything queued now (trio thread)."""
        items = []
        while True:
            try:
                items.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                return items

    def _serve(self, token: trio.lowlevel.TrioToken) -> None:
        """The referee thread: low priority, one torch thread, until the trio run ends."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        torch.set_num_threads(1)
        while True:
            try:
                items = [trio.from_thread.run(self._receive.receive, trio_token=token)]
                items += trio.from_thread.run_sync(self._take, trio_token=token)
            except BaseException:  # noqa: BLE001 - the run ended (RunFinishedError, Cancelled): so does the thread
                return
            self._run(items, token)

    def _run(self, items: list[Check | _Drop], token: trio.lowlevel.TrioToken) -> None:
        """Each session's checks in one forward: its last check's context and step contain the
        earlier ones (checks behind the generation are of committed steps, and a rewind cancels
        the checks after it)."""
        batches: dict[bytes, list[Check]] = {}
        for item in items:
            if isinstance(item, _Drop):
                self._flush(batches.pop(item.session_id, []), token)
                shadow = self._behind.pop(item.session_id, None)
                if shadow is not None:
                    shadow.cache.wipe()
            elif not item.cancelled:
                batches.setdefault(item.session.session_id, []).append(item)
        for checks in batches.values():
            self._flush(checks, token)

    def _flush(self, checks: list[Check], token: trio.lowlevel.TrioToken) -> None:
        if not checks:
            return
        t0 = time.thread_time()
        first, last = checks[0], checks[-1]
        try:
            shadow = self._behind.get(first.session.session_id)
            if shadow is None:
                span = first.material.referee_for(first.session.peer_dtype)
                shadow = self._behind[first.session.session_id] = Shadow(span, first.session.max_len)
            refs = shadow.replay([*last.context, last.step], [c.step for c in checks])
            results = [(c, ref, None) for c, ref in zip(checks, refs)]
        except Exception as e:  # noqa: BLE001 - handed to the judge, which re-raises it
            results = [(c, None, e) for c in checks]
        self.cpu_s += time.thread_time() - t0  # one torch thread: all of its work

        def finish() -> None:
            for check, ref, error in results:
                check.finish(ref, error)

        try:
            trio.from_thread.run_sync(finish, trio_token=token)
        except trio.RunFinishedError:
            pass
