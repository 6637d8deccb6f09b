"""Peers' batch traces (DIFFUSE_BATCH_TRACE, data/scheduler.py): a peer process started with it
naming a directory appends every forward pass its span computes to PID.trace there, as "start end
steps" on the system-wide monotonic clock, so two peers on one machine show whether they computed
at the same time. Two peers of one chain computing at once compute different sessions: a
session's next step needs the client's token from its last one."""

from __future__ import annotations

from pathlib import Path

Batch = tuple[float, float, int]  # start, end (monotonic seconds), steps in the pass


def trace_file(directory: Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.trace"


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def read(path: Path, offset: int = 0) -> list[Batch]:
    """The passes written to `path` from byte `offset` on."""
    if not path.exists():
        return []
    with open(path) as f:
        f.seek(offset)
        rows = [line.split() for line in f.read().splitlines()]
    return [(float(a), float(b), int(n)) for a, b, n in rows]


def overlap(a: list[Batch], b: list[Batch]) -> float:
    """Seconds during which a pass of `a` and a pass of `b` computed at once (one peer's passes
    follow one another, so no second is counted twice)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1, _ in a for s2, e2, _ in b)


def busy(batches: list[Batch]) -> float:
    return sum(e - s for s, e, _ in batches)


def steps_per_pass(batches: list[Batch]) -> float:
    return sum(n for *_, n in batches) / max(1, len(batches))
