"""The trust plane in live sessions (in-memory transport, tiny model): canaries vet peers before
they carry traffic, spot checks recompute steps before their output is used, commitments bind
every reply, and a caught peer is routed around without changing the answer."""

from __future__ import annotations

import random

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from diffuse.client.generate import stream_tokens
from diffuse.client.pipeline import LocalStage, Pipeline
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.client.speculative import SpecConfig, SpecState, speculative_tokens
from diffuse.data.client import Bans, RemoteSpan
from diffuse.data.hop import HopFailed, HopSession
from diffuse.data.codec import Open, OpenOk, StepOk
from diffuse.data.server import BlockServer
from diffuse.model.load import load_head, load_span
from diffuse.trust import reputation
from diffuse.trust.bank import CanaryBank
from diffuse.trust.checked import SessionChecks
from diffuse.trust.guard import Guard, TrustOptions
from diffuse.trust.tamper import Tamper
from support.speculation import ROUND_TRIP_80MS, FixedCost
from test_sessions import MODEL, PROMPT, Swarm, greedy, local_answer
from tiny import make_tiny


def peer() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


HONEST, CHEAT = peer(), peer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "t", layers=4)


@pytest.fixture(scope="module")
def bank(tiny, tmp_path_factory):
    return CanaryBank(tiny, tmp_path_factory.mktemp("home"), torch.float16, n=8, length=12)


async def streamed(pipe: Pipeline, prompt: list[int], n: int) -> list[int]:
    """Greedy through stream_tokens, which lets spot checks run behind it (deferred) and rewinds."""
    return [t async for t in stream_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=n)), set())]


async def speculated(pipe: Pipeline, prompt: list[int], n: int) -> list[int]:
    """Greedy through speculative_tokens, planned as over an 80 ms round trip (candidate trees
    sent), with its checks behind it too."""
    state = SpecState(cost=FixedCost(ROUND_TRIP_80MS))
    out = [t async for t in speculative_tokens(pipe, prompt, Sampler(SamplingParams(max_tokens=n)), set(),
                                               SpecConfig(), state)]
    assert max(state.stats.positions) > 1 and max(state.stats.tokens) > 1  # trees sent, guesses kept
    return out


async def guarded_answer(path, bank, spans, tamper, n, options, published, max_len=64, run=greedy):
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, path, spans)
        for name, t in tamper.items():
            a, b = spans[name]
            swarm.servers[name] = BlockServer(MODEL, t.wrap(load_span(path, a, b)))

        async def publish(ev):
            published.append(ev)

        guard = Guard(MODEL, bank, create_new_key_pair(), options, publish, rng=random.Random(7))
        checks = SessionChecks(guard)

        async def route(start, end, exclude):  # as SwarmClient.route: never through a caught peer
            return await swarm.route(start, end, exclude | guard.excluded())

        remote = RemoteSpan(MODEL, 1, 4, swarm.dial, route, Bans(), max_len=max_len, timeout=10,
                            route_wait=0, checks=checks)
        await remote.open()
        pipe = Pipeline(load_head(path), [LocalStage(load_span(path, 0, 1), max_len), remote], behind=checks)
        out = await run(pipe, PROMPT, n)
        await pipe.close()
        nursery.cancel_scope.cancel()
    return out, remote, guard


def test_honest_swarm_passes_every_check(tiny, bank):
    expected = local_answer(tiny, PROMPT, 10)
    published = []
    opts = TrustOptions(spot_rate=1.0, vet_canaries=3, canary_rate=1.0)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, {HONEST: (1, 4)}, {}, 10, opts, published)
    assert out == expected
    assert guard.counts["canaries"] == 3 + 1  # vetting, then one after the session
    assert guard.counts["spot_checks"] == 11  # prompt + 10 steps
    assert guard.counts["caught"] == 0 and not remote.stats.failovers and not published
    assert not guard.referee.shadows  # referee caches freed with the session


def test_canaries_fit_sessions_shorter_than_a_canary(tiny, bank):
    """A 7-token prompt and 3 new tokens: the session is shorter than a 12-token canary, whose
    session asks for just enough room instead of being refused as too long."""
    published = []
    opts = TrustOptions(vet_canaries=2, spot_rate=1.0, canary_rate=0.0)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, {HONEST: (1, 4)}, {}, 3, opts, published,
                                  len(PROMPT) + 3)
    assert out == local_answer(tiny, PROMPT, 3)
    assert guard.counts["canaries"] == 2 and not remote.stats.failovers and not published


@pytest.mark.parametrize("kind,strength", [("noise", 20.0), ("scale", 8.0), ("skip", 1.0)])
def test_canaries_catch_a_tamperer_before_it_carries_traffic(tiny, bank, kind, strength):
    expected = local_answer(tiny, PROMPT, 10)
    published = []
    spans = {CHEAT: (1, 4), HONEST: (1, 3), peer(): (3, 4)}  # the cheat is the one-hop route
    opts = TrustOptions(spot_rate=0.0, vet_canaries=2)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, spans, {CHEAT: Tamper(kind, strength)}, 10,
                                  opts, published)
    assert out == expected
    assert CHEAT in guard.excluded() and CHEAT not in [h["peer"] for h in remote.route_taken]
    assert [f["during"] for f in remote.stats.failovers] == ["open"]
    (ev,) = published
    assert ev.evidence.kind == "canary" and ev.evidence.accused == CHEAT
    again = reputation.decode(ev.encode())  # anyone can verify who reported what
    assert again.evidence == ev.evidence
    assert reputation.decode_set(reputation.encode_set([ev]), reputation.evidence_key(CHEAT)) == [ev]
    with pytest.raises(reputation.InvalidEvidence):
        reputation.decode_set(reputation.encode_set([ev]), reputation.evidence_key(HONEST))


