"""`--from-swarm`: put into the store what a node needs from the peers that serve the model, and
nothing more: the manifest, the files it lists (config, tokenizer), the blocks of the span a peer
will serve (`join`), or a client's head and local blocks (`ask`, `api`), each checked by hash
(docs/fetch.md).

Trust starts at the manifest: its SHA-256 is the one the operator gives (`--model-hash`, which
may also be the model hash `diffuse model info` prints), else in a private swarm the one its
sentinels pin, else the one every announcing peer's record agrees on; announcers that disagree
are listed with their hashes and the operator is asked to choose, never silently
(client/manifests.py `trusted`, which `status` uses too). The manifest names every other byte by
hash and size. A store that holds some blocks already, whichever source put them there (a
`model pull --blocks`, an earlier fetch), gets only those it lacks; a partial manifest of its own
gives way to the swarm's where every hash it has agrees.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trio

from diffuse.control.coverage import coverage
from diffuse.control.identity import ephemeral
from diffuse.control.node import Node, NodeConfig, open_node
from diffuse.control.placement import choose_span, requested_blocks
from diffuse.control.records import PeerRecord
from diffuse.data.fetcher import Fetcher
from diffuse.client import manifests
from diffuse.client.manifests import BLOCK_FILES, MANIFEST_SHA, announced
from diffuse.errors import DiffuseError, FetchError, ModelError, first_leaf
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model import blockfiles, variants
from diffuse.model.config import ModelConfig
from diffuse.model.store import block_ranges as blockfiles_ranges
from diffuse.model.weights import MANIFEST, Manifest, load_manifest
from diffuse.trust import reputation

log = logging.getLogger(__name__)
Say = Callable[[str], None]


@dataclass(frozen=True)
class Wanted:
    """What to fetch: the model (swarm id; None the default, "auto" the least served), the span
    (`blocks` as join takes it), whether the head too (a client), the operator's hash, and how
    long the swarm gets to announce the model."""

    model: str | None = None
    blocks: str = "auto"
    local: tuple[int, int] | None = None  # a client: its first and last blocks (then no span)
    num_blocks: int | None = None
    max_memory: str | None = None
    head: bool = False
    model_hash: str | None = None
    wait: float = 60.0
    json_progress: bool = False
    quant: str = "none"  # a join serving that quantized variant: its blocks as its peers store them


async def from_swarm(home: Path, node_config: NodeConfig, want: Wanted, say: Say) -> tuple[str, tuple[int, int]]:
    """Fetch what `want` needs into the store; returns the model's store name and its span. With
    `want.json_progress`, what happens is told in JSON lines too (Progress), a failure included;
    a DiffuseError comes out of the node's nurseries bare, for the command line to print."""
    progress = Progress(say, want.json_progress)
    try:
        return await _from_swarm(home, node_config, want, progress)
    except Exception as e:
        leaf = _leaf(e)
        progress.event("failed", error=str(leaf))
        if isinstance(leaf, DiffuseError) and leaf is not e:
            raise leaf from None
        raise


