"""Daemons in a swarm of real processes on 127.0.0.1: a daemon serving blocks answers `ask` from
another process that imports neither torch nor py-libp2p, with the in-process model's tokens;
`status` and `api` go through it; `status` from an empty home reads the swarm (the manifest
fetched from peers by the hash their records announce); a `--client-only` daemon answers too and never appears in the
swarm's records; a SIGKILLed daemon leaves `ask` working without it, with a notice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from diffuse.daemon.client import running
from support.procs import DIFFUSE, Procs
from support.swarm import LOCAL, QUICK_RECORDS, Swarm
from test_swarm import QUESTION, TOKENS, reference_answer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HEAVY = """
import sys
from diffuse.cli import main
code = main({argv!r})
print("HEAVY", code, sorted(m for m in ("torch", "libp2p") if m in sys.modules))
"""


@pytest.fixture(scope="module")
def reference(home) -> list[int]:
    return reference_answer(home)


def own_home(home: Path, at: Path) -> Path:
    at.mkdir(parents=True)
    (at / "models").symlink_to(home / "models")
    return at


def cli(env: dict[str, str], *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(DIFFUSE + list(argv), capture_output=True, text=True, env=env, timeout=timeout)


def light_ask(env: dict[str, str], *extra: str) -> dict:
    """`ask --json` through the daemon in a process that must load neither torch nor py-libp2p."""
    argv = ["ask", "--json", "--max-tokens", str(TOKENS), *extra, QUESTION]
    out = subprocess.run([sys.executable, "-c", HEAVY.format(argv=argv)], capture_output=True, text=True, env=env,
                         timeout=300)
    *answer, heavy = out.stdout.splitlines()
    assert heavy == "HEAVY 0 []", (out.stdout, out.stderr)
    return json.loads(answer[0])


def status_of(env: dict[str, str]) -> dict:
    out = cli(env, "daemon", "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_peer_and_client_only_daemons(home, tmp_path, reference):
    with Procs(home) as procs:
        swarm = Swarm(procs, tmp_path / "swarm", {"A": "1:30"})
        peer = procs.env | {"DIFFUSE_HOME": str(own_home(home, tmp_path / "peer"))}
        client = procs.env | {"DIFFUSE_HOME": str(own_home(home, tmp_path / "client"))}
        try:
            out = cli(peer, "daemon", "start", "--bootstrap", swarm.boot, "--listen", LOCAL, "--blocks", "1:30",
                      "--identity", str(tmp_path / "daemon.key"), *QUICK_RECORDS, "--no-speculate", "--wait", "30")
            assert out.returncode == 0 and "a peer node" in out.stdout, out.stderr
            deadline = time.monotonic() + 180
            while not any(s.startswith("serving ") for s in status_of(peer)["serving"]):
                assert time.monotonic() < deadline, status_of(peer)
                time.sleep(0.5)
            assert status_of(peer)["contribution"] == {"level": "max"}
            got = light_ask(peer)
            assert got["token_ids"] == reference and got["mode"] == "swarm"
            out = cli(peer, "status", "--json")  # through the daemon: no --bootstrap given
            assert out.returncode == 0, out.stderr
            (model,) = json.loads(out.stdout)["models"]
            assert len(model["peers"]) == 2 and model["missing"] == [0], model  # block 0 stays with clients
            empty = procs.env | {"DIFFUSE_HOME": str(tmp_path / "empty")}  # no model in its store
            out = cli(empty, "status", "--bootstrap", swarm.boot, "--json", "--no-reach")
            assert out.returncode == 0, out.stderr
            (model,) = json.loads(out.stdout)["models"]
            assert model["model"] == "SmolLM2-135M-Instruct" and len(model["peers"]) == 2, model
            assert not (tmp_path / "empty" / "models").exists()

            out = cli(client, "--client-only", "daemon", "start", "--bootstrap", swarm.boot, "--no-speculate")
            assert out.returncode == 0 and "a client-only node" in out.stdout, out.stderr
            assert light_ask(client)["token_ids"] == reference
            api_answers(procs, client, reference)
            out = cli(client, "status", "--json", "--no-reach")
            (model,) = json.loads(out.stdout)["models"]
            assert len(model["peers"]) == 2, model  # the client-only daemon announces nothing

            pid = status_of(peer)["pid"]
            subprocess.run(["kill", "-9", str(pid)], check=True)
            deadline = time.monotonic() + 30
            while running(Path(peer["DIFFUSE_HOME"])) is not None:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            out = cli(peer, "ask", "--json", "--bootstrap", swarm.boot, "--max-tokens", str(TOKENS), "--no-speculate",
                      "--wait", "30", QUESTION)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["token_ids"] == reference and "is gone (a stale socket" in out.stderr
        finally:
            for env in (peer, client):
                cli(env, "daemon", "stop", timeout=150)


def api_answers(procs: Procs, env: dict[str, str], reference: list[int]) -> None:
    """`diffuse api` through the daemon: the OpenAI endpoint answers with the same tokens."""
    api = subprocess.Popen(DIFFUSE + ["api", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = api.stdout.readline()
        assert line.startswith("listening on "), api.stderr.read() if api.poll() is not None else line
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": TOKENS, "temperature": 0,
                           "messages": [{"role": "user", "content": QUESTION}]}).encode()
        request = urllib.request.Request(line.split()[-1] + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == len(reference), answer
        api.send_signal(signal.SIGTERM)
        assert api.wait(timeout=30) == 0
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
