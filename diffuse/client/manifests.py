"""The manifest a peer's record announces, and the checks a manifest fetched from the swarm
passes before anything is read from it: `join / ask --from-swarm` (client/from_swarm.py) and
`diffuse status` on a machine without weights (client/survey.py) trust it the same way.

A record announces its manifest by SHA-256 and size (peer/offer.py); the bytes fetched are
checked against that hash, and the manifest they hold names every other byte by hash and size:
one of those hashes becomes part of a file name, every size bounds a transfer, so each is checked
here before any is used.
"""

from __future__ import annotations

import re
from pathlib import Path

from diffuse.control.records import PeerRecord
from diffuse.errors import ModelError
from diffuse.model import blockfiles
from diffuse.model.weights import Manifest, load_manifest

MANIFEST_SHA, MANIFEST_BYTES = "manifest_sha256", "manifest_bytes"  # ext fields (peer/offer.py)
BLOCK_FILES = "block_files"  # ext field: true where the peer serves its span's blocks as files (files.md 9.2)
MAX_MANIFEST = 1 << 20  # bytes: ~10k blocks' hashes
MAX_FILE = 1 << 30  # bytes of one listed file (config, tokenizer)
MAX_BLOCK, MAX_LAYERS = 1 << 38, 4096  # canonical bytes of one block or the head; blocks of a model
HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def announced(record: PeerRecord) -> tuple[str, int] | None:
    """The manifest `record` announces, (SHA-256, size), or None where it announces none or one
    no node should fetch (a hash that is not 64 lowercase hex digits, a size out of bounds)."""
    sha, size = record.extra.get(MANIFEST_SHA), record.extra.get(MANIFEST_BYTES)
    if isinstance(sha, str) and HEX64.fullmatch(sha) and type(size) is int and 0 < size <= MAX_MANIFEST:
        return sha, size
    return None


def checked(where: Path, model: str, to_fetch: bool = True) -> Manifest:
    """The manifest in `where` once it can say what the swarm serves: of `model`, unquantized, its
    block count in bounds, every hash 64 lowercase hex digits; and, `to_fetch` (to fetch by it),
    format 2: every size an integer in bounds, its files' names safe, a config.json. Else a
    ModelError naming the field. (`status` reads coverage alone, so it takes format 1 too.)"""
    try:
        m = load_manifest(where)
    except (AttributeError, TypeError, ValueError) as e:  # JSON of another shape, bytes that are no text
        raise ModelError(f"not a manifest: {str(e)[:200]}") from None
    if m.model_id != model or not isinstance(m.model_id, str) or not _NAME.fullmatch(m.model_id) \
            or m.quant != "none":
        raise ModelError(f"not a manifest of {model} (of an unquantized model)")
    if type(m.num_layers) is not int or not 0 < m.num_layers <= MAX_LAYERS:
        raise ModelError(f"the manifest's num_layers is {str(m.num_layers)[:80]!r}, not an integer "
                         f"from 1 to {MAX_LAYERS}")
    for field in ("block_hashes", "block_sizes") if to_fetch else ("block_hashes",):
        value = getattr(m, field)
        if not isinstance(value, list) or len(value) != m.num_layers:
            raise ModelError(f"the manifest's {field} is not a list of {m.num_layers} entries (one per block)")
    hashes = [("head_hash", m.head_hash), *((f"block_hashes[{i}]", h) for i, h in enumerate(m.block_hashes))]
    for field, value in hashes:
        if not isinstance(value, str) or not HEX64.fullmatch(value):
            raise ModelError(f"the manifest's {field} is {str(value)[:80]!r}, not 64 lowercase hex digits")
    if to_fetch:
        _check_sizes(m)
    return m


def _check_sizes(m: Manifest) -> None:
    """Format 2's fields: the head's and each block's size, and `files` {name: [size, sha256]}."""
    for field, value, least in [("head_size", m.head_size, 0),
                                *((f"block_sizes[{i}]", n, 1) for i, n in enumerate(m.block_sizes))]:
        if type(value) is not int or not least <= value <= MAX_BLOCK:
            raise ModelError(f"the manifest's {field} is {str(value)[:80]!r}, not an integer "
                             f"from {least} to {MAX_BLOCK}")
    if not isinstance(m.files, dict):
        raise ModelError("the manifest's files is not a mapping of names to [size, sha256]")
    for name, entry in m.files.items():
        if not _NAME.fullmatch(name) or name.endswith(".safetensors") or name in blockfiles.NOT_FILES \
                or not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int \
                or not 0 < entry[0] <= MAX_FILE or not isinstance(entry[1], str) or not HEX64.fullmatch(entry[1]):
            raise ModelError(f"the manifest's files list {str(name)[:80]!r} as {str(entry)[:200]}")
    if "config.json" not in m.files:
        raise ModelError("the manifest lists no config.json (format 2)")
