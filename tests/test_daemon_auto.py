"""`--contribution auto` with real processes: a peer daemon and a CPU hog in a PID namespace of
their own (so that other tests' processes are not "other processes" to it), a replica outside.
While a client's session runs through the auto peer, the hog makes it drain and pause: the session
is handed to the replica and the answer is the in-process model's, token for token; `daemon
status` says it is paused and why; once the hog ends and the idle window passes it serves again.
The events are asserted, not their durations."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from diffuse.client.generate import Generation
from diffuse.client.local import open_local
from diffuse.client.sampling import SamplingParams
from support.procs import DIFFUSE, Procs
from support.swarm import LOCAL, PROMPT, QUICK_RECORDS, Swarm

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(900)]
TOKENS = 200  # long enough to be running still when the hog has made the peer drain (10 tokens in, here)
# The peer divides CPU use by the CPUs it may run on: pinned with the hog to one, the hog is 100%.
PIN = ["taskset", "-c", str(min(os.sched_getaffinity(0)))]
LIMITS = "cpu=25,memory=100,gpu=100,busy=0.5,idle=3,every=0.25"  # memory and gpu: not this test's business


def reference(home: Path) -> list[int]:
    model, tok = open_local(home, None, "bf16")
    prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])

    async def run():
        gen = Generation(model.session(len(prompt) + TOKENS), tok, prompt, SamplingParams(max_tokens=TOKENS))
        async for _ in gen:
            pass
        return gen.completion.token_ids

    return trio.run(run)


def status(env: dict[str, str]) -> dict:
    out = subprocess.run(DIFFUSE + ["daemon", "status", "--json"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def until(env: dict[str, str], check, what: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while not check(now := status(env)):
        assert time.monotonic() < deadline, f"never {what}: {now}"
        time.sleep(0.2)
    return now


def test_a_hog_pauses_an_auto_peer_whose_session_fails_over_unchanged(home, tmp_path):
    if not all(shutil.which(tool) for tool in ("unshare", "nsenter", "taskset")):
        pytest.skip("unshare, nsenter and taskset (util-linux) are needed to give the peer its own PID namespace "
                    "and CPU")
    expected = reference(home)
    own = tmp_path / "auto-home"
    own.mkdir()
    (own / "models").symlink_to(home / "models")
    env = {"DIFFUSE_HOME": str(own)}
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path / "swarm", {"R": "1:30"}, extra={"R": ["--throughput", "1"]})
        auto = procs.start("daemon", "run", "--bootstrap", swarm.boot, "--listen", LOCAL, "--blocks", "1:30",
                           "--identity", str(tmp_path / "auto.key"), "--throughput", "1000", *QUICK_RECORDS,
                           "--contribution", "auto", "--auto-limits", LIMITS, "--drain-timeout", "0",
                           prefix=[*PIN, "unshare", "--pid", "--fork", "--mount-proc", "--kill-child"], env=env)
        auto.read_until("daemon ready", timeout=240)
        env = procs.env | env
        try:
            watch(procs, swarm, auto, env, tmp_path, expected)
        finally:
            subprocess.run(DIFFUSE + ["daemon", "stop"], env=env, timeout=150)


def watch(procs: Procs, swarm: Swarm, auto, env: dict[str, str], tmp_path: Path, expected: list[int]) -> None:
    """With the auto peer up: a session through it, a hog, the pause, the failover, the return."""
    until(env, lambda s: any(x.startswith("serving ") for x in s["serving"]), "serving")
    ask = procs.start("--client-only", "ask", "--no-daemon", "--bootstrap", swarm.boot, "--json", "--max-tokens",
                      str(TOKENS), "--no-speculate", "--wait", "30", PROMPT)
    until(env, lambda s: s["load"].get("sessions", 0) >= 1, "a session on the auto peer")
    inside = Path(f"/proc/{auto.p.pid}/task/{auto.p.pid}/children").read_text().split()[0]
    stop = tmp_path / "hog.stop"  # the hog spins until this file appears (at most 10 minutes)
    hog = subprocess.Popen([*PIN, "nsenter", "--target", inside, "--pid", "--mount", "--", sys.executable, "-c",
                            f"import os, time\nend = time.time() + 600\n"
                            f"while time.time() < end and not os.path.exists({str(stop)!r}): pass"])
    try:
        paused = until(env, lambda s: s["contribution"]["paused"], "paused")["contribution"]
        assert paused["level"] == "auto" and paused["lending"] == "pause"
        assert "of the CPUs (limit 25%)" in paused["paused"], paused
        answer = json.loads(ask.read_until("{", timeout=600)[-1])
        assert answer["token_ids"] == expected
        assert answer["failovers"] and [h["peer"] for h in answer["route"]] == [swarm.ids["R"]], answer["route"]
    finally:
        stop.touch()
        hog.wait(timeout=60)
    until(env, lambda s: not s["contribution"]["paused"], "back")
    said = "\n".join(auto.stderr)
    events = ["contribution auto: pausing", "handed 1 sessions to replicas", "contribution auto: paused",
              "contribution auto: returning", "contribution auto: serving again"]
    assert [said.find(e) >= 0 for e in events] == [True] * len(events), said
    assert sorted(said.find(e) for e in events) == [said.find(e) for e in events], said
    out = procs.run("status", "--bootstrap", swarm.boot, "--json", "--no-reach", "--no-daemon", timeout=120)
    (model,) = json.loads(out.stdout)["models"]
    assert len(model["peers"]) == 2, model  # announced again
