"""Serving an ASGI app over HTTP on trio (Hypercorn), shared by the API and peers' /metrics."""

from __future__ import annotations

import logging

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from diffuse.errors import DiffuseError


def parse_listen(listen: str) -> str:
    """'HOST:PORT' (IPv6 as '[::1]:8000'; port 0 lets the OS choose), checked before binding so
    a typo is a one-line error rather than a traceback from the server."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise DiffuseError(f"bad listen address {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return listen


async def serve_http(app, listen: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` until cancelled; `nursery.start` returns the bound URLs (the real port
    when `listen` asked for port 0)."""
    config = Config()
    config.bind = [parse_listen(listen)]
    config.alpn_protocols = ["http/1.1"]
    config.errorlog = logging.getLogger("diffuse.http")  # our log level and format, not Hypercorn's
    config.accesslog = None
    try:
        await serve(app, config, task_status=task_status)
    except OSError as e:
        raise DiffuseError(f"cannot listen on {listen}: {e.strerror or e}") from None
