"""80 s of scripts/chaos.py's churn (peers SIGKILLed and restarted, or frozen, every 6-12 s for the
first 50 s, each among the peers answers were just routed through; then 30 s without faults) under
three users of the OpenAI-compatible API: no request may fail, and every answer must be the
fault-free one. Alone: on two cores any other test's load would change what it measures."""

from __future__ import annotations

import chaos
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(1200)]


def test_churn_fails_no_request_and_changes_no_answer(home, tmp_path):
    args = chaos.parser().parse_args(["--scenario", "churn", "--duration", "80", "--home", str(home),
                                      "--json", str(tmp_path / "chaos.json")])
    summary = chaos.run(args)  # kills every process it started, pass or fail
    assert summary["faults"] and summary["failovers"], summary  # the faults met sessions
    assert summary["problems"] == [], summary
    assert summary["failed"] == {}, summary
    assert summary["different"] == 0 and summary["without_route_facts"] == 0, summary
