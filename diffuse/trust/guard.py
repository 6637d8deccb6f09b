"""The client's trust plane in a live swarm: vet peers with canaries, spot-check steps, act on verdicts.

- Vetting: before a peer carries a session's traffic it must have answered `vet_canaries`
  canaries for the blocks it will serve, and after every session it carried it gets one more
  with probability `canary_rate`. A canary session looks like a real one: OPEN with the session's
  max_length, a prefill of the canary's first tokens, then single-token steps paced like the
  client's real decode steps. Replies are scored against the peer's declared compute dtype
  (canary.CanaryMonitor), so benign dtype drift is not tampering.
- Spot checks: recomputed by the client's fp32 referee for the hop's span, which replays the
  hop's committed inputs into its own KV cache, and compared within the calibrated tolerance.
  Deferred (plain steps of a generation that can rewind): each hop session is audited with
  probability `spot_rate`, decided in secret as it opens, and then every step of it is
  checked: a check needs the referee to recompute the session's whole history anyway, so
  checking all of it costs what checking one late step would (TOPLOC audits whole sequences
  for the same reason). The output is used at once; a background thread at low priority
  verifies each batch of steps in one forward, trailing by at most `max_lag` tokens; a failure
  rewinds the generation to before the bad step (the data plane's Rewind), and no token after
  it has been shown (the generation holds back tokens with checks pending). Otherwise
  (candidate trees): each step with probability `spot_rate`, verified before its output is
  used. Either way a caught step never reaches the answer.
- Verdicts: a failed canary test or spot check becomes signed Evidence, bans the peer locally for
  a day, is published in the DHT (public mode), and raises `Caught`, which the data plane treats
  like any failed hop: route around it and replay into a replica.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import torch
import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from torch import Tensor

from diffuse.control.routing import Hop
from diffuse.errors import DiffuseError
from diffuse.trust.bank import CanaryBank, SpanMaterial
from diffuse.trust.canary import CanaryMonitor
from diffuse.trust.commitments import bind
from diffuse.trust.reputation import BanList, Evidence, SignedEvidence, canary_evidence, sign, spot_evidence
from diffuse.trust.spotcheck import DEFAULT_RATE, SpotChecker, compare

log = logging.getLogger(__name__)


@dataclass
class TrustOptions:
    spot_rate: float = DEFAULT_RATE
    vet_canaries: int = 1  # canaries a peer must pass before it carries traffic for a span
    canary_rate: float = 0.25  # chance per session and hop of one more canary once vetted
    decode_tail: int = 4  # canary tokens sent as single-token steps after the prefill
    canaries: int = 16  # pool size per span
    canary_tokens: int = 16
    publish: bool = True  # public mode: evidence goes to the DHT
    max_lag: int = 16  # tokens a deferred spot check may trail the generation (what a stream holds back)


class Caught(Exception):
    """A peer failed a trust check; `evidence` says how."""

    def __init__(self, evidence: SignedEvidence):
        e = evidence.evidence
        super().__init__(f"failed a {e.kind} check on blocks {e.start}-{e.end - 1} "
                         f"(statistic {e.statistic:.3g} vs threshold {e.threshold:.3g})")
        self.evidence = evidence
        self.check: Check | None = None  # set when a deferred spot check failed: rewind to before it


class TrustUnavailable(DiffuseError):
    """The client cannot judge peers (no canary material for a span): refuse rather than trust blindly."""


class _Shadow:
    """The referee's KV cache for one hop session: the hop's committed inputs, caught up at each check."""

    def __init__(self, material: SpanMaterial, max_len: int):
        self.span, self.cache = material.referee, material.referee.new_cache(max_len)
        self.done: list[Any] = []  # the context items already in the cache (by identity)

    def replay(self, context: Sequence[Any], wanted: set[int] = frozenset()) -> dict[int, Tensor]:
        """Bring the cache to `context`. What is new since the last call goes in as one causal
        chunk of the committed rows (a kept tree path is a chain): a prefill's cost, not one
        decode step per token, and equal to the peer's cache up to fp32 rounding. Returns the
        outputs of the new items whose id() is in `wanted` (the deferred checks' steps)."""
        same = 0
        while same < min(len(self.done), len(context)) and self.done[same] is context[same]:
            same += 1
        if same < len(self.done):
            self.cache.rollback(sum(x.tokens for x in self.done[:same]))
            del self.done[same:]
        new = list(context[same:])
        if not new:
            return {}
        rows = [sent.committed() for sent in new]
        y = self.span(torch.cat([r[0] for r in rows], 1).float(), torch.cat([r[1] for r in rows]), self.cache)
        self.done.extend(new)
        outs, offset = {}, 0
        for sent, (h, _) in zip(new, rows):
            if id(sent) in wanted:
                outs[id(sent)] = y[:, offset:offset + h.shape[1]]
            offset += h.shape[1]
        return outs

    def step(self, h: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        """The step's output as the referee computes it; leaves no trace in the cache."""
        out = self.span(h.float(), positions, self.cache, mask, False)
        self.cache.rollback(self.cache.length)
        return out


@dataclass
class Check:
    """A deferred spot check of one committed plain step of one hop session."""

    session: Any  # data.client.HopSession
    length: int  # tokens the session held before the step: where a failed check rewinds to
    context: list[Any]  # the session's committed inputs before the step (data.client.Sent)
    step: Any  # the step's input as sent (Sent)
    out: Tensor  # the peer's output as received
    receipt: tuple[int, bytes | None]  # the step's number and input commitment
    material: SpanMaterial
    result: Future = field(default_factory=Future)  # -> the referee's output


def _background() -> None:
    """The referee thread yields to the data plane: the lowest priority, and one core (a team
    of threads at low priority stalls whenever one of them is preempted). Both are per thread
    (Linux nice, OpenMP's thread count), so the client's own computation keeps its cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    torch.set_num_threads(1)


class Guard:
    """Per client and model: canary monitors per (peer, span), referees, bans and evidence."""

    def __init__(self, model_id: str, bank: CanaryBank, key_pair: KeyPair, options: TrustOptions | None = None,
                 publish: Callable[[SignedEvidence], Awaitable[None]] | None = None,
                 rng: random.Random | None = None):
        self.model_id, self.bank, self.key_pair = model_id, bank, key_pair
        self.opts = options or TrustOptions()
        self.me = ID.from_pubkey(key_pair.public_key).to_base58()
        self.publish = publish if self.opts.publish else None
        self.rng = rng or random.SystemRandom()  # picks the peer must not be able to predict
        self.spot = SpotChecker(self.opts.spot_rate, self.rng)
        self.bans = BanList(self.me)
        self.monitors: dict[tuple[str, int, int, str], CanaryMonitor] = {}
        self.passed: dict[tuple[str, int, int], int] = {}
        self.shadows: dict[int, _Shadow] = {}
        self.checks: list[Check] = []  # deferred spot checks not yet judged, in order
        self._referee: ThreadPoolExecutor | None = None
        self._lagging: dict[int, _Shadow] = {}  # the deferred checks' shadows: referee thread only
        self._inbox: list[Check] = []  # deferred checks the referee thread has not taken yet
        self._inbox_lock = threading.Lock()
        self.pace = 0.0  # seconds between the client's real decode steps (EMA), for canary timing
        self.counts = {"canaries": 0, "spot_checks": 0, "caught": 0, "referee_cpu_s": 0.0}

    # ---- materials ----

    async def material(self, start: int, end: int, dtype: str | None = None) -> SpanMaterial:
        """Canaries, calibration and referee for a span, able to judge a peer computing in `dtype`."""
        m = self.bank.spans.get((start, end))
        if m is not None and (dtype is None or dtype in m.benign):
            return m
        try:
            if dtype is None:
                return await trio.to_thread.run_sync(self.bank.material, start, end)
            return await trio.to_thread.run_sync(self.bank.judging, start, end, dtype)
        except Exception as e:  # noqa: BLE001 - any failure here means we cannot vouch for anyone
            raise TrustUnavailable(f"cannot judge peers on blocks {start}-{end - 1} ({dtype}): "
                                   f"{type(e).__name__}: {e}") from e

    def excluded(self) -> set[str]:
        return self.bans.active()

    def note_step(self, seconds: float) -> None:
        self.pace = seconds if self.pace == 0 else 0.8 * self.pace + 0.2 * seconds

    # ---- canaries ----

    async def vet(self, hop: Hop, session_factory: Callable[[Hop, int], Awaitable[Any]]) -> None:
        """Canaries for `hop` until it has passed enough; raises Caught on a failed test."""
        key = (hop.peer_id, hop.start, hop.end)
        for _ in range(self.opts.vet_canaries - self.passed.get(key, 0)):
            await self.canary(hop, session_factory)
            self.passed[key] = self.passed.get(key, 0) + 1

    async def after_session(self, hops: Sequence[Hop], session_factory: Callable[[Hop, int], Awaitable[Any]]) -> None:
        """One more canary for each hop with probability canary_rate, once the user has the answer
        (off the time to first token and the tokens' pace). A cheat caught here is banned and
        reported for the sessions to come; nothing is raised, the session is over."""
        for hop in hops:
            if self.rng.random() >= self.opts.canary_rate or self.bans.banned(hop.peer_id):
                continue
            try:
                await self.canary(hop, session_factory)
            except Caught:
                pass
            except Exception as e:  # noqa: BLE001 - a peer gone since is the data plane's business
                log.info("canary for %s not run: %s", hop.peer_id, e)

    async def canary(self, hop: Hop, session_factory: Callable[[Hop, int], Awaitable[Any]]) -> None:
        base = await self.material(hop.start, hop.end)  # before the session: a peer must not sit idle
        session = await session_factory(hop, base.canaries[0].hidden.shape[0])
        try:
            dtype = session.peer_dtype
            material = await self.material(hop.start, hop.end, dtype)
            monitor = self.monitors.get((hop.peer_id, hop.start, hop.end, dtype))
            if monitor is None:
                benign = material.calibration.for_dtype(dtype)
                monitor = self.monitors[(hop.peer_id, hop.start, hop.end, dtype)] = CanaryMonitor(benign)
            index = self.rng.randrange(len(material.canaries))
            c = material.canaries[index]
            h, t = c.hidden[None], c.hidden.shape[0]
            first = max(1, t - self.opts.decode_tail)
            outs, receipts = [await session.step(h[:, :first], torch.arange(first), None, True)], [session.receipt]
            for j in range(first, t):
                await trio.sleep(self.pace)
                outs.append(await session.step(h[:, j:j + 1], torch.tensor([j]), None, True))
                receipts.append(session.receipt)
        finally:
            await session.close()
        self.counts["canaries"] += 1
        verdict = monitor.observe(index, c, torch.cat(outs, 1)[0])
        if verdict.tampered:
            steps = tuple(r for r in receipts if r is not None)
            await self._convict(canary_evidence(verdict, hop.peer_id, self.me, self.model_id, hop.start, hop.end,
                                                dtype, steps))

    # ---- spot checks ----

    def pick(self) -> bool:
        return self.spot.pick()

    async def checked_step(self, session: Any, context: Sequence[Any], h: Tensor, positions: Tensor,
                           mask: Tensor | None, commit: bool) -> Tensor:
        """`session.step(...)` with the referee recomputing the same step meanwhile (so on a real
        network the check costs little beyond the round trip); Caught if the outputs disagree.
        `context` is what the session had committed before this step."""
        hop = session.hop
        material = await self.material(hop.start, hop.end, session.peer_dtype)
        shadow = self.shadows.get(id(session))
        if shadow is None:
            shadow = self.shadows[id(session)] = _Shadow(material, session.max_len)
        sent = h.to(session.dtype)
        refs: list[Tensor] = []

        def recompute() -> None:
            shadow.replay(context)
            refs.append(shadow.step(sent, positions, mask))

        async def referee() -> None:
            await trio.to_thread.run_sync(recompute)

        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(referee)
            try:
                out = await session.step(h, positions, mask, commit)
            except Exception as e:  # noqa: BLE001 - re-raised as is, not wrapped in a group
                error = e
        if error is not None:
            raise error
        self.counts["spot_checks"] += 1
        wire = out.dtype
        verdict = compare(out.float(), refs[0].to(wire).float(), material.tolerance, session.peer_dtype,
                          torch.float32, positions.tolist())
        if not verdict.ok:
            step, inputs = session.receipt_context
            binding, tree = bind(session.session_id, step, inputs, out, wire)
            await self._convict(spot_evidence(verdict, hop.peer_id, self.me, self.model_id, hop.start, hop.end,
                                              session.peer_dtype, "self", binding, tree))
        return out

    async def defer(self, session: Any, context: Sequence[Any], out: Tensor) -> None:
        """Queue a spot check of the plain step `session` just committed (its last input), for
        the referee thread; `settle` judges it."""
        material = await self.material(session.hop.start, session.hop.end, session.peer_dtype)
        check = Check(session, session.committed - session.history[-1].tokens, list(context),
                      session.history[-1], out, session.receipt_context, material)
        if self._referee is None:
            self._referee = ThreadPoolExecutor(1, "diffuse-referee", initializer=_background)
        self.checks.append(check)
        with self._inbox_lock:
            self._inbox.append(check)
        self._referee.submit(self._recompute)

    def _recompute(self) -> None:
        """Referee thread: every check queued so far, one forward per session (its last check's
        context and step contain the earlier ones: deferred steps always commit, and a rewind
        cancels the checks after it)."""
        with self._inbox_lock:
            batch, self._inbox = self._inbox, []
        sessions: dict[int, list[Check]] = {}
        for check in batch:
            if check.result.set_running_or_notify_cancel():
                sessions.setdefault(id(check.session), []).append(check)
        for key, checks in sessions.items():
            t0 = time.thread_time()
            try:
                shadow = self._lagging.get(key)
                if shadow is None:
                    shadow = self._lagging[key] = _Shadow(checks[0].material, checks[0].session.max_len)
                last = checks[-1]
                outs = shadow.replay([*last.context, last.step], {id(c.step) for c in checks})
                for check in checks:
                    check.result.set_result(outs[id(check.step)])
            except BaseException as e:  # noqa: BLE001 - handed to settle(), which re-raises it
                for check in checks:
                    if not check.result.done():
                        check.result.set_exception(e)
            self.counts["referee_cpu_s"] += time.thread_time() - t0  # one torch thread: all of it

    def unverified_from(self, sessions: Sequence[Any]) -> int | None:
        """The smallest length a pending check of these sessions could rewind to, or None."""
        ids = {id(s) for s in sessions}
        return min((c.length for c in self.checks if id(c.session) in ids), default=None)

    async def settle(self, sessions: Sequence[Any], wait: bool) -> None:
        """Judge the finished checks of these sessions (with `wait`, all of them), oldest first.
        Raises Caught with `.check` set at the first failure; its and all later checks of these
        sessions are dropped (the caller rewinds past them)."""
        ids = {id(s) for s in sessions}
        for check in [c for c in self.checks if id(c.session) in ids]:
            if not check.result.done():
                if not wait:
                    return
                await trio.to_thread.run_sync(check.result.exception, abandon_on_cancel=True)
            self.checks.remove(check)
            try:
                await self._judge(check, check.result.result())
            except Caught as e:
                e.check = check
                for c in [c for c in self.checks if id(c.session) in ids]:
                    c.result.cancel()
                    self.checks.remove(c)
                raise

    async def _judge(self, check: Check, ref: Tensor) -> None:
        session, out = check.session, check.out
        self.counts["spot_checks"] += 1
        verdict = compare(out.float(), ref.to(out.dtype).float(), check.material.tolerance, session.peer_dtype,
                          torch.float32, check.step.positions.tolist())
        if not verdict.ok:
            step, inputs = check.receipt
            binding, tree = bind(session.session_id, step, inputs, out, out.dtype)
            hop = session.hop
            await self._convict(spot_evidence(verdict, hop.peer_id, self.me, self.model_id, hop.start, hop.end,
                                              session.peer_dtype, "self", binding, tree))

    def forget(self, session: Any) -> None:
        for c in [c for c in self.checks if c.session is session]:
            c.result.cancel()
            self.checks.remove(c)
        shadow = self.shadows.pop(id(session), None)
        if shadow is not None:
            shadow.cache.wipe()
        if self._referee is not None:  # after any check it is running for this session
            self._referee.submit(self._drop, id(session))

    def _drop(self, key: int) -> None:
        shadow = self._lagging.pop(key, None)
        if shadow is not None:
            shadow.cache.wipe()

    # ---- verdicts ----

    async def _convict(self, evidence: Evidence) -> None:
        signed = sign(evidence, self.key_pair)
        self.bans.add(signed)
        self.counts["caught"] += 1
        log.warning("peer %s caught: %s check on blocks %d-%d, statistic %.3g vs threshold %.3g",
                    evidence.accused, evidence.kind, evidence.start, evidence.end - 1, evidence.statistic,
                    evidence.threshold)
        if self.publish is not None:
            with trio.move_on_after(5.0):
                try:
                    await self.publish(signed)
                except Exception as e:  # noqa: BLE001 - the verdict stands even if the DHT is down
                    log.warning("could not publish evidence against %s: %s", evidence.accused, e)
        raise Caught(signed)

    def status(self) -> dict:
        return {**self.counts, "banned": sorted(self.bans.active()), "at": time.time()}


__all__ = ["Caught", "Guard", "TrustOptions", "TrustUnavailable"]
