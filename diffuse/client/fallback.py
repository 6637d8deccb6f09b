"""Which model answers when the asked one cannot: the best the swarm can give, never silently.

The design's rule is that a client never refuses when some model can answer. When the asked
model is not servable (some of its blocks have no live peer), `ask` and the API answer with the
first model of the fallback order that is: by default every other model this client holds, the
largest first (more weights, better answers, as the design's ladder ranks them); or the
operator's own list; or none, which refuses with the uncovered blocks named. Whoever answers with
another model says so (a notice on stderr, the API's `model` field, header and /metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diffuse.errors import DiffuseError

AUTO, NONE = "auto", "none"


def parse_fallback(text: str) -> str | list[str]:
    """`--fallback`: "auto", "none", or a comma-separated list of models, best first."""
    value = text.strip()
    if value.lower() in (AUTO, NONE):
        return value.lower()
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise DiffuseError(f"--fallback wants auto, none or MODEL[,MODEL...], got {text!r}")
    return names


def fallback_order(spec: str | Sequence[str], asked: str, held: dict[str, int]) -> list[str]:
    """The models to try after `asked`, in order. `held`: the models this client can answer
    with and their weight bytes; a listed model it does not hold is an error."""
    if spec == NONE:
        return []
    if spec == AUTO:
        return sorted((m for m in held if m != asked), key=lambda m: (-held[m], m))
    unknown = [m for m in spec if m not in held]
    if unknown:
        raise DiffuseError(f"--fallback names {', '.join(unknown)}, which this client does not hold "
                           f"(it holds {', '.join(sorted(held)) or 'no model'})")
    return [m for m in spec if m != asked]


def held_models(home: Path) -> dict[str, int]:
    """Whole models in the store (a partial one cannot answer alone): their ids and weight bytes."""
    from diffuse.model import store  # torch: not for parse_fallback, which the parser calls

    return {m.manifest.model_id: m.size_bytes for m in store.list_models(home) if m.held is None}


def store_name(home: Path, model_id: str) -> str:
    """The store directory that holds `model_id` (a model's id and its directory name may differ)."""
    from diffuse.model import store

    for m in store.list_models(home):
        if m.manifest.model_id == model_id:
            return m.name
    return model_id


def notice(asked: str, answering: str, why: str) -> str:
    return (f"notice: {asked} is not servable now ({why}); answering with {answering} instead "
            "(--fallback none refuses)")
