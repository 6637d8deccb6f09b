"""The daemon's parts that need no swarm: the control protocol's checks (a bad request is answered
with an error naming the field, and the daemon keeps serving), the unit files `daemon install`
writes (checked by `systemd-analyze verify` where systemd is; under CI its absence fails), and a
local daemon's life: one per home, `ask` through it in a process that imports neither torch nor
py-libp2p, a SIGKILL leaving a stale socket that `ask` says and goes past."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffuse.daemon import client, protocol, units
from diffuse.validate import Malformed
from support.procs import DIFFUSE

pytestmark = pytest.mark.timeout(600)


def test_requests_are_checked_and_name_what_is_wrong():
    ask = protocol.parse(b'{"op": "ask", "messages": [{"role": "user", "content": "hi"}], "sampling": {"top_k": 3}}')
    assert isinstance(ask, protocol.Ask) and ask.sampling.top_k == 3 and ask.keep
    for line, where in [(b'{"op": "ask"}', "messages"), (b'{"op": "launch"}', "op"), (b"[1]", None),
                        (b'{"op": "status", "v": 2}', "v"), (b'{"op": "status", "extra": 1}', "extra"),
                        (b'{"op": "ask", "messages": [{"role": "root", "content": "x"}]}', "messages[0].role"),
                        (b'{"op": "api", "listen": "x", "max_sessions": 0}', "max_sessions"), (b"\xff{", None)]:
        with pytest.raises(Malformed) as e:
            protocol.parse(line)
        assert e.value.field == where, (line, e.value)


def test_per_ask_options_travel_only_when_given_and_a_daemon_running_others_says_mismatch(tmp_path):
    from types import SimpleNamespace

    from diffuse.cli import build_parser
    from diffuse.client.service import ServiceConfig
    from diffuse.daemon.process import Daemon, DaemonConfig

    parse = build_parser().parse_args
    plain = client.ask_request(vars(parse(["ask", "hi"])), [{"role": "user", "content": "hi"}])
    assert not set(plain) & set(protocol.OPTIONS), plain  # the parser's defaults: whatever the daemon runs
    asked = client.ask_request(vars(parse(["ask", "hi", "--route", "chain", "--accept-quant", "int8, none",
                                           "--quant", "int8", "--exact"])), [{"role": "user", "content": "hi"}])
    assert {k: asked[k] for k in protocol.OPTIONS} == {"quant": "int8", "accept_quant": "int8, none",
                                                        "route": "chain", "exact": True}
    api = client.api_request(vars(parse(["api", "--route", "star"])), frozenset())
    assert api["route"] == "star" and "quant" not in api
    swarm = SimpleNamespace(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",),
                            options=SimpleNamespace(route="chain", accept_quant="none,int8"))
    daemon = Daemon(DaemonConfig(tmp_path, ServiceConfig(tmp_path, swarm=swarm, quant="int8", exact=True), "peer"))
    assert daemon._why_not(protocol.parse(json.dumps({"op": "ask"} | asked).encode())) is None
    assert daemon._why_not(protocol.parse(json.dumps({"op": "ask"} | plain).encode())) is None
    for given, why in [({"route": "star"}, "--route chain, not --route star"), ({"exact": False}, "not --no-exact"),
                       ({"quant": "none"}, "--quant int8, not --quant none"),
                       ({"accept_quant": "any"}, "not --accept-quant any")]:
        assert why in daemon._why_not(protocol.parse(json.dumps({"op": "ask"} | plain | given).encode()))
    local = Daemon(DaemonConfig(tmp_path, ServiceConfig(tmp_path), "local"))
    assert "whole model" in local._why_not(protocol.parse(json.dumps({"op": "ask"} | plain | {"route": "chain"})
                                                          .encode()))


def _argv() -> list[str]:
    return ["daemon", "run", "--bootstrap", "/ip4/127.0.0.1/tcp/31330/p2p/QmX", "--contribution", "auto",
            "--auto-limits", "cpu=30,idle=120", "--system", "50% of $HOME \"quoted\""]


def test_systemd_unit_is_accepted_by_systemd_analyze(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    home = tmp_path / "home"
    out = units.install(home, _argv(), platform="linux")
    path = units.unit_path(home, "linux")
    assert str(path) in out and path.parent == tmp_path / "config" / "systemd" / "user"
    text = path.read_text()
    assert f"--home {home.resolve()} daemon run" in text and "50%% of $$HOME" in text and "Restart=on-failure" in text
    assert "WantedBy=default.target" in text and f"StandardOutput=append:{home.resolve()}/daemon.log" in text
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing (apt-get install systemd): the unit cannot be verified")
        pytest.skip("systemd-analyze is missing (apt-get install systemd)")
    check = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and path.name not in check.stderr, check.stderr
    units.uninstall(home, platform="linux")
    assert not path.exists()


def test_launchd_agent_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / "home"
    units.install(home, _argv(), platform="darwin")
    agent = plistlib.loads(units.unit_path(home, "darwin").read_bytes())
    assert agent["ProgramArguments"] == [sys.executable, "-m", "diffuse", "--home", str(home.resolve()), *_argv()]
    assert agent["RunAtLoad"] and agent["KeepAlive"] == {"SuccessfulExit": False} and agent["Label"].startswith(
        "org.diffuse.diffuse-")
    assert agent["StandardErrorPath"] == str(home.resolve() / "daemon.log")


HEAVY = """
import sys
from diffuse.cli import main
code = main({argv!r})
print("HEAVY", code, sorted(m for m in ("torch", "libp2p") if m in sys.modules))
"""


def _cli(home: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(DIFFUSE + ["--home", str(home), *argv], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def own_home(home, tmp_path) -> Path:
    """A home of its own (one daemon per home) sharing the session's model store."""
    own = tmp_path / "h"
    own.mkdir()
    (own / "models").symlink_to(home / "models")
    return own


