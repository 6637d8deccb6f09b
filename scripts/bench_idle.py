#!/usr/bin/env python
"""What an idle swarm costs the machine it runs on, by heartbeat: a sentinel and six `diffuse
join` peers on loopback serving no session, their processes' CPU over a quiet window, against
the default heartbeat measured in the same run.

    .venv/bin/python scripts/bench_idle.py [--beats 2 5 15] [--window 30]

Each heartbeat re-signs a peer's record and stores it under every key it is kept at (its peer
key, one per window of blocks, the model's blocks key) on the closest nodes, which check it:
the cost grows with the beat's rate and the swarm's size. The test swarms renew records faster
than the default (scripts/support/swarm.py QUICK_RECORDS) so that restarts show soon; this is
what that costs them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.procs import Procs  # noqa: E402
from support.swarm import Swarm  # noqa: E402

from diffuse.control.announce import DEFAULT_HEARTBEAT_S  # noqa: E402
from diffuse.home import DEFAULT_MODEL, models_dir  # noqa: E402

SPANS = {"p0": "0:10", "p1": "10:20", "p2": "20:30", "p3": "0:15", "p4": "15:30", "p5": "0:30"}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU of the processes so far (/proc/PID/stat fields 14 and 15)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def idle_cores(home: Path, beat: float, settle: float, window: float) -> float:
    with Procs(home) as procs:
        Swarm(procs, Path(tempfile.mkdtemp()), SPANS,
              join=["--heartbeat", f"{beat:g}", "--ttl", f"{max(30.0, 3 * beat):g}", "--throughput", "10"])
        time.sleep(settle)  # start-up work (loading, first lookups) out of the window
        pids = [p.p.pid for p in procs.procs]
        before = cpu_seconds(pids)
        time.sleep(window)
        return (cpu_seconds(pids) - before) / window


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--beats", type=float, nargs="+", default=[2.0, 5.0, DEFAULT_HEARTBEAT_S])
    p.add_argument("--window", type=float, default=30.0, help="seconds measured, per heartbeat")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after every peer serves")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("DIFFUSE_HOME", Path.home() / ".diffuse")))
    a = p.parse_args()
    if not (models_dir(a.home) / DEFAULT_MODEL).is_dir():
        sys.exit(f"error: no {DEFAULT_MODEL} under {a.home} (run scripts/setup.sh)")
    beats = sorted(set(a.beats) | {DEFAULT_HEARTBEAT_S})
    cores = {b: idle_cores(a.home, b, a.settle, a.window) for b in beats}
    base = cores[DEFAULT_HEARTBEAT_S]
    print(f"sentinel + {len(SPANS)} idle peers, {a.window:g} s window")
    print("| heartbeat s | CPU (cores) | / default beat |")
    print("|---|---|---|")
    for b in beats:
        print(f"| {b:g} | {cores[b]:.2f} | {cores[b] / base:.1f}x |")


if __name__ == "__main__":
    main()
