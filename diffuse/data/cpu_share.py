"""How many of this process's cores other programs are using now: a batch's thread count depends on it.

A parallel region waits for its slowest thread, so a torch computation on as many threads as
cores stalls whenever another program runs on one of them: on a 2-core machine, another process
using a quarter of a core is enough for one thread to beat two (`scripts/bench_threads.py`;
figures: docs/measurements.md, 'Figures once quoted in module comments').
Linux counts every CPU's busy time in /proc/stat; what this process used itself (all its
threads) is subtracted.
"""

from __future__ import annotations

import os
import time

CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MIN_WINDOW = 0.2  # seconds between samples: /proc/stat counts in ticks (10 ms), per CPU
SMOOTHING = 0.5  # weight of the newest window
CPU_LINES_BYTES = 64 * 1024  # enough for ~600 CPUs' lines


class OtherLoad:
    """Cores' worth of CPU time that other programs (and the hypervisor's steal) took lately on
    the CPUs this process may run on; 0 where /proc/stat cannot be read (not Linux)."""

    def __init__(self, stat: str = "/proc/stat", smoothing: float = SMOOTHING) -> None:
        """smoothing: the weight of the newest window (1: each window's own rate, for benchmarks)."""
        self.stat, self.smoothing = stat, smoothing
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.cpus = {f"cpu{i}" for i in mine} if mine is not None else None
        self.ncpus = len(mine) if mine is not None else os.cpu_count() or 1
        self.last: tuple[float, float, float] | None = None  # (wall s, busy s of those CPUs, own CPU s)
        self.value = 0.0

    def cores(self) -> float:
        """The smoothed load of other programs, in cores, updated when MIN_WINDOW has passed
        (/proc/stat is read only then: it is called from the event loop at every batch)."""
        if self.last is not None and time.monotonic() - self.last[0] < MIN_WINDOW:
            return self.value
        sample = self._sample()
        if sample is None:
            return 0.0
        if self.last is not None:
            wall, busy, own = (a - b for a, b in zip(sample, self.last))
            now = max(0.0, (busy - own) / wall)
            self.value = (1 - self.smoothing) * self.value + self.smoothing * now
        self.last = sample
        return self.value

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            with open(self.stat) as f:
                head = f.read(CPU_LINES_BYTES)  # the per-CPU lines come first; the interrupt counts after are long
        except OSError:
            return None
        ticks = 0
        for line in head.splitlines():
            name, *fields = line.split() or [""]
            if not name.startswith("cpu"):
                break
            if name == "cpu" or (self.cpus is not None and name not in self.cpus) or len(fields) < 8:
                continue
            n = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            ticks += sum(n) - n[3] - n[4]
        return time.monotonic(), ticks / CLOCK_TICK, time.process_time()
