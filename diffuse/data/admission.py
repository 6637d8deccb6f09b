"""A bounded admission queue: a full peer holds an OPEN a few seconds, best standing first.

Without it a full peer answered NO_CAPACITY at once and the client tried elsewhere; now an OPEN
waits up to `wait` seconds (under the client's OPEN deadline, hop.FLOOR_S) for a session to end,
and waiters are admitted in order of the standing the peer's books give their identity
(trust/credits.py through `Books`). An identity the books call exposed (it took more than it
gave) is served from idle room only, never queued. Without books every identity ranks alike, so
a client without credit sees what it saw before, except that it may wait briefly.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import Protocol

import trio


class Books(Protocol):
    def standing(self, identity: str) -> float: ...
    def exposed(self, identity: str) -> bool: ...
    def took(self, identity: str, work: int) -> None: ...


class Admission:
    """Waiting OPENs, ordered by (standing, arrival); `changed()` wakes them when room frees."""

    def __init__(self, books: Books | None, wait: float, depth: int = 64):
        self.books, self.wait, self.depth = books, wait, depth
        self.queue: list[tuple[float, int]] = []
        self._seq = itertools.count()
        self._changed = trio.Event()

    async def enter(self, remote: str, fits: Callable[[], bool]) -> bool:
        """True once the session fits and no better-standing OPEN waits; False after `wait` s, or
        at once when the queue is full or `remote` is exposed."""
        if not self.queue and fits():
            return True
        books = self.books
        if len(self.queue) >= self.depth or self.wait <= 0 or (books is not None and books.exposed(remote)):
            return False
        entry = (-(books.standing(remote) if books else 0.0), next(self._seq))
        bisect.insort(self.queue, entry)
        try:
            with trio.move_on_after(self.wait):
                while not (self.queue[0] == entry and fits()):
                    await self._changed.wait()
                return True
            return False
        finally:
            self.queue.remove(entry)
            self.changed()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def took(self, remote: str, work: int) -> None:
        if self.books is not None and work:
            self.books.took(remote, work)
