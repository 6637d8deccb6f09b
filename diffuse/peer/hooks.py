"""What the data plane adds to a peer's node: its stream handlers, live status, span loading."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuse.control.ladder import AUTO
from diffuse.data.serve import Contribution, PeerService
from diffuse.data.admission import Books
from diffuse.data.levels import AutoLimits
from diffuse.data.server import ServerLimits
from diffuse.metrics import watch_peer
from diffuse.model.load import parse_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """How a peer serves: its compute dtype and device, the throughput it announces (None:
    measured), its KV-cache and session bounds, how much of the machine it lends
    (data/serve.py: LEVELS; `client_only` lends nothing), and TESTING ONLY a tampering double
    (trust/tamper.py) corrupting a share of its outputs."""

    dtype: str = "bf16"
    device: str = "cpu"
    quant: str = "none"  # the variant of the blocks it holds (model/variants.py)
    throughput: float | None = None
    cache_tokens: int = 65536
    max_session_tokens: int = 8192
    session_timeout: float = 300.0
    contribution: str = "max"
    client_only: bool = False
    tamper: tuple[str, float] | None = None
    tamper_rate: float = 1.0
    tamper_after: int = 0
    drain_timeout: float = 30.0
    auto: AutoLimits = field(default_factory=AutoLimits)  # contribution "auto": when to pause and return


@dataclass
class ServeHooks:
    """Stream handlers (registered before the host listens), a status callback read at every
    heartbeat ({"cache_tokens": .., "throughput": .., ...}), the protocols served, `prepare(start,
    end)`, awaited once the span is chosen and before it is announced (load and verify the blocks;
    return measured tokens/s or None), `drain(timeout)` and `use(model_dir, model_id)`."""

    handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = field(default_factory=dict)
    status_fn: Callable[[], Mapping[str, Any]] | None = None
    protocols: tuple[str, ...] = ()
    prepare: Callable[[int, int], Awaitable[float | None]] | None = None
    drain: Callable[[float], Awaitable[int]] | None = None
    use: Callable[[Path, str], None] = lambda model_dir, model_id: None  # serve this model from the next prepare
    resume: Callable[[], None] = lambda: None  # take sessions again after a drain
    use_host: Callable[[Any], None] = lambda host: None  # the node's host, to dial the next peer of a chain


def data_plane_hooks(serve: ServeConfig, model_dir: Path, model_id: str, lend: Contribution | None,
                     metered: bool, books: Books | None = None) -> ServeHooks:
    """The inference service: blocks are loaded (and checked against the manifest) once the span
    is chosen, measured, and served on /diffuse/inference/1.0.0; `metered`: counted for /metrics;
    `books`: the credit ledger that orders a full peer's waiting OPENs."""
    limits = ServerLimits(max_session_tokens=serve.max_session_tokens,
                          max_total_tokens=lend.cache_tokens if lend else serve.cache_tokens,
                          idle_timeout=serve.session_timeout, max_sessions=lend.max_sessions if lend else 0,
                          books=books)
    wrap = alter = None
    if serve.tamper is not None and serve.tamper[0] == "forward":
        from diffuse.trust.tamper import altered_forward

        alter = altered_forward(serve.tamper[1])
        log.warning("TESTING ONLY: this peer alters the outputs it forwards to the next peer of a chain")
    elif serve.tamper is not None:
        from diffuse.trust.tamper import Tamper  # the test double loads only when asked for

        kind, strength = serve.tamper
        wrap = Tamper(kind, strength, serve.tamper_rate, after=serve.tamper_after).wrap
        log.warning("TESTING ONLY: this peer tampers with %s of its outputs (%s, strength %g) past position %d",
                    f"{serve.tamper_rate:.0%}", kind, strength, serve.tamper_after)
    service = PeerService(model_dir, model_id, parse_dtype(serve.dtype), serve.device, limits, wrap,
                          serve.throughput, serve.quant)
    service.alter_forward = alter
    handle = service.handle
    if metered:
        handle = watch_peer(lambda: service.model_id, lambda: service.server.status() if service.server else {},
                            handle)
    return ServeHooks(handlers={p: handle for p in service.protocols}, status_fn=service.status,
                      protocols=service.protocols, prepare=service.prepare, drain=service.drain, use=service.use,
                      resume=service.resume, use_host=service.use_host)


def placed(status_fn: Callable[[], Mapping[str, Any]] | None) -> Callable[[], Mapping[str, Any]]:
    """The data plane's status, and that this peer places itself (its record's ext["placement"]):
    other auto peers take turns with it to fill a gap (control/ladder.py)."""
    return lambda: {**(status_fn() if status_fn else {}), "placement": AUTO}