async def _from_swarm(home: Path, node_config: NodeConfig, want: Wanted,
                      progress: "Progress") -> tuple[str, tuple[int, int]]:
    config = replace(node_config, listen=["/ip4/0.0.0.0/tcp/0"], server=False, announce_addrs=(), relay=False,
                     upnp=False, reach_check=False)
    async with open_node(ephemeral(), config, codecs=reputation.swarm_codecs()) as node:
        records = await _records(node, want)
        fetcher = Fetcher(manifests.opener(node, records), on_bytes=progress.add)
        try:
            want, variant_sha = await _variant_named(fetcher, home, records, want)
            model_dir, manifest, sha = await _manifest(home, node, config, want, fetcher, records, progress)
            sources = [r.peer_id for r in records
                       if r.extra.get(MANIFEST_SHA) == sha and r.extra.get(BLOCK_FILES) is True]
            await _files(fetcher, model_dir, manifest, sources)
            where, served, serving = model_dir, manifest, records
            if want.quant != "none":
                where, served, serving = await _variant(fetcher, model_dir, manifest, records, want.quant, progress,
                                                        variant_sha)
            span, blocks = _span(want, where, served, serving)
            await _blocks(fetcher, where, served, serving, blocks, want.head, progress)
            progress.finish()
            by = ", ".join(f"{p}: {n / 2**20:.1f} MiB" for p, n in fetcher.stats.by_peer.items())
            held = f"blocks {blockfiles_ranges(blocks) or 'none'}{' and the head' if want.head else ''}"
            progress.say(f"{model_dir.name}: {held} in the store ({fetcher.stats.received / 2**20:.1f} MiB fetched"
                         f"{' from ' + by if by else ''}{_banned(fetcher)})")
            progress.event("done", model=model_dir.name, blocks=blocks, head=want.head,
                           fetched_bytes=fetcher.stats.received, by_peer=dict(fetcher.stats.by_peer),
                           banned=dict(fetcher.banned))
            return model_dir.name, span
        finally:
            await fetcher.close()  # the streams kept between files


def _span(want: Wanted, model_dir: Path, manifest: Manifest,
          records: list[PeerRecord]) -> tuple[tuple[int, int], list[int]]:
    """The span to serve ((0, 0) for a client) and the blocks to hold."""
    if want.local is not None:
        front, back = want.local
        return (0, 0), [*range(min(front, manifest.num_layers)),
                        *range(max(front, manifest.num_layers - back), manifest.num_layers)]
    span, length = requested_blocks(want.blocks, want.num_blocks, want.max_memory, ModelConfig.load(model_dir),
                                    manifest.dtype, manifest.quant)
    span = span or choose_span(coverage(records, manifest.model_id, manifest.num_layers,
                                        expected_hashes=manifest.block_hashes).replicas, length)
    return span, list(range(*span))


def _leaf(e: BaseException) -> BaseException:
    """The error to tell: the first DiffuseError in a nursery's group, else the first error."""
    if isinstance(e, BaseExceptionGroup):
        mine, _ = e.split(DiffuseError)
        return first_leaf(mine if mine is not None else e)
    return e


def for_join(home: Path, node_config: NodeConfig, want: Wanted, say: Say) -> dict:
    """`join --from-swarm`, before the peer starts: what it then runs as (a store name, its span)."""
    name, span = trio.run(from_swarm, home, node_config, want, say)
    return {"model": name, "blocks": f"{span[0]}:{span[1]}", "num_blocks": None, "max_memory": None}


def for_client(home: Path, options: Mapping[str, Any], node_config: NodeConfig, judging: bool, say: Say) -> str:
    """`ask / api --from-swarm`: the head, tokenizer and local blocks (--local-blocks) of the
    model (--model); `judging` (a trust plane on): every block, since the client judges peers by
    recomputing their spans (trust/canary.py). Returns the model's store name."""
    front_back = tuple(int(x) for x in str(options.get("local_blocks") or "1,0").split(","))
    if judging:
        say("the trust plane judges peers by computing their blocks here: fetching every block the store lacks "
            "(with --trust off, only the head and the local blocks)")
        front_back = (1 << 30, 0)
    want = Wanted(model=options.get("model"), local=(front_back[0], front_back[1]), head=True,
                  model_hash=options.get("model_hash"), wait=max(float(options.get("wait") or 0), 30.0),
                  json_progress=bool(options.get("json")))
    return trio.run(from_swarm, home, node_config, want, say)[0]


def _banned(fetcher: Fetcher) -> str:
    return "; banned " + ", ".join(f"{p} ({why})" for p, why in fetcher.banned.items()) if fetcher.banned else ""


