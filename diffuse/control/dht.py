"""The Kademlia DHT of py-libp2p 0.8.1, adapted to hold *sets* of signed peer records.

py-libp2p keeps ONE value per key and answers reads from the local store first. Diffuse needs
many peers under one key (everyone serving blocks of a model) and fresh values. So:

- `MergingValueStore` replaces the DHT's value store: a PUT under /diffuse/ is merged into what
  the node holds (latest record per peer wins, expired records dropped) instead of replacing
  it. Served values are pruned of expired records on every read.
- `put_set` stores our records locally and at the k closest nodes, sending only our own
  records (never the whole merged set we happen to hold).
- `fetch_set` asks the k closest nodes *and* the local store and merges every answer, so a
  stale local copy can never hide newer remote records (trap 6 of the notes).

Provider records were rejected: 0.8.1 caps them at 20 per key, keeps dead ones 48 h, ignores
newcomers once full, and rate-limits ADD_PROVIDER to 10 per 10 s per sender (a peer serving 15
blocks could not even announce them all). See protocols/dht-records.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.common import ALPHA, BUCKET_SIZE, format_time_rfc3339
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.kad_dht.value_store import ValueStore
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from diffuse.control.pnet import NO_HANDSHAKE, dial_failure, speaks_first
from diffuse.control.records import (
    MAX_COUNTED,
    NAMESPACE,
    WINDOW_PREFIX,
    RecordValidator,
    SetCodec,
    SetCodecs,
    SignedRecord,
    value_count,
)
from diffuse.errors import DiffuseError

log = logging.getLogger(__name__)

RANK_EPOCH_S = 3600.0  # how long a node's sample ranks its owners alike (MergingValueStore.rank)
QUERY_TIMEOUT_S = 5.0  # per remote GET/PUT; a dead peer on a LAN fails faster than this
STRAGGLER_S = 1.0  # least time a read waits for the last nodes once most answered (fetch_answers)
PREFIX = f"/{NAMESPACE}/".encode()


class BootstrapError(DiffuseError):
    """None of the bootstrap peers could be reached. `refused`: some answered but the handshake
    failed (another swarm key or mode), which is not the same as no swarm being there."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class MergingValueStore(ValueStore):
    """A value store whose /diffuse/ values are record sets merged on write, pruned on read.

    A value holds at most its codec's `capacity` items, so a flood of valid records from
    throwaway identities cannot grow it past what readers can fetch. When a merge overflows, the
    half of the items this node has held longest (by its own clock, not by any claim in the
    records) stay, and the rest are the others whose owners rank first under a hash keyed by this
    node's secret: peers that were here before a flood keep their place in every node's copy, and
    the other half is a uniform sample that a refresh does not reshuffle within the hour and that
    no one can aim at, drawn independently on each node, so readers can estimate what the nodes did not keep
    (see "Flooding" and "Layout 2" in protocols/dht-records.md).

    Under a window key the node also counts the owners whose unexpired records it has been sent,
    kept or not, and puts that count first in the value it serves: readers scale the samples by
    it (control/windows.py) instead of guessing the population from how the samples overlap.

    Parsed sets are cached next to the raw value (keyed by its bytes), so a heartbeat PUT costs
    one signature check for the new record, not one per record already held.
    """

    def __init__(self, host: IHost, local_peer_id: ID, codecs: SetCodecs, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        super().__init__(host=host, local_peer_id=local_peer_id)
        self.codecs, self.clock, self.rng = codecs, clock, rng or random.Random()
        # Keys this node's sample (`rank`): unguessable, unless a seeded `rng` (a simulation) asks otherwise.
        self.secret = rng.randbytes(16) if rng is not None else secrets.token_bytes(16)
        self._parsed: dict[bytes, tuple[bytes, list]] = {}
        self._first_seen: dict[bytes, dict[str, float]] = {}  # key -> owner -> when this node first held it
        self._owners: dict[bytes, dict[str, tuple]] = {}  # window key -> owner -> (order, expires, online)
        self._online: dict[bytes, int] = {}  # window key -> owners whose latest record is online
        self._swept: dict[bytes, float] = {}  # window key -> when expired owners were last dropped

    def records(self, key: bytes) -> list:
        entry = self.store.get(key)
        if entry is None:
            self._parsed.pop(key, None)
            return []
        raw = entry[0].value
        cached = self._parsed.get(key)
        if cached is not None and cached[0] == raw:
            return cached[1]
        try:
            k = key.decode()
            recs = self.codecs.for_key(k).decode(raw, k, now=self.clock(), strict=False)
        except (*self.codecs.invalid, UnicodeDecodeError):
            recs = []
        self._parsed[key] = (raw, recs)
        return recs

    def put_record(self, key: bytes, record: Record) -> None:
        if not key.startswith(PREFIX):
            return super().put_record(key, record)
        try:
            k = key.decode()
            codec = self.codecs.for_key(k)
            new = codec.decode(record.value, k, now=self.clock(), strict=False)
        except (*self.codecs.invalid, UnicodeDecodeError):
            return
        if k.startswith(WINDOW_PREFIX):
            self._count(key, new)
        self._set(key, self._admit(key, codec, codec.merge(self.records(key) + new, self.clock())))

    def _count(self, key: bytes, new: list[SignedRecord]) -> None:
        """Note each owner's latest record; past `MAX_COUNTED` owners, newcomers go uncounted."""
        owners = self._owners.setdefault(key, {})
        for sr in new:
            had = owners.get(sr.peer_id)
            if had is not None and had[0] >= sr.order:
                continue
            if had is None and len(owners) >= MAX_COUNTED:
                self._purge(key)
                if len(owners) >= MAX_COUNTED:
                    continue
            owners[sr.peer_id] = (sr.order, sr.record.expires, sr.record.online)
            self._online[key] = self._online.get(key, 0) + sr.record.online - (had is not None and had[2])

    def counted(self, key: bytes) -> int | None:
        """Owners with an unexpired online record sent here under window `key` (expiries swept at
        most once a second: a hot key takes thousands of PUTs a minute)."""
        if key not in self._owners:
            return None
        if abs(self.clock() - self._swept.get(key, -math.inf)) >= 1.0:
            self._purge(key)
        return self._online.get(key, 0)

    def _purge(self, key: bytes) -> None:
        owners, now = self._owners[key], self.clock()
        for owner in [o for o, (_, expires, _) in owners.items() if expires <= now]:
            self._online[key] -= owners.pop(owner)[2]
        self._swept[key] = now

    def answer(self, key: bytes) -> tuple[list, int | None]:
        """What this node would answer a GET for `key`: its items, and its count if it counts."""
        rec = self.get(key)
        return self.records(key), value_count(rec.value) if rec is not None else None

    def _admit(self, key: bytes, codec: SetCodec, items: list) -> list:
        """At most `codec.capacity` items: the longest-held half, then the best ranked others."""
        seen, now = self._first_seen.setdefault(key, {}), self.clock()
        for item in items:
            seen.setdefault(codec.owner(item), now)
        if len(items) > codec.capacity:
            ordered = sorted(items, key=lambda it: (seen[codec.owner(it)], codec.owner(it)))
            half = codec.capacity // 2
            items = ordered[:half] + sorted(ordered[half:], key=lambda it: self.rank(codec.owner(it)))[
                :codec.capacity - half]
        held = {codec.owner(item) for item in items}
        for owner in [o for o in seen if o not in held]:
            del seen[owner]
        return items

    def rank(self, owner: str) -> bytes:
        """Where `owner` stands in this node's sample: a hash keyed by the node's secret and salted
        with the hour (`RANK_EPOCH_S`), so a peer left out during a flood draws again each hour."""
        epoch = int(self.clock() // RANK_EPOCH_S).to_bytes(8, "big")
        return hashlib.blake2b(owner.encode(), key=self.secret, salt=epoch, digest_size=8).digest()

    def get(self, key: bytes) -> Record | None:
        rec = super().get(key)
        if rec is None or not key.startswith(PREFIX):
            return rec
        held = self.records(key)
        live = self.codecs.for_key(key.decode()).merge(held, self.clock())
        if len(live) != len(held):
            self._set(key, live)
            rec = super().get(key)
        return rec

    def _set(self, key: bytes, recs: list) -> None:
        if not recs:
            self.remove(key)
            for cache in (self._parsed, self._first_seen, self._owners, self._online, self._swept):
                cache.pop(key, None)
            return
        codec = self.codecs.for_key(key.decode())
        window = key.startswith(WINDOW_PREFIX.encode())
        value = codec.encode(recs, self.counted(key)) if window else codec.encode(recs)
        # Unsigned at the libp2p layer on purpose: this node assembled the set, and every record
        # in it carries its own peer's signature, which is what readers check.
        rec = Record(key=key, value=value, timeReceived=format_time_rfc3339())
        super().put_record(key, rec)
        self._parsed[key] = (value, recs)


INBOUND_KAD_STREAMS = 32


def make_dht(host: IHost, codecs: SetCodecs, server: bool = True) -> KadDHT:
    """A DHT node: server mode stores and serves records (peers, sentinels); client mode only
    queries (status, clients), so short-lived processes never become storage that vanishes.
    `codecs` are the value formats it validates, stores and merges under /diffuse/."""
    dht = KadDHT(host, DHTMode.SERVER if server else DHTMode.CLIENT, strict_validation=True)
    dht.register_validator(NAMESPACE, RecordValidator(codecs))
    dht.value_store = MergingValueStore(host, host.get_id(), codecs)
    # py-libp2p serves 12 inbound KAD streams at once and resets the rest (its guard against
    # floods of public-network peers): a sentinel or peer that a swarm's clients all ask at once
    # answered some reads empty (bench_api, 16 clients). Clients now share reads (reads.py);
    # this leaves room for many clients, and stays bounded.
    dht._inbound_limiter = trio.CapacityLimiter(INBOUND_KAD_STREAMS)
    _only_servers_in_routing_table(dht)
    return dht


def _only_servers_in_routing_table(dht: KadDHT) -> None:
    """py-libp2p adds the sender of any inbound KAD request to its routing table, DHT clients
    included (`diffuse status`, pure clients), and then stores records on them in vain. Keep the
    identify-based check instead: a peer known not to speak KAD is not added."""
    add = dht.add_peer

    async def add_peer(peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        return await add(peer_id, skip_server_mode_check=False)

    dht.add_peer = add_peer  # type: ignore[method-assign]


async def closest(dht: KadDHT, key: str) -> list[ID]:
    """The k closest DHT nodes to `key` (iterative lookup), excluding ourselves."""
    me = dht.host.get_id()
    return [p for p in await dht.peer_routing.find_closest_peers_network(key.encode()) if p != me]


async def put_set(dht: KadDHT, key: str, records: Sequence,
                  targets: Sequence[ID] | None = None) -> int:
    """Store `records` (or evidence, under an evidence key) under `key` here and at `targets`
    (default: a fresh lookup of the k closest nodes); returns how many remote nodes accepted
    them. A node that already holds them refuses a replay, which is fine."""
    return (await store_set(dht, key, records, targets))[0]


async def store_set(dht: KadDHT, key: str, records: Sequence,
                    targets: Sequence[ID] | None = None) -> tuple[int, list[ID]]:
    """`put_set`, also naming the silent nodes (gone, frozen, or past `QUERY_TIMEOUT_S`): those
    are churn; a node that refuses while staying connected (an older layout's node refusing a key
    it does not know) is not."""
    value = _codecs(dht).for_key(key).encode(list(records))
    dht.validator.validate(key, value)  # never publish what others would refuse
    kb = key.encode()
    dht.value_store.put_record(kb, Record(key=kb, value=value))
    peers = list(targets) if targets is not None else await closest(dht, key)
    acks, silent = 0, []

    async def store(peer: ID) -> None:
        nonlocal acks
        with trio.move_on_after(QUERY_TIMEOUT_S):
            if await dht.value_store._store_at_peer(peer, kb, value, record=Record(key=kb, value=value)):
                acks += 1
                return
            if peer in dht.host.get_connected_peers():
                return
        silent.append(peer)

    await _gather(store, peers)
    return acks, silent


async def fetch_set(dht: KadDHT, key: str) -> tuple[list, Counter[str]]:
    """Every valid record (or evidence) under `key` that the k closest nodes or this node hold,
    merged, and per owner how many of those answers held it (its support: a peer that announced
    before a flood is in every node's copy, a throwaway record in a few). Includes tombstones
    (OFFLINE records), which callers filter."""
    codec = _codecs(dht).for_key(key)
    answers = [a.items for a in await fetch_answers(dht, key)]
    support = Counter(owner for answer in answers for owner in {codec.owner(item) for item in answer})
    return codec.merge([item for answer in answers for item in answer], None), support


class Answer(NamedTuple):
    """One DHT node's answer for a key: its valid items, and its owner count (window keys)."""

    items: list
    count: int | None


async def fetch_answers(dht: KadDHT, key: str) -> list[Answer]:
    """The valid items under `key` as each of the k closest nodes hold them, this node included
    only when it is one of them (a node farther away holds at least its own record there, which
    is no sample of the key), one answer per node (unmerged: readers estimate from them)."""
    kb = key.encode()
    codecs = _codecs(dht)
    codec = codecs.for_key(key)
    peers = await closest(dht, key)
    me = dht.host.get_id()
    near = len(peers) < BUCKET_SIZE or sort_peer_ids_by_distance(kb, [*peers, me]).index(me) < BUCKET_SIZE
    answers: list[Answer] = [Answer(*dht.value_store.answer(kb))] if near else []

    began, done = trio.current_time(), 0
    most = trio.Event()

    async def ask(peer: ID) -> None:
        nonlocal done
        with trio.move_on_after(QUERY_TIMEOUT_S):
            rec = await dht.value_store._get_from_peer(peer, kb, return_record=True)
            if isinstance(rec, Record) and rec.value:
                try:
                    answers.append(Answer(codec.decode(rec.value, key, strict=False), value_count(rec.value)))
                except codecs.invalid as e:
                    log.debug("dropped a bad value for %s from %s: %s", key, peer, e)
        done += 1
        if 2 * done > len(peers):
            most.set()

    async def asked_all(cancel: trio.CancelScope) -> None:
        await _gather(ask, peers)
        cancel.cancel()

    # Once most nodes answered, the rest get as long again as that took (at least
    # `STRAGGLER_S`): one frozen node among the k closest must not hold every read to the timeout.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(asked_all, nursery.cancel_scope)
        if peers:
            await most.wait()
            await trio.sleep(max(STRAGGLER_S, trio.current_time() - began))
        nursery.cancel_scope.cancel()
    return answers


def _codecs(dht: KadDHT) -> SetCodecs:
    """The value formats of a DHT that `make_dht` built."""
    store = dht.value_store
    if not isinstance(store, MergingValueStore):
        raise TypeError("a Diffuse DHT comes from make_dht")
    return store.codecs


async def _gather(fn, items: Iterable) -> None:
    """Run fn(item) for each item, at most ALPHA at a time, in one nursery."""
    limit = trio.CapacityLimiter(ALPHA)

    async def one(item) -> None:
        async with limit:
            await fn(item)

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, item)


async def bootstrap(host: IHost, dht: KadDHT, peers: Sequence[PeerInfo], timeout: float = 5.0) -> list[PeerInfo]:
    """Connect to every bootstrap peer at once; those that answer seed the routing table.
    Raises BootstrapError only if none answers: one reachable sentinel is enough. A peer of a
    private swarm that we cannot join (no key, another key, the other mode) is named as such."""
    reached: list[PeerInfo] = []
    refused: list[PeerInfo] = []
    errors: list[str] = []

    async def one(info: PeerInfo) -> None:
        if info.peer_id == host.get_id():
            return
        with trio.move_on_after(timeout) as scope:
            try:
                await host.connect(info)
            except Exception as e:  # noqa: BLE001 - py-libp2p raises many unrelated types on dial failure
                addr, why = f"{info.addrs[0]}/p2p/{info.peer_id}", dial_failure(e)
                if why is None and await speaks_first(info.addrs[0]):  # the chain lost the handshake failure
                    why = NO_HANDSHAKE
                if why is not None:  # it answered, in another swarm or mode
                    refused.append(info)
                errors.append(f"{addr}: {why or e or type(e).__name__}" if why != NO_HANDSHAKE else
                              f"{NO_HANDSHAKE} with {addr}: if this swarm is private, give its key with "
                              "--swarm-key FILE")
                return
            for _ in range(10):  # add_peer can refuse until the connection is fully up
                if await dht.routing_table.add_peer(info):
                    break
                await trio.sleep(0.05)
            reached.append(info)
        if scope.cancelled_caught:
            errors.append(f"{info.addrs[0]}/p2p/{info.peer_id}: no answer within {timeout:g} s")

    await _gather(one, peers)
    if peers and not reached and any(p.peer_id != host.get_id() for p in peers):
        raise BootstrapError("could not reach any bootstrap peer:\n  " + "\n  ".join(errors), refused=bool(refused))
    if reached:
        # Populate the routing table beyond the sentinels and let them learn about us.
        with trio.move_on_after(timeout):
            await dht.peer_routing.find_closest_peers_network(host.get_id().to_bytes())
    return reached
