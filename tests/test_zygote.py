"""The test zygote's children behave as exec'd `diffuse` children: their own environment, working
directory, arguments, streams and exit status, and signals reach them."""

from __future__ import annotations

import os
import signal

import pytest

from support.procs import Procs
from support.swarm import LOCAL
from support.zygote import Forked

pytestmark = pytest.mark.timeout(120)


def test_a_forked_child_takes_its_own_environment_arguments_and_exit_status(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Procs(tmp_path / "a") as a, Procs(tmp_path / "b") as b:
        first, second = a.run("id"), b.run("id")
        assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
        assert first.stdout != second.stdout  # each took its own $DIFFUSE_HOME, so its own identity
        assert (tmp_path / "a" / "identity.key").exists() and (tmp_path / "b" / "identity.key").exists()
        relative = a.run("--home", "rel", "id")
        assert relative.returncode == 0 and (tmp_path / "rel" / "identity.key").exists()  # its cwd is ours
        wrong = a.run("no-such-command")
        assert wrong.returncode == 2 and "invalid choice" in wrong.stderr


def test_a_forked_server_is_signalled_and_reaped_like_a_popen(tmp_path):
    with Procs(tmp_path) as procs:
        stopped, killed = (procs.start("sentinel", "--listen", LOCAL, "--identity", str(tmp_path / f"{n}.key"))
                           for n in range(2))
        assert isinstance(stopped.p, Forked) and stopped.p.pid != os.getpid()
        for proc in (stopped, killed):
            assert proc.readline(60).startswith("/ip4/127.0.0.1/tcp/") and proc.p.poll() is None
        stopped.signal(signal.SIGTERM)
        killed.signal(signal.SIGKILL)
        assert stopped.wait(30) == 0 and killed.wait(30) == -signal.SIGKILL
        assert killed.p.poll() == -signal.SIGKILL
