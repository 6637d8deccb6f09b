"""Signed peer records: encode/verify, rejection of forged/tampered/stale/garbage values (pure
and over real DHT nodes), and the merge rule that lets one key hold every peer's record."""

from __future__ import annotations

import time
from dataclasses import replace

import cbor2
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from control_helpers import fake_hashes
from diffuse.control.identity import peer_id
from diffuse.control.records import (
    InvalidRecord,
    PeerRecord,
    RecordValidator,
    SetCodecs,
    SignedRecord,
    blocks_key,
    decode_set,
    encode_set,
    merge,
    peer_key,
    relays_key,
    sign,
    verify,
    withdrawn,
)

MODEL = "SmolLM2-135M-Instruct"
KP_A, KP_B = create_new_key_pair(), create_new_key_pair()


def record(kp=KP_A, start=0, end=15, ts=None, ttl=30.0, **kw) -> PeerRecord:
    ts = time.time() if ts is None else ts
    return PeerRecord(
        peer_id=peer_id(kp).to_base58(), model=MODEL, num_blocks=30, start=start, end=end,
        block_hashes=tuple(fake_hashes(30)[start:end]), dtype="bfloat16", throughput=12.5,
        cache_tokens=4096, addrs=("/ip4/127.0.0.1/tcp/4001",), timestamp=ts, expires=ts + ttl,
        started=ts - 5, **kw)


def raw(sr: SignedRecord) -> bytes:
    return encode_set([sr])


def test_roundtrip_is_canonical_and_exact():
    r = record(extra={"queue": 3, "gpu": "none"}, protocols=("/diffuse/inference/1.0.0",))
    s1, s2 = sign(r, KP_A), sign(r, KP_A)
    assert s1.payload == s2.payload  # deterministic encoding
    back = verify(s1.payload, s1.signature).record
    assert back == s1.record
    assert back.block_hashes == r.block_hashes and back.extra == {"queue": 3, "gpu": "none"}
    assert decode_set(raw(s1), blocks_key(MODEL))[0].record == back
    assert decode_set(raw(s1), peer_key(r.peer_id))[0].record == back


def test_a_remembered_check_never_passes_other_bytes():
    """verify remembers pairs that passed (a DHT node re-reads whole sets): the same payload under
    another signature, or a stale record it remembers, is still refused, and non-bytes are named."""
    sr = sign(record(ts=time.time() - 100, ttl=30.0), KP_A)
    assert verify(sr.payload, sr.signature) is verify(sr.payload, sr.signature)
    flipped = sr.signature[:-1] + bytes([sr.signature[-1] ^ 1])
    for _ in range(2):
        with pytest.raises(InvalidRecord, match="bad signature"):
            verify(sr.payload, flipped)
    with pytest.raises(InvalidRecord, match="stale"):  # times are checked on every read, never remembered
        decode_set(raw(sr), blocks_key(MODEL))
    with pytest.raises(InvalidRecord, match=r"\[payload bytes, 64-byte signature\]"):
        verify([sr.payload], sr.signature)


def test_record_signed_by_another_key_is_rejected():
    payload = cbor2.dumps(record(KP_A).to_payload(), canonical=True)
    forged = cbor2.dumps([[payload, KP_B.private_key.sign(b"diffuse/peer-record/v1\x00" + payload)]])
    with pytest.raises(InvalidRecord, match="signature"):
        decode_set(forged, blocks_key(MODEL))
    with pytest.raises(ValueError):
        sign(record(KP_A), KP_B)  # and we never produce one


def test_modified_block_range_is_rejected():
    sr = sign(record(start=0, end=15), KP_A)
    d = cbor2.loads(sr.payload)
    d["start"], d["hashes"] = 1, d["hashes"][1:]  # still self-consistent, but not what was signed
    tampered = cbor2.dumps([[cbor2.dumps(d, canonical=True), sr.signature]])
    with pytest.raises(InvalidRecord, match="signature"):
        decode_set(tampered, blocks_key(MODEL))


def test_stale_future_and_immortal_records_are_rejected():
    key = blocks_key(MODEL)
    for bad, why in [(record(ts=time.time() - 100, ttl=30), "stale"),
                     (record(ts=time.time() + 600), "future"),
                     (record(ttl=86400), "implausible")]:
        with pytest.raises(InvalidRecord, match=why):
            decode_set(raw(sign(bad, KP_A)), key)


@pytest.mark.parametrize("garbage", [b"", b"\xff\x00garbage", cbor2.dumps({"a": 1}), cbor2.dumps([[b"x", b"y"]]),
                                     cbor2.dumps([1, 2, 3]), cbor2.dumps([]), b"\x9f" * 5000])
def test_garbage_values_are_rejected(garbage):
    with pytest.raises(InvalidRecord):
        RecordValidator(SetCodecs()).validate(blocks_key(MODEL), garbage)


