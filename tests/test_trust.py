"""The trust plane: step commitments and openings, the spot-check tolerance, the canary test
against every tamper kind (and honest fp32/bf16 peers), and signed evidence."""

from __future__ import annotations

import copy
import math
import os
import random
from dataclasses import replace

import cbor2
import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from diffuse.data.codec import FrameDecoder, StepOk, encode
from diffuse.model.load import load_head, load_span
from diffuse.trust import canary as C
from diffuse.trust import reputation as R
from diffuse.data.commitments import (
    CHUNK_SIZE, bind, chunks_of_token, input_commitment, output_commitment,
)
from diffuse.trust.spotcheck import SpotChecker, SpotVerdict, Tolerance, compare
from diffuse.trust.tamper import KINDS, Tamper
from tiny import make_tiny

SID = bytes(range(16))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These are small matmuls: on a shared 2-core box one thread ran ~10x faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# ---------------------------------------------------------------------------- commitments


@pytest.mark.parametrize("tokens", [1, 3, 7, 36])
def test_every_chunk_opens_and_a_changed_chunk_does_not(tokens):
    out = torch.randn(1, tokens, 576).to(torch.float16)
    binding, tree = bind(SID, 5, None, out)
    commitment = binding.commit(tree.root)
    assert commitment == output_commitment(SID, 5, None, out)
    for i in range(tree.n):
        opening = tree.open(i)
        assert binding.verify(commitment, opening)
        flipped = bytes([opening.chunk[0] ^ 1]) + opening.chunk[1:]
        assert not binding.verify(commitment, replace(opening, chunk=flipped))
        if tree.n > 1:
            assert not binding.verify(commitment, replace(opening, index=(i + 1) % tree.n))
            assert not binding.verify(commitment, replace(opening, path=opening.path[:-1]))


def test_commitment_is_bound_to_session_step_input_and_shape():
    out = torch.randn(1, 4, 64).to(torch.bfloat16)
    ic = input_commitment(SID, 2, None, torch.randn(1, 4, 64), [0, 1, 2, 3], 0)
    base = output_commitment(SID, 2, ic, out)
    others = [
        output_commitment(bytes(16), 2, ic, out),
        output_commitment(SID, 3, ic, out),
        output_commitment(SID, 2, bytes(32), out),
        output_commitment(SID, 2, ic, out.reshape(1, 2, 128)),  # same bytes, other shape
        output_commitment(SID, 2, ic, out.view(torch.float16)),  # same bytes, other dtype
    ]
    assert len({base, *others}) == 6
    # An opening of this step's output does not verify under another step's binding.
    binding, tree = bind(SID, 2, ic, out)
    other_step, _ = bind(SID, 3, ic, out)
    assert binding.verify(base, tree.open(0)) and not other_step.verify(base, tree.open(0))


