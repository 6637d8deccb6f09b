"""The ladder `join --model auto` climbs (control/ladder.py), as pure planning over replica counts."""

from __future__ import annotations

import pytest

from diffuse.control.ladder import Offer, choose, filled, ladder
from diffuse.control.placement import PlacementError

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
