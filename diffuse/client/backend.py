"""What answers need from whatever runs a model: the `Backend` protocol, and its refusals.

A backend lists the models it knows with their coverage, hands out one inference session (a
`Pipeline`) per answer, and the tokenizer of each model; it never decides which model answers
(the service does, client/service.py). `LocalBackend` (client/local.py) runs whole models in this
process; `SwarmBackend` (client/swarm_backend.py) routes the same sessions through peers. Both
report coverage in the control plane's `Coverage.to_dict()` shape, so the status page and
`/v1/models` read one format whatever the backend.
"""

from __future__ import annotations

from typing import Any, Protocol

from diffuse.client.pipeline import Pipeline
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.errors import DiffuseError
from diffuse.model.tokenizer import Tokenizer

LOCAL_PEER = "local"  # the peer id the status page shows for blocks computed in this process


class UnknownModel(DiffuseError):
    """No backend knows this model id (HTTP 404)."""

    def __init__(self, model: str, known: list[str]):
        super().__init__(f"the model {model!r} does not exist here; known models: {', '.join(known) or 'none'}")
        self.model = model


class Unservable(DiffuseError):
    """The model is known but some blocks have no peer right now (HTTP 503)."""

    def __init__(self, model: str, missing: list[int]):
        self.why = f"no peer serves blocks {_runs(missing)}"
        super().__init__(f"the model {model!r} is not servable now: {self.why}")
        self.model, self.missing = model, missing


class Overloaded(DiffuseError):
    """Capacity is exhausted for now; the client should retry in `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Backend(Protocol):
    async def models(self) -> list[dict[str, Any]]:
        """Coverage of every known model, servable or not (one `Coverage.to_dict()` each)."""
        ...

    def tokenizer(self, model_id: str) -> Tokenizer:
        """The model's tokenizer; UnknownModel if the id is not known."""
        ...

    def context_length(self, model_id: str) -> int:
        """Longest session (prompt + answer, in tokens) the model supports."""
        ...

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        """A fresh session for up to `max_len` tokens, which the caller closes.
        Raises UnknownModel, Unservable (naming the uncovered blocks) or Overloaded."""
        ...

    async def speculation(self, model_id: str) -> SpecConfig | None:
        """How this model's answers speculate (None: plain decoding, as where a step is no round trip)."""
        ...

    def speculated(self, model_id: str, state: SpecState) -> None:
        """A speculating answer ended with `state` (how its draft head guessed)."""
        ...

    def describe(self, model_id: str, pipeline: Pipeline, tokens: int) -> dict[str, Any]:
        """Where a session's `tokens` were computed, before it closes (route, failovers, checks)."""
        ...


def _runs(blocks: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9': uncovered blocks come in runs, and a long list helps nobody."""
    out: list[str] = []
    for b in sorted(blocks):
        if out and int(out[-1].rpartition("-")[2]) == b - 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{b}"
        else:
            out.append(str(b))
    return ", ".join(out)
