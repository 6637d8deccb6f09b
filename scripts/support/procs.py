"""`diffuse` children for tests and scripts alike: the command line as this interpreter runs it,
free loopback ports, processes whose stdout lines arrive without blocking (Proc) under an owner
that kills them all on exit (Procs), and servers started and waited for until they say they serve.
Under the tests, Procs' children are forks of a zygote that has imported torch (zygote.py).

The swarms `Procs` starts are private, as the CLI's default: every child finds one swarm key,
made once per process, in $DIFFUSE_SWARM_KEY, and in-process nodes joining them take
`swarm_key()`."""

from __future__ import annotations

import atexit
import functools
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from diffuse.control.modes import KEY_ENV
from diffuse.control.swarm_key import SwarmKey, read_key, write_key
from support.zygote import Forked, forkable, zygote

# The CLI entry point exactly as the `diffuse` console script runs it.
DIFFUSE = [sys.executable, "-c", "from diffuse.cli import run; run()"]


def free_port() -> int:
    """A loopback port free now, so that a restarted process, or one behind a relay, can take it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `diffuse ...` child process whose stdout lines arrive through a queue (no blocking reads)."""

    def __init__(self, args: list[str], env: dict[str, str], prefix: Sequence[str] = (),
                 program: Sequence[str] = DIFFUSE) -> None:
        self.args = args
        if not prefix and program is DIFFUSE and forkable(env):
            self.p: subprocess.Popen | Forked = zygote().spawn(args, env)
        else:
            self.p = subprocess.Popen([*prefix, *program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.p.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, self._err), daemon=True).start()

    def _err(self, line: str | None) -> None:
        if line is not None:
            self.stderr.append(line)

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def readline(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from diffuse {' '.join(self.args)} in {timeout} s; its stderr ends:\n"
                               + "\n".join(self.stderr[-40:])) from None
        if line is None:
            raise RuntimeError(f"diffuse {' '.join(self.args)} exited {self.p.wait()}:\n" + "\n".join(self.stderr))
        return line

    def read_until(self, prefix: str, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        out: list[str] = []
        while True:
            out.append(self.readline(max(0.01, deadline - time.monotonic())))
            if out[-1].startswith(prefix):
                return out

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.p.wait(timeout=timeout)


@functools.cache
def swarm_key_file() -> Path:
    """This process's swarm key, written once (mode 0600) and removed when the process ends."""
    tmp = Path(tempfile.mkdtemp(prefix="diffuse-swarm-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    write_key(tmp / "swarm.key", SwarmKey.generate())
    return tmp / "swarm.key"


def swarm_key() -> SwarmKey:
    """The key of the swarms `Procs` starts, for in-process nodes that join them."""
    return read_key(swarm_key_file())


class Procs:
    """Context manager owning child processes: every one is killed on exit, pass or fail. They
    join a private swarm, whose key in-process nodes take from `swarm_key()`. one_thread: each
    computes on one thread, as tests want (many processes share two cores); a benchmark's peers
    take every core, as a peer lending its machine would."""

    def __init__(self, home: Path, one_thread: bool = True) -> None:
        self.env = os.environ | {"DIFFUSE_HOME": str(home), "PYTHONUNBUFFERED": "1", KEY_ENV: str(swarm_key_file())}
        if one_thread:
            self.env["OMP_NUM_THREADS"] = "1"
        self.env.pop("LIBP2P_DEBUG", None)
        self.swarm_key = swarm_key()
        self.procs: list[Proc] = []

    def start(self, *args: str, prefix: Sequence[str] = (), env: dict[str, str] | None = None,
              program: Sequence[str] = DIFFUSE) -> Proc:
        """`diffuse ARGS` (or `program` ARGS) under a wrapper that execs it (`prefix`, e.g. unshare),
        in `env` (default: ours)."""
        proc = Proc(list(args), self.env | (env or {}), prefix, program)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """`diffuse ARGS` to its end, as `subprocess.run(..., capture_output=True, text=True)`."""
        if not forkable(self.env):
            return subprocess.run(DIFFUSE + list(args), capture_output=True, text=True, env=self.env, timeout=timeout)
        child = zygote().spawn(args, self.env)
        with ThreadPoolExecutor(2) as pool:
            out, err = pool.submit(child.stdout.read), pool.submit(child.stderr.read)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                raise
            return subprocess.CompletedProcess(DIFFUSE + list(args), code, out.result(), err.result())

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """SIGKILL every child still running, and reap it."""
        for proc in self.procs:
            if proc.p.poll() is None:
                proc.p.send_signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def start_server(cmd: list[str], log: Path | None = None, ready: str = "listening on ",
                 timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start a process and wait for its stdout line starting with `ready`; return it and that
    line's last word (a URL or multiaddr). Its stderr goes to `log` where given. Blocking reads
    with a kill timer: select() on a pipe misses lines a buffered readline has already pulled in."""
    with open(log, "w") if log else open(os.devnull) as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err if log else None, text=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(ready):
                return proc, line.split()[-1]
    except BaseException:
        stop_server(proc)
        raise
    finally:
        timer.cancel()
    code = proc.wait()
    stop_server(proc)
    tail = f"; stderr:\n{log.read_text()[-3000:]}" if log else ""
    raise RuntimeError(f"no {ready.strip()!r} line within {timeout:g} s (exit {code}) from "
                       f"{' '.join(cmd[-6:])}{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


@contextmanager
def local_api(home: Path, log: Path, *options: str) -> Iterator[str]:
    """`diffuse api --local` on a free port of the loopback, with `options`; yields its URL and
    stops it on the way out."""
    proc, url = start_server([*DIFFUSE, "--home", str(home), "api", "--local", "--listen", "127.0.0.1:0",
                              *options], log)
    try:
        yield url
    finally:
        stop_server(proc)
