"""Which sources a fetch draws on at once, let go of and called up by the rate they add.

More sources are not always faster: where the receiver's CPU, not the sources' links, bounds a
fetch (a fast link, or sources on the receiver's own machine), each further source only adds
streams to juggle and processes competing for the cores, and the fetch slows down. So a fetch
(data/fetcher.py) starts from the best sources it knows (fastest on earlier files; those not yet
tried first, in the order given), as many as served best on the last file (two at first), and
compares the rate they deliver together over short windows: it lets the slowest go while that
costs less than LOSS of the rate; if none could go, it calls one more up while that adds at least
GAIN (if one could, the sources do not bound the fetch, and more would not help); then it keeps
what it has. A receiving loop busy for BUSY of a window (computing, or ready to and waiting for a
core: `loop_seconds`) means the receiver bounds the fetch: no source is called up then, and one
busy in the first window keeps the fastest source alone at once. Steering waits until bytes flow
(streams opening, a GET's round trip, may take longer than a window), and a trial waits out one
window before its own (pieces in flight finishing). A rate counts the bytes of the sources at work
alone: one let go finishes the piece it has, and its bytes would make the rate without it look
unchanged. Only a file with enough left to tell is steered. A source that fails, is dropped or
answers BUSY is replaced from the reserve at once, whatever the windows say; one that failed is
never called up again for the file. The count and each source's rate carry over to the next file
of the same fetcher.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import trio

WINDOW_S = 0.15  # one measurement
LOSS, GAIN = 0.95, 1.10  # a source is let go if the rate keeps above LOSS without it; kept if it adds GAIN
BUSY = 0.8  # share of a window the receiving loop was busy from which the receiver bounds the fetch
START_WIDTH = 2  # sources at work at once on a fetcher's first file


class Crew:
    """The sources of one fill: `working` (their workers take pieces) and `reserve`; `cpu`, the
    receiving loop's busy seconds (`loop_seconds`)."""

    def __init__(self, live: list[str], width: int, rates: dict[str, float], start: Callable[[str], None],
                 cpu: Callable[[], float] | None = None) -> None:
        order = sorted(live, key=lambda p: -rates.get(p, math.inf))  # stable: the untried first, as given
        n = max(1, min(width, len(order)))
        self.working, self.reserve, self.start, self.cpu = order[:n], order[n:], start, cpu or loop_seconds
        self.busy = 0.0  # share of the last window the receiving loop was busy

    def begin(self) -> None:
        for peer in self.working:
            self.start(peer)

    def call_up(self) -> str | None:
        """Put the first of the reserve to work; None if none is left."""
        if not self.reserve:
            return None
        peer = self.reserve.pop(0)
        self.working.append(peer)
        self.start(peer)
        return peer

    def drop(self, peer: str) -> None:
        """`peer` failed, was dropped, or is busy: another from the reserve takes its place (one let
        go whose last piece failed leaves the reserve: it is never called up again)."""
        if peer in self.reserve:
            self.reserve.remove(peer)
        if peer in self.working:
            self.working.remove(peer)
            self.call_up()

    def let_go(self, peer: str) -> None:
        if peer in self.working:
            self.working.remove(peer)
            self.reserve.insert(0, peer)

    def restore(self, peer: str) -> None:
        """Put a source let go back to work."""
        if peer in self.reserve:
            self.reserve.remove(peer)
            self.working.append(peer)
            self.start(peer)

    async def steer(self, received: Callable[[], int], by_peer: dict[str, int], left: Callable[[], int]) -> None:
        """Let sources go, then call them up, while the rate says so; until there is too little left
        to tell (the caller cancels it when the fill ends). A receiving loop busy in the first
        window keeps the fastest source alone at once: a trial would cost windows of a fetch that
        more sources only slow down."""
        first = received()
        while received() == first:  # nothing yet: streams opening, a GET's round trip
            await trio.sleep(WINDOW_S / 10)
        start, per = await self._rates(received, by_peer)  # the first bytes: requests starting up
        if self.busy >= BUSY and len(self.working) > 1 and left() > start * WINDOW_S:
            for peer in sorted(self.working, key=lambda p: per.get(p, 0))[:-1]:
                self.let_go(peer)
            return
        rate = 0.0
        while not rate:
            rate, per = await self._rates(received, by_peer)
        going, shed = "down" if len(self.working) > 1 else "up", False
        while going and rate and left() > rate * 3 * WINDOW_S:
            if going == "down" and len(self.working) > 1:
                slowest = min(self.working, key=lambda p: per.get(p, 0))
                self.let_go(slowest)
                without, after = await self._trial(received, by_peer)
                if without >= rate * LOSS:
                    rate, per, shed = without, after, True
                    continue
                self.restore(slowest)
                going = "" if shed else "up"
            elif going == "down":  # shed down to one: the sources do not bound this fetch
                going = ""
            elif self.busy >= BUSY:  # the receiver bounds this fetch: another source only costs it
                going = ""
            elif (trial := self.call_up()) is not None:
                with_it, after = await self._trial(received, by_peer)
                if with_it >= rate * GAIN:
                    rate, per = with_it, after
                    continue
                self.let_go(trial)
                going = ""
            else:
                going = ""

    async def _trial(self, received: Callable[[], int], by_peer: dict[str, int]) -> tuple[float, dict[str, int]]:
        """The rates one window after a change, once the window it takes to settle has passed."""
        await _window(received)
        return await self._rates(received, by_peer)

    async def _rates(self, received: Callable[[], int], by_peer: dict[str, int]) -> tuple[float, dict[str, int]]:
        """The rate of the sources at work over one window (the bytes of one let go, still on its
        piece, are not theirs), and each peer's bytes in it; notes how busy the receiving loop was."""
        received()  # brings `by_peer` up to date where it is computed on demand
        before, at, cpu = dict(by_peer), trio.current_time(), self.cpu()
        await trio.sleep(WINDOW_S)
        received()
        took = max(trio.current_time() - at, 1e-9)
        self.busy = (self.cpu() - cpu) / took
        per = {p: n - before.get(p, 0) for p, n in by_peer.items()}
        return sum(per.get(p, 0) for p in self.working) / took, per


def loop_seconds() -> float:
    """Seconds this thread (the receiving loop) has computed or waited, ready, for a core (Linux's
    schedstat): on a machine whose cores are all taken the loop gets less CPU time than it wants,
    and its CPU time alone would read it as idle. Elsewhere its CPU time."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return (int(ran) + int(waited)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


async def _window(received: Callable[[], int]) -> float:
    """Bytes per second over one window."""
    start, at = received(), trio.current_time()
    await trio.sleep(WINDOW_S)
    return (received() - start) / max(trio.current_time() - at, 1e-9)
