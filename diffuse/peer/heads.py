"""The draft heads a peer offers over the files protocol, announced in its record."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from diffuse.client import draft_fetch
from diffuse.data.files import PROTOCOL_ID, FileServer
from diffuse.peer.offer import offer


class DraftHeads:
    """The files protocol serving this peer's draft heads (client/draft_fetch.py), and per model id
    the record fields announcing its head (`heads`; none: nothing to offer for it yet). Its handler
    is always set (handlers go on before the host runs), so that a head trained after the start
    (in the background) is served and announced without a restart."""

    def __init__(self, home: Path, models: Mapping[str, Path], say: Callable[[str], None]) -> None:
        self.home, self.models, self.say = home, models, say
        self.server, self.protocol = FileServer(), PROTOCOL_ID
        self.handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = {PROTOCOL_ID: self.server.serve}
        self.heads = draft_fetch.offer(self.server, home, models)

    def manifest(self, model_id: str, span: tuple[int, int] | None = None,
                 variant: Path | None = None) -> dict[str, Any]:
        """Serve the model's manifest by hash, and the blocks of `span` (of the quantized `variant`
        where it serves one: peer/offer.py); the record fields that announce them, so that a node
        without the weights can read the swarm (`diffuse status` from an empty store) and start
        from it (`join --from-swarm`)."""
        return offer(self.server, Path(self.models[model_id]), span, variant)

    async def watch(self, node: Any, every: float = 15.0) -> None:
        """Every `every` seconds, offer a head that appeared for the model being served, and
        amend the announcement to say so."""
        while True:
            await trio.sleep(every)
            serving = node.announcer.serving if node.announcer is not None else None
            if serving is None or serving.model in self.heads or serving.model not in self.models:
                continue
            found = draft_fetch.offer(self.server, self.home, {serving.model: self.models[serving.model]})
            if found:
                self.heads.update(found)
                node.amend(protocols=tuple(serving.protocols) + (self.protocol,),
                           extra=dict(serving.extra) | found[serving.model])
                self.say(f"offering the draft head of {serving.model} trained since the start")
