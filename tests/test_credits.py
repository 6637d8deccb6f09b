"""Receipts and the ledger: forged, altered, replayed, expired and self-signed receipts are
refused; Sybil signers add at most one per-signer cap; standing orders admission."""

from __future__ import annotations

import os

import cbor2
import pytest

from diffuse.control import receipts
from diffuse.control.identity import ephemeral, peer_id
from diffuse.control.receipts import InvalidReceipt, issue, verify
from diffuse.trust.credits import ALLOWANCE, SIGNER_CAP, Ledger, Spent, format_report, report

SID = os.urandom(16)


def me(kp) -> str:
    return peer_id(kp).to_base58()


def test_a_receipt_round_trips():
    client, peer = ephemeral(), ephemeral()
    s = issue(client, me(peer), "m", 0, 10, 25, 0.5, SID)
    got = verify(*s.wire()).receipt
    assert (got.peer, got.client, got.work, got.session) == (me(peer), me(client), 250, SID)


def test_forged_and_altered_receipts_are_refused():
    client, peer, forger = ephemeral(), ephemeral(), ephemeral()
    s = issue(client, me(peer), "m", 0, 10, 25, 0.5, SID)
    altered = cbor2.loads(s.payload) | {"tokens": 10_000}
    with pytest.raises(InvalidReceipt, match="bad signature"):
        verify(cbor2.dumps(altered, canonical=True), s.signature)
    forged = issue(forger, me(peer), "m", 0, 10, 25, 0.5, SID)
    with pytest.raises(InvalidReceipt, match="bad signature"):  # the forger's signature under the client's name
        verify(cbor2.dumps(cbor2.loads(forged.payload) | {"client": peer_id(client).to_bytes()}, canonical=True),
               forged.signature)
    with pytest.raises(InvalidReceipt, match="not valid CBOR"):
        verify(s.payload[:-3], s.signature)


def test_noncanonical_expired_and_self_signed_receipts_are_refused():
    client, peer = ephemeral(), ephemeral()
    s = issue(client, me(peer), "m", 0, 10, 25, 0.5, SID)
    d = cbor2.loads(s.payload)
    loose = b"\xaa" + b"".join(cbor2.dumps(k) + cbor2.dumps(d[k]) for k in reversed(sorted(d)))
    with pytest.raises(InvalidReceipt, match="not canonical"):
        verify(loose, s.signature)
    with pytest.raises(InvalidReceipt, match="expired"):
        verify(*s.wire(), now=s.receipt.expires + 1)
    with pytest.raises(ValueError, match="itself"):
        issue(client, me(client), "m", 0, 10, 25, 0.5, SID)
    forged = receipts.Receipt(me(client), me(client), "m", 0, 1, 1, 0.0, SID, 0.0, 1.0)
    payload, sig = receipts.sign_payload(
        {"v": 1, "peer": peer_id(client).to_bytes(), "client": peer_id(client).to_bytes(), "model": "m",
         "blocks": [0, 1], "tokens": 1, "ms": 0, "sid": SID, "ts": 1000, "exp": 2000}, client, forged.client,
        receipts.SIG_DOMAIN, 1024, "a receipt")
    with pytest.raises(InvalidReceipt, match="self-signed"):
        verify(payload, sig, now=1.5)


def test_the_ledger_refuses_replays_and_receipts_not_its_own(tmp_path):
    client, peer, other = ephemeral(), ephemeral(), ephemeral()
    ledger = Ledger(tmp_path, me(peer))
    s = issue(client, me(peer), "m", 0, 10, 25, 0.5, SID)
    assert ledger.accept([s.wire()], me(client)) == (1, [])
    n, why = ledger.accept([s.wire()], me(client))
    assert n == 0 and "replayed" in why[0]
    ledger.flush()
    assert Ledger(tmp_path, me(peer)).accept([s.wire()], me(client))[0] == 0  # kept on disk across restarts
    foreign = issue(client, me(other), "m", 0, 10, 25, 0.5, os.urandom(16))
    n, why = ledger.accept([foreign.wire(), [b"x", b"y"]], me(peer))
    assert n == 0 and "must pay this peer" in why[0] and "payload" in why[1]
    assert Ledger(tmp_path, me(peer)).held[0].payload == s.payload


