"""The API's accepted keys: --api-key values and the lines of --api-key-file (# comments). Light,
so that `diffuse api` reads them before deciding whether a daemon serves it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diffuse.errors import DiffuseError


def api_keys(given: Sequence[str], key_file: Path | None) -> frozenset[str]:
    keys = [k.strip() for k in given]
    if key_file:
        try:
            lines = key_file.read_text().splitlines()
        except OSError as e:
            raise DiffuseError(f"cannot read --api-key-file {key_file}: {e.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if any(not k for k in keys):
        raise DiffuseError("an empty --api-key would accept anyone")
    return frozenset(keys)
