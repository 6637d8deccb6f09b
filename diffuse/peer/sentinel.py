"""`diffuse sentinel` as a library call: a swarm's DHT bootstrap node (control/sentinel.py), its
evidence codecs and /metrics, checked before the network as a peer is (join.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from diffuse.control import pins
from diffuse.control.identity import KeyPair
from diffuse.control.modes import SwarmAccess
from diffuse.control.sentinel import run_sentinel
from diffuse.errors import DiffuseError
from diffuse.http import parse_listen
from diffuse.metrics import DHT_RECORDS, serve_metrics
from diffuse.trust import reputation

Say = Callable[[str], None]


@dataclass(frozen=True)
class SentinelConfig:
    """Which swarm (`access`), where it listens and what it announces instead, the fellow
    sentinels it dials, whether it relays and answers mDNS, where it exports /metrics (HOST:PORT),
    and the manifests it pins for nodes fetching from the swarm (`model_hash`: MODEL=SHA256 each;
    a private swarm's only, whose nodes read them: control/pins.py)."""

    access: SwarmAccess
    listen: Sequence[str]
    bootstrap: Sequence[str] = ()
    announce: Sequence[str] = ()
    relay: bool = True
    mdns: bool = False
    metrics: str | None = None
    model_hash: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.metrics:
            parse_listen(self.metrics)
        if self.model_hash and self.access.key is None:
            raise DiffuseError("--model-hash pins a manifest for a private swarm's nodes; a public swarm's do not "
                               "read pins (its joining nodes give --model-hash themselves)")
        pins.parse(self.model_hash)


async def serve_sentinel(key_pair: KeyPair, config: SentinelConfig, show: Say, say: Say) -> None:
    """Run until cancelled; `show` gets its full multiaddrs (what peers bootstrap from) once it
    listens, `say` the notices."""
    access = config.access

    def ready(addrs: list[str]) -> None:
        for a in addrs:
            show(a)
        say(f"sentinel ready ({access.describe()}); stop with Ctrl-C")
        for model, sha in pins.parse(config.model_hash).items():
            say(f"pinning {model}: nodes fetching it from the swarm trust manifest {sha}")

    async with trio.open_nursery() as nursery:
        if config.metrics:
            urls = await nursery.start(serve_metrics, config.metrics)
            say(f"metrics at {urls[0]}/metrics")
        await run_sentinel(key_pair, config.listen, config.bootstrap, ready, config.announce,
                           reputation.swarm_codecs(), access.key, access.allow, config.relay, config.mdns,
                           started=lambda node: DHT_RECORDS.set_function(node.stored_records),  # for /metrics
                           pins=pins.parse(config.model_hash))
