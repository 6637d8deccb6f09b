#!/usr/bin/env python
"""Fuzz a serving peer for longer than the test suite does (tests/test_fuzz_peer.py: frames of
every kind, well formed and not, in any split into reads, against a real BlockServer).

    .venv/bin/python scripts/fuzz_peer.py                    # 20,000 examples
    .venv/bin/python scripts/fuzz_peer.py --examples 200000

Hypothesis keeps what it finds in .hypothesis/ and replays it first on the next run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=20000)
    args = ap.parse_args()
    env = os.environ | {"FUZZ_EXAMPLES": str(args.examples)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "--timeout", "0",
                           str(ROOT / "tests" / "test_fuzz_peer.py")], env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
