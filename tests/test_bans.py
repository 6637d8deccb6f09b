"""Failure bans never outlive the fault (data/client.py `Bans`), and a step's deadline is sized by
its work (data/hop.py `deadline`): the rules alone, on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import trio

from diffuse.control.routing import Hop
from diffuse.data.client import Bans, cause_of
from diffuse.data.hop import EXACT_COST, FLOOR_S, HopFailed, deadline


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def record(peer: str, started: float) -> NS:
    return NS(peer_id=peer, started=started)


def test_a_failure_bans_with_doubling_back_off_until_the_strikes_are_forgotten():
    clock = Clock()
    bans = Bans(base=15.0, forget=600.0, clock=clock)
    bans.ban("A", started=1.0)
    assert bans.active() == {"A"}
    clock.t += 15.1
    assert bans.active() == set()
    bans.ban("A", started=1.0)  # a repeat within `forget`: 30 s
    clock.t += 29.0
    assert bans.active() == {"A"}
    clock.t += 1.1 + 601  # quiet for longer than `forget`: back to 15 s
    bans.ban("A", started=1.0)
    clock.t += 15.1
    assert bans.active() == set()


def test_a_restart_lifts_a_ban_once_per_run():
    clock = Clock()
    bans = Bans(clock=clock)
    for _ in range(3):
        bans.ban("A", started=1.0)  # three strikes: 60 s
    assert bans.seen([record("A", 1.0)]) == []  # the same run: still banned
    assert bans.active() == {"A"}
    assert bans.seen([record("A", 2.0), record("B", 9.0)]) == ["A"]  # a new run: usable at once
    assert bans.active() == set()
    bans.ban("A", started=2.0)  # fails again soon after its restart: back on its doubled back-off
    assert bans.seen([record("A", 2.0)]) == []
    clock.t += 100.0
    assert bans.active() == {"A"}  # 15 * 2**3 s
    clock.t += 21.0
    assert bans.active() == set()


def test_a_probe_lifts_a_ban_but_keeps_its_strikes():
    clock = Clock()
    bans = Bans(clock=clock)
    bans.ban("A")
    bans.lift("A")
    assert bans.active() == set()
    bans.ban("A")
    clock.t += 29.0
    assert bans.active() == {"A"}  # the second strike: 30 s


def test_a_steps_deadline_grows_with_its_rows_between_a_floor_and_the_cap():
    hop = Hop("A", (), 1, 15, throughput=50.0, rtt=0.01)
    assert deadline(hop, 1, 30.0) == FLOOR_S  # a decode step: a frozen peer is noticed in seconds
    assert FLOOR_S < deadline(hop, 200, 30.0) < 30.0  # a prefill: more time, as its rows need
    assert deadline(hop, 10_000, 30.0) == 30.0  # --step-timeout caps it
    assert deadline(Hop("A", (), 1, 15), 1, 30.0) == 30.0  # throughput unknown: the cap
    far = Hop("A", (), 1, 15, throughput=50.0, rtt=2.0)
    assert deadline(far, 1, 30.0) > 4.0  # the round trip counts, twice


def test_an_exact_steps_rows_get_the_exact_kernels_time():
    """A peer announces its fast kernels' throughput; the batch-invariant ones take up to ~5x."""
    hop = Hop("A", (), 1, 15, throughput=50.0, rtt=0.01)
    assert deadline(hop, 1, 30.0, exact=True) == FLOOR_S  # a decode step: still seconds
    fast, exact = deadline(hop, 40, 300.0), deadline(hop, 40, 300.0, exact=True)
    assert exact == pytest.approx(0.02 + (fast - 0.02) * EXACT_COST)  # a prefill's rows: EXACT_COST times


def test_failures_are_named_by_cause():
    hop = Hop("A", (), 1, 15)
    assert cause_of(trio.TooSlowError()) == "timeout"
    assert cause_of(HopFailed(hop, "connection closed", cause="closed")) == "closed"
    assert cause_of(HopFailed(hop, "error 7: busy", 7, cause="error")) == "error"
    assert cause_of(HopFailed(hop, "refused", cause="unreachable")) == "unreachable"
    assert cause_of(ConnectionResetError()) == "closed"
