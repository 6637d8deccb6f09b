"""What a client accepts of a peer before checking it: the variant its OPEN_OK declares must be
its record's (which the client accepted), a record whose variant the client cannot make is
rejected alone, and a hop that cannot reach the next peer tells the client no more than that."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace as NS

import pytest
import torch
import trio
import trio.testing

from diffuse.client.swarm import SwarmClient
from diffuse.control.records import PeerRecord
from diffuse.control.routing import Hop, plan_route
from diffuse.data.chain import UNREACHABLE, link_write_s, open_link
from diffuse.data.codec import PROTOCOL_ID, Downstream, FrameDecoder, OpenOk, encode
from diffuse.data.hop import HopFailed, HopSession
from diffuse.errors import ModelError
from test_sessions import MODEL, MemStream


async def _open_against(declared: str, quant: str) -> HopFailed | None:
    """Open a session on a hop whose record announced `quant`, answered by an OPEN_OK declaring `declared`."""
    a, b = trio.testing.memory_stream_pair()
    session = HopSession(Hop("QmPeer", (), 0, 2, quant=quant), MemStream(a), MODEL, 32, 1, torch.float32, 10)

    async def answer():
        dec, got = FrameDecoder(), []
        while not got:
            got = dec.feed(await b.receive_some())
        await b.send_all(encode(OpenOk(got[0].session_id, 32, declared)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        try:
            await session.open()
        except HopFailed as e:
            return e
    assert session.peer_dtype == declared
    return None


@pytest.mark.parametrize("declared,quant", [("float32", "none"), ("bfloat16+int4", "int4"), ("float16+int8", "int8")])
def test_a_peer_declaring_its_records_variant_opens(declared, quant):
    assert trio.run(_open_against, declared, quant) is None


@pytest.mark.parametrize("declared,quant", [
    ("bfloat16+int4", "none"),  # a variant its record did not announce (nor the client accept)
    ("float32", "int8"),  # the full weights where its record announced int8
    ("float32+int3", "none"),  # a made-up scheme
    ("bfloat16+int4", "int8"),
    ("int8", "none"),  # not a float dtype
    ("", "none"),
])
def test_a_peer_declaring_another_variant_broke_the_protocol(declared, quant):
    e = trio.run(_open_against, declared, quant)
    assert isinstance(e, HopFailed) and e.cause == "protocol", e
    assert repr(declared) in str(e) and quant in str(e)


def _record(peer: str, quant: str) -> PeerRecord:
    now = time.time()
    return PeerRecord(peer, MODEL, 2, 0, 2, ("h0", "h1"), "float32", 10.0, 1000, ("/ip4/127.0.0.1/tcp/1",),
                      now, now + 60, now - 5, protocols=(PROTOCOL_ID,), extra={"quant": quant})


def test_routes_carry_the_variant_of_each_record():
    (hop,) = plan_route([_record("QmA", "int8")], 0, 2)
    assert hop.quant == "int8"
    (hop,) = plan_route([_record("QmB", "none")], 0, 2)
    assert hop.quant == "none"


def test_a_variant_this_client_cannot_make_rejects_that_record_alone():
    async def variant_hashes(scheme):
        if scheme == "int4":
            raise ModelError("this family has no int4 variant")
        return ["h0", "h1"]

    async def records(model):
        return [_record("QmInt4", "int4"), _record("QmPlain", "none")]

    client = dict(model_id=MODEL, _records=(-1e9, []), node=NS(records=records, may_serve=lambda p: True),
                  accepted=("none", "int4"), variant_hashes=variant_hashes, rejected={}, cfg=NS(num_layers=2),
                  runs={}, rtt={})
    swarm = NS(**client, bans=NS(seen=lambda good: []))
    good = trio.run(SwarmClient.records, swarm)
    client["rejected"] = swarm.rejected
    assert [r.peer_id for r in good] == ["QmPlain"]
    assert "int4" in swarm.rejected["QmInt4"] and "no int4 variant" in swarm.rejected["QmInt4"]
    from diffuse.client.swarm_backend import SwarmBackend

    async def mine(_client):
        return await records(MODEL)

    client |= {"manifest": NS(block_hashes=["h0", "h1"]), "remote_range": (0, 2), "opts": NS(dtype=torch.float32),
               "bans": NS(active=lambda: set())}  # the API's coverage rejects that record alone as well
    api = trio.run(SwarmBackend._coverage, NS(_records=mine, started=time.time(), trust={}), NS(**client))
    assert api["servable"] and "no int4 variant" in api["excluded"]["QmInt4"]


def test_a_failed_dial_tells_the_client_nothing_of_the_address(caplog):
    async def dial(peer_id, addrs):
        raise ConnectionRefusedError("[Errno 111] Connection refused: 10.0.0.7:22")

    async def run():
        async with trio.open_nursery() as nursery:
            return await open_link(dial, Downstream("QmNext", b"\x01" * 16, b"record", b"sig"), nursery,
                                   addrs_of=lambda d: ("/ip4/10.0.0.7/tcp/22",))

    with caplog.at_level(logging.INFO, logger="diffuse.data.chain"):
        link, why = trio.run(run)
    assert link is None and why == UNREACHABLE
    assert "Connection refused" in caplog.text  # the detail stays in this peer's log


def test_a_forwarded_frame_may_take_longer_the_larger_it_is():
    assert link_write_s(0) == 2.0
    assert link_write_s(10_000_000) == pytest.approx(12.0)


def test_status_counts_the_variants_the_store_holds_and_makes_only_those_asked_for(tmp_path, monkeypatch):
    """A status query does not quantize the model because a record names a scheme: a variant the
    store lacks is excluded, said, unless --accept-quant names it; a variant that cannot be made
    (an OSError as well as a ModelError) excludes its peers alone."""
    from diffuse.client.survey import Variants
    from diffuse.model import variants
    from diffuse.model.quant import SCHEMES
    from diffuse.model.weights import load_manifest
    from tiny import make_tiny

    model = make_tiny(tmp_path / "models" / "tiny", layers=2)
    manifest = load_manifest(model)
    now = time.time()

    def rec(peer: str, hashes, scheme: str) -> PeerRecord:
        return PeerRecord(peer, manifest.model_id, 2, 0, 2, tuple(hashes), "bfloat16", 10.0, 100,
                          ("/ip4/127.0.0.1/tcp/1",), now, now + 60, now - 5, extra={"quant": scheme})

    recs = [rec("QmPlain", manifest.block_hashes, "none"), rec("QmFour", ["x", "y"], "int4")]

    async def records(model_id):
        return recs

    def survey(make=()):
        node = NS(records=records, num_blocks={})
        return trio.run(Variants({manifest.model_hash: model}, SCHEMES, make).coverage, node, manifest)

    plain = survey()
    assert set(plain.peers) == {"QmPlain"} and not variants.variant_dir(model, "int4").exists()
    assert plain.excluded["QmFour"] == "the int4 variant is not made here (--accept-quant int4 makes it)"
    assert "other weights" in survey(("int4",)).excluded["QmFour"]  # made, and checked against
    recs[1] = rec("QmFour", load_manifest(variants.variant_dir(model, "int4")).block_hashes, "int4")
    assert set(survey().peers) == {"QmPlain", "QmFour"}  # the store holds it now

    def full(source, scheme):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(variants, "resolve", full)
    recs.append(rec("QmEight", ["x", "y"], "int8"))
    cov = survey(("int8",))
    assert "QmPlain" in cov.peers
    assert "int8 variant, which cannot be made here: [Errno 28] No space left" in cov.excluded["QmEight"]


def test_status_of_a_variant_surveys_its_source(tmp_path):
    """`status --model NAME@int4`: the records are the source's, each variant's hashes checked as such."""
    from diffuse.client.survey import stored
    from diffuse.model import variants
    from diffuse.model.weights import load_manifest
    from tiny import make_tiny

    model = make_tiny(tmp_path / "models" / "tiny", layers=2)
    variants.make_variant(model, "int4")
    assert stored(tmp_path, ["tiny@int4"]) == {load_manifest(model).model_hash: model}
