"""Reading a model's records under layout 2 (one key per window of blocks), and what the
nodes' bounded copies imply about the peers they did not keep.

Each window's value is capped at `MAX_SET_RECORDS` per DHT node: the longest-held half, which
every node near the key holds alike, and a sample ranked by a hash keyed by the node's own secret,
so every node's sample is uniform and independent of the others' (dht.MergingValueStore). Each
node also states how many owners it holds unexpired records of. A reader that merges the k
nodes' answers sees the held half exactly and, past capacity, a union of independent samples of
the rest, which stand for the median count of those nodes: `WindowSample.weight` is how many
peers each sampled peer stands for.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import trio
from libp2p.kad_dht.kad_dht import KadDHT

from diffuse.control.coverage import Coverage
from diffuse.control.dht import Answer, fetch_answers
from diffuse.control.records import (
    MAX_BLOCKS,
    MAX_SET_RECORDS,
    WINDOW_BLOCKS,
    PeerRecord,
    SignedRecord,
    blocks_key,
    merge,
    window_key,
)

READS_AT_ONCE = 4  # window keys read concurrently: each read is a lookup plus k GETs
MIN_SAMPLED = 8  # valid sampled peers a window needs before a reader scales them up: fewer are noise


@dataclass(frozen=True)
class WindowSample:
    """What a reader saw of one window's key: the peers `seen` in any answer, of which the `sure`
    ones (held by most nodes that answered, or all when no node was full) stand for themselves
    and the others together for `weight` times as many peers."""

    seen: frozenset[str]
    sure: frozenset[str]
    weight: float = 1.0

    @property
    def sampled(self) -> bool:
        return self.weight > 1.0


def sample_of(answers: Sequence[tuple[Iterable[str], int | None]], capacity: int = MAX_SET_RECORDS) -> WindowSample:
    """The sample that the answers (owners held and owners counted, one pair per DHT node) make up.
    A node's count is only its claim: the median of the full nodes' counts is used, so a minority
    of nodes lying about it moves nothing, and a count below what the node holds is ignored."""
    sets = [(set(a), n) for a, n in answers]
    sets = [(a, n) for a, n in sets if a]
    if not sets:
        return WindowSample(frozenset(), frozenset())
    seen = frozenset(set().union(*(a for a, _ in sets)))
    counts = [n for a, n in sets if len(a) >= capacity and n is not None and n >= len(a)]
    if len(counts) < len([a for a, _ in sets if len(a) >= capacity]) / 2 or not counts:
        return WindowSample(seen, seen)  # no node full, or too few counting: what was seen is all
    held = Counter(o for a, _ in sets for o in a)
    sure = frozenset(o for o, n in held.items() if 2 * n > len(sets))  # one odd answer moves nothing
    rest = len(seen - sure)
    if rest == 0:
        return WindowSample(seen, sure)
    population = max(statistics.median(counts) - len(sure), rest)
    return WindowSample(seen, sure, population / rest)


def estimate_replicas(records: Iterable[PeerRecord], num_blocks: int,
                      samples: Mapping[int, WindowSample]) -> list[float]:
    """Per block, how many peers serve it: the peers a coverage judged valid (`records`, which a
    reader may also know from other windows' keys), plus the valid peers its window's sample
    implies that the reader does not know, spread over the window's blocks as the sampled valid
    peers are. Only valid sampled peers are scaled up (a flood of rejected records inflates
    nothing), and a window with fewer than `MIN_SAMPLED` of them is left at what is known."""
    recs = list(records)
    counts = [0.0] * num_blocks
    for r in recs:
        for b in range(r.start, min(r.end, num_blocks)):
            counts[b] += 1.0
    for w, s in samples.items():
        lo, hi = w * WINDOW_BLOCKS, min((w + 1) * WINDOW_BLOCKS, num_blocks)
        touching = [r for r in recs if r.start < hi and r.end > lo and r.peer_id not in s.sure]
        sampled = [r for r in touching if r.peer_id in s.seen]
        unseen = s.weight * len(sampled) - len(touching)
        if not s.sampled or len(sampled) < MIN_SAMPLED or unseen <= 0:
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
    windows of the largest block count their records state follow (all `MAX_BLOCKS` when none
    does): a vote could be won by throwaway records stating a small count, hiding the rest."""
    answers: dict[str, list[Answer]] = {}
    limit = trio.CapacityLimiter(READS_AT_ONCE)

    async def read(key: str) -> None:
        async with limit:
            answers[key] = await fetch_answers(dht, key)

    first = [blocks_key(model)] + ([window_key(model, 0)] if num_blocks is None else [])
    if num_blocks is None:
        await _all(read, first)
        num_blocks = max((r.record.num_blocks for a in answers.values() for ans in a for r in ans.items
                          if r.record.model == model), default=MAX_BLOCKS)
    await _all(read, [k for k in [*first, *(window_key(model, w) for w in model_windows(num_blocks))]
                      if k not in answers])
    support: Counter[str] = Counter()
    for per_key in answers.values():
        for owner, n in Counter(owner for ans in per_key for owner in {r.peer_id for r in ans.items}).items():
            support[owner] = max(support[owner], n)
    samples = {w: sample_of([([r.peer_id for r in a.items], a.count) for a in answers[window_key(model, w)]])
               for w in model_windows(num_blocks) if window_key(model, w) in answers}
    found = merge([r for per_key in answers.values() for ans in per_key for r in ans.items], None)
    return found, support, samples


async def _all(fn, items: Sequence[str]) -> None:
    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(fn, item)
