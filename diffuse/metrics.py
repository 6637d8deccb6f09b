"""Prometheus metrics of one Diffuse process (API or peer) and an endpoint that serves them.

The metrics both roles share are defined here once, so one dashboard reads any mix of API
servers and peers; `role` tells a client's view (a token's trip through the whole model) from
a server's (a step through its own span). They live in a registry of our own rather than
prometheus_client's global one, which libraries (libp2p) may fill with theirs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import trio
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from diffuse.data.codec import ErrorCode, MsgType, peek
from diffuse.http import serve_http

disable_created_metrics()  # the *_created series double the exposition and no dashboard reads them
REGISTRY = CollectorRegistry()
# 1 ms (a few local blocks) .. 10 s (a failover replay): one step spans both extremes.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

TOKENS_GENERATED = Counter("diffuse_tokens_generated", "Tokens sampled for this process's clients",
                           ["model"], registry=REGISTRY)
PROMPT_TOKENS = Counter("diffuse_prompt_tokens", "Prompt tokens prefilled for this process's clients",
                        ["model"], registry=REGISTRY)
STEP_SECONDS = Histogram("diffuse_step_seconds", "Latency of one decoding step (role=client: through "
                         "the whole model; role=server: through this peer's span)", ["role"],
                         buckets=_LATENCY_BUCKETS, registry=REGISTRY)
FIRST_TOKEN_SECONDS = Histogram("diffuse_first_token_seconds", "Time to first token: from a request's "
                                "arrival (its wait for a session and its prefill included) to the first token "
                                "of each answer", buckets=_LATENCY_BUCKETS, registry=REGISTRY)
DHT_RECORDS = Gauge("diffuse_dht_records_stored", "Items this node's DHT store holds (a record set counted "
                    "item by item)", registry=REGISTRY)
SESSIONS_OPEN = Gauge("diffuse_sessions_open", "Inference sessions open now", ["role"], registry=REGISTRY)
FAILOVERS = Counter("diffuse_failovers", "Peers a client session replaced after they failed",
                    ["model"], registry=REGISTRY)
FAILED_CHECKS = Counter("diffuse_failed_checks", "Peer answers or records that failed verification",
                        ["check"], registry=REGISTRY)
WIRE_BYTES = Counter("diffuse_wire_bytes", "Bytes of inference traffic on the wire",
                     ["direction"], registry=REGISTRY)  # direction: sent | received
FALLBACKS = Counter("diffuse_fallbacks", "Answers given by another model because the asked one was not "
                    "servable", ["asked", "answered"], registry=REGISTRY)
DECODE_STEPS = Counter("diffuse_decode_steps", "Decoding round trips of this process's clients, by mode (tree: "
                       "guesses sent; plain: the planner's choice; held: plain because speculation did not pay)",
                       ["model", "mode"], registry=REGISTRY)
DECODE_STEP_TOKENS = Counter("diffuse_decode_step_tokens", "Tokens those round trips produced (per step: divide "
                             "by diffuse_decode_steps_total)", ["model", "mode"], registry=REGISTRY)
DECODE_STEP_POSITIONS = Counter("diffuse_decode_step_positions", "Positions those round trips sent (the root "
                                "and its guesses)", ["model", "mode"], registry=REGISTRY)
REQUESTS = Counter("diffuse_api_requests", "HTTP requests to the API by endpoint and status code",
                   ["endpoint", "code"], registry=REGISTRY)


# ERROR replies a peer sends because a request failed one of its checks (not its own trouble).
_REFUSALS = {ErrorCode.BAD_FRAME, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_MODEL,
             ErrorCode.BLOCKS_NOT_SERVED, ErrorCode.TOO_LONG, ErrorCode.BAD_STEP, ErrorCode.NUMERIC}


class MeteredStream:
    """An inference stream that counts its bytes. On a peer (`server=True`) it also times each
    step, from the read that brought the request to the write of its STEP_OK (queueing for the
    compute limiter included: that is what a client waits), and counts refused requests. It reads
    only the frame header of what the peer writes (one frame per write, see data/codec.py), so
    the data plane needs no hooks for it."""

    def __init__(self, stream: Any, server: bool = False):
        self.stream, self.server = stream, server
        self.t_request = time.perf_counter()

    async def read(self, n: int = -1) -> bytes:
        data = await self.stream.read(n)
        WIRE_BYTES.labels("received").inc(len(data))
        self.t_request = time.perf_counter()
        return data

    async def write(self, data: bytes) -> None:
        seen = peek(data) if self.server else None
        if seen is not None:
            mtype, code = seen
            if mtype == MsgType.STEP_OK:
                STEP_SECONDS.labels("server").observe(time.perf_counter() - self.t_request)
            elif code in _REFUSALS:
                FAILED_CHECKS.labels(f"request:{ErrorCode(code).name.lower()}").inc()
        await self.stream.write(data)
        WIRE_BYTES.labels("sent").inc(len(data))

    async def close(self) -> None:
        await self.stream.close()

    def __getattr__(self, name: str) -> Any:  # reset(), muxed_conn, ...: the stream's own
        return getattr(self.stream, name)


class _ServedCollector(Collector):
    """Tokens, steps and batches a peer served, read from its block server's own counters at
    scrape time."""

    def __init__(self, model: Callable[[], str], status: Callable[[], Mapping[str, Any]]):
        self.model, self.status = model, status

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s, model = self.status(), self.model()
        for name, doc, key in (("diffuse_tokens_served", "Token positions this peer computed through its blocks",
                                "tokens_served"),
                               ("diffuse_steps_served", "Steps (requests through its span) this peer answered",
                                "steps_served"),
                               ("diffuse_batches", "Forward passes through the span, each one batch of steps",
                                "batches"),
                               ("diffuse_batch_steps", "Steps computed in those passes (a long prefill once per "
                                "chunk): over diffuse_batches, the mean batch size", "batch_steps"),
                               ("diffuse_batched_steps", "Steps that shared their forward pass with another "
                                "session's", "batched_steps")):
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], float(s.get(key, 0)))
            yield family
        most = GaugeMetricFamily("diffuse_most_steps_in_flight", "The most sessions this peer has held a step of "
                                 "at once (taken, not yet answered): a high-water mark since the peer started",
                                 labels=["model"])
        most.add_metric([model], float(s.get("most_in_flight", 0)))
        yield most


def watch_peer(model: Callable[[], str], status: Callable[[], Mapping[str, Any]],
               handle: Callable[[Any, str], Awaitable[None]]) -> Callable[[Any, str], Awaitable[None]]:
    """Export a peer's counters (`status()` gives steps_served, tokens_served, sessions) under
    the model it serves now (`model()`), and return `handle` wrapped so that every inference
    stream is metered."""
    REGISTRY.register(_ServedCollector(model, status))
    SESSIONS_OPEN.labels("server").set_function(lambda: status().get("sessions", 0))

    async def metered(stream: Any, remote: str) -> None:
        await handle(MeteredStream(stream, server=True), remote)

    return metered


def exposition() -> tuple[bytes, str]:
    """The Prometheus text format of every metric, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


async def metrics_app(scope, receive, send) -> None:
    """A bare ASGI app: GET /metrics, 404 elsewhere; lifespan events are acknowledged."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/metrics":
        status, (body, ctype) = 200, exposition()
    else:
        status, body, ctype = 404, b"not found; metrics are at /metrics\n", "text/plain"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def serve_metrics(listen: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve /metrics on `listen` ('HOST:PORT') until cancelled: `await nursery.start(serve_metrics,
    addr)` returns the bound URLs."""
    await serve_http(metrics_app, listen, task_status=task_status)
