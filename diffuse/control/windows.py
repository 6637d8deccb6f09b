"""Reading a model's records under layout 2 (one key per window of blocks), and what the
nodes' bounded copies imply about the peers they did not keep.

Each window's value is capped at `MAX_SET_RECORDS` per DHT node: the longest-held half, which
every node near the key holds alike, and a sample ranked by a hash keyed by the node's own secret,
so every node's sample is uniform and independent of the others' (dht.MergingValueStore). A
reader that merges the k nodes' answers sees the held half exactly and, past capacity, a union of
independent samples of the rest, from which it estimates how many there are (capture-recapture):
`WindowSample.weight` is how many peers each sampled peer stands for.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import trio
from libp2p.kad_dht.kad_dht import KadDHT

from diffuse.control.coverage import Coverage
from diffuse.control.dht import fetch_answers
from diffuse.control.records import (
    MAX_SET_RECORDS,
    WINDOW_BLOCKS,
    PeerRecord,
    SignedRecord,
    blocks_key,
    merge,
    window_key,
)

READS_AT_ONCE = 4  # window keys read concurrently: each read is a lookup plus k GETs


@dataclass(frozen=True)
class WindowSample:
    """What a reader saw of one window's key: the peers `seen` in any answer, of which the `sure`
    ones (held by every node that answered, or all when no node was full) stand for themselves
    and each other one for `weight` peers."""

    seen: frozenset[str]
    sure: frozenset[str]
    weight: float = 1.0

    @property
    def sampled(self) -> bool:
        return self.weight > 1.0


def sample_of(answers: Sequence[Iterable[str]], capacity: int = MAX_SET_RECORDS) -> WindowSample:
    """The sample that the answers (owners held, one collection per DHT node) make up."""
    sets = [set(a) for a in answers if a]
    if not sets:
        return WindowSample(frozenset(), frozenset())
    seen = frozenset(set().union(*sets))
    if all(len(s) < capacity for s in sets):
        return WindowSample(seen, seen)
    sure = frozenset(set.intersection(*sets))
    rest = [len(s - sure) for s in sets]
    distinct = len(seen - sure)
    if distinct == 0:
        return WindowSample(seen, sure)
    return WindowSample(seen, sure, _population(rest, distinct) / distinct)


def _population(sizes: Sequence[int], distinct: int) -> float:
    """M such that independent uniform samples of `sizes` from M items are expected to show
    `distinct` different items: M (1 - prod(1 - n/M)) = distinct, by bisection."""
    def expected(m: float) -> float:
        return m * (1.0 - math.prod(max(0.0, 1.0 - n / m) for n in sizes))

    lo, hi = float(distinct), float(distinct) * 1000.0
    if expected(hi) < distinct:  # (almost) no overlap between the samples: bounded, and said so by a large weight
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < distinct else (lo, mid)
    return (lo + hi) / 2


def estimate_replicas(records: Iterable[PeerRecord], num_blocks: int,
                      samples: Mapping[int, WindowSample]) -> list[float]:
    """Per block, how many peers serve it: the peers a coverage judged valid (`records`, which a
    reader may also know from other windows' keys), plus the peers its window's sample implies
    that the reader does not know, spread over the window's blocks as the sampled peers are."""
    recs = list(records)
    counts = [0.0] * num_blocks
    for r in recs:
        for b in range(r.start, min(r.end, num_blocks)):
            counts[b] += 1.0
    for w, s in samples.items():
        lo, hi = w * WINDOW_BLOCKS, min((w + 1) * WINDOW_BLOCKS, num_blocks)
        touching = [r for r in recs if r.start < hi and r.end > lo and r.peer_id not in s.sure]
        sampled = [r for r in touching if r.peer_id in s.seen]
        unseen = s.weight * len(s.seen - s.sure) - len(touching)
        if not s.sampled or not sampled or unseen <= 0:
            continue
        for b in range(lo, hi):
            counts[b] += unseen * sum(r.serves(b) for r in sampled) / len(sampled)
    return counts


def with_estimates(cov: Coverage, samples: Mapping[int, WindowSample]) -> Coverage:
    """`cov` with its estimated replica counts, where the nodes kept samples of its windows."""
    if not any(s.sampled for s in samples.values()):
        return cov
    return replace(cov, estimated=estimate_replicas(cov.peers.values(), cov.num_blocks, samples))


def model_windows(num_blocks: int) -> range:
    return range((num_blocks + WINDOW_BLOCKS - 1) // WINDOW_BLOCKS)


async def read_model(dht: KadDHT, model: str, num_blocks: int | None
                     ) -> tuple[list[SignedRecord], Counter[str], dict[int, WindowSample]]:
    """Every record of `model` under its window keys and its layout-1 blocks key, merged; per
    peer its support (most DHT answers holding it under any one key); per window its sample.
    Without `num_blocks` (not known yet) window 0 and the blocks key are read first, and the
    block count most of their records state decides which windows follow."""
    answers: dict[str, list[list[SignedRecord]]] = {}
    limit = trio.CapacityLimiter(READS_AT_ONCE)

    async def read(key: str) -> None:
        async with limit:
            answers[key] = await fetch_answers(dht, key)

    first = [blocks_key(model)] + ([window_key(model, 0)] if num_blocks is None else [])
    if num_blocks is None:
        await _all(read, first)
        stated = Counter(r.record.num_blocks for a in answers.values() for ans in a for r in ans
                         if r.record.model == model)
        num_blocks = stated.most_common(1)[0][0] if stated else 0
    await _all(read, [k for k in [*first, *(window_key(model, w) for w in model_windows(num_blocks))]
                      if k not in answers])
    support: Counter[str] = Counter()
    for per_key in answers.values():
        for owner, n in Counter(r.peer_id for ans in per_key for r in {r.peer_id: r for r in ans}.values()).items():
            support[owner] = max(support[owner], n)
    samples = {w: sample_of([[r.peer_id for r in ans] for ans in answers[window_key(model, w)]])
               for w in model_windows(num_blocks) if window_key(model, w) in answers}
    found = merge([r for per_key in answers.values() for ans in per_key for r in ans], None)
    return found, support, samples


async def _all(fn, items: Sequence[str]) -> None:
    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(fn, item)
