"""Every message on a secured connection is written whole or not at all, even by a cancelled writer.

Noise numbers its messages, and pnet's keystream runs on: both advance when a message is
encrypted, before the socket send, whose first act is a cancellation checkpoint. A writer
cancelled there (the step of an API request whose client just hung up, a lookup that timed out)
has spent a nonce and keystream the other side never sees: it cannot decrypt anything that comes
after, and every stream on the connection stalls, with its sessions held until their idle
timeout. py-libp2p 0.8.1's `SecureSession.write` is that path for every frame yamux sends, so
`apply` makes it check for cancellation once, before anything is encrypted, and then write
shielded. A shielded write still ends: past WRITE_TIMEOUT_S (a peer that stopped reading) the
connection is closed, since part of a message may have gone out, and the writer gets an
IOException like any other broken connection's. The shield costs one cancel scope a message,
small next to the milliseconds of a token's round trip
(figures: docs/measurements.md, 'Figures once quoted in module comments').
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import trio
from libp2p.io.exceptions import IOException

SESSION = "libp2p.security.secure_session"
WRITE_TIMEOUT_S = 30.0  # one message is at most 64 KiB: only a peer that stopped reading takes this long
MARK = "_diffuse_whole_write"


def _whole(write: Callable[..., Any]) -> Callable[..., Any]:
    """`SecureSession.write` that a cancellation reaches before it encrypts, or not at all."""

    @functools.wraps(write)
    async def write_whole(self: Any, data: bytes) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True, deadline=trio.current_time() + WRITE_TIMEOUT_S) as late:
            await write(self, data)
        if late.cancelled_caught:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 1.0):
                await self.close()
            raise IOException(f"a {len(data)}-byte write took over {WRITE_TIMEOUT_S:g} s: connection closed")

    setattr(write_whole, MARK, True)
    return write_whole


def apply() -> None:
    """Install the whole-message write (idempotent); RuntimeError, before changing anything, if
    py-libp2p no longer has `SecureSession.write`."""
    session = getattr(importlib.import_module(SESSION), "SecureSession", None)
    write = vars(session).get("write") if session is not None else None
    if not callable(write):
        raise RuntimeError(f"{SESSION}.SecureSession.write is gone: diffuse.control.whole_writes needs updating")
    if not getattr(write, MARK, False):
        session.write = _whole(write)