def test_spot_checks_catch_a_tamperer_mid_generation(tiny, bank):
    """A cheat that passed vetting (it tampers with 1 request in 4) is caught by a spot check;
    the step it corrupted is redone on a replica, so the answer is unchanged."""
    expected = local_answer(tiny, PROMPT, 12)
    published = []
    spans = {CHEAT: (1, 4), HONEST: (1, 3), peer(): (3, 4)}  # the cheat is the one-hop route
    opts = TrustOptions(spot_rate=1.0, vet_canaries=0, canary_rate=0.0)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, spans,
                                  {CHEAT: Tamper("noise", 10.0, rate=0.25, seed=3)}, 12, opts, published)
    assert out == expected
    (ev,) = published
    assert ev.evidence.kind == "spotcheck" and ev.evidence.accused == CHEAT and ev.evidence.openings_verify()
    (failover,) = remote.stats.failovers
    assert failover["peer"] == CHEAT and failover["during"] == "step" and "Caught" in failover["error"]
    assert HONEST in [h["peer"] for h in remote.route_taken]


def caught_behind(published, remote) -> None:
    """The cheat was caught by a check behind the generation: one spot-check report whose openings
    verify, and one failover of the cheat after it."""
    (ev,) = published
    assert ev.evidence.kind == "spotcheck" and ev.evidence.accused == CHEAT and ev.evidence.openings_verify()
    (failover,) = remote.stats.failovers
    assert failover["peer"] == CHEAT and failover["during"] == "check" and "Caught" in failover["error"]


def test_deferred_spot_checks_rewind_a_caught_step(tiny, bank):
    """In a generation (stream_tokens) spot checks run behind it: the cheat's corrupted step is
    used at once, caught by the referee thread, and the generation rewinds to before it; tokens
    are held back while a check is pending, so what was shown never changes."""
    expected = local_answer(tiny, PROMPT, 12)
    published = []
    spans = {CHEAT: (1, 4), HONEST: (1, 3), peer(): (3, 4)}  # the cheat is the one-hop route
    opts = TrustOptions(spot_rate=1.0, vet_canaries=0, canary_rate=0.0)
    # Everything shown is in `out`: a token shown and then rewound would make it differ.
    out, remote, guard = trio.run(guarded_answer, tiny, bank, spans,
                                  {CHEAT: Tamper("noise", 10.0, rate=0.25, seed=3)}, 12, opts, published,
                                  64, streamed)
    assert out == expected
    caught_behind(published, remote)
    assert HONEST in [h["peer"] for h in remote.route_taken]
    assert guard.counts["spot_checks"] >= 12 and not guard.referee.pending


def test_deferred_spot_checks_pass_an_honest_swarm(tiny, bank):
    expected = local_answer(tiny, PROMPT, 10)
    published = []
    opts = TrustOptions(spot_rate=1.0, vet_canaries=1, canary_rate=0.0)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, {HONEST: (1, 3), peer(): (3, 4)}, {}, 10, opts,
                                  published, 64, streamed)
    assert out == expected
    assert guard.counts["spot_checks"] == 2 * 10 and guard.counts["caught"] == 0  # prompt + 9 steps, 2 hops
    assert not remote.stats.failovers and not published and not guard.referee.pending


def test_a_speculating_answer_is_checked_behind_it_and_rewound(tiny, bank):
    """Speculating, every hop audited: the kept path of each candidate tree is checked behind the
    generation (never before use), the cheat's spoilt step is caught there with evidence that
    opens the tree as the cheat committed to it, and the answer is rewound to the honest one."""
    expected = local_answer(tiny, PROMPT, 16)
    published = []
    spans = {CHEAT: (1, 4), HONEST: (1, 3), peer(): (3, 4)}  # the cheat is the one-hop route
    opts = TrustOptions(spot_rate=1.0, vet_canaries=0, canary_rate=0.0)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, spans,
                                  {CHEAT: Tamper("noise", 10.0, rate=0.25, seed=3)}, 16, opts, published,
                                  64, speculated)
    assert out == expected
    caught_behind(published, remote)
    assert not guard.referee.pending and not guard.referee.shadows  # nothing was checked before use


def test_an_honest_speculating_swarm_passes_its_checks_behind(tiny, bank):
    published = []
    opts = TrustOptions(spot_rate=1.0, vet_canaries=1, canary_rate=0.0)
    out, remote, guard = trio.run(guarded_answer, tiny, bank, {HONEST: (1, 3), peer(): (3, 4)}, {}, 16, opts,
                                  published, 64, speculated)
    assert out == local_answer(tiny, PROMPT, 16)
    assert guard.counts["spot_checks"] > 2 and guard.counts["caught"] == 0
    assert not remote.stats.failovers and not published and not guard.referee.pending


def test_output_commitment_must_match_the_bytes(tiny):
    class Stream:
        async def write(self, data):
            pass

    from diffuse.control.routing import Hop

    s = HopSession(Hop(HONEST, (), 1, 4), Stream(), MODEL, 8, 1, torch.float16, 5, commitments=True)
    s.rules.send(Open(s.session_id, MODEL, 1, 4, 8, 1, torch.float16, True))
    s.rules.receive(OpenOk(s.session_id, 8))
    msg_out = torch.randn(1, 2, 64).half()

    async def fake_receive():
        return StepOk(s.session_id, 0, msg_out, output_commitment=bytes(32))

    s._receive = fake_receive
    with pytest.raises(HopFailed, match="output commitment"):
        trio.run(s.step, torch.randn(1, 2, 64), torch.arange(2), None, True)
