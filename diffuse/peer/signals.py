"""How a long-running node ends: on SIGINT or SIGTERM it leaves gracefully (a peer drains its
sessions), and a second signal stops it at once."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import trio


async def until_signal(body: Callable[[], Awaitable[None]],
                        leave: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run `body`, then until SIGINT/SIGTERM; then `leave()` (a peer drains its sessions) unless a
    second signal comes first. Cancelled, every node's `run` withdraws its announcement."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async def leave_then_stop() -> None:
                if leave is not None:
                    await leave()
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                leaving = False
                async for _ in signals:
                    if leave is None or leaving:
                        nursery.cancel_scope.cancel()
                        return
                    leaving = True
                    nursery.start_soon(leave_then_stop)

            nursery.start_soon(watch)
            await body()