def test_record_only_lives_under_its_own_keys():
    sr = sign(record(KP_A), KP_A)
    with pytest.raises(InvalidRecord, match="another peer"):
        decode_set(raw(sr), peer_key(peer_id(KP_B).to_base58()))
    with pytest.raises(InvalidRecord, match="another model"):
        decode_set(raw(sr), blocks_key("other-model"))
    with pytest.raises(InvalidRecord, match="serves no relay"):  # only relays are listed as relays
        decode_set(raw(sr), relays_key())
    relay = sign(record(KP_A, extra={"relay": True}), KP_A)
    assert [r.peer_id for r in decode_set(raw(relay), relays_key())] == [relay.peer_id]


def test_non_canonical_payload_is_rejected():
    d = record().to_payload()
    payload = cbor2.dumps(dict(reversed(list(d.items()))))  # same map, keys out of canonical order
    sig = KP_A.private_key.sign(b"diffuse/peer-record/v1\x00" + payload)
    with pytest.raises(InvalidRecord, match="canonical"):
        verify(payload, sig)


def test_inconsistent_fields_are_rejected_even_when_signed():
    d = record().to_payload()
    for k, v in [("start", 16), ("hashes", []), ("tput", float("nan")), ("state", "maybe"), ("v", 2)]:
        bad = dict(d, **{k: v})
        payload = cbor2.dumps(bad, canonical=True)
        with pytest.raises(InvalidRecord):
            verify(payload, KP_A.private_key.sign(b"diffuse/peer-record/v1\x00" + payload))


def test_lenient_decode_drops_only_the_bad_records():
    good = sign(record(KP_B, 15, 30), KP_B)
    stale = sign(record(KP_A, ts=time.time() - 100), KP_A)
    value = cbor2.dumps([[stale.payload, stale.signature], [good.payload, good.signature], [b"junk", b"x" * 64]])
    with pytest.raises(InvalidRecord):
        decode_set(value, blocks_key(MODEL), strict=True)
    assert [r.peer_id for r in decode_set(value, blocks_key(MODEL), strict=False)] == [good.peer_id]


def test_merge_keeps_latest_per_peer_and_tombstones_win():
    now = time.time()
    a1, a2 = sign(record(KP_A, ts=now - 2), KP_A), sign(record(KP_A, ts=now - 1), KP_A)
    b1 = sign(record(KP_B, 15, 30, ts=now - 1), KP_B)
    assert merge([a2, b1, a1]) == merge([a1, a2, b1]) == merge([b1, a1, a2, a2])  # order-free, idempotent
    assert {r.payload for r in merge([a1, a2, b1])} == {a2.payload, b1.payload}
    tomb = sign(withdrawn(a2.record, now, 30), KP_A)
    assert not tomb.record.online and tomb.record.timestamp > a2.record.timestamp
    assert merge([a2, tomb])[0].payload == tomb.payload
    assert merge([tomb, a1, a2])[0].payload == tomb.payload  # a replayed online record stays withdrawn


def test_select_refuses_replays_and_accepts_news():
    v, key, now = RecordValidator(SetCodecs()), blocks_key(MODEL), time.time()
    old, new = sign(record(KP_A, ts=now - 2), KP_A), sign(record(KP_A, ts=now - 1), KP_A)
    other = sign(record(KP_B, 15, 30), KP_B)
    held = encode_set([new, other])
    assert v.select(key, [held, raw(old)]) == 0  # replay of an older record
    assert v.select(key, [held, raw(new)]) == 0  # exact duplicate adds nothing
    assert v.select(key, [raw(old), raw(new)]) == 1
    assert v.select(key, [raw(other), raw(new)]) == 1  # a new peer joins the set
    assert v.select(key, [held, b"garbage"]) == 0


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_bit_flip_is_rejected_or_harmless(pos, bit):
    sr = sign(record(), KP_A)
    value = bytearray(raw(sr))
    value[pos % len(value)] ^= 1 << bit
    try:
        recs = decode_set(bytes(value), blocks_key(MODEL))
    except InvalidRecord:
        return
    assert [r.record for r in recs] == [sr.record]  # never a different valid record


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_validator(data):
    v = RecordValidator(SetCodecs())
    try:
        v.validate(blocks_key(MODEL), data)
    except InvalidRecord:
        pass
    assert v.select(blocks_key(MODEL), [data, data]) == 0


# ---- the same attacks over real DHT nodes (loopback sockets, in one trio loop) ----

