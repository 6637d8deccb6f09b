"""Reading record sets from the DHT: one read in flight per key, records kept to their expiry."""

from __future__ import annotations

import logging
import math
import time
from typing import Awaitable, Callable

import trio

from diffuse.control.records import PeerRecord

log = logging.getLogger(__name__)
SHARE_S = 1.0  # a DHT read this recent answers every caller that asks meanwhile


class SharedReads:
    """A node's DHT reads of record sets, shared by every caller.

    An API answer reads the DHT twice (the coverage check, then `SwarmClient.session`), and every
    read sends a FIND_NODE and a GET_VALUE to each DHT node near the key. py-libp2p 0.8.1 serves at
    most 12 inbound KAD streams per node at once and resets the rest (`KadDHT.handle_stream`), so
    N concurrent answers made 2N concurrent reads and those past the limit came back empty: 4 of
    16 concurrent reads on an idle loopback swarm. Once the records of the last good read had
    expired (bench_api: a 60 s round of another client in between, records of a 30 s ttl), an
    empty read made the model unservable (503). Here one read is in flight at a time per model;
    callers that arrive meanwhile wait for it, and a read younger than `share_s` is reused.

    Records are also kept to their signed expiry when a read misses a peer (newest per peer wins,
    so a tombstone still removes its peer at once): a loaded DHT node that drops one read must not
    make the model unservable while the peer's own signature says it is still there.
    """

    def __init__(self, read: Callable[[str], Awaitable[list[PeerRecord]]], share_s: float = SHARE_S):
        self.read, self.share_s = read, share_s  # read(model): every record of the model, offline too
        self.known: dict[str, dict[str, PeerRecord]] = {}  # model -> peer -> newest record read
        self.read_at: dict[str, float] = {}  # model -> trio time the last read completed
        self.reading: dict[str, trio.Event] = {}  # model -> set when the read in flight ends

    async def records(self, model: str, *, include_offline: bool = False) -> list[PeerRecord]:
        """Records from a read made at most `share_s` ago (or waited for), merged with the
        unexpired records of earlier reads."""
        asked = trio.current_time()
        while self.read_at.get(model, -math.inf) < asked - self.share_s:  # no read recent enough
            event = self.reading.get(model)
            if event is not None:  # a read is in flight: wait, then look again (it may have failed)
                await event.wait()
                continue
            event = self.reading[model] = trio.Event()
            try:
                self._merge(model, await self.read(model))
                self.read_at[model] = trio.current_time()
            finally:
                del self.reading[model]
                event.set()
        now = time.time()
        recs = [r for r in self.known.get(model, {}).values() if r.fresh(now)]
        return recs if include_offline else [r for r in recs if r.online]

    def _merge(self, model: str, got: list[PeerRecord]) -> None:
        known, now = self.known.setdefault(model, {}), time.time()
        missed = set(known) - {r.peer_id for r in got}
        for r in got:
            if r.peer_id not in known or r.timestamp >= known[r.peer_id].timestamp:
                known[r.peer_id] = r
        for peer in [p for p, r in known.items() if not r.fresh(now)]:
            del known[peer]
        if missed & set(known):
            log.debug("a DHT read of %s missed %d peers: their records are kept until they expire",
                      model, len(missed & set(known)))