async def _records(node: Node, want: Wanted) -> list[PeerRecord]:
    """Live records announcing a manifest: of the model asked, or (auto) of the least-served one."""
    deadline, settled = trio.current_time() + want.wait, False
    while True:
        if want.model and want.model.lower() != "auto":
            found = await node.records(want.model)
        else:
            found = [r for pid in node.known_peers() if (r := await node.peer_record(pid)) is not None]
        found = [r for r in found if r.online and announced(r) is not None]
        if want.model is None:
            found = [r for r in found if r.model == DEFAULT_MODEL]
        if (found and settled) or trio.current_time() >= deadline:
            break
        settled = bool(found)  # once some answer, a moment more for the others' records
        await trio.sleep(2.0 if settled else 0.5)
    if not found:
        raise DiffuseError(f"no peer announces {want.model or DEFAULT_MODEL} with a manifest within "
                           f"{want.wait:g} s: is the swarm reachable (--bootstrap), and does it serve that model?")
    if want.model and want.model.lower() == "auto":  # the model whose least-served block has fewest replicas
        models = {r.model for r in found}
        least = min(sorted(models), key=lambda m: min(_replicas([r for r in found if r.model == m])))
        found = [r for r in found if r.model == least]
    return found


def _replicas(records: list[PeerRecord]) -> list[int]:
    n = max(r.end for r in records)
    return [sum(r.start <= i < r.end for r in records) for i in range(n)]


async def _manifest(home: Path, node: Node, config: NodeConfig, want: Wanted, fetcher: Fetcher,
                    records: list[PeerRecord], progress: "Progress") -> tuple[Path, Manifest, str]:
    """The manifest to trust (client/manifests.py `trusted`), in the store; its directory and hash."""
    with tempfile.TemporaryDirectory(prefix=".manifests-", dir=_mkdir(models_dir(home))) as tmp:
        got = await manifests.trusted(node, config, want.model_hash, records, fetcher, Path(tmp))
        manifest, sha, by = got.manifest, got.sha, got.by
        dest = models_dir(home) / manifest.model_id
        if not (dest / MANIFEST).is_file() or _partial_of(load_manifest(dest), manifest, dest):
            _mkdir(dest)
            shutil.copyfile(got.where / MANIFEST, dest / f".{MANIFEST}.tmp")
            (dest / f".{MANIFEST}.tmp").replace(dest / MANIFEST)
        progress.say(f"{manifest.model_id}: manifest {sha[:16]}… (model hash {manifest.model_hash[:16]}…), announced "
                     f"by {len(got.announcers)} peer(s){', trusted by ' + by if by else ''}")
        progress.event("manifest", model=manifest.model_id, manifest_sha256=sha, model_hash=manifest.model_hash,
                       announcers=got.announcers, trusted_by=by or "the announcers' agreement")
        return dest, manifest, sha


async def _variant_named(fetcher: Fetcher, home: Path, records: list[PeerRecord], want: Wanted
                         ) -> tuple[Wanted, str | None]:
    """With --quant, --model-hash may name the variant's manifest (by its SHA-256): then that
    manifest is the variant's, and the source to trust is the model hash it names. Returns `want`
    trusting that source, and the variant's hash (None where --model-hash names no variant)."""
    sha = (want.model_hash or "").strip().lower()
    named = [r for r in records if want.quant != "none" and r.extra.get("quant") == want.quant
             and (announced(r, variant=True) or ("",))[0] == sha]
    if not named:
        return want, None
    size = announced(named[0], variant=True)[1]
    with tempfile.TemporaryDirectory(prefix=".manifests-", dir=_mkdir(models_dir(home))) as tmp:
        await fetcher.fetch(sha, size, Path(tmp) / MANIFEST, [r.peer_id for r in named],
                            f"the {want.quant} manifest {sha[:16]}…")
        try:
            source = load_manifest(Path(tmp)).source
        except (AttributeError, TypeError, ValueError) as e:
            raise ModelError(f"the manifest {sha} (--model-hash) is not a manifest: {str(e)[:200]}") from None
    if not (isinstance(source, str) and manifests.HEX64.fullmatch(source)):
        raise ModelError(f"the manifest {sha} (--model-hash) names no source model hash: not a variant's")
    return replace(want, model_hash=source), sha


