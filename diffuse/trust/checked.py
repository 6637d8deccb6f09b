"""The trust plane around each hop session: `CheckedHop` checks one hop's steps, `SessionChecks`
keeps a session's checks that run behind its generation.

A remote span hands every new hop session to `SessionChecks.wrap` (the data plane's HopChecks,
data/checks.py) and steps the wrapper instead, so a step reads the same with or without checks:

- Behind the generation (once the pipeline has `defer`red checks because its caller handles
  Rewind, as plain and speculative decoding both do): each hop session is audited with
  probability `spot_rate`, decided in secret as it is wrapped, and then every row it commits is
  checked: a plain step's as it comes back, a candidate tree's kept path when the commit names it.
  A check needs the referee to recompute the session's whole history anyway, so checking all of
  it costs what checking one late step would (TOPLOC audits whole sequences for the same reason).
  The output is used at once; the hop's next step judges the verdicts ready by then (waiting for
  them once they trail by more than `max_lag` tokens), and `settle` the rest. A failed one
  condemns the hop: Rewind to before the bad step (the pipeline rolls every stage back; no token
  after it has been shown, since the generation holds back tokens with checks pending), then
  Rejected at the hop's next step, so the span replaces it by a replica. Rows of a tree that are
  not kept are never checked: no token is drawn from them (client/speculative.py, `verify`), and
  a peer that spoils them only loses its guesses.
- Before use (a caller that cannot rewind): each step with probability `spot_rate`, recomputed
  while the peer computes it; a failure raises Rejected and the step is redone on a replica.
  Either way a caught step never reaches the answer.

The rule for every check: a hop is judged from what it committed to and from inputs the client
can obtain, never on the assumption that the client sent its input. Its context is the hop's
committed inputs (`inputs()`, bound by the input-commitment chain into every output commitment
it returned), its output is held to the commitment it returned (`receipt_context`), and a step
checked before use starts from that step's input as the previous hop committed it (the tensor
the wrapper is handed). On a route whose peers forward activations to each other, the client
sends nothing past the first hop, and these checks must keep holding there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import trio
from torch import Tensor

from diffuse.control.routing import Hop
from diffuse.data.checks import ChecksUnavailable, OpenSession
from diffuse.data.hop import HopSession, Sent
from diffuse.errors import Rewind
from diffuse.trust.bank import SpanMaterial
from diffuse.trust.guard import PACED_ROWS, Caught, Guard
from diffuse.trust.referee import Check


class SessionChecks:
    """The trust plane's part in one session: HopChecks for its remote spans, Behind for its pipeline."""

    commitments = True  # every session asks for, and checks, output commitments: evidence needs them

    def __init__(self, guard: Guard):
        self.guard = guard
        self.hops: dict[bytes, CheckedHop] = {}  # open wrappers, by their session's id
        self.deferred = False  # plain steps may be checked behind the generation

    async def vet(self, hop: Hop, probe: OpenSession) -> None:
        await self.guard.vet(hop, probe)

    def wrap(self, session: HopSession) -> CheckedHop:
        self.hops[session.session_id] = hop = CheckedHop(session, self)
        return hop

    async def closed(self, hops: Sequence[Hop], probe: OpenSession) -> None:
        await self.guard.closed(hops, probe)

    def defer(self) -> None:
        self.deferred = True

    def pending(self, hop: CheckedHop | None = None) -> list[Check]:
        """Checks behind the generation not judged yet, of one hop or of all, oldest first."""
        mine = [c for c in self.guard.referee.pending if c.session.session_id in self.hops]
        return mine if hop is None else [c for c in mine if c.session is hop.inner]

    def unverified_from(self) -> int | None:
        """The smallest length a pending check could rewind the session to, or None."""
        return min((c.length for c in self.pending()), default=None)

    async def settle(self) -> None:
        await self.judge(self.pending(), wait=True)

    async def judge(self, checks: list[Check], wait: bool) -> None:
        """Judge the finished `checks` (with `wait`, all of them), oldest first. At the first
        failure the hop is condemned and the session rewound to before the bad step."""
        for check in checks:
            if not check.done.is_set():
                if not wait:
                    return
                await check.done.wait()
            if check.cancelled:  # rolled back or closed meanwhile
                continue
            self.guard.referee.pending.remove(check)
            if check.error is not None:
                raise ChecksUnavailable(f"the referee failed: {check.error}") from check.error
            evidence = await self.guard.verdict(check.session, check.receipt, check.out, check.reference,
                                                check.step.positions, check.material, check.step.keep)
            if evidence is not None:
                self.hops[check.session.session_id].condemned = Caught(evidence, check.length, behind=True)
                raise Rewind(check.length)


