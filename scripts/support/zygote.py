"""`diffuse` children forked from a process that has already imported torch and libp2p.

Starting the CLI costs about 2.5 s of CPU in imports, most of it torch and libp2p, and tests start
hundreds of children on two cores. A zygote imports those once; each child is a fork of it that
takes the request's arguments, environment, working directory and standard streams, then runs the
CLI's entry point exactly as `python -c "from diffuse.cli import run; run()"` would. Children are
still separate OS processes on real sockets; only the import is shared.

The zygote imports third-party packages alone, never diffuse, whose modules may read the
environment when imported. It is single-threaded when it forks (numpy's pool aside, which is
fork-safe), and it serves only children that compute on one thread (OMP_NUM_THREADS=1), the
setting it started with.

Each child comes with a reaper: a fork between the zygote and the child that waits for it and
reports its pid, then its exit status, on a socket of the child's own, so the caller's handle
(`Forked`) offers what `subprocess.Popen` does (poll, wait, signals, pipes)."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

# What the CLI's commands import that costs: loaded once in the zygote.
PRELOAD = ("torch", "numpy", "libp2p", "trio", "safetensors", "tokenizers", "httpx", "requests",
           "prometheus_client", "nacl.secret", "cryptography.hazmat.primitives.asymmetric.ed25519")
MAX_REQUEST = 1 << 20
ZYGOTE_ENV = "DIFFUSE_TEST_ZYGOTE"


def serve(control: socket.socket) -> None:
    """The zygote's loop: fork a reaper per request. Returns only in a child, set up to run the CLI."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the reapers are reaped by the kernel
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, MAX_REQUEST, 4)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)  # the caller has gone
        if os.fork() == 0:
            control.close()
            _reap(json.loads(msg), fds)
            return
        for fd in fds:
            os.close(fd)


def _reap(request: dict, fds: list[int]) -> None:
    """In the reaper: fork the child, report its pid and then its exit status. Returns only in the
    child, with its streams, directory, environment and argv those of the request."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stdin, stdout, stderr, status = fds
    pid = os.fork()
    if pid == 0:
        os.close(status)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-c", *request["args"]]
        return
    for fd in (stdin, stdout, stderr):
        os.close(fd)
    try:
        os.write(status, f"{pid}\n".encode())
        _, code = os.waitpid(pid, 0)
        os.write(status, f"{os.waitstatus_to_exitcode(code)}\n".encode())
    except OSError:
        pass  # the caller has gone: nobody to tell
    os._exit(0)


def main(control: int) -> None:
    """The zygote's process: preload, serve on the `control` fd, and in each child run the CLI."""
    for name in PRELOAD:
        __import__(name)
    serve(socket.socket(fileno=control))
    import torch

    torch.set_num_threads(1)
    from diffuse.cli import run

    run()


class Forked:
    """A forked `diffuse` child, with the part of `subprocess.Popen`'s interface tests use."""

    def __init__(self, args: Sequence[str], pid: int, status: socket.socket, stdout, stderr) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout, self.stderr = stdout, stderr
        self._status = status
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            try:
                ready = select.select([self._status], [], [], timeout)[0]
            except (OSError, ValueError):
                ready = True  # another thread collected it and closed the socket
            if ready:
                with self._lock:
                    if self.returncode is None:
                        line = self._status.recv(64)
                        self.returncode = int(line) if line else -signal.SIGKILL  # a killed reaper says nothing
                        self._status.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """This process's zygote: started on first use, gone when this process is."""

    def __init__(self) -> None:
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "LIBP2P_DEBUG"} | {
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        code = f"from support.zygote import main; main({theirs.fileno()})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env,
                                      stdin=subprocess.DEVNULL, cwd=Path(__file__).parents[1])
        theirs.close()
        self._lock = threading.Lock()

    def spawn(self, args: Sequence[str], env: dict[str, str]) -> Forked:
        """Fork `diffuse ARGS` in `env`, its stdout and stderr as text pipes, stdin empty."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"the zygote exited with {self._proc.returncode}")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ours, theirs = socket.socketpair()
        request = json.dumps({"args": list(args), "env": env, "cwd": os.getcwd()}).encode()
        try:
            with open(os.devnull) as null, self._lock:
                socket.send_fds(self._control, [request], [null.fileno(), out_w, err_w, theirs.fileno()])
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        if not select.select([ours], [], [], 60)[0]:
            raise RuntimeError(f"the zygote did not fork diffuse {' '.join(args)} within 60 s")
        first = ours.recv(64).decode()
        pid, _, rest = first.partition("\n")
        child = Forked(args, int(pid), ours, open(out_r), open(err_r))
        if rest.strip():
            child.returncode = int(rest)
            ours.close()
        return child


@functools.cache
def zygote() -> Zygote:
    return Zygote()


def forkable(env: dict[str, str]) -> bool:
    """Whether a child in `env` starts from the zygote: where $DIFFUSE_TEST_ZYGOTE is 1 (tests set it;
    benchmarks start children as users do) and the child computes on one thread, as the zygote."""
    return env.get(ZYGOTE_ENV) == "1" and env.get("OMP_NUM_THREADS") == "1"

