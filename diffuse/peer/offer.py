"""What a peer offers over the files protocol so that new peers can start from the swarm: its
model's manifest (format 2, model/blockfiles.py), the files the manifest lists (config,
tokenizer), the canonical bytes of the blocks it serves and, where it holds it, of the head.

Blocks and head are served under the hashes its manifest lists, which its loader checked against
the bytes when it loaded its span (the head: when the manifest was made from, or fetched onto,
this store); what it serves is never trusted by a receiver, which hashes everything it gets.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from diffuse.client.manifests import BLOCK_FILES, MANIFEST_BYTES, MANIFEST_SHA, VARIANT_BYTES, VARIANT_SHA
from diffuse.data.files import FileServer
from diffuse.model import blockfiles
from diffuse.model.weights import MANIFEST, ModelFiles

log = logging.getLogger(__name__)


def offer(server: FileServer, model_dir: Path, span: tuple[int, int] | None,
          variant: Path | None = None) -> dict[str, Any]:
    """Serve the model's manifest and, for a span of its blocks, its files and blocks (`variant`:
    the directory of the quantized variant served, whose manifest and stored blocks it serves
    instead of the source's blocks); the record fields that announce them."""
    model_dir = Path(model_dir)
    manifest = blockfiles.complete(model_dir)
    if "" in manifest.block_hashes:  # part of a hub model (model/hub_blocks.py): no manifest of the model's
        return {}
    data = (model_dir / MANIFEST).read_bytes()  # served from memory: a later rewrite on disk never
    sha = hashlib.sha256(data).hexdigest()      # sends other bytes under the hash announced
    size = server.add_composite(sha, [data])
    extra: dict[str, Any] = {MANIFEST_SHA: sha, MANIFEST_BYTES: size}
    if span is None or manifest.format < blockfiles.FORMAT or manifest.quant != "none":
        return extra
    for name, (length, want) in manifest.files.items():
        got = server.add(model_dir / name) if (model_dir / name).is_file() else None
        if got != (want, length):
            if got:
                server.files.pop(got[0], None)
            log.warning("%s differs from the manifest's %s: not offered", model_dir / name, name)
    if variant is not None:
        return extra | _variant(server, Path(variant), span)
    files = ModelFiles(model_dir)
    blocks, head = blockfiles.held(model_dir)
    for i in range(*span):
        if i in blocks:
            server.add_composite(manifest.block_hashes[i], blockfiles.segments(files, i))
    if head:
        server.add_composite(manifest.head_hash, blockfiles.segments(files, None))
    return extra | {BLOCK_FILES: True}


def _variant(server: FileServer, variant: Path, span: tuple[int, int]) -> dict[str, Any]:
    """A variant's manifest (format 2, its own block sizes) and its span's blocks as stored: the
    record fields that announce them. Its files are its source's (config, tokenizer)."""
    manifest = blockfiles.complete(variant)
    if manifest.format < blockfiles.FORMAT:
        return {}
    data = (variant / MANIFEST).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    size = server.add_composite(sha, [data])
    files = ModelFiles(variant)
    blocks, _ = blockfiles.held(variant)
    for i in range(*span):
        if i in blocks:
            server.add_composite(manifest.block_hashes[i], blockfiles.segments(files, i))
    return {VARIANT_SHA: sha, VARIANT_BYTES: size, BLOCK_FILES: True}
