"""Announcing what a peer serves: publish now, re-publish on a heartbeat, withdraw on stop.

Each heartbeat signs a fresh record (new timestamp, expiry = now + ttl) and stores it under the
peer's key, the window keys its span touches (layout 2) and, while older readers remain, its
model's blocks key (layout 1). A peer that dies stops refreshing, so its record expires
after ttl (a few heartbeats); a peer that stops gracefully publishes a tombstone at once, which
outranks its online record everywhere it lands.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import KadDHT

from diffuse import __version__
from diffuse.control.dht import closest, store_set
from diffuse.control.identity import peer_id as peer_id_of
from diffuse.control.records import (
    MAX_TTL_S,
    PeerRecord,
    SignedRecord,
    is_scalar,
    blocks_key,
    peer_key,
    relays_key,
    sign,
    window_key,
    windows_of,
    withdrawn,
)

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 15.0
TTL_HEARTBEATS = 3  # a record outlives two missed heartbeats, not three
LOOKUP_EVERY = 10  # heartbeats between lookups of the k closest nodes (sooner if half go silent)
WRITE_LAYOUT_1 = True  # also the model's blocks key, for readers of layout 1 (protocols/dht-records.md)
StatusFn = Callable[[], Mapping[str, Any]]


@dataclass(frozen=True)
class Serving:
    """What this peer serves; the data plane fills in throughput and cache once it measures them."""

    model: str
    num_blocks: int
    start: int
    end: int
    block_hashes: Sequence[str]  # hex SHA-256 of blocks start..end-1
    dtype: str
    throughput: float | None = None  # tokens/s through the span; None: a conservative estimate
    cache_tokens: int = 0
    protocols: Sequence[str] = field(default_factory=tuple)
    extra: Mapping[str, Any] = field(default_factory=dict)  # fixed ext fields, e.g. the draft head it offers

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end <= self.num_blocks):
            raise ValueError(f"bad span [{self.start}, {self.end}) of {self.num_blocks} blocks")
        if len(self.block_hashes) != self.end - self.start:
            raise ValueError("block_hashes must list the hashes of the served blocks only")
        bad = [k for k, v in self.extra.items() if not (isinstance(k, str) and len(k) <= 64 and is_scalar(v))]
        if bad:
            raise ValueError(f"extra fields must be scalars under short string keys: {bad}")


def estimate_throughput(num_blocks: int) -> float:
    """A deliberately low guess (tokens/s through `num_blocks` blocks) until the data plane
    measures one: ~2 ms per block per token on a small CPU, plus a 20 ms network hop."""
    return round(1.0 / (0.002 * num_blocks + 0.020), 2)


def default_ttl(heartbeat: float) -> float:
    return min(MAX_TTL_S, TTL_HEARTBEATS * heartbeat)


class Announcer:
    """Signs and publishes this peer's record; `run` keeps it fresh until cancelled."""

    def __init__(
        self,
        dht: KadDHT,
        key_pair: KeyPair,
        serving: Serving,
        addrs_fn: Callable[[], Sequence[str]],
        *,
        heartbeat: float = DEFAULT_HEARTBEAT_S,
        ttl: float | None = None,
        status_fn: StatusFn | None = None,
        clock: Callable[[], float] = time.time,
        mode: str | None = None,
    ) -> None:
        """`mode`: the swarm mode the record states (`ext["mode"]`: private or public)."""
        if heartbeat <= 0:
            raise ValueError("heartbeat must be positive")
        self.dht, self.key_pair, self.serving = dht, key_pair, serving
        self.addrs_fn, self.status_fn, self.clock = addrs_fn, status_fn, clock
        self.mode = mode
        self.heartbeat = heartbeat
        self.ttl = ttl if ttl is not None else default_ttl(heartbeat)
        if not (heartbeat < self.ttl <= MAX_TTL_S):
            raise ValueError(f"ttl must exceed the heartbeat and be at most {MAX_TTL_S:g} s")
        self.peer_id = peer_id_of(key_pair).to_base58()
        self.started = clock()
        self.current: SignedRecord | None = None
        self.withdrawn = False
        self._targets: dict[str, tuple[int, list, int]] = {}  # key -> (beats left, nodes kept, nodes found)

    def build(self, now: float) -> PeerRecord:
        s = self.serving
        try:
            status = dict(self.status_fn() if self.status_fn else {})
        except Exception as e:  # noqa: BLE001 - another plane's bug must not silence our heartbeat
            log.warning("status callback failed: %s", e)
            status = {}
        tput = status.pop("throughput", None)
        tput = tput if tput is not None else s.throughput
        if tput is None or not math.isfinite(float(tput)) or tput < 0:
            tput = estimate_throughput(s.end - s.start)
        cache = status.pop("cache_tokens", None)
        cache = max(0, int(cache if cache is not None else s.cache_tokens))
        extra = dict(s.extra) | {k: v for k, v in status.items() if isinstance(k, str) and is_scalar(v)}
        if self.mode is not None:
            extra["mode"] = self.mode
        last = self.current.record.timestamp if self.current else 0.0
        ts = max(now, last + 0.001)  # strictly increasing, even if the clock steps back
        return PeerRecord(
            peer_id=self.peer_id, model=s.model, num_blocks=s.num_blocks, start=s.start, end=s.end,
            block_hashes=tuple(s.block_hashes), dtype=s.dtype, throughput=float(tput),
            cache_tokens=int(cache), addrs=tuple(self.addrs_fn()), protocols=tuple(s.protocols),
            software=f"diffuse/{__version__}", timestamp=ts, expires=ts + self.ttl,
            started=min(self.started, ts), extra=extra,
        )

    async def publish(self) -> int:
        """Sign a fresh record and store it under its keys; returns the peer key's remote acks.
        After `withdraw` this does nothing: a withdrawn peer stays withdrawn."""
        if self.withdrawn:
            return 0
        signed = sign(self.build(self.clock()), self.key_pair)
        self.current = signed
        return await self._put(signed)

    async def withdraw(self) -> int:
        """Publish a tombstone so readers drop this peer now rather than at expiry."""
        if self.current is None or self.withdrawn:
            return 0
        self.withdrawn = True
        tomb = sign(withdrawn(self.current.record, self.clock(), self.ttl), self.key_pair)
        self.current = tomb
        return await self._put(tomb)

    async def _put(self, signed: SignedRecord) -> int:
        """Store under the peer key, the window keys and the blocks key at once (and the relays
        key, for a peer that serves relay hops). The k closest nodes of each key are looked up every
        LOOKUP_EVERY beats, or sooner once half of them went silent (churn): a lookup costs several
        round trips, more than the stores themselves."""
        rec = signed.record
        keys = [peer_key(self.peer_id), *(window_key(rec.model, w) for w in windows_of(rec.start, rec.end))]
        if WRITE_LAYOUT_1:
            keys.append(blocks_key(rec.model))
        if signed.record.extra.get("relay") is True:
            keys.append(relays_key())
        acks = [0] * len(keys)

        async def put(i: int, key: str) -> None:
            left, targets, found = self._targets.get(key, (0, [], 0))
            if left <= 0 or not targets:
                targets = await closest(self.dht, key)
                left, found = LOOKUP_EVERY, len(targets)
            acks[i], silent = await store_set(self.dht, key, [signed], targets)
            # A silent node is dropped until the next lookup, so it does not hold up every beat; a
            # lookup comes early once half the nodes found have gone silent. A node that answers
            # "no" (an older layout's, for a window key) is no sign of churn.
            kept = [t for t in targets if t not in silent]
            self._targets[key] = (left - 1 if 2 * len(kept) >= found else 0, kept, found)

        async with trio.open_nursery() as nursery:
            for i, key in enumerate(keys):
                nursery.start_soon(put, i, key)
        return acks[0]  # the peer key, which every layout's node accepts

    async def run(self, *, on_lonely: Callable[[], Any] | None = None,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish, report started, then re-publish every heartbeat (±10% jitter, so peers
        started together do not pulse together). The period counts from the start of each
        publish, so a slow publish does not stretch it. `on_lonely` runs when no node acked."""
        first = True
        while True:
            next_at = trio.current_time() + self.heartbeat * random.uniform(0.9, 1.1)
            try:
                acks = await self.publish()
            except Exception as e:  # noqa: BLE001 - the network is not ours: log, retry next beat
                log.warning("announcement failed: %s", e)
                acks = 0
            if acks == 0 and on_lonely is not None:
                await on_lonely()
            if first:
                task_status.started()
                first = False
            await trio.sleep_until(next_at)
