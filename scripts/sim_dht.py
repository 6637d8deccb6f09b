#!/usr/bin/env python
"""Discovery at 100, 1,000 and 10,000 peers, simulated with the project's own record code.

Every simulated peer serves a span of an 80-block model and is a DHT server. What runs is real:
- records: `records.sign`, `decode_set`, `merge`, `coverage`, `plan_route`, and the DHT nodes'
  stores are `dht.MergingValueStore` (merge on write, bounded admission), one per node near a key;
- routing: each node's routing table is py-libp2p's `RoutingTable` (its k-buckets and splitting),
  and every lookup is py-libp2p's own `PeerRouting.find_closest_peers_network` (rounds of ALPHA
  queries, BETA, stop when no closer peer comes), with only its one network call replaced
  (`_query_peer_for_closest`): the queried node answers from its own routing table after a
  simulated round trip, or a dial timeout when it has left.
What is simulated: the network (in memory, trio's MockClock: round trips 20-200 ms by distance
between random positions; a departed node costs a 5 s timeout), byte counts (the protobuf
messages py-libp2p would send, sized exactly, plus a fixed FRAMING estimate per request for
Noise/yamux/multistream and the sender's signed peer record), who is in a routing table (up to
k = 20 random live-or-departed peers per shared-prefix length, inserted through py-libp2p's
`add_peer`; remote tables do not learn from queries), and churn: 20% of peers leave per hour, so
routing tables hold DEAD_SHARE of departed peers, and a departed peer's record stays readable
until it expires (records are read a ttl after they were written at most).

Idealisations, which make the figures a best case for both layouts:
- writes go to an oracle's exact k closest live nodes (no lookup before a PUT, no missed node),
  so every node near a window key counts every writer (a real node misses some; readers take
  the median count);
- no node joins during a run (peers only leave);
- the reader is a copy of `windows.read_model` without the reader's own store as an answer and
  without the layout-1 blocks-key read (its `sample_of` and `estimate_replicas` are the real ones);
- the flood uses only records with valid hashes (all of one window); floods that coverage rejects
  are covered by tests/test_windows.py.

Layouts compared in one run, on the same peers and routing tables:
- layout 1: one key per model; DHT nodes sample overflowing values at random (the previous
  admission rule, reproduced in `RandomAdmission`), readers count what they see;
- layout 2: one key per window of 8 blocks; nodes keep the longest-held half and a keyed-hash
  sample, and count the owners they were sent; readers scale each window's samples by the
  nodes' median count (control/windows.py).

    python scripts/sim_dht.py                         # 100, 1,000, 10,000 peers
    python scripts/sim_dht.py --peers 100,1000 --clients 10
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402
from libp2p.kad_dht.common import ALPHA, BUCKET_SIZE  # noqa: E402
from libp2p.kad_dht.pb.kademlia_pb2 import Message, Record  # noqa: E402
from libp2p.kad_dht.peer_routing import PeerRouting  # noqa: E402
from libp2p.kad_dht.routing_table import RoutingTable, peer_id_to_key  # noqa: E402
from libp2p.peer.peerinfo import PeerInfo  # noqa: E402
from multiaddr import Multiaddr  # noqa: E402

import diffuse.control.records as records  # noqa: E402
from diffuse.control.coverage import coverage  # noqa: E402
from diffuse.control.dht import STRAGGLER_S, MergingValueStore  # noqa: E402
from diffuse.control.identity import peer_id as peer_id_of  # noqa: E402
from diffuse.control.routing import NoRoute, plan_route  # noqa: E402
from diffuse.control.windows import estimate_replicas, model_windows, sample_of  # noqa: E402

MODEL, BLOCKS = "sim-model", 80
SPAN = (4, 20)  # blocks a peer serves, uniform
QUANT_SHARE = 0.2  # peers serving the int8 variant (ext quant / variant, hashes of the variant)
HEARTBEAT_S, TTL_S, LOOKUP_EVERY = 15.0, 45.0, 10  # announce.py's defaults
K = BUCKET_SIZE
LEAVE_PER_HOUR = 0.2
DEAD_SHARE = LEAVE_PER_HOUR * 0.5  # routing-table entries last checked half an hour ago on average
LISTED_GONE = LEAVE_PER_HOUR / 3600 * (TTL_S - HEARTBEAT_S / 2)  # left, record still unexpired
DEAD_DIAL_S = 5.0  # dht.QUERY_TIMEOUT_S: what a query to a departed node costs
FRAMING = 300  # bytes per request/response pair beyond the protobufs (estimate, see the docstring)
HASHES = {"none": [hashlib.sha256(f"b{i}".encode()).hexdigest() for i in range(BLOCKS)],
          "int8": [hashlib.sha256(f"q{i}".encode()).hexdigest() for i in range(BLOCKS)]}
LEGACY, WINDOWS = "layout 1", "layout 2"


class RandomAdmission(MergingValueStore):
    """The previous admission rule (layout 1's nodes): longest-held half, then a fresh uniform
    random sample of the others at every overflow."""

    def _admit(self, key: bytes, codec, items: list) -> list:
        seen, now = self._first_seen.setdefault(key, {}), self.clock()
        for item in items:
            seen.setdefault(codec.owner(item), now)
        if len(items) > codec.capacity:
            ordered = sorted(items, key=lambda it: (seen[codec.owner(it)], codec.owner(it)))
            half = codec.capacity // 2
            items = ordered[:half] + self.rng.sample(ordered[half:], codec.capacity - half)
        held = {codec.owner(item) for item in items}
        for owner in [o for o in seen if o not in held]:
            del seen[owner]
        return items


class Host:
    """What py-libp2p's lookup asks of a host: who it is; nothing connected beyond the table."""

    class _Store:
        def peer_ids(self) -> list:
            return []

    def __init__(self, pid) -> None:
        self.pid = pid

    def get_id(self):
        return self.pid

    def get_connected_peers(self) -> list:
        return []

    def get_peerstore(self):
        return Host._Store()


@dataclass
class Cost:
    msgs: int = 0
    bytes: int = 0
    depth: dict = field(default_factory=dict)


class SimRouting(PeerRouting):
    """py-libp2p's peer routing whose single network call is answered in memory."""

    def __init__(self, swarm: "Swarm", me: int, table: RoutingTable, cost: Cost) -> None:
        super().__init__(Host(swarm.ids[me]), table)
        self.swarm, self.me, self.cost = swarm, me, cost

    async def _query_peer_for_closest(self, peer, target_key: bytes) -> list:
        sw, j = self.swarm, self.swarm.index[peer]
        self.cost.msgs += 1
        self.cost.bytes += FRAMING + sw.find_node_bytes(target_key, 0)
        if sw.dead[j]:
            await trio.sleep(DEAD_DIAL_S)
            self.routing_table.remove_peer(peer)
            return []
        closer = (await sw.table(j)).find_local_closest_peers(target_key, K)
        self.cost.bytes += sw.find_node_bytes(target_key, len(closer))
        d = self.cost.depth.get(peer, 0) + 1
        for p in closer:
            self.cost.depth.setdefault(p, d)
        await trio.sleep(sw.rtt(self.me, j))
        return closer


class Swarm:
    """N peers: identities, positions, spans, routing tables (built when first asked) and stores."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.n, self.rng = n, rng
        self.keys = [create_new_key_pair() for _ in range(n)]
        self.ids = [peer_id_of(kp) for kp in self.keys]
        self.index = {pid: i for i, pid in enumerate(self.ids)}
        self.infos = [PeerInfo(pid, [Multiaddr(f"/ip4/10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/tcp/4001")])
                      for i, pid in enumerate(self.ids)]
        self.pos = [int.from_bytes(peer_id_to_key(pid), "big") for pid in self.ids]
        self.top = np.array([p >> 192 for p in self.pos], dtype=np.uint64)
        self.loc = np.array([rng.random() for _ in range(n)])
        self.dead = np.array([rng.random() < DEAD_SHARE for _ in range(n)])
        self.listed_gone = {i for i in range(n) if not self.dead[i] and rng.random() < LISTED_GONE}
        self.spans = []
        for _ in range(n):
            length = rng.randint(*SPAN)
            start = rng.randint(0, BLOCKS - length)
            self.spans.append((start, start + length, "int8" if rng.random() < QUANT_SHARE else "none"))
        self.phase = [rng.uniform(0, HEARTBEAT_S) for _ in range(n)]
        self.tables: dict[int, RoutingTable] = {}
        self.stores: dict[str, dict[int, MergingValueStore]] = {}
        self.now = 0.0
        self._peer_bytes = len(_closer_msg(b"", self.infos[:1]).SerializeToString()) - len(
            _closer_msg(b"", []).SerializeToString())

    def rtt(self, a: int, b: int) -> float:
        return 0.020 + 0.180 * abs(float(self.loc[a] - self.loc[b]))

    def find_node_bytes(self, key: bytes, closer: int) -> int:
        return len(_closer_msg(key, []).SerializeToString()) + closer * self._peer_bytes

    async def table(self, i: int) -> RoutingTable:
        """Node i's py-libp2p routing table: up to k random others per shared-prefix length."""
        if i not in self.tables:
            table = RoutingTable(self.ids[i], Host(self.ids[i]))
            xor = self.top ^ self.top[i]
            cpl = np.full(self.n, 64)
            nz = xor != 0
            cpl[nz] = 63 - np.floor(np.log2(xor[nz].astype(np.float64))).astype(int)
            for c in np.unique(cpl):
                members = [int(j) for j in np.flatnonzero(cpl == c) if j != i]
                for j in self.rng.sample(members, min(K, len(members))):
                    await table.add_peer(self.infos[j], skip_server_mode_check=True)
            self.tables[i] = table
        return self.tables[i]

    def closest_live(self, key: str) -> list[int]:
        """Where a key's value lives: the k closest nodes that are up (what a converged lookup of an
        announcing peer finds once timeouts have dropped the departed)."""
        target = int.from_bytes(hashlib.sha256(key.encode()).digest(), "big")
        order = sorted((p ^ target, i) for i, p in enumerate(self.pos) if not self.dead[i])
        return [i for _, i in order[:K]]


def _closer_msg(key: bytes, infos) -> Message:
    msg = Message(type=Message.MessageType.FIND_NODE, key=key)
    for info in infos:
        peer = msg.closerPeers.add()
        peer.id = info.peer_id.to_bytes()
        peer.addrs.extend(a.to_bytes() for a in info.addrs)
    return msg


def _value_msg(kind, key: str, value: bytes) -> int:
    return len(Message(type=kind, key=key.encode(), record=Record(key=key.encode(), value=value)).SerializeToString())


# ---- announcing: records written to the nodes near each key ----

def layout_keys(layout: str, start: int, end: int) -> list[str]:
    if layout == LEGACY:
        return [records.blocks_key(MODEL)]
    return [records.window_key(MODEL, w) for w in records.windows_of(start, end)]


def signed(sw: Swarm, i: int, ts: float, span=None, key_pair=None) -> records.SignedRecord:
    start, end, quant = span or sw.spans[i]
    extra = {"quant": quant, "variant": "ab" * 32} if quant != "none" else {}
    kp = key_pair or sw.keys[i]
    rec = records.PeerRecord(
        peer_id=peer_id_of(kp).to_base58(), model=MODEL, num_blocks=BLOCKS, start=start, end=end,
        block_hashes=tuple(HASHES[quant][start:end]), dtype="bfloat16", throughput=20.0, cache_tokens=8192,
        addrs=(str(sw.infos[i % sw.n].addrs[0]),), timestamp=ts, expires=ts + TTL_S, started=ts - 600.0, extra=extra)
    return records.sign(rec, kp)


def store_at(sw: Swarm, layout: str, key: str, node: int) -> MergingValueStore:
    stores = sw.stores.setdefault(key, {})
    if node not in stores:
        kind = RandomAdmission if layout == LEGACY else MergingValueStore
        stores[node] = kind(None, None, records.SetCodecs(), clock=lambda: sw.now, rng=random.Random(node * 7919 + 1))
    return stores[node]


def announce_round(sw: Swarm, t0: float, writers: list[tuple[float, int, records.SignedRecord]]) -> None:
    """Every writer's record stored, in time order, at the live k closest nodes of its keys."""
    targets: dict[str, list[int]] = {}
    for ts, _, sr in sorted(writers, key=lambda w: w[0]):
        sw.now = ts
        for layout in (LEGACY, WINDOWS):
            for key in layout_keys(layout, sr.record.start, sr.record.end):
                kb, value = key.encode(), records.encode_set([sr])
                if key not in targets:
                    targets[key] = sw.closest_live(key)
                for node in targets[key]:
                    store_at(sw, layout, key, node).put_record(kb, Record(key=kb, value=value))


def honest_writers(sw: Swarm, t: float) -> list:
    return [(t + sw.phase[i], i, signed(sw, i, t + sw.phase[i])) for i in range(sw.n) if not sw.dead[i]]


# ---- reading: a client's lookups and GETs ----

@dataclass
class Lookup:
    hops: int
    msgs: int
    bytes: int
    secs: float


async def read_key(sw: Swarm, client: int, layout: str, key: str, out: list) -> list[tuple[list, int | None]]:
    """py-libp2p's lookup of `key` from `client`, then GET_VALUE at the k closest (ALPHA at a time),
    waiting for the last nodes once most answered as `dht.fetch_answers` does (STRAGGLER_S)."""
    cost, t0 = Cost(), trio.current_time()
    routing = SimRouting(sw, client, await sw.table(client), cost)
    closest = await routing.find_closest_peers_network(key.encode())
    answers: list[tuple[list, int | None]] = []
    limit = trio.CapacityLimiter(ALPHA)
    began, done, most = trio.current_time(), 0, trio.Event()

    async def get(peer) -> None:
        nonlocal done
        async with limit:
            j = sw.index[peer]
            cost.msgs += 1
            if sw.dead[j]:
                await trio.sleep(DEAD_DIAL_S)
            else:
                held = sw.stores.get(key, {}).get(j)
                rec = held.get(key.encode()) if held is not None else None
                value = rec.value if rec is not None else b""
                cost.bytes += FRAMING + _value_msg(Message.MessageType.GET_VALUE, key, b"") + _value_msg(
                    Message.MessageType.GET_VALUE, key, value)
                await trio.sleep(sw.rtt(client, j))
                if value:
                    items = records.decode_set(value, key, now=sw.now, strict=False)
                    answers.append((items, records.value_count(value)))
        done += 1
        if 2 * done > len(closest):
            most.set()

    async with trio.open_nursery() as nursery:
        for peer in closest:
            nursery.start_soon(get, peer)
        if closest:
            await most.wait()
            await trio.sleep(max(STRAGGLER_S, trio.current_time() - began))
        nursery.cancel_scope.cancel()
    hops = cost.depth.get(closest[0], 0) if closest else 0
    out.append(Lookup(hops, cost.msgs, cost.bytes, trio.current_time() - t0))
    return answers


async def read_model(sw: Swarm, client: int, layout: str, out: list) -> tuple[list, dict, float, int]:
    """Layout 1: the model's key. Layout 2: every window key, 4 at a time (windows.READS_AT_ONCE)."""
    t0, before = trio.current_time(), len(out)
    keys = layout_keys(layout, 0, BLOCKS)
    answers: dict[str, list[tuple[list, int | None]]] = {}
    limit = trio.CapacityLimiter(4)

    async def one(key: str) -> None:
        async with limit:
            answers[key] = await read_key(sw, client, layout, key, out)

    async with trio.open_nursery() as nursery:
        for key in keys:
            nursery.start_soon(one, key)
    found = records.merge([r for a in answers.values() for ans, _ in a for r in ans], sw.now)
    samples = ({w: sample_of([([r.peer_id for r in ans], n) for ans, n in answers[records.window_key(MODEL, w)]])
                for w in model_windows(BLOCKS)} if layout == WINDOWS else {})
    return found, samples, trio.current_time() - t0, sum(lk.bytes for lk in out[before:])


# ---- what a client's view gets right ----

def judged(sw: Swarm, found: list) -> dict:
    return coverage([s.record for s in found], MODEL, BLOCKS, expected_hashes=HASHES["none"], now=sw.now,
                    variants=HASHES).peers


def counts(view: dict, layout: str, samples: dict) -> list[float]:
    if layout == WINDOWS:
        return estimate_replicas(view.values(), BLOCKS, samples)
    return [float(sum(r.serves(b) for r in view.values())) for b in range(BLOCKS)]


def truth(sw: Swarm, extra_spans=()) -> list[int]:
    spans = [sw.spans[i] for i in range(sw.n) if not sw.dead[i] and i not in sw.listed_gone] + list(extra_spans)
    return [sum(s <= b < e for s, e, _ in spans) for b in range(BLOCKS)]


def route_gone(sw: Swarm, view: dict) -> tuple[int, int]:
    """(1, 0) when a route exists and its hops are all up, (1, 1) when one of them has left, (0, 0)
    when the view holds no route at all."""
    gone = {sw.ids[i].to_base58() for i in sw.listed_gone}
    try:
        hops = plan_route(view.values(), 0, BLOCKS, now=sw.now)
    except NoRoute:
        return 0, 0
    return 1, int(any(h.peer_id in gone for h in hops))


# ---- one swarm size ----

async def announce_cost(sw: Swarm, layout: str, sample: list[int], with_legacy: bool) -> float:
    """Bytes per peer per minute: each heartbeat, a PUT of its record to the k closest of each key
    (its peer key, and its layout's keys), and every LOOKUP_EVERY heartbeats a lookup per key."""
    per_min = []
    for i in sample:
        sr = signed(sw, i, sw.now)
        keys = [records.peer_key(sr.peer_id), *layout_keys(layout, sr.record.start, sr.record.end)]
        if with_legacy and layout == WINDOWS:
            keys.append(records.blocks_key(MODEL))
        beat = 0.0
        for key in keys:
            cost = Cost()
            await SimRouting(sw, i, await sw.table(i), cost).find_closest_peers_network(key.encode())
            put = 2 * _value_msg(Message.MessageType.PUT_VALUE, key, records.encode_set([sr])) + FRAMING
            beat += K * put + (cost.bytes / LOOKUP_EVERY)
        per_min.append(beat * 60.0 / HEARTBEAT_S)
    return statistics.median(per_min)


async def measure(n: int, clients: int, hostile: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    t_build = time.perf_counter()
    sw = Swarm(n, rng)
    for r in range(2):  # two heartbeats: nodes have held everyone once and seen a refresh
        announce_round(sw, 1_700_000_000.0 + r * HEARTBEAT_S, honest_writers(sw, 1_700_000_000.0 + r * HEARTBEAT_S))
    sw.now = 1_700_000_000.0 + 2 * HEARTBEAT_S
    live = [i for i in range(n) if not sw.dead[i]]
    who = rng.sample(live, min(clients, len(live)))
    rows = []
    for layout in (LEGACY, WINDOWS):
        rows.append(await client_views(sw, layout, who, truth(sw)))
        sample = rng.sample(live, min(8, len(live)))
        rows[-1]["announce_B_min"] = await announce_cost(sw, layout, sample, with_legacy=False)
        if layout == WINDOWS:
            rows[-1]["announce_B_min_transition"] = await announce_cost(sw, layout, sample, with_legacy=True)
    if hostile:
        await flood(sw, rng, hostile, who, rows)
    for row in rows:
        row.update(peers=n, setup_s=round(time.perf_counter() - t_build, 1))
    return rows


async def client_views(sw: Swarm, layout: str, who: list[int], true: list[int], flooded=frozenset()) -> dict:
    lookups: list[Lookup] = []
    reads, right, routes, gone, hidden, stale = [], [], 0, 0, 0, []
    left = {sw.ids[i].to_base58() for i in sw.listed_gone}
    for c in who:
        found, samples, secs, nbytes = await read_model(sw, c, layout, lookups)
        reads.append((secs, nbytes))
        view = judged(sw, found)
        stale.append(len(left & set(view)) / max(1, len(view)))
        est = counts(view, layout, samples)
        right.append(sum(abs(e - t) <= 0.1 * t for e, t in zip(est, true)) / BLOCKS)
        honest = [sum(r.serves(b) for p, r in view.items() if p not in flooded) for b in range(BLOCKS)]
        hidden += sum(1 for b in range(BLOCKS) if honest[b] == 0 and true[b] > 0)
        a, g = route_gone(sw, {p: r for p, r in view.items() if p not in flooded})
        routes, gone = routes + a, gone + g
    return {"layout": layout, "noroute": 1 - routes / len(who), **_quantiles("hops", [lk.hops for lk in lookups]),
            **_quantiles("msgs", [lk.msgs for lk in lookups]), **_quantiles("KB", [lk.bytes / 1024 for lk in lookups]),
            **_quantiles("s", [lk.secs for lk in lookups]), "read_s": statistics.median(s for s, _ in reads),
            "read_KB": statistics.median(b for _, b in reads) / 1024, "right": statistics.mean(right),
            "gone": gone / max(1, routes), "stale": statistics.mean(stale), "hidden": hidden / len(who)}


def _quantiles(name: str, xs: list[float]) -> dict:
    xs = sorted(xs)
    return {f"{name}_p50": xs[len(xs) // 2], f"{name}_p90": xs[min(len(xs) - 1, int(len(xs) * 0.9))]}


async def flood(sw: Swarm, rng: random.Random, hostile: int, who: list[int], rows: list[dict]) -> None:
    """`hostile` valid records from throwaway keys, all claiming spans inside one window (blocks
    32-39: the worst case for that window; under layout 1 they share the model's one key), written
    over one heartbeat among the honest peers' refreshes; then the clients read again."""
    t = sw.now
    keys = [create_new_key_pair() for _ in range(hostile)]
    spans = []
    writers = honest_writers(sw, t)
    for kp in keys:
        s = rng.randint(32, 38)
        span = (s, rng.randint(s + 1, 40), "none")
        spans.append(span)
        ts = t + rng.uniform(0, HEARTBEAT_S)
        writers.append((ts, -1, signed(sw, rng.randrange(sw.n), ts, span, kp)))
    announce_round(sw, t, writers)
    sw.now = t + HEARTBEAT_S
    flooded = frozenset(peer_id_of(kp).to_base58() for kp in keys)
    for row in list(rows):
        got = await client_views(sw, row["layout"], who[: max(3, len(who) // 2)], truth(sw, spans), flooded)
        row.update({f"flood_{k}": v for k, v in got.items() if k in ("right", "hidden", "gone", "noroute")})


def table(rows: list[dict]) -> str:
    head = (f"{'peers':>6} {'layout':<9} {'hops p50/p90':>12} {'msgs p50/p90':>13} {'KB p50/p90':>13} "
            f"{'time s p50/p90':>14} {'read KB':>8} {'read s':>7} {'announce B/min':>15} {'right':>6} "
            f"{'stale':>6} {'gone':>6} {'noroute':>7} | flood: {'right':>6} {'hidden':>6} {'gone':>6} {'noroute':>7}")
    lines = [head]
    for r in rows:
        ann = f"{r['announce_B_min']:.0f}" + (f" ({r['announce_B_min_transition']:.0f})"
                                               if "announce_B_min_transition" in r else "")
        lines.append(
            f"{r['peers']:>6} {r['layout']:<9} {r['hops_p50']:>5}/{r['hops_p90']:<6} "
            f"{r['msgs_p50']:>6}/{r['msgs_p90']:<6} "
            f"{r['KB_p50']:>6.0f}/{r['KB_p90']:<6.0f} {r['s_p50']:>6.2f}/{r['s_p90']:<7.2f} {r['read_KB']:>8.0f} "
            f"{r['read_s']:>7.2f} {ann:>15} {r['right']:>6.0%} {r['stale']:>6.2%} {r['gone']:>6.1%} "
            f"{r['noroute']:>7.0%} | {'':>6} "
            f"{r.get('flood_right', float('nan')):>6.0%} {r.get('flood_hidden', float('nan')):>6.1f} "
            f"{r.get('flood_gone', float('nan')):>6.1%} {r.get('flood_noroute', float('nan')):>7.0%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default="100,1000,10000", help="comma-separated swarm sizes")
    ap.add_argument("--clients", type=int, default=10, help="clients reading the model per size")
    ap.add_argument("--hostile", type=int, default=1000, help="valid hostile records in the flood (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    records.verify = functools.lru_cache(maxsize=None)(records.verify)  # deterministic: one check per record
    rows: list[dict] = []
    t0 = time.perf_counter()
    for n in (int(x) for x in args.peers.split(",")):
        clock = trio.testing.MockClock(autojump_threshold=0)  # simulated time: it moves when every task waits
        rows += trio.run(measure, n, args.clients, args.hostile, args.seed, clock=clock)
        print(f"# {n} peers done after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    print(f"# wall {time.perf_counter() - t0:.0f} s; per lookup: FIND_NODE rounds to the closest node (hops), "
          "FIND_NODE + GET_VALUE messages, bytes, simulated time; read: a client's whole model read; announce: "
          "median peer, in parentheses while it also writes layout 1's key; right: blocks whose replica count is "
          "within 10% of the truth; stale: peers in view that have left; "
          "gone: routes through a peer that has left; noroute: clients whose view "
          "holds no route; hidden: blocks with no honest peer in view, per client", file=sys.stderr)


if __name__ == "__main__":
    main()
