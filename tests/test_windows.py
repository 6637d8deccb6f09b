"""Layout 2: one DHT key per window of blocks, bounded per node, sampled so readers can estimate.

- A record is accepted only under the windows its span touches (and nowhere else by a window).
- A node's overflowing value keeps its longest-held half and a sample ranked by its own keyed
  hash: stable across refreshes, independent between nodes.
- Readers estimate a window's population from the nodes' samples (capture-recapture).
- Two real nodes on loopback: an announced peer is found through its window keys.
"""

from __future__ import annotations

import random
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from control_helpers import fake_hashes
from diffuse.control.announce import Serving
from diffuse.control.dht import MergingValueStore
from diffuse.control.identity import peer_id
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.records import (
    MAX_SET_RECORDS, InvalidRecord, PeerRecord, SetCodecs, check_key, decode_set, encode_set, sign, window_key,
    windows_of,
)
from diffuse.control.windows import WindowSample, estimate_replicas, sample_of

MODEL, BLOCKS = "win-model", 80
LISTEN = ["/ip4/127.0.0.1/tcp/0"]


def record(kp, start: int, end: int) -> PeerRecord:
    now = time.time()
    return PeerRecord(peer_id=peer_id(kp).to_base58(), model=MODEL, num_blocks=BLOCKS, start=start, end=end,
                      block_hashes=tuple(fake_hashes(BLOCKS)[start:end]), dtype="bfloat16", throughput=10.0,
                      cache_tokens=4096, addrs=("/ip4/10.0.0.1/tcp/4001",), timestamp=now, expires=now + 60,
                      started=now - 1, extra={"quant": "int8"})


def test_a_record_belongs_under_exactly_the_windows_its_span_touches():
    assert list(windows_of(0, 8)) == [0] and list(windows_of(7, 9)) == [0, 1] and list(windows_of(8, 80)) == list(
        range(1, 10))
    kp = create_new_key_pair()
    sr = sign(record(kp, 6, 17), kp)
    for w in (0, 1, 2):
        check_key(window_key(MODEL, w), sr.record)
        assert decode_set(encode_set([sr]), window_key(MODEL, w))[0].record.extra["quant"] == "int8"
    for key in (window_key(MODEL, 3), window_key("other", 1)):
        with pytest.raises(InvalidRecord, match="window"):
            decode_set(encode_set([sr]), key)
    assert all(len(window_key(MODEL * 20, w)) <= 50 for w in range(32))  # py-libp2p's FIND_NODE bound


def _fill(store: MergingValueStore, key: str, records) -> set[str]:
    kb = key.encode()
    for sr in records:
        store.put_record(kb, Record(key=kb, value=encode_set([sr])))
    return {sr.peer_id for sr in decode_set(store.get(kb).value, key)}


def test_a_nodes_sample_is_stable_under_refreshes_and_independent_of_other_nodes():
    key = window_key(MODEL, 0)
    keys = [create_new_key_pair() for _ in range(200)]
    first = [sign(record(kp, 0, 8), kp) for kp in keys]
    a, b = (MergingValueStore(None, None, SetCodecs(), rng=random.Random(seed)) for seed in (1, 2))
    held_a, held_b = _fill(a, key, first), _fill(b, key, first)
    assert len(held_a) == len(held_b) == MAX_SET_RECORDS
    early = {sr.peer_id for sr in first[:MAX_SET_RECORDS // 2]}
    assert early <= held_a and early <= held_b  # the longest-held half is everyone's
    # The sampled halves differ between nodes (each node's own secret ranks the others).
    assert len((held_a - early) & (held_b - early)) < MAX_SET_RECORDS // 2
    time.sleep(0.002)  # newer timestamps: a heartbeat of every peer, in another order
    again = [sign(record(kp, 0, 8), kp) for kp in keys]
    random.Random(3).shuffle(again)
    assert _fill(a, key, again) == held_a  # a refresh does not reshuffle who is held


def test_readers_estimate_a_window_from_independent_samples():
    rng = random.Random(5)
    protected = {f"p{i}" for i in range(32)}
    population = [f"s{i}" for i in range(2000)]
    answers = [protected | set(rng.sample(population, 32)) for _ in range(20)]
    s = sample_of(answers)
    assert s.sure == protected and s.sampled
    seen = set().union(*answers) - protected
    assert abs(len(seen) * s.weight - 2000) / 2000 < 0.15
    small = [protected | {"s1", "s2"}, protected]
    everyone = frozenset(protected | {"s1", "s2"})
    assert sample_of(small) == WindowSample(everyone, everyone)  # nobody full: exact
    assert sample_of([]) == WindowSample(frozenset(), frozenset())


def test_estimated_replicas_add_the_peers_a_sample_implies_and_the_reader_does_not_know():
    kps = [create_new_key_pair() for _ in range(4)]
    recs = [record(kps[0], 0, 10), record(kps[1], 4, 12), record(kps[2], 8, 9), record(kps[3], 7, 9)]
    a, b, c, d = (r.peer_id for r in recs)
    # Window 1: a is sure; b and c were sampled, standing for 2 x 4 = 8 peers, of which the reader
    # knows b, c and d (d through window 0): 5 unknown, spread as b and c serve blocks 8-15.
    samples = {0: WindowSample(frozenset({a, b, d}), frozenset({a, b, d})),
               1: WindowSample(frozenset({a, b, c}), frozenset({a}), weight=4.0)}
    counts = estimate_replicas(recs, BLOCKS, samples)
    assert counts[0] == 1 and counts[4] == 2 and counts[7] == 3  # window 0: exact
    assert counts[8] == 4 + 5 and counts[10] == 1 + 2.5 and counts[12] == 0
    assert estimate_replicas(recs, BLOCKS, {})[8] == 4  # no samples: the peers known


def test_a_client_finds_peers_through_the_window_keys():
    async def scenario() -> None:
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as sentinel:
            boot = sentinel.full_addrs()
            async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=boot)) as peer, \
                    open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=boot, server=False)) as client:
                await peer.serve(Serving(MODEL, BLOCKS, 6, 17, fake_hashes(BLOCKS)[6:17], "bfloat16"))
                stored = sentinel.dht.value_store
                with trio.fail_after(20):
                    while not all(stored.records(window_key(MODEL, w).encode()) for w in (0, 1, 2)):
                        await trio.sleep(0.05)
                assert not stored.records(window_key(MODEL, 3).encode())
                cov = await client.coverage(MODEL, BLOCKS, fake_hashes(BLOCKS))
                assert list(cov.peers) == [peer.record.peer_id] and cov.replicas[6:17] == [1] * 11
                assert set(client.samples[MODEL]) == set(range(10))  # every window of the model was read

    trio.run(scenario)
