"""Prometheus metrics of one Diffuse process (API or peer) and an endpoint that serves them.

The metrics both roles share are defined here once, so one dashboard reads any mix of API
servers and peers; `role` tells a client's view (a token's trip through the whole model) from
a server's (a step through its own span). They live in a registry of our own rather than
prometheus_client's global one, which libraries (libp2p) may fill with theirs.
"""

from __future__ import annotations

import trio
from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest,
)

disable_created_metrics()  # the *_created series double the exposition and no dashboard reads them
REGISTRY = CollectorRegistry()
# 1 ms (a few local blocks) .. 10 s (a failover replay): one step spans both extremes.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

TOKENS_GENERATED = Counter("diffuse_tokens_generated", "Tokens sampled for this process's clients",
                           ["model"], registry=REGISTRY)
PROMPT_TOKENS = Counter("diffuse_prompt_tokens", "Prompt tokens prefilled for this process's clients",
                        ["model"], registry=REGISTRY)
TOKENS_SERVED = Counter("diffuse_tokens_served", "Token positions this peer computed through its blocks",
                        ["model"], registry=REGISTRY)
STEP_SECONDS = Histogram("diffuse_step_seconds", "Latency of one decoding step (role=client: through "
                         "the whole model; role=server: through this peer's span)", ["role"],
                         buckets=_LATENCY_BUCKETS, registry=REGISTRY)
FIRST_TOKEN_SECONDS = Histogram("diffuse_first_token_seconds", "Prefill: from starting an answer to "
                                "its first token", buckets=_LATENCY_BUCKETS, registry=REGISTRY)
SESSIONS_OPEN = Gauge("diffuse_sessions_open", "Inference sessions open now", ["role"], registry=REGISTRY)
FAILOVERS = Counter("diffuse_failovers", "Peers a client session replaced after they failed",
                    ["model"], registry=REGISTRY)
FAILED_CHECKS = Counter("diffuse_failed_checks", "Peer answers or records that failed verification",
                        ["check"], registry=REGISTRY)
WIRE_BYTES = Counter("diffuse_wire_bytes", "Bytes of inference traffic on the wire",
                     ["direction"], registry=REGISTRY)  # direction: sent | received
REQUESTS = Counter("diffuse_api_requests", "HTTP requests to the API by endpoint and status code",
                   ["endpoint", "code"], registry=REGISTRY)


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
    from diffuse.api.http import serve_http

    await serve_http(metrics_app, listen, task_status=task_status)
