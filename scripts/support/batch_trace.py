"""Peers' batch traces (DIFFUSE_BATCH_TRACE, data/scheduler.py): a peer process started with it
naming a directory appends every forward pass each of its servers (one per model) computes to
that server's file there (trace_name: PID-model.trace), as "start end steps sessions" on the
system-wide monotonic clock, so two peers on one machine show whether they computed at the same
time; sessions are the pass's steps' session ids at that peer (hex, comma-separated). Two peers
of one chain computing at once compute different sessions: a session's next step needs the
client's token from its last one."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from diffuse.data.scheduler import trace_name
from diffuse.home import DEFAULT_MODEL


class Batch(NamedTuple):
    start: float  # monotonic seconds
    end: float
    steps: int  # steps in the pass
    sessions: tuple[str, ...]  # each step's session id at that peer (hex), "-" where it had none


def trace_file(directory: Path, pid: int, model: str = DEFAULT_MODEL) -> Path:
    return Path(directory) / trace_name(pid, model)


def size(path: Path) -> int:
    """Bytes up to the end of the last whole line: where the next pass's line starts."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    return data.rfind(b"\n") + 1


def read(path: Path, offset: int = 0) -> list[Batch]:
    """The passes written to `path` from byte `offset` on (a last line still being written is left out)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode().split("\n")[:-1]  # the piece after the last newline is not a whole line
    return [Batch(float(r[0]), float(r[1]), int(r[2]), tuple(r[3].split(",")) if len(r) > 3 else ())
            for r in (line.split() for line in lines)]


def of_sessions(batches: list[Batch], sessions: set[str]) -> list[Batch]:
    """The passes that computed a step of one of `sessions`."""
    return [b for b in batches if sessions.intersection(b.sessions)]


def steps_of(batches: list[Batch], sessions: set[str]) -> int:
    """Steps of `sessions` in `batches`."""
    return sum(s in sessions for b in batches for s in b.sessions)


def overlap(a: list[Batch], b: list[Batch]) -> float:
    """Seconds during which a pass of `a` and a pass of `b` computed at once (one peer's passes
    follow one another, so no second is counted twice)."""
    return sum(max(0.0, min(x.end, y.end) - max(x.start, y.start)) for x in a for y in b)


def busy(batches: list[Batch]) -> float:
    return sum(b.end - b.start for b in batches)


def steps_per_pass(batches: list[Batch]) -> float:
    return sum(b.steps for b in batches) / max(1, len(batches))