def test_a_local_daemon_answers_from_a_light_process_and_its_death_is_survived(own_home):
    home = own_home
    try:
        started = _cli(home, "daemon", "start", "--local")
        assert started.returncode == 0 and "ready, a local node" in started.stdout, started.stderr
        assert (home / "daemon.sock").stat().st_mode & 0o777 == 0o600
        again = _cli(home, "daemon", "start", "--local")
        assert again.returncode == 2 and "a daemon already runs for" in again.stderr, again.stderr
        argv = ["--home", str(home), "ask", "--json", "--max-tokens", "8", "What is the capital of France?"]
        out = subprocess.run([sys.executable, "-c", HEAVY.format(argv=argv)], capture_output=True, text=True,
                             timeout=120)
        *answer, heavy = out.stdout.splitlines()
        assert heavy == "HEAVY 0 []", (out.stdout, out.stderr)
        here = _cli(home, "ask", "--no-daemon", "--local", "--json", "--max-tokens", "8",
                    "What is the capital of France?")
        assert json.loads(answer[0])["token_ids"] == json.loads(here.stdout)["token_ids"]
        with socket.socket(socket.AF_UNIX) as s:  # a bad request gets its error; the daemon serves on
            s.connect(str(home / "daemon.sock"))
            s.sendall(b'{"op": "ask", "messages": []}\n')
            reply = json.loads(s.makefile().readline())
        assert reply == {"error": "bad request: messages: expected `array` of length >= 1", "kind": "bad-request"}
        status = json.loads(_cli(home, "daemon", "status", "--json").stdout)
        assert status["state"] == "ready" and status["role"] == "local" and status["mode"] == "local"
        os.kill(status["pid"], signal.SIGKILL)
        _gone(home)
        after = _cli(home, "ask", "--local", "--max-tokens", "8", "What is the capital of France?")
        assert after.returncode == 0 and "Paris" in after.stdout, after.stderr
        assert "notice: the daemon of" in after.stderr and "is gone (a stale socket" in after.stderr
        assert not (home / "daemon.sock").exists()
        assert _cli(home, "daemon", "status").returncode == 3
    finally:
        _cli(home, "daemon", "stop", timeout=150)


