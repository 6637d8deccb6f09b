"""`--contribution auto`: lend the machine only while its owner does not use it.

Every `every` seconds the peer reads what the other processes use: their share of the CPUs, the
memory pressure (Linux PSI, "some" over 10 s), and where `nvidia-smi` runs, the GPU if another
process computes on it. "Other" is everything but this node's own process tree and the diffuse
processes of its home (a client asking it, a daemon's children), so the peer does not pause for
its own work. CPU is summed over the processes this peer can see in /proc, not /proc/stat's
machine-wide counters, so a PID namespace (`unshare --pid --mount-proc`) bounds what counts.

Past a limit for `busy` seconds the peer drains as on SIGTERM (withdraws its announcement, gives
open sessions the drain timeout, then hands them to replicas, whose replay keeps the answer
unchanged) and pauses; under every limit for `idle` seconds it announces again. The two windows
are the hysteresis that keeps it from flapping; BOINC's defaults (25% CPU by others; back after
three minutes) are the starting point.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from diffuse.data.levels import AutoLimits

CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
GPU_QUERY_S = 5.0


def _stat(pid: str) -> tuple[int, int, int] | None:
    """(ppid, start time, CPU ticks used) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    after = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    return int(after[1]), int(after[19]), int(after[11]) + int(after[12])


def _home_of(pid: str) -> Path | None:
    """The diffuse home of a `diffuse` process (--home, else $DIFFUSE_HOME, else ~/.diffuse)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        if not any("diffuse" in a for a in argv):
            return None
        if "--home" in argv[:-1]:
            return Path(argv[argv.index("--home") + 1]).expanduser().resolve()
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
                   .split("\0") if "=" in e)
    except OSError:
        return None
    found = env.get("DIFFUSE_HOME") or (str(Path(env["HOME"]) / ".diffuse") if "HOME" in env else None)
    return Path(found).expanduser().resolve() if found else None


class Machine:
    """What the other processes of this machine use, sampled on each call."""

    def __init__(self, home: Path) -> None:
        self.home = home.expanduser().resolve()
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.last: tuple[float, dict[tuple[str, int], int]] | None = None
        self.homes: dict[tuple[str, int], bool] = {}  # (pid, start) -> a diffuse process of our home
        self.watched = os.path.isdir("/proc/self")

    def _ours(self, procs: dict[str, tuple[int, int, int]]) -> set[str]:
        """This process's tree and our home's diffuse processes (with their trees)."""
        roots = {str(os.getpid())}
        for pid, (_, start, _) in procs.items():
            key = (pid, start)
            if key not in self.homes:
                self.homes[key] = _home_of(pid) == self.home
            if self.homes[key]:
                roots.add(pid)
        children: dict[str, list[str]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(str(ppid), []).append(pid)
        ours, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid not in ours:
                ours.add(pid)
                todo += children.get(pid, [])
        return ours

    def cpu(self, procs: dict[str, tuple[int, int, int]], ours: set[str]) -> float:
        """% of the CPUs the other processes used since the last call (0 at the first)."""
        now = time.monotonic()
        ticks = {(pid, start): used for pid, (_, start, used) in procs.items() if pid not in ours}
        last, self.last = self.last, (now, ticks)
        if last is None or now <= last[0]:
            return 0.0
        used = sum(t - last[1].get(key, 0) for key, t in ticks.items())  # a newcomer counts from its start
        return 100.0 * used / CLOCK_TICK / (now - last[0]) / self.cpus

    @staticmethod
    def memory() -> float | None:
        """PSI's "some avg10" for memory: % of the last 10 s some task waited for memory."""
        try:
            with open("/proc/pressure/memory") as f:
                return float(f.readline().split()[1].split("=")[1])
        except (OSError, IndexError, ValueError):
            return None

    def gpu(self, ours: set[str]) -> float | None:
        """GPU utilisation % while another process computes on it (0 when none does); None without nvidia-smi."""
        if shutil.which("nvidia-smi") is None:
            return None
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=GPU_QUERY_S).stdout.split()
            if not set(apps) - ours:
                return 0.0
            util = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=GPU_QUERY_S).stdout.split()
            return max(float(u) for u in util) if util else None
        except (OSError, subprocess.SubprocessError, ValueError):
            return None

    def sample(self) -> dict[str, float]:
        procs = {pid: s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid))}
        ours = self._ours(procs)
        use = {"cpu": round(self.cpu(procs, ours), 1)}
        if (memory := self.memory()) is not None:
            use["memory"] = memory
        if (gpu := self.gpu(ours)) is not None:
            use["gpu"] = gpu
        return use


def over(use: dict[str, float], limits: AutoLimits) -> str | None:
    """Why the machine is in use now (None: it is idle enough to lend)."""
    words = {"cpu": "of the CPUs", "memory": "memory pressure", "gpu": "of the GPU"}
    for key, what in words.items():
        if key in use and use[key] > getattr(limits, key):
            return f"other processes use {use[key]:.0f}% {what} (limit {getattr(limits, key):g}%)"
    return None


class Auto:
    """The pause-and-return loop; `state()` is what `daemon status` shows."""

    def __init__(self, limits: AutoLimits, home: Path, pause: Callable[[], Awaitable[None]],
                 resume: Callable[[], Awaitable[None]], say: Callable[[str], None]) -> None:
        self.limits, self.home, self._pause, self._resume, self.say = limits, home, pause, resume, say
        self.paused: str | None = None
        self.use: dict[str, float] = {}

    def state(self) -> dict[str, object]:
        return {"level": "auto", "lending": "pause" if self.paused else "max", "paused": self.paused,
                "others": self.use}

    async def run(self) -> None:
        machine, limits = Machine(self.home), self.limits
        if not machine.watched:
            self.say("contribution auto: this system has no /proc to watch; lending as max")
            return
        busy_since = idle_since = None
        while True:
            await trio.sleep(limits.every)
            self.use = await trio.to_thread.run_sync(machine.sample)
            why, now = over(self.use, limits), trio.current_time()
            busy_since, idle_since = (busy_since or now, None) if why else (None, idle_since or now)
            if why and not self.paused and now - busy_since >= limits.busy:
                self.paused = why
                self.say(f"contribution auto: pausing: {why} for {limits.busy:g} s; draining")
                await self._pause()
                self.say("contribution auto: paused")
            elif self.paused and not why and now - idle_since >= limits.idle:
                self.say(f"contribution auto: returning: the machine was idle for {limits.idle:g} s")
                await self._resume()
                self.paused = None
                self.say("contribution auto: serving again")