async def _variant(fetcher: Fetcher, model_dir: Path, source: Manifest, records: list[PeerRecord], scheme: str,
                   progress: "Progress", trusted: str | None = None) -> tuple[Path, Manifest, list[PeerRecord]]:
    """The `scheme` variant's manifest, from the peers serving that variant (their records' ext
    `quant`), into the store beside its source (model/variants.py), with the source's files: its
    directory, manifest and the records of its peers. Its hashes cannot be recomputed without the
    source's weights: its manifest is the one `trusted` names (--model-hash, by its SHA-256), else
    the one every announcer of the variant agrees on (quantizing is deterministic, so honest peers
    do), and it must name the trusted source."""
    serving = [r for r in records if r.extra.get("quant") == scheme and announced(r, variant=True) is not None]
    groups: dict[tuple[str, int], list[str]] = {}
    for r in serving:
        groups.setdefault(announced(r, variant=True), []).append(r.peer_id)
    if not groups:
        raise DiffuseError(f"no peer serves the {scheme} variant of {source.model_id} as files (its manifest "
                           f"announced: {manifests.VARIANT_SHA}); serve it unquantized, or pull the whole model")
    dest = variants.variant_dir(model_dir, scheme)
    with tempfile.TemporaryDirectory(prefix=".manifests-", dir=model_dir.parent) as tmp:
        found = await manifests.fetch_manifests(fetcher, groups, Path(tmp), source.model_id, source=source,
                                                quant=scheme)
        sha = manifests.choose(found, groups, trusted)
        manifest, where = found[sha]
        if (dest / MANIFEST).is_file() and load_manifest(dest).model_hash != manifest.model_hash:
            raise DiffuseError(f"the store's {dest.name} is another variant than the swarm's "
                               f"({manifest.model_hash[:16]}…): remove {dest}")
        _mkdir(dest)
        for name in manifest.files:  # the source's files, checked again by hash below
            if (model_dir / name).is_file() and not (dest / name).is_file():
                shutil.copyfile(model_dir / name, dest / name)
        shutil.copyfile(where / MANIFEST, dest / f".{MANIFEST}.tmp")
        (dest / f".{MANIFEST}.tmp").replace(dest / MANIFEST)
    peers = [p for (s, _), ps in groups.items() if s == sha for p in ps]
    await _files(fetcher, dest, manifest, peers)
    progress.say(f"{dest.name}: manifest {sha[:16]}… (model hash {manifest.model_hash[:16]}…), announced by "
                 f"{len(peers)} peer(s) of the {scheme} variant")
    progress.event("variant", model=dest.name, manifest_sha256=sha, model_hash=manifest.model_hash, announcers=peers)
    return dest, manifest, [r for r in serving if r.peer_id in peers]


def _partial_of(own: Manifest, swarm: Manifest, dest: Path) -> bool:
    """Whether the store's manifest is to be replaced by the swarm's: it is of the same model and
    partial (`model pull --blocks` leaves empty hashes for the blocks it lacks), each hash it has
    the swarm's. False where it is the swarm's model already (kept: whole, it may hold more, such
    as its own format-1 manifest); a DiffuseError where it is another model."""
    if own.model_hash == swarm.model_hash:
        return False
    same = own.num_layers == swarm.num_layers and own.head_hash in ("", swarm.head_hash) and all(
        h in ("", s) for h, s in zip(own.block_hashes, swarm.block_hashes))
    if not same or own.quant != "none":
        raise DiffuseError(f"the store's {dest.name} is another model (model hash {own.model_hash[:16]}…) "
                           f"than the swarm's ({swarm.model_hash[:16]}…): remove {dest} or pull it anew")
    log.info("%s: the store's partial manifest agrees with the swarm's on every block it holds: taking the swarm's",
             dest.name)
    return True


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


async def _files(fetcher: Fetcher, model_dir: Path, manifest: Manifest, sources: list[str]) -> None:
    """The listed files the store lacks (or holds with other bytes)."""
    from diffuse.data.files import sha256_file

    for name, (size, sha) in manifest.files.items():
        path = model_dir / name
        if not (path.is_file() and path.stat().st_size == size and sha256_file(path) == sha):
            await fetcher.fetch(sha, size, path, sources, f"{manifest.model_id}'s {name}")


