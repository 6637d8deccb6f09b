"""The byte stream a session runs over (a libp2p stream, or an in-memory one in tests)."""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)
READ_CHUNK = 1 << 16  # one read may carry several frames: fewer yamux reads, each a fixed cost


class ByteStream(Protocol):
    async def read(self, n: int = -1) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close(self) -> None: ...


async def close_quietly(stream: ByteStream) -> None:
    """Close a stream that may already be gone (py-libp2p then raises types of its own)."""
    try:
        await stream.close()
    except Exception as e:  # noqa: BLE001 - any failure to close a dead stream means it is closed
        log.debug("closing a stream: %s", e)
