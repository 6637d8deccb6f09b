"""`diffuse api` in this process: the client service behind the HTTP app until SIGINT or SIGTERM,
the default model's draft head training in the background while no request is being answered."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import trio

from diffuse.api.app import Settings, create_app
from diffuse.client import draft_trainer
from diffuse.client.service import ServiceConfig, open_service
from diffuse.http import serve_http


@contextmanager
def serving(config: ServiceConfig, options: Mapping[str, Any], listen: str, train_draft: bool,
            show: Callable[[str], None]) -> Iterator[Callable[[], Awaitable[None]]]:
    """The coroutine function that serves (`show` gets `listening on URL`), with the draft
    trainer around it; `options`: the API's Settings by field name (others are ignored)."""
    settings = Settings(**{f.name: options[f.name] for f in dataclasses.fields(Settings) if f.name in options})
    activity: dict[str, float] = {}  # /v1 requests being answered: the draft head trains only while none are

    async def main() -> None:
        async with open_service(config) as service, trio.open_nursery() as nursery:
            app = draft_trainer.counting(create_app(service, settings), activity)
            show(f"listening on {(await nursery.start(serve_http, app, listen))[0]}")
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    with draft_trainer.background(config.home, config.models[0], lambda: activity.get("requests", 0) > 0,
                                  train_draft):
        yield main
