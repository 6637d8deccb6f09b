"""The ladder `join --model auto` climbs (control/ladder.py), as pure planning over replica counts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from diffuse.control.identity import peer_id
from diffuse.control.ladder import Hosting, Offer, choose, filled, ladder
from diffuse.control.placement import PlacementError
from diffuse.control.records import PeerRecord
from diffuse.control.windows import WindowSample

MiB = 2**20
SMALL = Offer("small", 30, 10 * MiB, 300 * MiB, ())
LARGE = Offer("large", 18, 40 * MiB, 720 * MiB, ())
OFFERS = [LARGE, SMALL]


def join_one_at_a_time(budgets: list[int]) -> list[tuple[str, int, int]]:
    """Peers join an empty swarm one by one; each chooses given those before it."""
    replicas = {o.model: [0.0] * o.num_blocks for o in OFFERS}
    chosen = []
    for budget in budgets:
        c = choose(OFFERS, replicas, budget)
        for b in range(c.start, c.end):
            replicas[c.model][b] += 1
        chosen.append(c.span)
    return chosen


def test_the_ladder_is_smallest_then_each_larger_model_once_then_twice():
    assert ladder(OFFERS) == [("small", 1), ("large", 1), ("large", 2)]


def test_whole_model_peers_climb_the_ladder_then_strengthen_the_weakest():
    assert join_one_at_a_time([10**12] * 5) == [
        ("small", 0, 30),  # servable at all
        ("large", 0, 18),  # the larger model, fragile
        ("large", 0, 18),  # its second replica: reliable
        ("small", 0, 30),  # every rung met: the model with the fewest replicas
        ("large", 0, 18)]  # both at two: the larger


def test_peers_that_hold_half_a_model_cover_it_together_first():
    half = 15 * SMALL.block_bytes  # 15 small blocks, or 3 large ones
    assert join_one_at_a_time([half] * 3) == [("small", 0, 15), ("small", 15, 30), ("large", 0, 3)]


def test_a_budget_below_one_block_of_every_model_is_refused():
    with pytest.raises(PlacementError, match="cannot hold one block"):
        choose(OFFERS, {"small": [0.0] * 30, "large": [0.0] * 18}, MiB)


def test_after_a_death_only_an_earlier_rung_moves_a_peer():
    """Swarm: small x2 (peers S1, S2), large x1 (L1) after L2 died. Without itself, S1 sees small
    at 1 replica, so its own span fills small's second replica (beyond the ladder); large's second
    replica is rung 3: it moves. L1 fills large's first replica (rung 2): it stays."""
    without_s1 = {"small": [1.0] * 30, "large": [1.0] * 18}
    new = choose(OFFERS, without_s1, 10**12)
    assert new.span == ("large", 0, 18) and new.rung == 2
    assert filled(OFFERS, without_s1, 10**12, "small", 0, 30) > new.rung
    without_l1 = {"small": [2.0] * 30, "large": [0.0] * 18}
    assert filled(OFFERS, without_l1, 10**12, "large", 0, 18) == choose(OFFERS, without_l1, 10**12).rung == 1


def test_a_hosting_peer_is_not_counted_twice_where_the_window_sampled_it():
    """The ladder drops its own record and the window's sample still holds it: the estimate
    scales only the valid peers it knows, so it does not come back as an unknown peer."""
    hashes = tuple(f"{i:064x}" for i in range(80))
    now = time.time()

    def rec(start: int, end: int) -> PeerRecord:
        return PeerRecord(peer_id=peer_id(create_new_key_pair()).to_base58(), model="m", num_blocks=80,
                          start=start, end=end, block_hashes=hashes[start:end], dtype="bfloat16", throughput=1.0,
                          cache_tokens=64, addrs=("/ip4/10.0.0.1/tcp/1",), timestamp=now, expires=now + 60,
                          started=now)

    me, others = rec(8, 12), [rec(8, 12) for _ in range(8)]
    # Window 1's nodes were full: 9 sampled (me among them), each standing for 2 peers.
    sample = WindowSample(frozenset({me.peer_id, *(r.peer_id for r in others)}), frozenset(), weight=2.0)
    node = SimpleNamespace(peer_id=me.peer_id, samples={"m": {1: sample}})
    hosting = Hosting(node, [Offer("m", 80, 1, 80, hashes)], 80, None, None, 60.0, print)
    counts = hosting._replicas({"m": [me, *others]}, without=me.peer_id)["m"]
    assert counts[8:12] == [16.0] * 4  # the 8 others and the 8 they stand for; not me again
