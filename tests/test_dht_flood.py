"""Discovery against valid but hostile records: signed by throwaway keys, within every bound.

- A DHT node keeps a bounded sample of each value, so a flood can neither blank a key (a value
  past py-libp2p's message limit reads as nothing) nor evict the peers it held before.
- Coverage (`diffuse status`, the API, routing) judges records against the model's manifest:
  its block count and weight hashes, never a majority of records.
"""

from __future__ import annotations

import hashlib
import json
import random
import time

import cbor2
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from control_helpers import fake_hashes, make_fake_model
from diffuse.control.announce import Serving
from diffuse.control.dht import MergingValueStore
from diffuse.control.identity import peer_id
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.records import (
    MAX_PAYLOAD_BYTES, MAX_SET_RECORDS, MAX_VALUE_BYTES, SIG_DOMAIN, InvalidRecord, PeerRecord, SetCodecs,
    blocks_key, decode_set, encode_set, sign,
)
from diffuse.home import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
LISTEN = ["/ip4/127.0.0.1/tcp/0"]


def record(kp, start=0, end=30, nblocks=30, hashes=None, pad=0) -> PeerRecord:
    now = time.time()
    return PeerRecord(
        peer_id=peer_id(kp).to_base58(), model=MODEL, num_blocks=nblocks, start=start, end=end,
        block_hashes=tuple(hashes if hashes is not None else fake_hashes(nblocks)[start:end]), dtype="bfloat16",
        throughput=10.0, cache_tokens=4096, addrs=tuple(f"/ip4/10.0.{i // 250}.{i % 250}/tcp/4001" for i in range(16)),
        timestamp=now, expires=now + 60, started=now - 1,
        extra={f"k{i}": "x" * pad for i in range(32)} if pad else {})


def test_a_flood_of_valid_records_cannot_blank_the_key_or_evict_the_peers_held_before():
    key = blocks_key(MODEL)
    kb = key.encode()
    store = MergingValueStore(None, None, SetCodecs(), rng=random.Random(1))
    kp = create_new_key_pair()  # a ~20 KB record, as in a flood that once blanked the key
    payload = cbor2.dumps(record(kp, 0, 256, nblocks=256, hashes=fake_hashes(256), pad=250).to_payload(),
                          canonical=True)
    assert len(payload) > MAX_PAYLOAD_BYTES
    huge = cbor2.dumps([[payload, kp.private_key.sign(SIG_DOMAIN + payload)]])
    with pytest.raises(InvalidRecord, match="too large"):
        decode_set(huge, key)
    honest_keys = [create_new_key_pair() for _ in range(20)]
    honest = [sign(record(kp, 0, 15), kp) for kp in honest_keys]
    for sr in honest:
        store.put_record(kb, Record(key=kb, value=encode_set([sr])))
    big = [sign(record(kp, pad=250), kp) for kp in [create_new_key_pair() for _ in range(300)]]
    assert all(len(sr.payload) > 8000 for sr in big)  # each within the record bound, the flood far past any
    for sr in big:
        store.put_record(kb, Record(key=kb, value=encode_set([sr])))
    value = store.get(kb).value
    held = decode_set(value, key)
    assert len(held) == MAX_SET_RECORDS and len(value) <= MAX_VALUE_BYTES
    assert {sr.peer_id for sr in honest} <= {sr.peer_id for sr in held}  # the peers there first stay
    assert len(value) < 4 << 20  # py-libp2p's message limit: the value can still be read


def test_records_are_bounded_in_size_and_blocks():
    kp = create_new_key_pair()
    with pytest.raises(InvalidRecord, match="block range"):
        sign(record(kp, 0, 300, nblocks=300), kp)
    sign(record(kp, pad=200), kp)  # 32 extension strings of 200 characters still fit
    assert MAX_PAYLOAD_BYTES * MAX_SET_RECORDS <= MAX_VALUE_BYTES < 4 << 20


@pytest.mark.timeout(120)
def test_status_counts_only_peers_with_the_manifests_blocks_and_weights(tmp_path):
    """An honest peer, a peer announcing other weights, and three throwaway peers claiming a
    256-block model: `diffuse status` reports the manifest's 30 blocks, each served once."""
    from diffuse.cli import main

    make_fake_model(tmp_path)
    honest_kp, liar_kp = create_new_key_pair(), create_new_key_pair()
    shapes = [create_new_key_pair() for _ in range(3)]

    async def scenario() -> dict:
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as sentinel:
            boot = sentinel.full_addrs()
            async with trio.open_nursery() as nursery:
                nodes = [await nursery.start(lambda task_status, kp=kp: _serve(kp, boot, task_status))
                         for kp in [honest_kp, liar_kp, *shapes]]
                await nodes[0].serve(Serving(MODEL, 30, 0, 30, fake_hashes(30), "bfloat16"))
                await nodes[1].serve(Serving(MODEL, 30, 0, 30, fake_hashes(30, "other"), "bfloat16"))
                other_model = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(256)]
                for n in nodes[2:]:
                    await n.serve(Serving(MODEL, 256, 0, 256, other_model, "bfloat16"))
                out = await trio.to_thread.run_sync(_status, main, tmp_path, boot[0])
                nursery.cancel_scope.cancel()
        return out

    cov = trio.run(scenario)["models"][0]
    honest, liar = peer_id(honest_kp).to_base58(), peer_id(liar_kp).to_base58()
    assert cov["num_blocks"] == 30 and [b["replicas"] for b in cov["blocks"]] == [1] * 30
    assert [p["peer_id"] for p in cov["peers"]] == [honest]
    assert "other weights" in cov["excluded"][liar]
    assert all("256 blocks" in cov["excluded"][peer_id(kp).to_base58()] for kp in shapes)


async def _serve(kp, boot, task_status) -> None:
    async with open_node(kp, NodeConfig(listen=LISTEN, bootstrap=boot, heartbeat=30)) as node:
        task_status.started(node)
        await trio.sleep_forever()


def _status(main, home, boot: str) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--home", str(home), "status", "--bootstrap", boot, "--json", "--wait", "20",
                     "--mode", "public"]) == 0  # the in-process nodes above have no swarm key
    return json.loads(out.getvalue())
