"""Draft heads through the swarm: a peer offers its own, a client without one fetches a peer's.

A draft head cannot change an answer (the model verifies every token it guesses), so a client may
use one it did not train: a bad head costs speed, never correctness. A serving peer with a head
for its model serves the file on `/diffuse/files/1.0.0` (data/files.py) and announces its SHA-256
and size in its record (`ext` "draft_head", "draft_head_bytes"). A client with no head of its own
fetches one, keeps it only if the bytes hash to the announced value and it loads as a head of the
model's width, and caches it in `<home>/drafts/<store name>/` beside a side file saying it was
fetched (`fetched.json`). The speculation code drops a fetched head whose guesses are poorly
accepted (`drop_fetched`); its hash is remembered (`refused.json`), so it is not fetched again.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from diffuse.client import draft_head
from diffuse.client.draft_head import DraftHead
from diffuse.control.records import PeerRecord
from diffuse.data import files
from diffuse.errors import FetchError, ModelError
from diffuse.model.config import ModelConfig
from diffuse.model.weights import load_manifest

log = logging.getLogger(__name__)

HASH_KEY, BYTES_KEY = "draft_head", "draft_head_bytes"  # the record's ext fields
FETCHED = "fetched.json"  # beside a fetched head: {"sha256", "bytes", "peer", "at"}
REFUSED = "refused.json"  # hashes of fetched heads dropped for poor acceptance
MAX_DRAFT_BYTES = 2 << 30  # ~10 h^2 fp32 numbers: a head for hidden size 8192 is 2.7 GB, refused
MAX_TRIES = 4  # peers tried before going without a head
_HEX64 = re.compile(r"[0-9a-f]{64}")


def fetch_seconds(size: int) -> float:
    """How long one peer gets to deliver `size` bytes: 30 s, plus a second per MiB."""
    return 30.0 + size / 2**20


def offer(server: files.FileServer, home: Path, models: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """Serve, on `server`, the draft head each model has in `home` (models: model id -> its
    directory in the store); returns model id -> the ext fields announcing it. Hashed here, once."""
    found: dict[str, dict[str, Any]] = {}
    for model_id, model_dir in models.items():
        file = draft_head.path(Path(home), Path(model_dir).name)
        if file.is_file():
            sha, size = server.add(file)
            found[model_id] = {HASH_KEY: sha, BYTES_KEY: size}
            log.info("offering the draft head of %s (%d bytes, sha256 %s)", model_id, size, sha)
    return found


def announced(record: PeerRecord) -> tuple[str, int] | None:
    """(sha256, size) of the draft head `record` offers, or None if it offers none usable."""
    sha, size = record.extra.get(HASH_KEY), record.extra.get(BYTES_KEY)
    if files.PROTOCOL_ID not in record.protocols or not isinstance(sha, str) or not _HEX64.fullmatch(sha):
        return None
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_DRAFT_BYTES:
        return None
    return sha, size


async def obtain_draft_head(node: Any, records: Sequence[PeerRecord], home: Path, model_dir: Path, *,
                            say: Callable[[str], None] = log.warning) -> DraftHead | None:
    """The draft head for the model at `model_dir`: the one in `home` if there is one, else one
    fetched from a peer among `records` (those of the model) that announces it, verified and
    cached; None if no peer offers a usable one. Each refusal (a peer that fails, a file that
    does not hash to its announced value, or is not a head of this model) goes to `say`;
    nothing of a refused file is kept."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    hidden, limit = cfg.hidden_size, draft_head.max_bytes(cfg.hidden_size, cfg.vocab_size)
    file = draft_head.path(Path(home), model_dir.name)
    if file.exists():
        return draft_head.load(file, hidden, cfg.vocab_size)
    model_id = load_manifest(model_dir).model_id
    refused = _refused(file.parent)
    offers = [(r, a) for r in records
              if r.model == model_id and r.peer_id != node.peer_id and (a := announced(r)) and a[0] not in refused]
    for record, (sha, size) in [o for o in offers if o[1][1] > limit]:
        say(f"draft head of peer {record.peer_id} (sha256 {sha}) not fetched: {size} bytes is more than a head "
            f"of this model can be ({limit})")
    offers = [o for o in offers if o[1][1] <= limit]
    random.shuffle(offers)  # ties in any order, not the records' (a flooder's) order
    by_hash = Counter(sha for _, (sha, _) in offers)
    support = node.support.get(model_id, {})
    offers.sort(key=lambda o: (-by_hash[o[1][0]], -support.get(o[0].peer_id, 0)))  # the commonest head first
    unusable: set[str] = set()
    try:
        for record, (sha, size) in offers[:MAX_TRIES]:
            if sha in unusable:
                continue
            head = await _fetch_one(node, record, sha, size, file, cfg, say)
            if head is not None:
                return head
            unusable.add(sha)
    finally:
        if file.parent.is_dir() and not any(file.parent.iterdir()):
            file.parent.rmdir()  # nothing fetched: leave no trace
    return None


async def _fetch_one(node: Any, record: PeerRecord, sha: str, size: int, file: Path, cfg: ModelConfig,
                     say: Callable[[str], None]) -> DraftHead | None:
    """Fetch, check and cache one peer's head; None (said why) if refused."""
    staged = file.with_name(f".{file.name}.{os.getpid()}.fetched")
    seconds = fetch_seconds(size)
    try:
        with trio.fail_after(seconds):
            await files.fetch(node.host, record.peer_id, sha, size, staged,
                              draft_head.max_bytes(cfg.hidden_size, cfg.vocab_size), record.addrs)
    except FetchError as e:
        say(f"draft head not fetched: {e}")
        return None
    except trio.TooSlowError:
        say(f"draft head not fetched: peer {record.peer_id} did not deliver {size} bytes in {seconds:g} s")
        return None
    try:
        try:
            head = draft_head.load(staged, cfg.hidden_size, cfg.vocab_size)
        except ModelError as e:
            say(f"draft head from peer {record.peer_id} (sha256 {sha}) refused: {e}")
            return None
        if head is None:
            say(f"draft head from peer {record.peer_id} (sha256 {sha}) refused: not made for this model's "
                f"hidden size {cfg.hidden_size}")
            return None
        _write_json(file.parent / FETCHED, {"sha256": sha, "bytes": size, "peer": record.peer_id, "at": time.time()})
        staged.replace(file)  # the side file first: a head in place is never taken for one trained here
    finally:
        staged.unlink(missing_ok=True)
    log.info("draft head %s fetched from peer %s into %s", sha, record.peer_id, file)
    return head


def drop_fetched(home: Path, model: str) -> bool:
    """Delete the draft head of `model` (its name in the store, as draft_head.path takes) if it
    was fetched rather than trained here, and remember its hash so it is not fetched again.
    Returns whether a head was deleted; one trained here since it was fetched is kept."""
    file = draft_head.path(Path(home), model)
    side = file.parent / FETCHED
    info = _read_json(side)
    sha = info.get("sha256") if isinstance(info, dict) else None
    if not isinstance(sha, str):
        return False
    if file.exists() and files.sha256_file(file) != sha:  # trained over the fetched one: ours now
        side.unlink(missing_ok=True)
        return False
    _write_json(file.parent / REFUSED, sorted(_refused(file.parent) | {sha}))
    file.unlink(missing_ok=True)
    side.unlink(missing_ok=True)
    log.info("dropped the fetched draft head %s of %s", sha, model)
    return True


def _refused(folder: Path) -> set[str]:
    got = _read_json(folder / REFUSED)
    return {s for s in got if isinstance(s, str)} if isinstance(got, list) else set()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
