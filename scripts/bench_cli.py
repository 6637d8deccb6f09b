#!/usr/bin/env python
"""How long `diffuse --help` and `diffuse ask --help` take, against importing torch and py-libp2p
(what they used to load), measured in the same run: median of 5 fresh processes each.

    .venv/bin/python scripts/bench_cli.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

RUNS = 5
CASES = {
    "diffuse --help": "from diffuse.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass",
    "diffuse ask --help": "from diffuse.cli import main\ntry: main(['ask', '--help'])\nexcept SystemExit: pass",
    "python -c 'import torch, libp2p'": "import torch, libp2p",
}


def wall(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    medians = {name: statistics.median(wall(code) for _ in range(RUNS)) for name, code in CASES.items()}
    base = medians["python -c 'import torch, libp2p'"]
    print(f"| command | median of {RUNS} (ms) | vs import torch, libp2p |\n|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1000:.0f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
