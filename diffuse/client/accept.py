"""Which quantized peers a client counts: one policy for routing (client/swarm.py), the API's
coverage (client/swarm_backend.py) and `diffuse status` (client/survey.py). A record's variant
(its ext "quant") must be accepted (--accept-quant), and its block hashes those of the variant
this machine holds or makes from its own weights; a variant whose hashes cannot be had here (a
family int4 cannot take, a store that cannot be written, one `status` does not make) rejects the
records announcing it, not the whole lookup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from diffuse.control.records import PeerRecord
from diffuse.errors import ModelError

HashesOf = Callable[[str], Awaitable[Sequence[str]]]  # scheme -> that variant's block hashes here


class NotHere(ModelError):
    """A variant's hashes are not had here by choice; its text is the whole reason a record is excluded."""


def scheme_of(record: PeerRecord) -> str:
    return str(record.extra.get("quant", "none"))


async def accepted_hashes(records: Iterable[PeerRecord], accepted: Iterable[str],
                          hashes_of: HashesOf) -> tuple[dict[str, Sequence[str]], dict[str, str]]:
    """Each accepted scheme the records announce -> its block hashes here, and each one whose
    hashes cannot be had -> why a record announcing it is rejected."""
    known: dict[str, Sequence[str]] = {}
    failed: dict[str, str] = {}
    for scheme in sorted({scheme_of(r) for r in records} & set(accepted)):
        try:
            known[scheme] = await hashes_of(scheme)
        except NotHere as e:
            failed[scheme] = str(e)
        except (ModelError, OSError) as e:  # OSError: the store could not be read or written
            failed[scheme] = f"serves the {scheme} variant, which cannot be made here: {e}"
    return known, failed


def explain(excluded: dict[str, str], records: Iterable[PeerRecord], failed: dict[str, str]) -> None:
    """Say in `excluded` (a Coverage's) why a peer of a variant not had here is left out."""
    for r in records:
        why = failed.get(scheme_of(r))
        if why and r.peer_id in excluded:
            excluded[r.peer_id] = why
