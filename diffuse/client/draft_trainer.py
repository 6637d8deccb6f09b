"""Training the draft head in the background of a peer (`diffuse join`) and of `diffuse api`.

A model without a draft head speculates poorly, and training one takes minutes of both cores, so
a peer or API that has none trains it while nobody is asking anything of it: in a child process
(`diffuse model draft-head`) at the lowest priority, stopped (SIGSTOP) as soon as the peer
serves a session or the API answers a request and continued (SIGCONT) after some idle seconds,
killed when the parent leaves. A lock file beside the head keeps a second trainer off the same
home (the child holds it too, so a parent killed outright still blocks another until the child
ends); the head is written to a temporary file and renamed, so a killed run leaves none behind.
`--no-train-draft` or DIFFUSE_TRAIN_DRAFT=0 (tests and benchmarks set it) turns it off.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import TracebackType

from diffuse.errors import ModelError
from diffuse.model import store

ENV = "DIFFUSE_TRAIN_DRAFT"
_PR_SET_PDEATHSIG = 1


def enabled(flag: bool) -> bool:
    """Whether to train in the background: the flag (`--no-train-draft` clears it) and the environment."""
    return flag and os.environ.get(ENV, "1") != "0"


def _log(msg: str) -> None:
    print(f"draft head: {msg}", file=sys.stderr, flush=True)


class DraftTrainer:
    """Supervises one background `diffuse model draft-head` run for `model` (a store name or
    model directory) in `home`.

    `busy()` says whether the parent is serving now; the child starts once it has been idle for
    `idle` seconds and the model has no head, stops whenever it is busy, continues after `idle`
    seconds idle again. Use as a context manager: leaving it kills the child."""

    def __init__(self, home: Path, model: str, busy: Callable[[], bool], idle: float = 30.0, poll: float = 1.0,
                 extra: tuple[str, ...] = (), log: Callable[[str], None] = _log):
        from diffuse.client import draft_head  # torch: not before a command needs it

        self.home, self.model, self.busy, self.idle, self.poll = home, model, busy, idle, poll
        self.extra, self.log = extra, log
        self.name = Path(model).name
        self.file = draft_head.path(home, self.name)  # where `model draft-head` writes it
        self.child: subprocess.Popen | None = None
        self.stopped = False  # the child is SIGSTOPped
        self.done = threading.Event()  # set when leaving
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DraftTrainer:
        if not self.file.exists():
            self._thread = threading.Thread(target=self._run, name="draft-trainer", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.done.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        """Waits for idleness, then runs the child to its end (or until leaving), under the lock."""
        lock = None
        try:
            if not self._wait_idle():
                return
            self.file.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.file.with_suffix(".lock"), "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.log(f"another process is training {self.name}'s; not starting")
                return
            if self.file.exists():
                return
            self._supervise(lock.fileno())
        finally:
            if lock is not None:
                lock.close()

    def _wait_idle(self) -> bool:
        """True once `busy()` has been false for `idle` seconds; False when leaving first."""
        since = time.monotonic()
        while not self.done.wait(self.poll):
            if self.busy():
                since = time.monotonic()
            elif time.monotonic() - since >= self.idle:
                return True
        return False

    def _supervise(self, lock_fd: int) -> None:
        argv = [sys.executable, "-m", "diffuse", "--home", str(self.home), "model", "draft-head", self.model,
                *self.extra]
        libc = ctypes.CDLL(None)  # loaded here: the child between fork and exec only calls it

        def setup() -> None:  # in the child: lowest priority, and killed if this thread dies
            os.nice(19)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

        out = open(self.file.with_suffix(".log"), "w")
        try:
            self.child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                          pass_fds=(lock_fd,), preexec_fn=setup)
        finally:
            out.close()
        self.log(f"training {self.name}'s in the background (pid {self.child.pid}, nice 19; "
                 f"log {out.name}), paused while serving")
        since = time.monotonic()  # when the parent was last busy
        try:
            while self.child.poll() is None:
                if self.done.wait(self.poll):
                    return
                if self.busy():
                    since = time.monotonic()
                    if not self.stopped:
                        self.child.send_signal(signal.SIGSTOP)
                        self.stopped = True
                        self.log("paused: serving")
                elif self.stopped and time.monotonic() - since >= self.idle:
                    self.child.send_signal(signal.SIGCONT)
                    self.stopped = False
                    self.log(f"resumed after {self.idle:g} s idle")
            if self.child.returncode == 0 and self.file.exists():
                self.log(f"trained -> {self.file}")
            else:
                self.log(f"training failed (exit {self.child.returncode}); see {out.name}")
        finally:
            if self.child.poll() is None:
                self.child.kill()  # a stopped process dies of SIGKILL too
                self.child.wait()
                self.file.with_suffix(".tmp").unlink(missing_ok=True)
                self.log("training stopped: leaving")


def counting(app: Callable[..., Awaitable[None]], activity: MutableMapping[str, float]
             ) -> Callable[..., Awaitable[None]]:
    """The ASGI `app`, keeping in `activity["requests"]` how many /v1 requests are being answered
    (the API's work; status pages and metrics do not count)."""
    activity.setdefault("requests", 0)

    async def wrapped(scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http" or not scope.get("path", "").startswith("/v1/"):
            return await app(scope, receive, send)
        activity["requests"] += 1
        try:
            await app(scope, receive, send)
        finally:
            activity["requests"] -= 1

    return wrapped


def background(home: Path, model: str | Path | None, busy: Callable[[], bool], wanted: bool = True
               ) -> AbstractContextManager:
    """What `join` and `api` run under: a trainer for `model` (a store name or directory) in
    `home`, or nothing when it is not `wanted`, turned off by the environment, or the model is not
    there (the command itself says so)."""
    if not enabled(wanted):
        return nullcontext()
    try:
        path = store.resolve(home, None if model is None else str(model))
    except ModelError:
        return nullcontext()
    return DraftTrainer(home, str(path), busy)
