"""The manifest a peer's record announces, which one to trust, and the checks a manifest fetched
from the swarm passes before anything is read from it: `join / ask / api --from-swarm`
(client/from_swarm.py) and `diffuse status` on a machine without weights (client/survey.py)
trust it the same way, through `trusted` (--model-hash, then the pins of the sentinels the node
bootstraps from in a private swarm, then agreement among the announcers).

A record announces its manifest by SHA-256 and size (peer/offer.py); the bytes fetched are
checked against that hash, and the manifest they hold names every other byte by hash and size:
one of those hashes becomes part of a file name, every size bounds a transfer, so each is checked
here before any is used.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import trio

from diffuse.control import pins
from diffuse.control.dial import connect, connected, open_stream
from diffuse.control.node import Node, NodeConfig
from diffuse.control.records import PeerRecord
from diffuse.data.fetcher import Fetcher
from diffuse.data.files import PROTOCOL_ID
from diffuse.errors import DiffuseError, FetchError, ModelError
from diffuse.model import blockfiles
from diffuse.model.weights import MANIFEST, Manifest, load_manifest

log = logging.getLogger(__name__)

MANIFEST_SHA, MANIFEST_BYTES = "manifest_sha256", "manifest_bytes"  # ext fields (peer/offer.py)
BLOCK_FILES = "block_files"  # ext field: true where the peer serves its span's blocks as files (files.md 9.2)
# ext fields of a peer serving a quantized variant: its variant's manifest (manifest_sha256 stays the source's)
VARIANT_SHA, VARIANT_BYTES = "variant_manifest_sha256", "variant_manifest_bytes"
MAX_MANIFEST = 1 << 20  # bytes: ~10k blocks' hashes
MAX_FILE = 1 << 30  # bytes of one listed file (config, tokenizer)
MAX_BLOCK, MAX_LAYERS = 1 << 38, 4096  # canonical bytes of one block or the head; blocks of a model
HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def announced(record: PeerRecord, variant: bool = False) -> tuple[str, int] | None:
    """The manifest `record` announces (`variant`: its variant's), (SHA-256, size), or None where
    it announces none or one no node should fetch (a hash that is not 64 lowercase hex digits, a
    size out of bounds)."""
    sha, size = record.extra.get(VARIANT_SHA if variant else MANIFEST_SHA), \
        record.extra.get(VARIANT_BYTES if variant else MANIFEST_BYTES)
    if isinstance(sha, str) and HEX64.fullmatch(sha) and type(size) is int and 0 < size <= MAX_MANIFEST:
        return sha, size
    return None


def checked(where: Path, model: str, to_fetch: bool = True, source: Manifest | None = None,
            quant: str = "none") -> Manifest:
    """The manifest in `where` once it can say what the swarm serves: of `model`, unquantized (or,
    `source` given, that model's `quant` variant: its source's model hash and block count), its
    block count in bounds, every hash 64 lowercase hex digits; and, `to_fetch` (to fetch by it),
    format 2: every size an integer in bounds, its files' names safe, a config.json. Else a
    ModelError naming the field. (`status` reads coverage alone, so it takes format 1 too.)"""
    try:
        m = load_manifest(where)
    except (AttributeError, TypeError, ValueError) as e:  # JSON of another shape, bytes that are no text
        raise ModelError(f"not a manifest: {str(e)[:200]}") from None
    if m.model_id != model or not isinstance(m.model_id, str) or not _NAME.fullmatch(m.model_id) \
            or m.quant != quant:
        raise ModelError(f"not a manifest of {model} ({'of an unquantized model' if quant == 'none' else quant})")
    if source is not None and (m.source != source.model_hash or m.num_layers != source.num_layers):
        raise ModelError(f"not a variant of the model hash {source.model_hash} with {source.num_layers} blocks")
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


# Which manifest to trust: one policy for `--from-swarm` and `status`.
# Distinct manifests fetched to compare (the most announced first), and the time for all of them:
# announcing many manifests, or serving one slowly, cannot hold a join up for long.
MAX_MANIFESTS, MANIFESTS_TIMEOUT_S = 8, 120.0


@dataclass(frozen=True)
class Trusted:
    """The manifest chosen: its SHA-256, what it says, the directory it was fetched into, who
    announces it, and who vouches for it ("" where the announcers agree and nobody else does)."""

    sha: str
    manifest: Manifest
    where: Path
    announcers: list[str]
    by: str


def opener(node: Node, records: list[PeerRecord]):
    """A files stream to a peer of `records`, dialled at the addresses its record carries."""
    addrs = {r.peer_id: r.addrs for r in records}

    async def open_files(peer: str):
        try:
            if not connected(node.host, peer):
                await connect(node.host, peer, addrs.get(peer, ()))
            return await open_stream(node.host, peer, PROTOCOL_ID, (), timeout=10.0)
        except Exception as e:  # noqa: BLE001 - py-libp2p fails dials and streams in many types of its own
            raise FetchError(f"cannot open a files stream to peer {peer}: {e}") from None
    return open_files


async def trusted_hash(node: Node, config: NodeConfig, model_hash: str | None, model: str) -> tuple[str | None, str]:
    """The hash to trust and who vouches for it: the operator's (--model-hash); else, in a private
    swarm, the one its sentinels pin (those it bootstraps from: control/pins.py); else none."""
    if model_hash:
        return model_hash.strip().lower(), "--model-hash"
    if config.swarm_key is None or not config.bootstrap:
        return None, ""
    found = await pins.read(node, pins.bootstrap_ids(config.bootstrap), model)
    if len(set(found.values())) > 1:
        raise DiffuseError(f"the sentinels pin different manifests for {model}: "
                           f"{'; '.join(f'{h} by {s}' for s, h in found.items())}; give the one to trust with "
                           "--model-hash (and correct the sentinels' --model-hash)")
    return (next(iter(found.values())), f"the sentinel pin of {', '.join(found)}") if found else (None, "")


async def trusted(node: Node, config: NodeConfig, model_hash: str | None, records: list[PeerRecord],
                  fetcher: Fetcher, tmp: Path, to_fetch: bool = True) -> Trusted:
    """The manifest of the model of `records` to trust, fetched into `tmp` and checked: the one
    `model_hash` names (the manifest's SHA-256 or the model hash), else the one the sentinels
    this node bootstraps from pin (a private swarm), else the one every announcer agrees on;
    announcers of others are listed with their hashes, never chosen silently (a DiffuseError
    asking for --model-hash)."""
    model = records[0].model
    want, by = await trusted_hash(node, config, model_hash, model)
    groups: dict[tuple[str, int], list[str]] = {}
    for r in records:
        if (manifest := announced(r)) is not None:
            groups.setdefault(manifest, []).append(r.peer_id)
    if not groups:
        raise DiffuseError(f"the peers announce no manifest of {model} this node can fetch")
    chosen = {k: p for k, p in groups.items() if k[0] == want}  # the trusted one, if announced
    if chosen and len(chosen) < len(groups):
        log.warning("peers announcing other manifests than %s (%s) are not used: %s", want, by,
                    listing({}, {k: p for k, p in groups.items() if k[0] != want}))
    groups = chosen or groups
    found = await fetch_manifests(fetcher, groups, tmp, model, to_fetch)
    sha = choose(found, groups, want, by)
    manifest, where = found[sha]
    return Trusted(sha, manifest, where, [p for (s, _), ps in groups.items() if s == sha for p in ps], by)


async def fetch_manifests(fetcher: Fetcher, groups: dict[tuple[str, int], list[str]], tmp: Path,
                          model: str, to_fetch: bool = True, source: Manifest | None = None,
                          quant: str = "none") -> dict[str, tuple[Manifest, Path]]:
    """The announced manifests that could be fetched and read (`checked`, as of `source`'s `quant`
    variant where given), at most MAX_MANIFESTS of them (the most announced first) within
    MANIFESTS_TIMEOUT_S; those left out count as unreadable."""
    found: dict[str, tuple[Manifest, Path]] = {}
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    with trio.move_on_after(MANIFESTS_TIMEOUT_S) as late:
        for (sha, size), peers in ranked[:MAX_MANIFESTS]:
            where = tmp / sha
            try:
                await fetcher.fetch(sha, size, where / MANIFEST, peers, f"the manifest {sha[:16]}…")
                found[sha] = (checked(where, model, to_fetch, source, quant), where)
            except (FetchError, ModelError) as e:
                log.warning("manifest %s refused: %s", sha, e)
    if late.cancelled_caught or len(ranked) > MAX_MANIFESTS:
        log.warning("%d of %d announced manifests fetched (at most %d, within %g s)", len(found), len(groups),
                    MAX_MANIFESTS, MANIFESTS_TIMEOUT_S)
    return found


def choose(found: dict[str, tuple[Manifest, Path]], groups: dict[tuple[str, int], list[str]],
           trusted: str | None, by: str = "--model-hash") -> str:
    """The manifest hash to use: the trusted one (its SHA-256 or model hash; `by` says whose),
    else the only one announced."""
    if trusted:
        hit = [s for s, (m, _) in found.items() if trusted in (s, m.model_hash)]
        if not hit:
            raise DiffuseError(f"no peer serves a manifest with hash {trusted} ({by}); announced: "
                               f"{listing(found, groups)}")
        if len(hit) > 1:  # the model hash covers blocks and head only, not config or tokenizer
            hits = {k: p for k, p in groups.items() if k[0] in hit}
            raise DiffuseError(f"{len(hit)} different manifests have model hash {trusted}: {listing(found, hits)}; "
                               "give the manifest's SHA-256 with --model-hash")
        return hit[0]
    if len(groups) == 1 and found:
        return next(iter(found))
    raise DiffuseError(f"the peers announce different manifests for this model: {listing(found, groups)}; "
                       "give the one to trust with --model-hash")


def listing(found: dict[str, tuple[Manifest, Path]], groups: dict[tuple[str, int], list[str]]) -> str:
    return "; ".join(f"{sha} (model hash {found[sha][0].model_hash if sha in found else 'unreadable'}) by "
                     f"{', '.join(peers)}" for (sha, _), peers in groups.items())