def test_ten_sybils_add_at_most_one_signer_cap(tmp_path):
    """Ten identities that serve nothing sign huge receipts for one client: only a signer this
    member has seen do work counts, and at most SIGNER_CAP of it."""
    peer, client = ephemeral(), ephemeral()
    sybils = [ephemeral() for _ in range(10)]
    Spent(tmp_path).record([issue(ephemeral(), me(sybils[0]), "m", 0, 1, 1, 0.0, os.urandom(16))])  # seen once
    ledger = Ledger(tmp_path, me(peer))
    before = ledger.standing(me(client))
    items = [issue(s, me(client), "m", 0, 30, 100_000, 9.0, os.urandom(16)).wire() for s in sybils for _ in range(3)]
    assert ledger.accept(items, me(client))[0] == 30
    assert 0 < ledger.standing(me(client)) - before <= SIGNER_CAP


def test_standing_ranks_givers_over_consumers_and_caps_exposure(tmp_path):
    peer, giver, worker, consumer = ephemeral(), ephemeral(), ephemeral(), ephemeral()
    Spent(tmp_path).record([issue(peer, me(worker), "m", 0, 1, 1, 0.0, os.urandom(16))])  # peer's client used worker
    ledger = Ledger(tmp_path, me(peer))
    ledger.accept([issue(worker, me(giver), "m", 0, 10, 100, 1.0, os.urandom(16)).wire()], me(giver))
    assert ledger.standing(me(giver)) > ledger.standing(me(consumer)) == ALLOWANCE
    ledger.took(me(consumer), ALLOWANCE + 1)
    assert ledger.exposed(me(consumer)) and not ledger.exposed(me(giver))
    ledger.flush()
    r = report(tmp_path, me(peer))
    assert r["tabs"][me(consumer)]["served_them"] == ALLOWANCE + 1 and r["spent"]["peers"] == 1
    assert "standing" in format_report(r)



def test_a_delivery_is_answered_and_a_bad_one_refused_with_a_reason(tmp_path):
    import trio
    import trio.testing

    from test_sessions import MemStream

    client, peer = ephemeral(), ephemeral()
    ledger = Ledger(tmp_path, me(peer))
    good = issue(client, me(peer), "m", 0, 4, 8, 0.1, SID)

    async def exchange(body: bytes) -> dict:
        a, b = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receipts.handler(ledger.accept), MemStream(b), me(client))
            await MemStream(a).write(len(body).to_bytes(4, "big") + body)
            return cbor2.loads((await receipts._read_message(MemStream(a))))

    assert trio.run(exchange, cbor2.dumps([good.wire()])) == {"accepted": 1, "refused": []}
    answer = trio.run(exchange, b"\xff\x00")
    assert answer["accepted"] == 0 and "not valid CBOR" in answer["refused"][0]
    assert ledger.held[0].payload == good.payload


def test_the_books_are_written_in_the_background_and_on_the_way_out(tmp_path):
    """A session's close only marks the book; `keep` writes it soon after from a worker thread, and
    once more when cancelled (the peer's shutdown)."""
    import trio

    peer, client = ephemeral(), ephemeral()
    ledger = Ledger(tmp_path, me(peer))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ledger.keep, 0.01)
            ledger.took(me(client), 7)
            assert not ledger.path.exists()  # nothing written on the event loop
            with trio.fail_after(30):
                while not ledger.path.exists():
                    await trio.sleep(0.01)
            assert Ledger(tmp_path, me(peer)).served == {me(client): 7}
            ledger.took(me(client), 5)
            assert ledger.accept([issue(client, me(peer), "m", 0, 4, 8, 0.1, os.urandom(16)).wire()], me(client))[0]
            nursery.cancel_scope.cancel()
        again = Ledger(tmp_path, me(peer))
        assert again.served == {me(client): 12} and len(again.held) == 1 and not ledger.dirty

    trio.run(main)


def test_credit_refuses_to_share_a_running_nodes_identity(tmp_path):
    """`--credit` runs the client as the home's serving identity, locked; while the home's `join`
    holds it, the client refuses, naming why, rather than put one peer id at two addresses."""
    from diffuse.client.swarm_backend import _member_key
    from diffuse.control.identity import IdentityError, default_identity_path, load_or_create, lock

    path = default_identity_path(tmp_path)
    load_or_create(path)
    held = lock(path)  # a running `diffuse join` of this home
    try:
        with pytest.raises(IdentityError, match="--credit asks as this home's serving identity"):
            _member_key(tmp_path)
    finally:
        held.close()
