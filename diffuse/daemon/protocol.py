"""The daemon's control socket: JSON lines over a Unix socket at <home>/daemon.sock (mode 0600).

A client sends one request, a JSON object on one line whose "op" says what it asks; the daemon
answers with lines of its own: for `ask`, {"text": ...} as the answer grows and {"notice": ...}
for what the user should know, then one last line that is {"ok": {...}} or {"error": "...",
"kind": ...}. An `api` request keeps its connection: the daemon serves HTTP until it closes.
Requests are checked against the structs below (diffuse/validate.py); a bad one is answered
with an error naming the field, and the daemon keeps serving. This module loads nothing heavy:
the commands' side of the socket (client.py) imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from diffuse.validate import Count, Finite, Malformed, Text, convert

VERSION = 1
SOCKET, PID, LOG = "daemon.sock", "daemon.pid", "daemon.log"
MAX_LINE = 1 << 20  # bytes of one request line
BAD_REQUEST, MISMATCH, FAILED, BUSY = "bad-request", "mismatch", "failed", "starting"

Prompt = Annotated[str, Meta(max_length=1 << 19)]
Names = Annotated[list[Text], Meta(max_length=64)]


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Annotated[str, Meta(pattern="^(system|user|assistant)$")]
    content: Prompt


class Sampling(msgspec.Struct, forbid_unknown_fields=True):
    """client/sampling.py's SamplingParams, as `ask` gives them."""

    max_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] = 256
    temperature: Finite = 0.0
    top_p: Finite = 1.0
    top_k: Count = 0
    repetition_penalty: Finite = 1.0
    seed: int | None = None
    stop: Annotated[list[Text], Meta(max_length=16)] = []


SAMPLING = tuple(Sampling.__struct_fields__)


class Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    v: Annotated[int, Meta(ge=VERSION, le=VERSION)] = VERSION  # the protocol's version


class Status(Request, tag="status"):
    """The daemon itself: pid, role, state, contribution level and why paused, what it serves."""


class Stop(Request, tag="stop"):
    """Leave as on SIGTERM (a peer drains first); the answer comes before it goes."""


class Routed(Request, kw_only=True):
    """The per-ask options a user gave (None: not given, so whatever the daemon's service runs with);
    a daemon whose service runs with other ones answers kind "mismatch"."""

    quant: Annotated[str, Meta(pattern="^(none|int8|int4)$")] | None = None
    accept_quant: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    route: Annotated[str, Meta(pattern="^(auto|chain|star)$")] | None = None
    exact: bool | None = None


OPTIONS = {"quant": "none", "accept_quant": None, "route": "auto", "exact": False}  # the parser's defaults
assert set(OPTIONS) == set(Routed.__struct_fields__) - set(Request.__struct_fields__)


class Ask(Routed, tag="ask", kw_only=True):
    """One chat answer. `local`: the asker wants the model in this machine's process; `bootstrap`:
    the swarm it names (the daemon answers only for its own: else kind "mismatch")."""

    messages: Annotated[list[Message], Meta(min_length=1, max_length=256)]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    model: Text | None = None
    local: bool = False
    bootstrap: Names = []
    keep: bool = True  # into the history vault, where the daemon keeps one


class Survey(Request, tag="survey"):
    """`diffuse status` through the daemon's swarm: coverage of `models` (default: the store's)."""

    models: Names = []
    reach: bool = True
    wait: Annotated[float, Meta(ge=0, le=3600)] = 0.0
    bootstrap: Names = []
    accept_quant: Annotated[str, Meta(min_length=1, max_length=64)] | None = None  # variants counted (any)
    model_hash: Names = []  # MODEL=SHA256: the manifests to trust with no weights here (status --model-hash)


class Api(Routed, tag="api", kw_only=True):
    """Serve the OpenAI-compatible API on `listen` from the daemon's service until this
    connection closes (`diffuse api` holds it open)."""

    listen: Text
    api_keys: Annotated[list[Annotated[str, Meta(min_length=1, max_length=4096)]], Meta(max_length=256)] = []
    max_sessions: Annotated[int, Meta(ge=1, le=4096)] = 16
    max_queue: Annotated[int, Meta(ge=0, le=1 << 16)] = 64
    default_max_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] = 256
    models: Names = []
    local: bool = False
    bootstrap: Names = []


Requests = Union[Status, Stop, Ask, Survey, Api]


def parse(line: bytes) -> Requests:
    """One request line checked; Malformed names what is wrong with it."""
    try:
        value = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Malformed(f"not JSON: {e}", None) from None
    if not isinstance(value, dict):
        raise Malformed("expected a JSON object", None)
    if isinstance(value.get("v"), int) and value["v"] != VERSION:
        raise Malformed(f"protocol version {value['v']} is not spoken here (this daemon speaks {VERSION})", "v")
    return convert(value, Requests)


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def error(reason: str, kind: str = BAD_REQUEST) -> bytes:
    return encode({"error": reason, "kind": kind})


def paths(home: Path) -> tuple[Path, Path, Path]:
    """The socket, the pid file (locked while the daemon lives) and the log, in the home."""
    return home / SOCKET, home / PID, home / LOG