def _gone(home: Path) -> None:
    """Until the killed daemon's last thread is gone (its lock with it)."""
    deadline = time.monotonic() + 30
    while client.running(home) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_auto_limits_parse_and_judge():
    import argparse

    from diffuse.data.levels import AutoLimits, parse_limits
    from diffuse.peer.auto import over

    assert parse_limits("cpu=30, idle=5") == AutoLimits(cpu=30.0, idle=5.0)
    for bad in ("cpu=101", "busy=0", "speed=3", "cpu", "idle=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_limits(bad)
    limits = AutoLimits()
    assert over({"cpu": 24.0, "memory": 9.0}, limits) is None
    assert over({"cpu": 50.0}, limits) == "other processes use 50% of the CPUs (limit 25%)"
    assert over({"cpu": 1.0, "memory": 40.0}, limits) == "other processes use 40% memory pressure (limit 10%)"


def test_the_machine_counts_other_processes_not_its_own_tree(tmp_path):
    """Which processes count as others', judged from /proc (not from CPU figures, which every
    other process on a loaded machine moves): this process's busy child is its own, an orphaned
    busy process is another's, and its CPU ticks are what the share sums."""
    from diffuse.peer.auto import Machine, _stat

    machine = Machine(tmp_path)
    mine = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    orphan = ("import subprocess as s, sys\nprint(s.Popen([sys.executable, '-c', 'while True: pass'], "
              "stdout=s.DEVNULL, stderr=s.DEVNULL, start_new_session=True).pid)")  # its parent exits at once
    other = int(subprocess.run([sys.executable, "-c", orphan], capture_output=True, text=True, timeout=60).stdout)
    try:
        time.sleep(1.0)
        procs = {pid: st for pid in os.listdir("/proc") if pid.isdigit() and (st := _stat(pid))}
        ours = machine._ours(procs)
        assert {str(os.getpid()), str(mine.pid)} <= ours
        assert str(other) in procs and str(other) not in ours
        assert procs[str(other)][2] > 0  # ticks used: what Machine.cpu sums over the others
    finally:
        os.kill(other, signal.SIGKILL)
        mine.kill()
        mine.wait()


def test_status_sends_accept_quant_only_when_given_and_an_older_daemon_refusing_a_field_is_done_without(tmp_path):
    import fcntl
    import threading

    from diffuse.cli import build_parser

    plain = client.survey_request(vars(build_parser().parse_args(["status"])))
    assert "accept_quant" not in plain and "model_hash" not in plain
    assert isinstance(protocol.parse(json.dumps(plain).encode()), protocol.Survey)
    asked = client.survey_request(vars(build_parser().parse_args(["status", "--accept-quant", "int4"])))
    assert asked["accept_quant"] == "int4"
    pinned = client.survey_request(vars(build_parser().parse_args(["status", "--model-hash", "m=" + "a" * 64])))
    assert protocol.parse(json.dumps(pinned).encode()).model_hash == ["m=" + "a" * 64]
    sock_path, pid_path, _ = protocol.paths(tmp_path)  # a "daemon": this process holds the lock, a thread answers
    lock = os.open(pid_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(lock, b"1")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen()
    answers = [protocol.error("bad request: accept_quant: unknown field"), b"<html>\n"]

    def serve() -> None:
        for answer in answers:
            conn, _ = server.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        for _ in answers:
            said: list[str] = []
            assert client.call(tmp_path, asked, say=said.append) is None
            assert "going on without it" in said[0], said
    finally:
        thread.join(10)
        server.close()
        os.close(lock)


def test_ask_and_api_from_swarm_fetch_in_their_process_first_then_hand_the_daemon_the_stored_model(tmp_path,
                                                                                                 monkeypatch):
    """`--from-swarm`: the command fetches what the client holds (stubbed here) before it asks the
    daemon, which is then asked for the fetched store name, as for any stored model."""
    from diffuse.cli import build_parser
    from diffuse.client import options

    events: list = []

    def fetch(opts, home, models, boot, access, mdns):
        events.append(("fetch", tuple(models), tuple(boot)))
        return tuple(f"fetched-{m or 'default'}" for m in models)

    def serve_api(home, request, on_listening, say):
        events.append(("api", list(request["models"])))
        return True  # the daemon served it

    def ask(home, request, on_text, say):
        events.append(("ask", request["model"]))
        return {"text": "", "finish_reason": "stop"}

    monkeypatch.setattr(options, "fetch_for_client", fetch)
    monkeypatch.setattr(client, "serve_api", serve_api)
    monkeypatch.setattr(client, "ask", ask)
    boot = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWA1aRqSx6ZtVKZ9sKmUj1FpD8RkYb6cJqGvWm4n2hHxYz"
    for argv in (["api", "--listen", "127.0.0.1:0", "--model", "m"], ["ask", "hi"]):
        args = build_parser().parse_args(["--home", str(tmp_path), *argv, "--from-swarm", "--mode", "public",
                                          "--bootstrap", boot])
        assert args.func(args) == 0
    assert events == [("fetch", ("m",), (boot,)), ("api", ["fetched-m"]),
                      ("fetch", (None,), (boot,)), ("ask", "fetched-default")], events
