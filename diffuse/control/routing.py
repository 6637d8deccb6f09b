"""Just-in-time routes: the cheapest chain of peers that covers blocks [start, end).

Like Petals, a shortest path over block boundaries: from boundary s, any live peer whose span
contains block s can take the route to min(its end, end), at a cost of one round trip to it plus
its per-block compute time, plus a large penalty when it lacks KV-cache room for the session.
Peers may be entered mid-span: a session can ask a peer for a sub-range of what it serves.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from diffuse.control.records import PeerRecord, SignedRecord
from diffuse.errors import DiffuseError

DEFAULT_RTT = 0.05  # seconds assumed for a peer not measured yet
NO_ROOM_PENALTY = 30.0  # seconds: use a peer without cache room only if nothing else exists


class NoRoute(DiffuseError):
    """Some blocks have no live, unbanned replica: the message names them, `blocks` too ("3-5, 9"),
    and `runs` as [start, end) pairs ([(3, 6), (9, 10)])."""

    def __init__(self, message: str, blocks: str = "", runs: list[tuple[int, int]] | None = None):
        super().__init__(message)
        self.blocks, self.runs = blocks, runs or []


@dataclass(frozen=True)
class Hop:
    """One peer of a route and the blocks it computes there. `started` (its record's start time)
    tells a failure of this run of the peer from one of its next run; `throughput` (announced,
    tokens/s through its span) and `rtt` (measured, seconds) size a step's deadline; `quant`, the
    variant its record announces (the one the client accepted), is what its OPEN_OK must declare."""

    peer_id: str
    addrs: tuple[str, ...]
    start: int
    end: int
    started: float = 0.0
    throughput: float = 0.0
    rtt: float = DEFAULT_RTT
    quant: str = "none"
    signed: SignedRecord | None = field(default=None, compare=False, repr=False)  # as signed: a chain names it


def _cost(r: PeerRecord, s: int, e: int, rtt: Mapping[str, float], tokens: int) -> float:
    per_block = 1.0 / max(r.throughput * (r.end - r.start), 1e-6)
    penalty = NO_ROOM_PENALTY if r.cache_tokens < tokens else 0.0
    return rtt.get(r.peer_id, DEFAULT_RTT) + (e - s) * per_block + penalty


def plan_route(records: Iterable[PeerRecord], start: int, end: int, *, rtt: Mapping[str, float] = {},
               exclude: Iterable[str] = (), tokens: int = 0, now: float | None = None) -> list[Hop]:
    """Cheapest hops covering [start, end); raises NoRoute naming the uncovered blocks."""
    now = time.time() if now is None else now
    banned = set(exclude)
    live = [r for r in records if r.online and r.fresh(now) and r.peer_id not in banned]
    best: dict[int, float] = {start: 0.0}
    back: dict[int, tuple[int, PeerRecord]] = {}
    queue = [(0.0, start)]
    while queue:
        cost, s = heapq.heappop(queue)
        if s == end:
            break
        if cost > best.get(s, float("inf")):
            continue
        for r in live:
            if r.start <= s < r.end:
                e = min(r.end, end)
                c = cost + _cost(r, s, e, rtt, tokens)
                if c < best.get(e, float("inf")):
                    best[e], back[e] = c, (s, r)
                    heapq.heappush(queue, (c, e))
    if end not in best:
        runs = _runs([b for b in range(start, end) if not any(r.serves(b) for r in live)])
        blocks = ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs)
        why = " (some replicas are banned after failing)" if banned else ""
        raise NoRoute(f"no live peer serves block{'s' if '-' in blocks or ',' in blocks else ''} {blocks}{why}",
                      blocks, runs)
    hops, e = [], end
    while e != start:
        s, r = back[e]
        hops.append(Hop(r.peer_id, tuple(r.addrs), s, e, r.started, r.throughput * (r.end - r.start) / (e - s),
                        rtt.get(r.peer_id, DEFAULT_RTT), str(r.extra.get("quant", "none"))))
        e = s
    return hops[::-1]


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Block numbers as [start, end) runs: [3, 4, 5, 9] -> [(3, 6), (9, 10)]."""
    spans: list[list[int]] = []
    for b in blocks:
        if spans and b == spans[-1][1]:
            spans[-1][1] = b + 1
        else:
            spans.append([b, b + 1])
    return [(a, b) for a, b in spans]
