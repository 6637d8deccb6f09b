"""Block placement (`--blocks auto`) and the coverage map, as pure functions."""

from __future__ import annotations

import time

import pytest
import torch

from diffuse.model import kernels
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from control_helpers import SMOLLM2_CONFIG, fake_hashes
from diffuse.control.coverage import coverage, format_text
from diffuse.control.identity import peer_id
from diffuse.control.placement import (
    PlacementError,
    block_bytes,
    blocks_for_budget,
    choose_span,
    parse_size,
    parse_span,
)
from diffuse.control.records import OFFLINE, PeerRecord
from diffuse.model.config import ModelConfig

MODEL = "SmolLM2-135M-Instruct"


def test_uncovered_region_is_picked():
    reps = [2] * 10 + [0] * 10 + [1] * 10
    assert choose_span(reps, 10) == (10, 20)
    assert choose_span(reps, 5) == (10, 15)  # inside the hole, lowest start
    assert choose_span(reps, 14) == (10, 24)  # the whole hole, then the weaker side (1 < 2)


def test_weakest_blocks_first_then_lowest_start():
    assert choose_span([2, 2, 1, 1, 2, 2], 2) == (2, 4)
    assert choose_span([1, 1, 1, 1], 2) == (0, 2)
    assert choose_span([3, 0, 3, 0, 0, 1], 3) == (3, 6)  # two zeros and a one beat two zeros and a three
    assert choose_span([1, 2, 3], 10) == (0, 3)  # clamped to the model
    with pytest.raises(PlacementError):
        choose_span([], 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 40))
def test_choice_is_leximin_optimal(reps, length):
    s, e = choose_span(reps, length)
    L = min(length, len(reps))
    assert e - s == L
    chosen = sorted(reps[s:e])
    for t in range(len(reps) - L + 1):
        assert chosen <= sorted(reps[t:t + L])


def test_parse_span_and_size():
    assert parse_span("0:15", 30) == (0, 15)
    assert parse_span(":10", 30) == (0, 10)
    assert parse_span("20:", 30) == (20, 30)
    for bad in ["15:15", "0:31", "a:b", "3", "-1:4"]:
        with pytest.raises(PlacementError):
            parse_span(bad, 30)
    assert parse_size("800MiB") == 800 * 2**20
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("123456") == 123456
    for bad in ["", "lots", "0", "-5MB"]:
        with pytest.raises(PlacementError):
            parse_size(bad)


def test_memory_budget_in_blocks():
    cfg = ModelConfig(**SMOLLM2_CONFIG)
    # SmolLM2-135M: q/o 576x576, k/v 576x192, MLP 3x576x1536, two norms: 3,540,096 parameters.
    # The weights, and where products keep a reordered copy of them, that copy too.
    copies = 2 if kernels.reorders(torch.bfloat16) else 1
    assert block_bytes(cfg, "bfloat16") == 3_540_096 * 2 * copies
    assert block_bytes(cfg, "float32") == 3_540_096 * 4 * (2 if kernels.reorders() else 1)
    assert blocks_for_budget(100 * 2**20, cfg, "bfloat16") == 14 // copies
    assert blocks_for_budget(10**12, cfg, "float32") == 30
    with pytest.raises(PlacementError):
        blocks_for_budget(2**20, cfg, "float32")


def rec(start, end, *, kp=None, model=MODEL, state="online", ago=0.0, hashes=None, n=30) -> PeerRecord:
    now = time.time() - ago
    return PeerRecord(
        peer_id=peer_id(kp or create_new_key_pair()).to_base58(), model=model, num_blocks=n,
        start=start, end=end, block_hashes=tuple((hashes or fake_hashes(n))[start:end]), dtype="bfloat16",
        throughput=10.0, cache_tokens=100, addrs=("/ip4/127.0.0.1/tcp/1",), timestamp=now,
        expires=now + 30, started=now - 60, state=state)


def test_coverage_counts_fresh_online_consistent_peers():
    recs = [rec(0, 15), rec(15, 30), rec(0, 15), rec(10, 30),
            rec(0, 30, state=OFFLINE), rec(0, 30, ago=100), rec(0, 30, model="other"),
            rec(0, 10, hashes=fake_hashes(30, "evil"))]
    cov = coverage(recs, MODEL, 30, expected_hashes=fake_hashes(30))
    assert cov.servable and cov.missing == []
    assert cov.replicas == [2] * 10 + [3] * 5 + [2] * 15
    assert len(cov.peers) == 4 and len(cov.excluded) == 1
    assert "other weights" in next(iter(cov.excluded.values()))
    d = cov.to_dict()
    assert d["servable"] and d["min_replicas"] == 2 and len(d["blocks"]) == 30 and len(d["peers"]) == 4
    assert all(p["age_s"] >= 59 and p["last_heartbeat_s"] < 5 for p in d["peers"])
    text = format_text(cov)
    assert "servable" in text and "0-9" in text and "uncovered" not in text


def test_coverage_reports_holes():
    cov = coverage([rec(0, 10), rec(20, 30)], MODEL, 30)
    assert not cov.servable and cov.missing == list(range(10, 20))
    assert "NOT servable" in format_text(cov) and "uncovered" in format_text(cov)
    assert not coverage([], MODEL, 30).servable


def test_the_manifest_not_a_majority_of_records_says_how_many_blocks_a_model_has():
    """Three throwaway records claiming a 256-block model outnumber two real peers: they are
    excluded, and the real peers cover the manifest's 30 blocks."""
    fakes = [rec(0, 256, n=256) for _ in range(3)]
    cov = coverage([rec(0, 15), rec(15, 30), *fakes], MODEL, 30, expected_hashes=fake_hashes(30))
    assert cov.num_blocks == 30 and cov.servable and cov.replicas == [1] * 30
    assert len(cov.excluded) == 3 and all("256 blocks" in why for why in cov.excluded.values())


def test_peer_lines_stay_aligned_with_a_variant_in_the_span_column():
    from dataclasses import replace

    hashes = fake_hashes(130)
    recs = [rec(0, 15, hashes=hashes, n=130), replace(rec(100, 130, hashes=hashes, n=130), extra={"quant": "int4"})]
    lines = format_text(coverage(recs, MODEL, 130, expected_hashes=hashes,
                                 variants={"none": hashes, "int4": hashes})).splitlines()
    at = lines.index(next(line for line in lines if line.lstrip().startswith("peer ")))
    peers = lines[at + 1:at + 3]
    assert "[100,130) int4" in peers[1]
    assert len({line.index(" ago") for line in peers}) == 1, lines  # the columns after the span line up
