"""Layout 2: one DHT key per window of blocks, bounded per node, sampled so readers can estimate.

- A record is accepted only under the windows its span touches (and nowhere else by a window).
- A node's overflowing value keeps its longest-held half and a sample ranked by its own keyed
  hash: stable across refreshes, independent between nodes.
- Readers estimate a window's population from the nodes' samples (capture-recapture).
- Two real nodes on loopback: an announced peer is found through its window keys.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from control_helpers import fake_hashes
from diffuse.control import announce
from diffuse.control import dht as dht_module
from diffuse.control.announce import Serving
from diffuse.control.dht import RANK_EPOCH_S, MergingValueStore
from diffuse.control.identity import peer_id
from diffuse.control.node import Node, NodeConfig, open_node
from diffuse.control.records import (
    MAX_SET_RECORDS, InvalidRecord, PeerRecord, SetCodecs, check_key, decode_set, encode_set, sign, value_count,
    window_key, windows_of, withdrawn,
)
from diffuse.control.coverage import coverage
from diffuse.control.windows import WindowSample, estimate_replicas, sample_of, with_estimates

MODEL, BLOCKS = "win-model", 80
LISTEN = ["/ip4/127.0.0.1/tcp/0"]


def record(kp, start: int, end: int, now: float | None = None) -> PeerRecord:
    now = time.time() if now is None else now
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


def test_readers_scale_a_windows_samples_by_the_nodes_median_count():
    rng = random.Random(5)
    protected = {f"p{i}" for i in range(32)}
    population = [f"s{i}" for i in range(2000)]
    answers = [(protected | set(rng.sample(population, 32)), 2032 + rng.randint(-20, 20)) for _ in range(20)]
    s = sample_of(answers)
    assert s.sure == protected and s.sampled
    seen = set().union(*(a for a, _ in answers)) - protected
    assert abs(len(seen) * s.weight - 2000) <= 20
    liars = [(a, 10**6) for a, _ in answers[:9]] + answers[9:]  # a minority inflating its count
    assert abs(len(seen) * sample_of(liars).weight - 2000) <= 20
    silent = [(a, None) for a, _ in answers]  # full nodes that count nothing: no estimate
    assert not sample_of(silent).sampled
    small = [(protected | {"s1", "s2"}, 34), (protected, 32)]
    everyone = frozenset(protected | {"s1", "s2"})
    assert sample_of(small) == WindowSample(everyone, everyone)  # nobody full: exact
    assert sample_of([]) == WindowSample(frozenset(), frozenset())


def test_a_node_counts_the_owners_it_was_sent_kept_or_not():
    key, kb = window_key(MODEL, 0), window_key(MODEL, 0).encode()
    now = [time.time()]
    store = MergingValueStore(None, None, SetCodecs(), clock=lambda: now[0], rng=random.Random(1))
    keys = [create_new_key_pair() for _ in range(200)]
    for kp in keys:
        store.put_record(kb, Record(key=kb, value=encode_set([sign(record(kp, 0, 8, now[0]), kp)])))
    value = store.get(kb).value
    assert value_count(value) == 200 and len(decode_set(value, key)) == MAX_SET_RECORDS
    gone = sign(withdrawn(record(keys[0], 0, 8, now[0]), now[0] + 1, 60), keys[0])
    store.put_record(kb, Record(key=kb, value=encode_set([gone])))
    now[0] += 2  # past the once-a-second recount
    store.put_record(kb, Record(key=kb, value=encode_set([sign(record(keys[1], 0, 8, now[0]), keys[1])])))
    assert value_count(store.get(kb).value) == 199  # a tombstone is no longer counted
    now[0] += 59  # every record has expired but keys[1]'s refresh
    store.put_record(kb, Record(key=kb, value=encode_set([sign(record(keys[2], 0, 8, now[0]), keys[2])])))
    assert value_count(store.get(kb).value) == 2
    assert value_count(encode_set([sign(record(keys[3], 0, 8), keys[3])])) is None  # a peer's PUT: no count


def test_estimated_replicas_add_the_valid_peers_a_sample_implies_and_the_reader_does_not_know():
    recs = [record(create_new_key_pair(), s, e) for s, e in [(0, 10), (7, 9), *[(8, 12)] * 8]]
    a, d, *s = (r.peer_id for r in recs)
    bad = [f"x{i}" for i in range(8)]  # sampled owners whose records coverage rejected
    # Window 1: a is sure; 16 sampled owners stand for 4 x 16 peers, of which half are valid
    # (the 8 `s`): 32 valid, of which the reader knows the 8 and d (through window 0): 23
    # unknown, spread as the `s` serve blocks 8-11.
    samples = {0: WindowSample(frozenset({a, d}), frozenset({a, d})),
               1: WindowSample(frozenset({a, *s, *bad}), frozenset({a}), weight=4.0)}
    counts = estimate_replicas(recs, BLOCKS, samples)
    assert counts[0] == 1 and counts[7] == 2  # window 0: exact
    assert counts[8] == 10 + 23 and counts[11] == 8 + 23 and counts[12] == 0
    assert estimate_replicas(recs, BLOCKS, {})[8] == 10  # no samples: the peers known
    few = {1: WindowSample(frozenset({a, *s[:7], *bad}), frozenset({a}), weight=4.0)}
    assert estimate_replicas(recs, BLOCKS, few)[8] == 10  # too few valid sampled peers: no estimate


def test_a_flood_of_records_with_wrong_hashes_inflates_no_estimate():
    kb = window_key(MODEL, 0).encode()
    honest = [create_new_key_pair() for _ in range(21)]
    valid = [sign(dataclasses.replace(record(kp, 0, 8), extra={}), kp) for kp in honest]  # bf16: hashes checked
    wrong = ["0" * 64] * 8
    flood = []
    for _ in range(1000):
        kp = create_new_key_pair()
        flood.append(sign(dataclasses.replace(record(kp, 0, 8), block_hashes=tuple(wrong), extra={}), kp))
    stores = [MergingValueStore(None, None, SetCodecs(), rng=random.Random(seed)) for seed in range(20)]
    answers = []
    for store in stores:  # the flood came first: the honest peers are only in the nodes' samples
        for i in range(0, len(flood), 50):
            store.put_record(kb, Record(key=kb, value=encode_set(flood[i:i + 50])))
        store.put_record(kb, Record(key=kb, value=encode_set(valid)))
        items, count = store.answer(kb)
        answers.append(([sr.record for sr in items], count))
    s = sample_of([([r.peer_id for r in a], n) for a, n in answers])
    cov = coverage([r for a, _ in answers for r in a], MODEL, BLOCKS, expected_hashes=fake_hashes(BLOCKS))
    assert 0 < len(cov.peers) <= 21 and s.sampled
    # Only the valid share of the sample is scaled up: near the 21, not the flood's thousand.
    assert all(len(cov.peers) <= c <= 2 * 21 for c in with_estimates(cov, {0: s}).counts[:8])


def test_one_partial_answer_does_not_collapse_the_estimate():
    rng = random.Random(5)
    protected = {f"p{i}" for i in range(32)}
    population = [f"s{i}" for i in range(2000)]
    answers = [(protected | set(rng.sample(population, 32)), 2032) for _ in range(20)]
    for partial in ({"me"}, set(population[:10])):  # a far node's own record; a node not yet full
        s = sample_of([(partial, len(partial)), *answers])
        assert s.sure == protected and s.sampled
        assert abs(len(s.seen - s.sure) * s.weight - 2000) <= 1
    low = [(a, 3) for a, _ in answers]  # counts below what the nodes hold are no counts
    assert not sample_of(low).sampled


@asynccontextmanager
async def _swarm(servers: int = 1) -> AsyncIterator[tuple[Node, list[Node], Node]]:
    """A sentinel, `servers` DHT server nodes of which the first serves blocks 6-16, and a client."""
    async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as sentinel:
        boot = sentinel.full_addrs()
        async with AsyncExitStack() as stack:
            nodes = [await stack.enter_async_context(open_node(create_new_key_pair(), NodeConfig(
                listen=LISTEN, bootstrap=boot, server=i < servers))) for i in range(servers + 1)]
            await nodes[0].serve(Serving(MODEL, BLOCKS, 6, 17, fake_hashes(BLOCKS)[6:17], "bfloat16"))
            yield sentinel, nodes[:-1], nodes[-1]


def test_a_client_finds_peers_through_the_window_keys():
    async def scenario() -> None:
        async with _swarm() as (sentinel, (peer,), client):
            stored = sentinel.dht.value_store
            with trio.fail_after(20):
                while not all(stored.records(window_key(MODEL, w).encode()) for w in (0, 1, 2)):
                    await trio.sleep(0.05)
            assert not stored.records(window_key(MODEL, 3).encode())
            cov = await client.coverage(MODEL, BLOCKS, fake_hashes(BLOCKS))
            assert list(cov.peers) == [peer.record.peer_id] and cov.replicas[6:17] == [1] * 11
            samples = client.samples[MODEL]
            assert set(samples) == set(range(10))  # every window of the model was read
            assert [set(samples[w].seen) for w in range(10)] == [{peer.record.peer_id}] * 3 + [set()] * 7

    trio.run(scenario)


def test_throwaway_records_stating_a_small_block_count_hide_no_window(monkeypatch):
    """A reader that does not know the block count reads up to the largest one stated: a majority
    of records in window 0 claiming 8 blocks cannot stop it reading windows 1-9."""
    monkeypatch.setattr(announce, "WRITE_LAYOUT_1", False)  # window keys alone

    async def scenario() -> None:
        async with _swarm() as (sentinel, (peer,), client):
            store = sentinel.dht.value_store
            far = create_new_key_pair()
            for w in (6, 7):
                _fill(store, window_key(MODEL, w), [sign(record(far, 50, 60), far)])
            fakes = [create_new_key_pair() for _ in range(40)]
            _fill(store, window_key(MODEL, 0),
                  [sign(dataclasses.replace(record(kp, 0, 8), num_blocks=8), kp) for kp in fakes])
            with trio.fail_after(20):
                while peer.record.peer_id not in {sr.peer_id for sr in decode_set(
                        store.get(window_key(MODEL, 0).encode()).value, window_key(MODEL, 0))}:
                    await trio.sleep(0.05)
            found = {r.peer_id for r in await client.records(MODEL)}
            assert {peer.record.peer_id, peer_id(far).to_base58()} <= found

    trio.run(scenario)


def _announcer(monkeypatch, closest, store_set) -> announce.Announcer:
    """An announcer of blocks 6-16 whose lookups and stores are `closest` and `store_set`."""
    monkeypatch.setattr(announce, "closest", closest)
    monkeypatch.setattr(announce, "store_set", store_set)
    kp = create_new_key_pair()
    return announce.Announcer(None, kp, Serving(MODEL, BLOCKS, 6, 17, fake_hashes(BLOCKS)[6:17], "bfloat16"),
                              lambda: ["/ip4/10.0.0.1/tcp/4001"])


def test_nodes_refusing_window_keys_cause_no_lookups_and_no_rebootstrap(monkeypatch):
    """Nodes of layout 1 refuse window keys but answer: not churn (no lookup every beat), and
    the peer key, which they accept, is what says whether the DHT is reached at all."""
    lookups: list[str] = []

    async def closest(dht, key):
        lookups.append(key)
        return ["n1", "n2", "n3"]

    async def store_set(dht, key, records, targets):
        return (0, []) if key.startswith("/diffuse/window/") else (len(targets), [])

    a = _announcer(monkeypatch, closest, store_set)

    async def beats() -> list[int]:
        return [await a.publish() for _ in range(5)]

    assert trio.run(beats) == [3] * 5  # on_lonely (re-bootstrap) runs only on 0
    assert len(lookups) == len(set(lookups))  # each key looked up once, not every beat


def test_a_nodes_sample_is_drawn_again_each_epoch():
    """A peer left out of a node's sample while a flood lasts draws again the next hour."""
    key = window_key(MODEL, 0)
    now = [(time.time() // RANK_EPOCH_S + 1) * RANK_EPOCH_S - 10.0]  # 10 s before the next hour
    store = MergingValueStore(None, None, SetCodecs(), clock=lambda: now[0])
    keys = [create_new_key_pair() for _ in range(200)]

    def beat() -> set[str]:
        kb = key.encode()
        for kp in keys:
            store.put_record(kb, Record(key=kb, value=encode_set([sign(record(kp, 0, 8, now[0]), kp)])))
        return {sr.peer_id for sr in store.records(kb)}

    held = beat()
    now[0] += 5
    assert beat() == held  # same hour: stable
    now[0] += 10
    again = beat()
    # One clock reading for the whole first beat: the longest-held half is the lowest owners.
    early = set(sorted(peer_id(kp).to_base58() for kp in keys)[:MAX_SET_RECORDS // 2])
    assert early <= again and again != held  # the longest-held half stays, the sample is redrawn
    assert store.secret != MergingValueStore(None, None, SetCodecs()).secret


def test_a_silent_node_is_dropped_until_the_next_lookup(monkeypatch):
    """A node that stops answering (frozen, gone) is left out of the next beats' stores instead of
    costing a lookup and a store timeout every beat; a lookup comes once half the nodes went silent."""
    lookups: list[str] = []
    asked: list[list[str]] = []
    silent: set[str] = set()

    async def closest(dht, key):
        lookups.append(key)
        return ["n1", "n2", "n3", "n4"]

    async def store_set(dht, key, records, targets):
        if key.startswith("/diffuse/peer/"):
            asked.append(list(targets))
        return len([t for t in targets if t not in silent]), [t for t in targets if t in silent]

    a = _announcer(monkeypatch, closest, store_set)

    async def beat(*gone: str) -> None:
        silent.update(gone)
        await a.publish()

    async def beats() -> None:
        await beat()
        await beat("n2")  # n2 freezes: this beat waits for it, the next ones do not ask it
        await beat()
        await beat("n3")  # two of four left: still enough
        await beat()
        await beat("n4")  # one of four: look the key up again
        await beat()

    trio.run(beats)
    assert asked == [["n1", "n2", "n3", "n4"]] * 2 + [["n1", "n3", "n4"]] * 2 + [["n1", "n4"]] * 2 + [
        ["n1", "n2", "n3", "n4"]]
    keys = set(lookups)
    assert len(lookups) == 2 * len(keys)  # each key: looked up at the first beat and after the last


def test_one_frozen_node_does_not_hold_a_read_to_the_timeout(monkeypatch):
    """A node that accepts a GET and never answers: once most nodes answered, the read waits for
    it only about as long as they took, not `QUERY_TIMEOUT_S` (set here past the test's limit)."""
    monkeypatch.setattr(dht_module, "QUERY_TIMEOUT_S", 3600.0)

    async def scenario() -> None:
        async with _swarm(servers=2) as (sentinel, (peer, other), client):
            key = window_key(MODEL, 1)
            with trio.fail_after(20):
                while not (sentinel.dht.value_store.records(key.encode())
                           and other.dht.value_store.records(key.encode())):
                    await trio.sleep(0.05)
            frozen = other.host.get_id()
            get = client.dht.value_store._get_from_peer

            async def stalls(peer_id, *args, **kwargs):
                if peer_id == frozen:
                    await trio.sleep_forever()
                return await get(peer_id, *args, **kwargs)

            monkeypatch.setattr(client.dht.value_store, "_get_from_peer", stalls)
            with trio.fail_after(60):
                answers = await dht_module.fetch_answers(client.dht, key)
            held = [a.items for a in answers if a.items]  # the client's own store is empty
            assert len(held) == 2  # the sentinel's and the serving peer's, not the frozen node's
            assert all({sr.peer_id for sr in a} == {peer.record.peer_id} for a in held)

    trio.run(scenario)
