"""What `diffuse join` adds to a control-plane node: load the span, measure it, serve sessions."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffuse.control.dial import open_stream
from diffuse.data.chain import LINK_OPEN_S, DialPeer
from diffuse.data.codec import PROTOCOL_ID
from diffuse.data.levels import LEVELS
from diffuse.data.server import BlockServer, ServerLimits
from diffuse.data.stream import ByteStream
from diffuse.model.engine import BlockSpan
from diffuse.model.load import load_span

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contribution:
    """What a peer lends of its machine: torch threads, concurrent sessions, KV-cache tokens."""

    threads: int
    max_sessions: int
    cache_tokens: int


def contribution(level: str, cache_tokens: int, cores: int) -> Contribution | None:
    """What `level` lends of a machine with `cores` cores and `cache_tokens` of KV cache to
    give; None: serve nothing (pause)."""
    try:
        share = LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown contribution level {level!r}: choose one of {', '.join(LEVELS)}") from None
    if share is None:
        return None
    cpu, sessions, cache = share
    return Contribution(max(1, int(cores * cpu)), sessions, max(1, int(cache_tokens * cache)))


def measure_throughput(span: BlockSpan, tokens: int = 8) -> float:
    """Tokens/s one sequence gets through the span (single-token decode, the common step)."""
    cache = span.new_cache(tokens + 1)
    h = torch.randn(1, 1, span.cfg.hidden_size, dtype=cache.k.dtype, device=cache.k.device)
    span(h, torch.tensor([0]), cache)  # warm-up
    t0 = time.perf_counter()
    for i in range(1, tokens):
        span(h, torch.tensor([i]), cache)
    seconds = (time.perf_counter() - t0) / (tokens - 1)
    cache.wipe()
    return round(1.0 / max(seconds, 1e-6), 2)


class PeerService:
    """The inference handler of one peer; `prepare` loads the chosen span before it is announced."""

    def __init__(self, model_dir: Path, model_id: str, dtype: torch.dtype, device: str = "cpu",
                 limits: ServerLimits | None = None, wrap: Callable[[BlockSpan], BlockSpan] | None = None,
                 throughput: float | None = None, quant: str = "none"):
        self.model_dir, self.model_id, self.dtype, self.device = model_dir, model_id, dtype, device
        self.quant = quant  # the variant it holds: its blocks, hashes and kernels
        self.limits = limits or ServerLimits()
        self.wrap = wrap  # what serves the loaded span instead of it (testing only: `join --tamper`)
        self.server: BlockServer | None = None
        # An operator's figure replaces the start-up measurement, which peers starting together on
        # shared cores skew (and routes follow it).
        self.throughput: float | None = throughput
        self.given_throughput = throughput
        self.dial: DialPeer | None = None  # streams to other peers (chained sessions' links): `use_host`
        self.alter_forward = None  # TESTING ONLY: `join --tamper forward` (trust/tamper.py)

    def use_host(self, host: Any) -> None:
        """Dial other peers through `host` (the node's, once it exists) for chained sessions."""

        async def dial(peer_id: str, addrs: tuple[str, ...]) -> ByteStream:
            return await open_stream(host, peer_id, PROTOCOL_ID, addrs, timeout=LINK_OPEN_S)

        self.dial = dial
        if self.server is not None:
            self.server.dial = dial

    def use(self, model_dir: Path, model_id: str) -> None:
        """Serve another model from the next `prepare` on (join --model auto moving, once the
        current sessions have drained)."""
        self.model_dir, self.model_id, self.throughput = model_dir, model_id, self.given_throughput

    async def prepare(self, start: int, end: int) -> float:
        def load() -> tuple[BlockServer, float]:
            span = load_span(self.model_dir, start, end, self.dtype, self.device, quant=self.quant)  # verifies hashes
            throughput = self.throughput or measure_throughput(span)
            served = span if self.wrap is None else self.wrap(span)
            return BlockServer(self.model_id, served, self.limits), throughput

        self.server, self.throughput = load()  # on the main thread, like every step (server.py)
        self.server.dial, self.server.alter_forward = self.dial, self.alter_forward
        log.info("blocks %d:%d loaded, %.1f tokens/s", start, end, self.throughput)
        return self.throughput

    async def handle(self, stream: ByteStream, remote: str) -> None:
        """One inference stream from peer `remote` (libp2p authenticated it: its id is the key of
        its share of this peer)."""
        if self.server is None:  # not announced yet, so nobody should be here
            await stream.close()
            return
        await self.server.handle(stream, remote)

    def status(self) -> dict:
        if self.server is None:
            return {}
        return {"throughput": self.throughput, "cache_tokens": self.server.free_tokens,
                "sessions": self.server.sessions}

    async def drain(self, timeout: float) -> int:
        """Refuse new sessions, give open ones `timeout` s to finish, hand off the rest."""
        return 0 if self.server is None else await self.server.drain(timeout)

    def resume(self) -> None:
        """Take sessions again after a drain (contribution auto returning)."""
        if self.server is not None:
            self.server.accepting = True

    protocols = (PROTOCOL_ID,)
