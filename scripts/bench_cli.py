#!/usr/bin/env python
"""Wall time of `diffuse` commands as a user runs them, each against today's path without a
daemon (`--no-daemon`) measured in the same run:

- `diffuse --help` and `diffuse ask --help` against importing torch and py-libp2p (what they used
  to load); target <= 0.3 s;
- an 8-token `ask` through a loopback swarm (a sentinel and two peers serving blocks 1:30, 127.0.0.1)
  from a warm client-only daemon, target <= 1.0 s, and the first `ask` after `daemon start`,
  target <= 5 s;
- an 8-token `ask --local` from a warm `daemon start --local`, target <= 0.7 s;
- and, for the record, how long `daemon start` takes until the daemon answers.

Each cell is the median of fresh `diffuse` processes (the --no-daemon ones load torch, the model
and, through the swarm, a libp2p host every time). The machine may be shared: compare within a run.

    .venv/bin/python scripts/bench_cli.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.procs import DIFFUSE, Procs
from support.swarm import PROMPT, Swarm

from diffuse.home import data_home, models_dir

TOKENS = 8
HELP = {
    "diffuse --help": "from diffuse.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass",
    "diffuse ask --help": "from diffuse.cli import main\ntry: main(['ask', '--help'])\nexcept SystemExit: pass",
    "python -c 'import torch, libp2p'": "import torch, libp2p",
}


def wall(argv: list[str], env: dict[str, str] | None = None, check_tokens: bool = False) -> float:
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv[-8:])} failed: {out.stderr[-2000:]}")
    if check_tokens and json.loads(out.stdout)["completion_tokens"] != TOKENS:
        raise SystemExit(f"expected {TOKENS} tokens: {out.stdout[:500]}")
    return seconds


def median(runs: int, argv: list[str], env: dict[str, str] | None = None) -> float:
    return statistics.median(wall(argv, env, check_tokens="ask" in argv) for _ in range(runs))


def ask(*options: str) -> list[str]:
    return [*DIFFUSE, "ask", "--json", "--max-tokens", str(TOKENS), *options, PROMPT]


def own_home(root: Path, name: str) -> Path:
    home = root / name
    home.mkdir()
    (home / "models").symlink_to(models_dir(data_home()))
    return home


def daemon_rows(runs: int, root: Path) -> list[tuple[str, float, float, float]]:
    rows = []
    with Procs(data_home()) as procs:
        swarm = Swarm(procs, root / "swarm", {"A": "1:30", "B": "1:30"})
        env = procs.env | {"DIFFUSE_HOME": str(own_home(root, "client"))}
        today = median(runs, ask("--no-daemon", "--bootstrap", swarm.boot), env)
        start = wall([*DIFFUSE, "--client-only", "daemon", "start", "--bootstrap", swarm.boot], env)
        try:
            first = wall(ask(), env, check_tokens=True)
            rows.append(("`daemon start` until it answers (loopback swarm)", today, start, 0.0))
            rows.append(("first ask after `daemon start` (loopback swarm)", today, first, 5.0))
            rows.append(("warm ask through the daemon (loopback swarm)", today, median(runs, ask(), env), 1.0))
        finally:
            subprocess.run([*DIFFUSE, "daemon", "stop"], env=env, capture_output=True, timeout=300)
    env = os.environ | {"DIFFUSE_HOME": str(own_home(root, "local"))}
    today = median(runs, ask("--local", "--no-daemon"), env)
    start = wall([*DIFFUSE, "daemon", "start", "--local"], env)
    try:
        first = wall(ask("--local"), env, check_tokens=True)
        rows.append(("`daemon start --local` until it answers", today, start, 0.0))
        rows.append(("first ask --local after `daemon start --local`", today, first, 5.0))
        rows.append(("warm ask --local through the daemon", today, median(runs, ask("--local"), env), 0.7))
    finally:
        subprocess.run([*DIFFUSE, "daemon", "stop"], env=env, capture_output=True, timeout=300)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per cell (median)")
    runs = parser.parse_args().runs
    helps = {name: median(runs, [sys.executable, "-c", code]) for name, code in HELP.items()}
    base = helps["python -c 'import torch, libp2p'"]
    print(f"| command | median of {runs} (ms) | vs import torch, libp2p | target |\n|---|---|---|---|")
    for name, seconds in helps.items():
        print(f"| {name} | {seconds * 1000:.0f} | {seconds / base:.2f}x | {'<= 300 ms' if 'help' in name else ''} |")
    with tempfile.TemporaryDirectory(prefix="diffuse-bench-cli-") as tmp:
        rows = daemon_rows(runs, Path(tmp))
    print(f"\n| {TOKENS}-token ask | --no-daemon (s) | through the daemon (s) | speed-up | target | met |"
          "\n|---|---|---|---|---|---|")
    for name, today, daemon, target in rows:  # target 0: a figure for the record, no target
        print(f"| {name} | {today:.2f} | {daemon:.2f} | {today / daemon:.1f}x | "
              + (f"<= {target:g} s | {'yes' if daemon <= target else 'NO'} |" if target else "- | - |"))


if __name__ == "__main__":
    main()
