"""A chained hop dials only the addresses its next peer signed (protocol 1.3, CHAIN_TO_RECORD).

A client names the next peer of a chain by its signed record; the hop checks the signature, that
the record is the named peer's own, fresh and online, and dials its addresses and nowhere else. A
forged, tampered, stale or borrowed record, and a 1.2 OPEN's bare addresses (CHAIN_TO), are
refused with a reason and nothing is dialled, so no client can aim peers' dials at an address of
its choosing; the session itself goes on, returning through the client.
"""

from __future__ import annotations

import struct
import time

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from control_helpers import fake_hashes
from diffuse.control.identity import peer_id
from diffuse.control.records import SIG_DOMAIN, PeerRecord, sign, withdrawn
from diffuse.data.chain import UNREACHABLE, open_link
from diffuse.data.codec import Close, Downstream, Ext, Open, OpenOk, Step, StepOk, encode
from diffuse.data.server import BARE_CHAIN_TO
from test_chain import refusing_server
from test_sessions import MODEL, raw_session
from tiny import make_tiny

NEXT, OTHER = create_new_key_pair(), create_new_key_pair()
SIGNED_ADDRS = ("/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001")
TARGET = "/ip4/10.0.0.7/tcp/22"  # where a hostile client would aim the hop (a LAN service)
SID = b"\x02" * 16


def record(kp, addrs=SIGNED_ADDRS, ts=None, ttl=30.0) -> PeerRecord:
    ts = time.time() if ts is None else ts
    return PeerRecord(peer_id=peer_id(kp).to_base58(), model=MODEL, num_blocks=4, start=2, end=4,
                      block_hashes=tuple(fake_hashes(4)[2:4]), dtype="bfloat16", throughput=10.0,
                      cache_tokens=4096, addrs=addrs, timestamp=ts, expires=ts + ttl, started=ts - 5)


def named(kp=NEXT, **kw) -> Downstream:
    s = sign(record(kp, **kw), kp)
    return Downstream(peer_id(NEXT).to_base58(), SID, s.payload, s.signature)


def tampered() -> Downstream:
    """NEXT's genuine signature over a payload whose addresses were changed to TARGET."""
    good, bad = sign(record(NEXT), NEXT), sign(record(NEXT, addrs=(TARGET,)), NEXT)
    return Downstream(peer_id(NEXT).to_base58(), SID, bad.payload, good.signature)


def forged() -> Downstream:
    """A record naming NEXT at TARGET, signed by another key."""
    payload = sign(record(NEXT, addrs=(TARGET,)), NEXT).payload
    return Downstream(peer_id(NEXT).to_base58(), SID, payload, OTHER.private_key.sign(SIG_DOMAIN + payload))


def stale_or_withdrawn(which: str) -> Downstream:
    rec = record(NEXT, ts=time.time() - 100) if which == "stale" else withdrawn(record(NEXT), time.time(), 30.0)
    s = sign(rec, NEXT)
    return Downstream(peer_id(NEXT).to_base58(), SID, s.payload, s.signature)


async def link_to(down: Downstream) -> tuple[list, str | None]:
    dialled = []

    async def dial(peer, addrs):
        dialled.append((peer, addrs))
        raise ConnectionError("nobody there")

    async with trio.open_nursery() as nursery:
        link, why = await open_link(dial, down, nursery)
    assert link is None
    return dialled, why


def test_a_hop_dials_the_next_peer_at_its_signed_addresses_only():
    dialled, why = trio.run(link_to, named())
    assert dialled == [(peer_id(NEXT).to_base58(), SIGNED_ADDRS)] and why == UNREACHABLE


@pytest.mark.parametrize("down, reason", [
    (tampered, "refused: bad signature"),
    (forged, "refused: bad signature"),
    (lambda: named(OTHER), f"names peer {peer_id(OTHER).to_base58()}, not the next peer"),
    (lambda: stale_or_withdrawn("stale"), "stale record"),
    (lambda: stale_or_withdrawn("withdrawn"), "withdrawn"),
    (lambda: Downstream(peer_id(NEXT).to_base58(), SID, b"\xa0", b"s" * 64), "malformed record"),
    (lambda: Downstream(peer_id(NEXT).to_base58(), SID, b"garbage", b"s"), "refused"),
], ids=["tampered", "forged", "another-peers-record", "stale", "withdrawn", "empty-map", "garbage"])
def test_a_record_that_does_not_prove_the_next_peer_is_refused_and_nothing_dialled(down, reason):
    dialled, why = trio.run(link_to, down())
    assert not dialled
    assert why.startswith("not dialled: ") and reason in why


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "t", layers=4)


def bare_chain_to(addrs: tuple[str, ...]) -> bytes:
    """A 1.2 CHAIN_TO value: session, u8 n + peer id, u8 count, u16 n + address each."""
    pid = peer_id(NEXT).to_base58().encode()
    return b"".join([SID, bytes([len(pid)]), pid, bytes([len(addrs)]),
                     *(struct.pack(">H", len(a)) + a.encode() for a in addrs)])


@pytest.mark.parametrize("minor", [2, 3])
def test_a_peer_never_dials_bare_addresses_and_keeps_serving_the_session(tiny, minor):
    """An OPEN naming the next peer by bare addresses (a 1.2 client's CHAIN_TO, or a hostile one's
    at any minor) gets OPEN_OK without CHAINED, a LINK_ERROR saying why, and nothing is dialled;
    a forged record likewise. The session serves its STEPs through the client all the same."""
    server, dialled = refusing_server(tiny)
    for i, (ext, down) in enumerate([({Ext.CHAIN_TO: bare_chain_to((TARGET,))}, None), ({}, forged())]):
        sid = bytes([i + 1]) * 16
        frames = [encode(Open(sid, MODEL, 1, 4, 32, 1, torch.float32, minor=minor, extensions=ext,
                              downstream=down if minor >= 3 else None)),
                  encode(Step(sid, 0, 0, [0], torch.zeros(1, 1, 64))), encode(Close(sid))]
        replies = trio.run(raw_session, server, frames)
        assert isinstance(replies[0], OpenOk) and not replies[0].chained
        assert replies[0].link_error == (BARE_CHAIN_TO if ext else
                                         "not dialled: the next peer's record is refused: bad signature on the "
                                         f"record of {peer_id(NEXT).to_base58()}")
        assert isinstance(replies[1], StepOk) and not replies[1].forwarded
        if minor < 3:
            break
    assert not dialled