class CheckedHop:
    """A hop session whose steps the trust plane checks (module docstring); anything not
    overridden here is the inner session's."""

    def __init__(self, inner: HopSession, checks: SessionChecks):
        self.inner, self.checks, self.guard = inner, checks, checks.guard
        self.hop = inner.hop
        self.audited = self.guard.spot.pick()  # in secret, before it opens: every committed row checked behind
        self.condemned: Caught | None = None  # a check behind the generation failed: replace this hop
        self.replied: float | None = None  # when its last reply came (canaries imitate the pace)
        # an audited hop's last candidates: (output, receipt, material), checked once a commit keeps some
        self.candidate: tuple[Tensor, tuple[int, bytes | None], SpanMaterial] | None = None

    def __getattr__(self, name: str):  # session_id, peer_dtype, stream, receipt, ...
        return getattr(self.inner, name)

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    async def open(self) -> None:
        await self.inner.open()

    async def replay(self, inputs: Sequence[Sent], timeout: float) -> list[Tensor]:
        return await self.inner.replay(inputs, timeout)

    def commit(self, keep: Sequence[int] | None) -> None:
        """An audited hop's kept candidates are checked behind the generation, as a plain step is."""
        self.inner.commit(keep)
        if self.candidate is not None:
            (out, receipt, material), self.candidate = self.candidate, None
            inputs = self.inner.inputs()  # the kept path last: the tree as sent and the nodes kept
            self.guard.referee.queue(Check(self.inner, self.inner.committed, inputs[:-1], inputs[-1], out, receipt,
                                           material))

    def inputs(self) -> list[Sent]:
        return self.inner.inputs()

    def rollback(self, length: int) -> None:
        """Checks of the steps rolled back go too: their outputs are no longer in use."""
        self.inner.rollback(length)
        self.candidate = None
        self.guard.referee.cancel([c for c in self.checks.pending(self) if c.length >= length])

    async def close(self) -> None:
        await self.inner.close()
        self.checks.hops.pop(self.inner.session_id, None)
        self.guard.referee.forget(self.inner)

    async def step(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool) -> Tensor:
        """The step: with checks deferred, checked behind the generation if this hop is audited (a
        committed step now, candidates once their commit names the kept ones); else before use
        with probability spot_rate."""
        if self.condemned is not None:
            raise self.condemned
        self.candidate = None
        if not self.checks.deferred:
            if not self.guard.spot.pick():
                return await self._step(h, positions, mask, commit)
            material = await self.guard.material(self.hop.start, self.hop.end, self.inner.peer_dtype)
            return await self._checked(h, positions, mask, commit, material)
        if mine := self.checks.pending(self):
            trailing = int(positions.min()) - min(c.length for c in mine)
            await self.checks.judge(mine, wait=trailing > self.guard.opts.max_lag)
        if not self.audited:
            return await self._step(h, positions, mask, commit)
        material = await self.guard.material(self.hop.start, self.hop.end, self.inner.peer_dtype)
        out = await self._step(h, positions, mask, commit)
        inner = self.inner
        if not commit:
            self.candidate = out, inner.receipt_context, material
            return out
        # the step is the last of the hop's committed inputs, the rest its context
        self.guard.referee.queue(Check(inner, inner.committed - inner.history[-1].tokens, inner.history[:-1],
                                       inner.history[-1], out, inner.receipt_context, material))
        return out

    async def _checked(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool,
                       material: SpanMaterial) -> Tensor:
        """The step, recomputed by the referee while the peer computes it, judged before use."""
        context = self.inner.inputs()
        refs: list[Tensor] = []

        async def recompute() -> None:
            sent = h.to(self.inner.dtype)  # the previous hop's committed output: this step's input
            refs.append(await self.guard.referee.recompute(self.inner, material, context, sent, positions, mask))

        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recompute)
            try:
                out = await self._step(h, positions, mask, commit)
            except Exception as e:  # noqa: BLE001 - re-raised bare below, not in an exception group
                failed = e
        if failed is not None:
            raise failed
        evidence = await self.guard.verdict(self.inner, self.inner.receipt_context, out, refs[0], positions, material)
        if evidence is not None:
            raise Caught(evidence, sum(x.tokens for x in context))
        return out

    async def _step(self, h: Tensor, positions: Tensor, mask: Tensor | None, commit: bool) -> Tensor:
        if positions.shape[0] <= PACED_ROWS and self.replied is not None:
            self.guard.note_pace(time.perf_counter() - self.replied)
        out = await self.inner.step(h, positions, mask, commit)
        self.replied = time.perf_counter()
        return out


__all__ = ["CheckedHop", "SessionChecks"]
