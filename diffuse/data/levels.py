"""--contribution levels, apart from data/serve.py (which imports torch) so that the command
line's parser can offer them without loading it; auto's limits (peer/auto.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

# (share of the cores, sessions, share of the cache); pause lends nothing.
LEVELS: dict[str, tuple[float, int, float] | None] = {
    "max": (1.0, 64, 1.0), "moderate": (0.5, 32, 0.5), "min": (0.0, 8, 0.125), "pause": None}
AUTO = "auto"  # max while the owner leaves the machine idle, pause while not (peer/auto.py)


@dataclass(frozen=True)
class AutoLimits:
    """Limits on what other processes use, and the windows around them (`--auto-limits`)."""

    cpu: float = 25.0  # % of this machine's CPUs
    memory: float = 10.0  # % of time some task waited for memory (PSI some avg10)
    gpu: float = 25.0  # % GPU utilisation while another process computes on it
    busy: float = 60.0  # seconds past a limit before draining and pausing
    idle: float = 180.0  # seconds under every limit before serving again
    every: float = 2.0  # seconds between samples


def parse_limits(text: str) -> AutoLimits:
    """`cpu=25,memory=10,gpu=25,busy=60,idle=180,every=2`, any subset (argparse's type)."""
    given: dict[str, float] = {}
    names = [f.name for f in fields(AutoLimits)]
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if key not in names or not 0 < number < float("inf") or (key in ("cpu", "memory", "gpu") and number > 100):
            raise argparse.ArgumentTypeError(f"{part!r}: expected NAME=VALUE with NAME one of {', '.join(names)}, "
                                             "VALUE positive (a percentage at most 100 for cpu, memory and gpu)")
        given[key] = number
    return replace(AutoLimits(), **given)