async def _blocks(fetcher: Fetcher, model_dir: Path, manifest: Manifest, records: list[PeerRecord],
                  blocks: list[int], head: bool, progress: "Progress") -> None:
    """Blocks of `blocks` (and the head) the store lacks, each from the peers announcing its hash."""
    have, have_head = blockfiles.held(model_dir)
    todo: list[int | None] = [i for i in blocks if i not in have] + ([None] if head and not have_head else [])
    progress.expect(sum(manifest.head_size if i is None else manifest.block_sizes[i] for i in todo))
    for i in todo:
        sha = manifest.head_hash if i is None else manifest.block_hashes[i]
        what = f"{manifest.model_id}'s head" if i is None else f"block {i} of {manifest.model_id}"
        sources = [r.peer_id for r in records if r.extra.get(BLOCK_FILES) is True and
                   (r.extra.get(MANIFEST_SHA) is not None and "quant" not in r.extra if i is None else
                    r.start <= i < r.end and r.block_hashes[i - r.start] == sha)]
        if not sources:
            raise FetchError(f"{what}: no peer serves it as a file (none announces {BLOCK_FILES} with its hash)")
        size = manifest.head_size if i is None else manifest.block_sizes[i]
        canonical = await fetcher.fetch(sha, size, model_dir / f".{sha[:16]}.canonical", sources, what)
        try:
            dest = model_dir / blockfiles.HEAD_FILE if i is None else blockfiles.block_file(model_dir, i)
            await trio.to_thread.run_sync(blockfiles.to_safetensors, canonical, dest, i)
        finally:
            canonical.unlink(missing_ok=True)


class Progress:
    """Bytes fetched, rate and time left: a bar redrawn on stderr where it is a terminal, else a
    line on `say` at most once a second; or (`as_json`) JSON objects, one per line on stderr, each
    with its `event`: `manifest` (the one trusted), `progress` (at most once a second, and once
    at the end), `done` (what came from whom, who was banned), `failed` (why)."""

    def __init__(self, say: Say, as_json: bool = False) -> None:
        self.say, self.as_json, self.bar = say, as_json, not as_json and sys.stderr.isatty()
        self.total, self.base, self.goal, self.start, self.last = 0, 0, 0, time.monotonic(), 0.0

    def expect(self, goal: int) -> None:
        self.base, self.goal, self.start = self.total, self.total + goal, time.monotonic()

    def event(self, kind: str, **fields: Any) -> None:
        """With `as_json`: {"event": kind, **fields} as a line on stderr."""
        if self.as_json:
            print(json.dumps({"event": kind, **fields}), file=sys.stderr, flush=True)

    def add(self, n: int) -> None:
        self.total += n
        now = time.monotonic()
        if now - self.last < (0.2 if self.bar else 1.0) or not self.goal:
            return
        self.last = now
        rate = (self.total - self.base) / max(now - self.start, 1e-6)
        left = max(self.goal - self.total, 0) / max(rate, 1.0)
        if self.as_json:
            self.event("progress", fetched_bytes=self.total, of_bytes=self.goal, bytes_per_s=round(rate),
                       eta_s=round(left, 1))
            return
        text = f"{self.total / 2**20:.1f} of {self.goal / 2**20:.1f} MiB, {rate / 2**20:.1f} MiB/s, {left:.0f} s left"
        if self.bar:
            done = min(self.total / self.goal, 1.0)
            end = "\n" if self.total >= self.goal else ""
            print(f"\r[{'#' * int(30 * done):<30}] {text}", end=end, file=sys.stderr, flush=True)
        else:
            self.say(f"fetched {text}")

    def finish(self) -> None:
        """The last state: the bar's, its line ended; as JSON, a last progress line."""
        if (self.bar or self.as_json) and self.goal and self.last:
            self.last = 0.0
            self.add(0)
            if self.bar and self.total < self.goal:
                print(file=sys.stderr)