def test_input_commitment_chains_and_covers_every_field():
    h = torch.randn(1, 3, 64)
    args = dict(positions=[5, 6, 7], cache_len=5, keep=[0, 2], mask=None, commit=True)
    base = input_commitment(SID, 1, None, h, **args)
    variants = [
        input_commitment(SID, 1, base, h, **args),
        input_commitment(SID, 1, None, h + 1e-3, **args),
        input_commitment(SID, 1, None, h, **(args | {"positions": [5, 6, 8]})),
        input_commitment(SID, 1, None, h, **(args | {"cache_len": 4})),
        input_commitment(SID, 1, None, h, **(args | {"keep": [0, 1]})),
        input_commitment(SID, 1, None, h, **(args | {"commit": False})),
        input_commitment(SID, 1, None, h, **(args | {"mask": torch.eye(3, dtype=torch.bool)})),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_client_recomputes_the_servers_commitment_from_the_wire():
    """The server commits to its bf16 output sent in fp16; the client, from the decoded frame."""
    out = torch.randn(1, 9, 576, dtype=torch.bfloat16)
    sent = out.to(torch.float16)
    ic = os.urandom(32)
    msg = StepOk(SID, 4, sent, output_commitment=output_commitment(SID, 4, ic, sent))
    (got,) = FrameDecoder().feed(encode(msg))
    assert output_commitment(SID, 4, ic, got.hidden) == got.output_commitment
    tampered = got.hidden.clone()
    tampered[0, 3, 7] += 1
    assert output_commitment(SID, 4, ic, tampered) != got.output_commitment


def test_chunks_of_token_cover_exactly_that_token():
    shape, dtype = (2, 5, 576), torch.float16
    out = torch.arange(2 * 5 * 576, dtype=torch.float32).reshape(shape).to(dtype)
    binding, tree = bind(SID, 0, None, out)
    row, tok = 1, 3
    data = b"".join(tree.open(i).chunk for i in chunks_of_token(shape, dtype, row, tok))
    first = chunks_of_token(shape, dtype, row, tok)[0] * CHUNK_SIZE
    offset = (row * 5 + tok) * 576 * 2 - first
    assert data[offset:offset + 576 * 2] == out[row, tok].numpy().tobytes()


# ---------------------------------------------------------------------------- a real 3-block slice


@pytest.fixture(scope="module")
def slice3(smollm2):
    """Blocks [10, 13) of SmolLM2 with 12 canaries of 16 tokens and their benign calibration."""
    torch.manual_seed(0)
    head = load_head(smollm2)
    prefix = load_span(smollm2, 0, 13)
    tokens = torch.randint(200, 20000, (12, 16))
    x = C.forward(prefix.view(0, 10), head.embed_tokens(tokens))
    span = prefix.view(10, 13)
    canaries = C.make_canaries(tokens, x, span, torch.float16)
    benign = C.benign_outputs(span, canaries, [torch.float32, torch.bfloat16], torch.float16)
    return span, canaries, C.Calibration.from_outputs(canaries, benign), Tolerance.from_outputs(benign)


def peer_verdict(cal, canaries, dtype, out):
    return C.decide(cal.for_dtype(dtype), [(i, C.score(out[i], c)) for i, c in enumerate(canaries)])


def hidden_of(canaries):
    return torch.stack([c.hidden for c in canaries]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_honest_peers_pass_canaries_and_spot_checks(slice3, dtype):
    span, canaries, cal, tol = slice3
    for seed in (11, 12):  # summation orders the calibration never saw
        out = C.honest_output(span, hidden_of(canaries), dtype, seed, torch.float16)
        verdict = peer_verdict(cal, canaries, dtype, out)
        assert not verdict.tampered, verdict
        ref = torch.stack([c.reference for c in canaries]).to(torch.float16).float()
        assert compare(out, ref, tol, dtype, torch.float32, range(out.shape[1])).ok


STRENGTH = {"noise": 30, "scale": 2.0, "signflip": 4, "zero": 0.1, "replay": 1, "skip": 1, "quant": 6,
            "minifloat": 3, "lowrank": 0.03}


@pytest.mark.parametrize("kind", KINDS)
def test_canaries_flag_every_tamper_kind_from_a_bf16_peer(slice3, kind):
    span, canaries, cal, _ = slice3
    t = Tamper(kind, STRENGTH[kind], rate=1.0, seed=3)
    tampered_span = t.wrap(copy.deepcopy(span).to(torch.bfloat16))
    outs = []
    for c in canaries:  # one request at a time, as a server sees them
        h = c.hidden[None].to(torch.bfloat16)
        outs.append(tampered_span(h, torch.arange(h.shape[1]), tampered_span.new_cache(h.shape[1])))
    verdict = peer_verdict(cal, canaries, torch.bfloat16, torch.cat(outs).to(torch.float16))
    assert verdict.tampered, verdict


def test_spot_check_rejects_a_tampered_step(slice3):
    span, canaries, _, tol = slice3
    out = C.honest_output(span, hidden_of(canaries[:1]), torch.bfloat16, 11, torch.float16)
    ref = canaries[0].reference[None].to(torch.float16).float()
    pos = range(out.shape[1])
    assert compare(out, ref, tol, "bfloat16", "float32", pos).ok
    bad = compare(Tamper("noise", 10).apply_output(out), ref, tol, "bfloat16", "float32", pos)
    assert not bad.ok and bad.statistic > bad.threshold
    # A decode step (one token at position 12) with a few dimensions flipped:
    step = Tamper("signflip", 16).apply_output(out[:, 12:13])
    assert compare(out[:, 12:13], ref[:, 12:13], tol, "bfloat16", "float32", [12]).ok
    assert not compare(step, ref[:, 12:13], tol, "bfloat16", "float32", [12]).ok
    assert not compare(out[:, :3], ref, tol, "bfloat16", "float32", pos).ok  # wrong shape


def test_tolerance_is_per_dtype_pair_and_position_class(slice3):
    tol = slice3[3]
    assert tol.threshold("float32", "float32", 9) < tol.threshold("bfloat16", "float32", 9)
    assert tol.threshold("bfloat16", "float32", 9) == tol.threshold("float32", "bfloat16", 200)
    assert tol.threshold("bfloat16", "float32", 0) != tol.threshold("bfloat16", "float32", 9)
    with pytest.raises(ValueError):
        tol.threshold("float16", "float32", 9)


def test_spot_checker_rate_and_monitor_alpha_spending():
    picks = SpotChecker(0.1, random.Random(1))
    n = sum(picks.pick() for _ in range(10000))
    assert 850 < n < 1150
    benign = C.Benign(torch.zeros(4), sigma=0.01, tau=0.01, realizations=2)
    mon = C.CanaryMonitor(benign, alpha=1e-3)
    first = mon.add(0, 0.0)
    assert not first.tampered and first.log10_alpha == pytest.approx(math.log10(1e-3 * 6 / math.pi ** 2))
    assert mon.add(1, 0.5).tampered  # 40 sigma


# ---------------------------------------------------------------------------- tampering (tiny model)


def test_tampered_span_is_a_drop_in_and_respects_rate(tmp_path):
    path = make_tiny(tmp_path / "m")
    span = load_span(path, 0, 4)
    t = Tamper("lowrank", 0.5, rate=0.5, seed=1)
    wrapped = t.wrap(span)
    sub = wrapped.view(1, 3)
    assert (sub.start, sub.end, len(sub.blocks)) == (1, 3, 2)
    h = torch.randn(1, 5, 64)
    honest = C.forward(span.view(1, 3), h)
    hits = 0
    for _ in range(40):
        out = sub(h, torch.arange(5), sub.new_cache(5))
        hits += not torch.equal(out, honest)
    assert 10 < hits < 30
    assert torch.equal(C.forward(span.view(1, 3), h), honest)  # the honest weights were not touched


def test_a_late_tamperer_spares_requests_that_start_before_its_position(tmp_path):
    """`after`: a canary (a prefill from 0, then steps short of 16) is served honestly; a step
    at or past 16 is drawn like any other."""
    span = load_span(make_tiny(tmp_path / "m"), 0, 2)
    late = Tamper("noise", 0.0, rate=1.0, after=16).wrap(span)
    h = torch.randn(1, 20, 64)
    honest = C.forward(span, h)
    cache = late.new_cache(20)
    prefill = late(h[:, :16], torch.arange(16), cache)
    assert torch.equal(prefill, honest[:, :16])
    assert not torch.allclose(late(h[:, 16:17], torch.tensor([16]), cache), honest[:, 16:17], atol=1e-3)


def test_replay_sends_an_earlier_output():
    t = Tamper("replay", 2)
    outs = [torch.full((1, 2, 4), float(i)) for i in range(4)]
    got = [t.apply_output(o) for o in outs]
    assert torch.equal(got[0], outs[0]) and torch.equal(got[1], outs[1])
    assert torch.equal(got[2], outs[0]) and torch.equal(got[3], outs[1])
    assert t.apply_output(torch.zeros(1, 3, 4)).shape == (1, 3, 4)


# ---------------------------------------------------------------------------- evidence


KP_ME, KP_OTHER = create_new_key_pair(), create_new_key_pair()
ME, OTHER = (ID.from_pubkey(k.public_key).to_base58() for k in (KP_ME, KP_OTHER))
ACCUSED = ID.from_pubkey(create_new_key_pair().public_key).to_base58()


def evidence(reporter=ME, **kw) -> R.Evidence:
    """A failed spot check of step 7 (worst token 2), with the chunk holding that token opened."""
    out = torch.randn(1, 3, 576).to(torch.float16)
    binding, tree = bind(SID, 7, os.urandom(32), out)
    verdict = SpotVerdict(False, 0.9, 0.2, (0, 2))
    ev = R.spot_evidence(verdict, ACCUSED, reporter, "SmolLM2-135M-Instruct", 10, 20, "bfloat16", "float32",
                         binding, tree, now=1.7e9)
    return replace(ev, **kw)


def test_evidence_round_trips_and_its_opening_still_verifies():
    original = evidence()
    signed = R.sign(original, KP_ME)
    got = R.decode(signed.encode())
    assert got.evidence == signed.evidence == original and got.payload == signed.payload
    assert got.evidence.openings and got.evidence.openings_verify()
    k, opening = got.evidence.openings[0]
    flipped = replace(opening, chunk=bytes([opening.chunk[0] ^ 1]) + opening.chunk[1:])
    assert not replace(got.evidence, openings=((k, flipped),)).openings_verify()
    forged = R.sign(replace(original, openings=((k, flipped),)), KP_ME)  # signed, but it does not hold together
    with pytest.raises(R.InvalidEvidence, match="Merkle openings are not parts of the outputs"):
        R.decode(forged.encode())
    verdict = C.CanaryVerdict(True, -40.0, -4.0, 12.5, 14.0, (1, 2, 3), (-1.9, -1.8, -1.7))
    ev = R.canary_evidence(verdict, ACCUSED, ME, "SmolLM2-135M-Instruct", 1, 10, "bfloat16")
    assert R.decode(R.sign(ev, KP_ME).encode()).evidence.detail == {"z_mean": 12.5, "z_max": 14.0, "m": 3}


def test_modified_or_forged_evidence_is_rejected():
    signed = R.sign(evidence(), KP_ME)
    d = cbor2.loads(signed.payload)
    for change in ({"stat": 0.1}, {"accused": ID.from_base58(OTHER).to_bytes()}, {"steps": []}):
        payload = cbor2.dumps(d | change, canonical=True)
        with pytest.raises(R.InvalidEvidence):
            R.verify(payload, signed.signature)
    forged = R.sign(evidence(reporter=OTHER), KP_OTHER)  # OTHER's key, but claiming to be ME:
    payload = cbor2.dumps(cbor2.loads(forged.payload) | {"reporter": ID.from_base58(ME).to_bytes()},
                          canonical=True)
    with pytest.raises(R.InvalidEvidence):
        R.verify(payload, forged.signature)
    with pytest.raises(R.InvalidEvidence):
        R.verify(cbor2.dumps(dict(reversed(d.items()))), signed.signature)  # keys out of canonical order
    with pytest.raises(ValueError):
        R.sign(evidence(), KP_OTHER)  # signing in someone else's name


def test_ban_list_bans_on_own_verdicts_and_counts_others():
    now = [1000.0]
    bans = R.BanList(ME, ttl=60, clock=lambda: now[0])
    assert not bans.add(R.sign(evidence(reporter=OTHER), KP_OTHER))
    assert not bans.banned(ACCUSED) and bans.reports(ACCUSED) == 1
    assert bans.add(R.sign(evidence(), KP_ME))
    assert bans.active() == {ACCUSED}
    now[0] += 61
    assert not bans.banned(ACCUSED)


# Evidence as encoded before (reporter's key pair seeded with bytes 0..31; a float16 output of 1x3x8
# committed in 16-byte chunks, chunks 1 and 2 opened): it keeps decoding, and signing the same
# evidence keeps giving these exact bytes.
EVIDENCE_VALUE = bytes.fromhex(
    "82590205ae6176016274731b0000018bcfe5680063656e641463746872fb3fc999999999999a646b696e646973706f7463686563"
    "6b6473746174fb3feccccccccccccd6564747970656862666c6f61743136656d6f64656c75536d6f6c4c4d322d3133354d2d496e"
    "7374727563746573746172740a657374657073818750000102030405060708090a0b0c0d0e0f0758200000000000000000000000"
    "0000000000000000000000000000000000000000004e0103000000010000000300000008183010582059b47977b22dac91b64d69"
    "d9c9ceadfec36a91970f2c1d0b70920593fa2f05f46664657461696ca4617af9be0063726f770065746f6b656e02677265666572"
    "656567666c6f617433326761636375736564582600240801122079b5562e8fe654f94078b112e8a98ba7901f853ae695bed7e0e3"
    "910bad049664686f70656e696e677382840001500048804800498049004a804a004b804b825820e7914e2b386038331f72315b80"
    "7d919636feeef64d5dcf55172aa4b9b665f7875820f456064600d43f59b417d25972bf0706990579a0b04c01dfbd7fa157006a20"
    "8484000250004c404c804cc04c004d404d804dc04d81582001a564d2bdb2d6eaa723834275957b18a5cc4c5d5f7fabbb477372a5"
    "df179932687265706f72746572582600240801122003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531"
    "b8584065beafeb27727a53bb5819e271db0d4973f3c069e30331d72c051c79653166f0286ccbad80940cea837ef9a43fe74e6d83"
    "7d19ed8e3761c798944a5be6cf9a0d"
)


def test_evidence_encoded_before_decodes_and_re_encodes_identically():
    got = R.decode(EVIDENCE_VALUE).evidence
    assert (got.kind, got.model, got.start, got.end, got.timestamp, got.dtype) == (
        "spotcheck", "SmolLM2-135M-Instruct", 10, 20, 1.7e9, "bfloat16")
    assert (got.statistic, got.threshold) == (0.9, 0.2)
    assert got.detail == {"row": 0, "token": 2, "referee": "float32", "z": -1.5}
    (binding, commitment), = got.steps
    assert (binding.session_id, binding.step, binding.n_bytes, binding.chunk_size) == (bytes(range(16)), 7, 48, 16)
    assert [k for k, _ in got.openings] == [0, 0] and [o.index for _, o in got.openings] == [1, 2]
    assert got.openings_verify()
    assert R.sign(got, create_new_key_pair(bytes(range(32)))).encode() == EVIDENCE_VALUE


def test_the_audit_rate_replaces_the_trust_forms_and_is_checked():
    from diffuse.client.swarm_backend import trust_options
    from diffuse.errors import DiffuseError

    assert trust_options("public").spot_rate == 0.1 and trust_options("private").spot_rate == 0.02
    assert trust_options("private", 1.0).spot_rate == 1.0 and not trust_options("private", 1.0).publish
    with pytest.raises(DiffuseError, match="from 0 to 1, not 1.5"):
        trust_options("public", 1.5)
    with pytest.raises(DiffuseError, match="--trust off"):
        trust_options("off", 0.5)
    assert trust_options("off") is None