@pytest.mark.timeout(60)
def test_dht_refuses_attacks_and_keeps_honest_records():
    from diffuse.control.announce import Serving
    from diffuse.control.node import NodeConfig, open_node

    LISTEN = ["/ip4/127.0.0.1/tcp/0"]
    honest_kp, attacker_kp = create_new_key_pair(), create_new_key_pair()
    honest = peer_id(honest_kp).to_base58()

    async def main() -> None:
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as sentinel:
            boot = sentinel.full_addrs()
            async with open_node(honest_kp, NodeConfig(listen=LISTEN, bootstrap=boot, heartbeat=30)) as peer, \
                    open_node(attacker_kp, NodeConfig(listen=LISTEN, bootstrap=boot)) as attacker:
                mine = await peer.serve(Serving(MODEL, 30, 0, 15, fake_hashes(30)[:15], "bfloat16"))
                honest_signed = peer.announcer.current
                old = sign(replace(mine, timestamp=mine.timestamp - 5, expires=mine.expires - 5,
                                   started=mine.started - 5), honest_kp)
                tampered = cbor2.loads(honest_signed.payload)
                tampered["start"], tampered["hashes"] = 5, tampered["hashes"][5:]
                forged_payload = cbor2.dumps(dict(cbor2.loads(honest_signed.payload), cache=10**9), canonical=True)
                attacks = {
                    "signed by another key": cbor2.dumps([[forged_payload, attacker_kp.private_key.sign(
                        b"diffuse/peer-record/v1\x00" + forged_payload)]]),
                    "modified block range": cbor2.dumps([[cbor2.dumps(tampered, canonical=True),
                                                          honest_signed.signature]]),
                    "replayed old record": raw(old),
                    "garbage": b"\x00not a record set",
                }
                target = sentinel.host.get_id()
                for key in (blocks_key(MODEL), peer_key(honest)):
                    kb = key.encode()
                    for name, value in attacks.items():
                        ok = await attacker.dht.value_store._store_at_peer(
                            target, kb, value, record=Record(key=kb, value=value))
                        assert not ok, f"sentinel accepted a {name} under {key}"
                        held = sentinel.dht.value_store.records(kb)
                        assert [r.payload for r in held] == [honest_signed.payload], name
                # A reader still sees exactly the honest record, with its real numbers.
                recs = await attacker.records(MODEL)
                assert [(r.peer_id, r.start, r.end, r.cache_tokens) for r in recs] == [(honest, 0, 15, 0)]
                assert (await attacker.peer_record(honest)) == mine

    trio.run(main)


# ---- the wire format holds still ----

# A record value as encoded before (key pair seeded with bytes 0..31, issued at 1_700_000_000.123):
# it keeps decoding, and signing the same record keeps giving these exact bytes.
RECORD_VALUE = bytes.fromhex(
    "81825901c8b26176016273776d646966667573652f302e312e306274731b0000018bcfe5687b63656e6406636578701b0000018b"
    "cfe5ddab63657874a5636269671b4000000000000000646c6f6164f93400646d6f6465667075626c696365717565756522657265"
    "6c6179f56470656572582600240801122003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8647470"
    "7574f94a4065616464727382772f6970342f3132372e302e302e312f7463702f3430303178192f6970362f3a3a312f7564702f34"
    "3030312f717569632d76316563616368651910006564747970656862666c6f61743136656d6f64656c75536d6f6c4c4d322d3133"
    "354d2d496e7374727563746570726f746f8178182f646966667573652f696e666572656e63652f312e302e306573746172740365"
    "7374617465666f6e6c696e656668617368657383582055eae50b75e2b2990f2c18be84ca079727a85f61b839c3359249801fe1ab"
    "9e9c5820879cc67a846b570c4241f1880f79e6ed1646abd9eca44882782cb6c8c568ab535820bb349f269976d971294e3cdd5847"
    "b128917eb85d2834cc5320a5142f8cc579b8676e626c6f636b73181e67737461727465641b0000018bcfe554f35840ba1642fadd"
    "bfa0708f27881f4f18f35cd8583eb4d889bf2b9e5b65fb85e29f4150e4074e18571f78d6e4c9931a47dd8b3080784cec1be3d792"
    "14954ff0b94d08"
)


def test_a_record_value_encoded_before_decodes_and_re_encodes_identically():
    (sr,) = decode_set(RECORD_VALUE, blocks_key(MODEL), now=1_700_000_010.0)
    r = sr.record
    assert (r.start, r.end, r.num_blocks, r.throughput, r.cache_tokens) == (3, 6, 30, 12.5, 4096)
    assert (r.timestamp, r.expires, r.started, r.state) == (1_700_000_000.123, 1_700_000_030.123, 1_699_999_995.123,
                                                            "online")
    assert r.extra == {"relay": True, "queue": -3, "load": 0.25, "mode": "public", "big": 2**62}
    assert r.addrs == ("/ip4/127.0.0.1/tcp/4001", "/ip6/::1/udp/4001/quic-v1") and r.software == "diffuse/0.1.0"
    assert r.block_hashes == tuple(fake_hashes(30)[3:6]) and r.protocols == ("/diffuse/inference/1.0.0",)
    assert encode_set([sign(r, create_new_key_pair(bytes(range(32))))]) == RECORD_VALUE
