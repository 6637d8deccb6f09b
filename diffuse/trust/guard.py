"""The client's trust plane in a live swarm: vet peers with canaries, judge checked steps, act on verdicts.

- Vetting: before a peer carries a session's traffic it must have answered `vet_canaries`
  canaries for the blocks it will serve, and after every session it carried it gets one more
  with probability `canary_rate`. A canary session looks like a real one: OPEN with the session's
  max_length, a prefill of the canary's first tokens, then single-token steps paced like the
  client's real decode steps. Replies are scored against the peer's declared compute dtype
  (canary.CanaryMonitor), so benign dtype drift is not tampering.
- Spot checks: which steps are checked, and when, is the hop wrapper's business (checked.py);
  the referee (referee.py) recomputes them and `verdict` compares within the calibrated
  tolerance.
- Verdicts: a failed canary test or spot check becomes signed Evidence, bans the peer locally for
  a day, is published in the DHT (public mode), and raises `Caught`, which the data plane treats
  like any rejected hop: route around it and replay into a replica.

`Guard` is per client and model and shared by its sessions; each session's checks
(`checked.SessionChecks`) use it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import torch
import trio
from torch import Tensor

from diffuse.control.identity import KeyPair, peer_id
from diffuse.control.routing import Hop
from diffuse.data.checks import ChecksUnavailable, OpenSession, Rejected
from diffuse.data.hop import HopSession
from diffuse.data.commitments import bind
from diffuse.trust.bank import CanaryBank, SpanMaterial
from diffuse.trust.canary import DECODE_TAIL, CanaryMonitor
from diffuse.trust.referee import Referee
from diffuse.trust.reputation import BanList, Evidence, SignedEvidence, canary_evidence, sign, spot_evidence
from diffuse.trust.spotcheck import DEFAULT_RATE, SpotChecker, compare

log = logging.getLogger(__name__)
PACED_ROWS = 8  # steps of at most this many positions set the pace canary steps imitate


@dataclass
class TrustOptions:
    spot_rate: float = DEFAULT_RATE
    vet_canaries: int = 1  # canaries a peer must pass before it carries traffic for a span
    canary_rate: float = 0.25  # chance per session and hop of one more canary once vetted
    canaries: int = 16  # pool size per span
    canary_tokens: int = 16
    publish: bool = True  # public mode: evidence goes to the DHT
    max_lag: int = 16  # tokens a check behind the generation may trail it (what a stream holds back)


class Caught(Rejected):
    """A peer failed a trust check; `evidence` says how (`length`, `behind`: as Rejected's)."""

    def __init__(self, evidence: SignedEvidence, length: int = 0, behind: bool = False):
        e = evidence.evidence
        super().__init__(f"failed a {e.kind} check on blocks {e.start}-{e.end - 1} "
                         f"(statistic {e.statistic:.3g} vs threshold {e.threshold:.3g})", length, behind)
        self.evidence = evidence


class TrustUnavailable(ChecksUnavailable):
    """The client cannot judge peers (no canary material for a span): refuse rather than trust blindly."""


class Guard:
    """Per client and model: canary monitors per (peer, span), the referee, bans and evidence."""

    def __init__(self, model_id: str, bank: CanaryBank, key_pair: KeyPair, options: TrustOptions | None = None,
                 publish: Callable[[SignedEvidence], Awaitable[None]] | None = None,
                 rng: random.Random | None = None):
        self.model_id, self.bank, self.key_pair = model_id, bank, key_pair
        self.opts = options or TrustOptions()
        self.me = peer_id(key_pair).to_base58()
        self.publish = publish if self.opts.publish else None
        self.rng = rng or random.SystemRandom()  # picks the peer must not be able to predict
        self.spot = SpotChecker(self.opts.spot_rate, self.rng)
        self.bans = BanList(self.me)
        self.referee = Referee()
        self.monitors: dict[tuple[str, int, int, str], CanaryMonitor] = {}
        self.passed: dict[tuple[str, int, int], int] = {}
        self.pace = 0.0  # seconds a hop waits between the client's real decode steps (EMA), for canaries
        self.counts = {"canaries": 0, "spot_checks": 0, "caught": 0}

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

    def note_pace(self, seconds: float) -> None:
        """A hop waited `seconds` between a reply and the client's next decode step."""
        self.pace = seconds if self.pace == 0 else 0.8 * self.pace + 0.2 * seconds

    # ---- canaries ----

    async def vet(self, hop: Hop, open_session: OpenSession) -> None:
        """Canaries for `hop` until it has passed enough; raises Caught on a failed test."""
        key = (hop.peer_id, hop.start, hop.end)
        for _ in range(self.opts.vet_canaries - self.passed.get(key, 0)):
            await self.canary(hop, open_session)
            self.passed[key] = self.passed.get(key, 0) + 1

    async def closed(self, hops: Sequence[Hop], open_session: OpenSession) -> None:
        """One more canary for each hop with probability canary_rate, once the user has the answer
        (off the time to first token and the tokens' pace). A cheat caught here is banned and
        reported for the sessions to come; nothing is raised, the session is over."""
        for hop in hops:
            if self.rng.random() >= self.opts.canary_rate or self.bans.banned(hop.peer_id):
                continue
            try:
                await self.canary(hop, open_session)
            except Caught:
                pass
            except Exception as e:  # noqa: BLE001 - a peer gone since is the data plane's business
                log.info("canary for %s not run: %s", hop.peer_id, e)

    async def canary(self, hop: Hop, open_session: OpenSession) -> None:
        base = await self.material(hop.start, hop.end)  # before the session: a peer must not sit idle
        session = await open_session(hop, base.canaries[0].hidden.shape[0])
        if session.peer_dtype not in base.benign:  # first met (a variant): calibrate with no session idle
            await session.close()
            await self.material(hop.start, hop.end, session.peer_dtype)
            session = await open_session(hop, base.canaries[0].hidden.shape[0])
        try:
            dtype = session.peer_dtype
            material = await self.material(hop.start, hop.end, dtype)
            monitor = self.monitors.get((hop.peer_id, hop.start, hop.end, dtype))
            if monitor is None:
                benign = material.calibration.for_dtype(dtype)
                monitor = self.monitors[(hop.peer_id, hop.start, hop.end, dtype)] = CanaryMonitor(benign)
            index = self.rng.randrange(len(material.canaries))
            c = material.canaries_for(dtype)[index]
            h, t = c.hidden[None], c.hidden.shape[0]
            first = max(1, t - DECODE_TAIL)  # as calibrated
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
            raise Caught(await self._convict(canary_evidence(verdict, hop.peer_id, self.me, self.model_id,
                                                             hop.start, hop.end, dtype, steps)))

    # ---- verdicts ----

    async def verdict(self, session: HopSession, receipt: tuple[int, bytes | None], out: Tensor, ref: Tensor,
                      positions: Tensor, material: SpanMaterial,
                      rows: Sequence[int] | None = None) -> SignedEvidence | None:
        """Compare a peer's output of one step with the referee's, both as sent on the wire; the
        evidence convicting the peer if they disagree. `receipt` (the step's number and the input
        commitment the peer bound its output to) ties the evidence to what the peer committed.
        `rows`: the tokens of `out` that `ref` recomputes (a candidate tree's kept path; None:
        all); the evidence still opens the output as the peer committed to it, whole."""
        self.counts["spot_checks"] += 1
        seen, at = (out, positions) if rows is None else (out[:, list(rows)], positions[list(rows)])
        verdict = compare(seen.float(), ref.to(out.dtype).float(), material.tolerance, session.peer_dtype,
                          material.referee_name(session.peer_dtype), at.tolist())
        if verdict.ok:
            return None
        if rows is not None:
            verdict = replace(verdict, token=(verdict.token[0], rows[verdict.token[1]]))
        step, inputs = receipt
        binding, tree = bind(session.session_id, step, inputs, out, out.dtype)
        hop = session.hop
        evidence = spot_evidence(verdict, hop.peer_id, self.me, self.model_id, hop.start, hop.end,
                                 session.peer_dtype, "self", binding, tree)
        return await self._convict(evidence)

    async def _convict(self, evidence: Evidence) -> SignedEvidence:
        """Sign, ban locally, publish (public mode): what every failed check leads to."""
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
        return signed

    def status(self) -> dict:
        return {**self.counts, "referee_cpu_s": self.referee.cpu_s, "banned": sorted(self.bans.active()),
                "at": time.time()}


__all__ = ["Caught", "Guard", "TrustOptions", "TrustUnavailable"]
