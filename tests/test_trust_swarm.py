"""The trust plane in a real swarm: one replica runs the README's `diffuse join --tamper noise:20
--tamper-rate 0.5` (testing only: half its requests corrupted). Clients
(`diffuse --client-only ask`, separate processes) must still get the exact local answer, catch the
tamperer, publish signed evidence in the DHT, and `diffuse status` must show that evidence. Then a
second cheat joins that passes every canary (`--tamper-after 16`: it tampers only past a canary's
length): a client auditing every session catches it mid-answer, and the answer is still exact."""

from __future__ import annotations

import json
import time

import pytest

from support.procs import Procs
from support.swarm import Swarm
from test_swarm import QUESTION, TOKENS, reference_answer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def reference(home) -> list[int]:
    return reference_answer(home)


def ask(procs: Procs, boot: str, *extra: str) -> dict:
    """Like test_swarm.ask, with room for the first client to sample its canaries and calibrate
    three spans (a one-time cost per client, ~1 min on a quiet 2-core machine). Without speculation,
    whose bf16 tree steps may flip a near-tie against the one-token reference (DESIGN.md). The full
    trust plane (`--trust public`), whose evidence is published, in the private swarm Procs runs."""
    out = procs.run("--client-only", "ask", "--bootstrap", boot, "--json", "--max-tokens", str(TOKENS),
                    "--wait", "30", "--no-speculate", "--trust", "public", *extra, QUESTION, timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def listed(procs: Procs, boot: str, peers: set[str], timeout: float = 90.0) -> None:
    """Wait until the DHT lists every peer: a client that asked while the cheat's record was still
    on its way would route around it without ever meeting it."""
    deadline = time.monotonic() + timeout
    while True:
        out = procs.run("status", "--bootstrap", boot, "--json", timeout=60)
        models = json.loads(out.stdout)["models"] if out.returncode == 0 else []
        if peers <= {p["peer_id"] for m in models for p in m["peers"]}:
            return
        assert time.monotonic() < deadline, f"peers not all listed after {timeout} s: {out.stdout}{out.stderr}"
        time.sleep(1.0)


def test_tampering_replicas_are_caught_routed_around_and_reported(home, tmp_path, reference):
    with Procs(home) as procs:
        # The cheat alone covers the swarm's share in one hop, so routes try it first. Equal declared
        # speeds: start-up measurements of three peers loading at once on 2 cores can make the
        # cheat look slower than A and B together, and then no client would ever meet it.
        speed = ["--throughput", "20"]
        swarm = Swarm(procs, tmp_path, {"cheat": "1:30", "A": "1:15", "B": "15:30"},
                      {"cheat": ["--tamper", "noise:20", "--tamper-rate", "0.5", *speed], "A": speed, "B": speed})
        cheat = swarm.ids["cheat"]
        listed(procs, swarm.boot, set(swarm.ids.values()))
        got = ask(procs, swarm.boot)
        assert got["token_ids"] == reference, got
        assert cheat not in [h["peer"] for h in got["route"]]
        assert [(f["peer"], f["during"]) for f in got["failovers"]] == [(cheat, "open")]
        assert "Caught" in got["failovers"][0]["error"]

        out = procs.run("status", "--bootstrap", swarm.boot, "--json", timeout=60)
        assert out.returncode == 0, out.stderr
        (model,) = json.loads(out.stdout)["models"]
        (report,) = model["evidence"][cheat]
        assert report["kind"] == "canary" and report["start"] == 1 and report["end"] == 30
        assert report["statistic"] < report["threshold"]  # log10 p below log10 alpha
        assert set(model["evidence"]) == {cheat}  # no honest peer accused
        text = procs.run("status", "--bootstrap", swarm.boot, timeout=60).stdout
        assert f"EVIDENCE against {cheat[:6]}" in text

        # A second client (another process, another identity) reads the evidence and avoids the
        # cheat without having to be fooled first.
        again = ask(procs, swarm.boot)
        assert again["token_ids"] == reference, again
        assert not again["failovers"] and cheat not in [h["peer"] for h in again["route"]]

        # A cheat no canary catches: it serves every request that starts below position 16 (a
        # canary's length, a prompt's prefill) honestly and replaces half of the rest by noise, so
        # it passes its canaries and cheats mid-answer only. An audit must catch it: this client
        # audits every hop session (--audit-rate 1; the default audits 1 in 10, docs/trust.md).
        # Gross tampering, as audits need: their per-token tolerance for a bf16 peer against the
        # fp32 referee is wide (0.1 to 4 times a token's norm by span and canary sample): noise as
        # strong as the signal (0 dB) passed every audit in one run of five; -20 dB is ten times it.
        swarm.spans["late"] = "1:30"
        swarm.extra["late"] = ["--tamper", "noise:-20", "--tamper-rate", "0.5", "--tamper-after", "16", *speed]
        swarm.start("late")
        swarm.wait("late")
        late = swarm.ids["late"]
        listed(procs, swarm.boot, set(swarm.ids.values()))
        audited = ask(procs, swarm.boot, "--audit-rate", "1")
        assert audited["token_ids"] == reference, audited  # no tampered step reached the answer
        ((who, during, error),) = [(f["peer"], f["during"], f["error"]) for f in audited["failovers"]]
        # "check": caught by the referee behind the generation, the answer rewound to before the bad step
        assert who == late and during == "check" and "failed a spotcheck check" in error, audited["failovers"]
        assert late not in [h["peer"] for h in audited["route"]]
        assert audited["checks"]["referee_cpu_s"] > 0  # the referee thread's work, not the answer's
        out = procs.run("status", "--bootstrap", swarm.boot, "--json", timeout=60)
        (model,) = json.loads(out.stdout)["models"]
        assert set(model["evidence"]) == {cheat, late}  # still no honest peer accused
        (report,) = model["evidence"][late]
        assert report["kind"] == "spotcheck" and report["start"] == 1 and report["end"] == 30
        assert report["statistic"] > report["threshold"]  # the worst token's error above its tolerance
