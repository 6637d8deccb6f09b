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

from diffuse.client.manifests import BLOCK_FILES, MANIFEST_BYTES, MANIFEST_SHA
from diffuse.data.files import FileServer
from diffuse.model import blockfiles
from diffuse.model.weights import MANIFEST, ModelFiles

log = logging.getLogger(__name__)


def offer(server: FileServer, model_dir: Path, span: tuple[int, int] | None) -> dict[str, Any]:
    """Serve the model's manifest and, for a span of its own blocks (None: a variant's, not
    offered), its files and blocks; the record fields that announce them."""
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
    files = ModelFiles(model_dir)
    blocks, head = blockfiles.held(model_dir)
    for i in range(*span):
        if i in blocks:
            server.add_composite(manifest.block_hashes[i], blockfiles.segments(files, i))
    if head:
        server.add_composite(manifest.head_hash, blockfiles.segments(files, None))
    return extra | {BLOCK_FILES: True}
