"""What `diffuse status` shows: each model's coverage as the DHT says, with the evidence published
against its peers and how this machine reaches each of them.

A survey joins as a client with an ephemeral identity: a status query must never impersonate a
running peer, and nothing links two of a user's queries.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import trio

from diffuse.client import manifests
from diffuse.client.accept import NotHere, accepted_hashes, explain
from diffuse.client.swarm_backend import SwarmConfig
from diffuse.control.coverage import Coverage, coverage, format_text
from diffuse.control import pins
from diffuse.control.identity import ephemeral
from diffuse.control.node import Node, NodeConfig, open_node
from diffuse.control.records import PeerRecord
from diffuse.data.fetcher import Fetcher
from diffuse.errors import DiffuseError, ModelError
from diffuse.model import store, variants
from diffuse.model.quant import parse_accept
from diffuse.model.weights import MANIFEST, Manifest, load_manifest
from diffuse.trust import reputation

log = logging.getLogger(__name__)

MDNS_WAIT_S = 5.0  # with no bootstrap peer: how long the LAN gets to answer
EVIDENCE_WAIT_S = 5.0  # per peer: how long its published evidence may take to read


@dataclass
class Survey:
    coverages: list[Coverage]  # one per model, with evidence and (if asked) how each peer is reached
    lan: list[str]  # nodes of this swarm found on the LAN by mDNS
    refused: dict[str, str] = field(default_factory=dict)  # models with no manifest to trust: why


def stored(home: Path, names: list[str]) -> dict[str, Path]:
    """The named models' directories by model hash; by default every model in the store (the
    swarm's other models have no manifest to judge them by); none from an empty store: the
    survey fetches the swarm's manifests. A variant named (NAME@int4) stands for its source,
    whose records carry every variant's."""
    dirs = [store.resolve(home, name) for name in names] if names else [m.path for m in store.list_models(home)]
    found = {}
    for d in dirs:
        manifest = load_manifest(d)
        if manifest.quant != "none":
            d = variants.source_dir(d, manifest)
            manifest = load_manifest(d)
        found[manifest.model_hash] = d
    return found


class Variants:
    """The quantized variants a survey counts (client/accept.py): those accepted
    (`--accept-quant`), their hashes those of the store's own variant (model/variants.py). A
    variant the store lacks is made from its weights only where `make` names its scheme (the
    user asked for it): a status query does not spend minutes and disk on every scheme a record
    names."""

    def __init__(self, sources: Mapping[str, Path], accept: tuple[str, ...], make: tuple[str, ...] = ()):
        self.sources, self.accept, self.make = sources, accept, make
        self.hashes: dict[tuple[str, str], list[str]] = {}
        self.failed: dict[tuple[str, str], Exception] = {}  # (model hash, scheme) -> why it is not had

    async def coverage(self, node: Node, m: Manifest) -> Coverage:
        """`m`'s block map; without its weights here (a manifest from the swarm), a quantized peer
        is excluded as one whose hashes are not checked."""
        node.num_blocks[m.model_id] = m.num_layers  # which window keys hold the model
        records = await node.records(m.model_id)
        source = self.sources.get(m.model_hash)
        if source is None:
            return coverage(records, m.model_id, m.num_layers, expected_hashes=m.block_hashes)

        async def hashes_of(scheme: str) -> list[str]:
            key = (m.model_hash, scheme)
            if scheme == "none":
                return m.block_hashes
            if key in self.failed:  # not tried again while the survey polls
                raise self.failed[key]
            if key not in self.hashes:
                try:
                    self.hashes[key] = await self._hashes(source, scheme)
                except (ModelError, OSError) as e:
                    self.failed[key] = e
                    raise
            return self.hashes[key]

        known, failed = await accepted_hashes(records, self.accept, hashes_of)
        cov = coverage(records, m.model_id, m.num_layers, expected_hashes=m.block_hashes, variants=known)
        explain(cov.excluded, records, failed)
        return cov

    async def _hashes(self, source: Path, scheme: str) -> list[str]:
        if not (variants.variant_dir(source, scheme) / MANIFEST).is_file() and scheme not in self.make:
            raise NotHere(f"the {scheme} variant is not made here (--accept-quant {scheme} makes it)")
        made = await trio.to_thread.run_sync(variants.resolve, source, scheme)
        return load_manifest(made).block_hashes


async def survey(swarm: SwarmConfig, models: list[Manifest], reach: bool, judge: Variants,
                 model_hashes: Mapping[str, str] | None = None) -> Survey:
    """Coverage of `models` (none: the swarm's, by the manifests it would trust, `model_hashes`
    the operator's --model-hash per model), polled until all are servable or `swarm.wait` seconds
    pass; `judge`: the variants counted."""
    config, refused = swarm.node_config(), {}
    async with open_node(ephemeral(), config, codecs=reputation.swarm_codecs()) as node:
        if swarm.mdns and not swarm.bootstrap:  # the swarm is whoever answers on the LAN: give them a moment
            with trio.move_on_after(max(swarm.wait, MDNS_WAIT_S)):
                while not node.lan_peers:
                    await trio.sleep(0.1)
        models = models or await swarm_manifests(node, config, model_hashes or {}, refused)
        deadline = trio.current_time() + max(0.0, swarm.wait)
        while True:
            covs = [await judge.coverage(node, m) for m in models]
            if all(c.servable for c in covs) or trio.current_time() >= deadline:
                break
            await trio.sleep(0.5)
        reached = await node.reach_peers([r for c in covs for r in c.peers.values()]) if reach else {}
        covs = [replace(c, evidence=await _evidence(node, c.peers), reached=reached) for c in covs]
        return Survey(covs, list(node.lan_peers), refused)


async def status(home: Path, names: list[str], swarm: SwarmConfig, reach: bool,
                 accept: str | None = None, model_hashes: Sequence[str] = ()) -> dict[str, Any]:
    """What `diffuse status` prints, for people ("text") and for --json ("json"). `accept`:
    --accept-quant (default: every variant the store holds, each checked against it; those it
    names, `any` included, are made here where the store lacks them); `model_hashes`: --model-hash
    MODEL=SHA256, the manifests to trust where the store has no weights (a bad one: a DiffuseError)."""
    trust = pins.parse(model_hashes)
    sources = stored(home, names)
    judge = Variants(sources, parse_accept(accept or "any", "none"), parse_accept(accept, "none") if accept else ())
    models = [load_manifest(d) for d in sources.values()]
    text, data = report(await survey(swarm, models, reach, judge, trust), swarm)
    return {"text": text, "json": data}


def report(found: Survey, swarm: SwarmConfig) -> tuple[str, dict[str, Any]]:
    """What `diffuse status` prints: for people, and as --json gives it."""
    lan = [f"found on the LAN by mDNS: {len(found.lan)} node(s) of this swarm"] if swarm.mdns else []
    none = [] if found.coverages or found.refused else ["no model found: no peer reached announces one"]
    refused = [f"{m}: not shown, no manifest to trust: {why}" for m, why in found.refused.items()]
    text = "\n\n".join([swarm.access.describe(), *lan, *(format_text(c) for c in found.coverages), *refused, *none])
    return text, {"time": time.time(), "mode": swarm.access.mode, "models": [c.to_dict() for c in found.coverages]} \
        | ({"lan_peers": found.lan} if swarm.mdns else {}) | ({"refused": found.refused} if found.refused else {})


async def swarm_manifests(node: Node, config: NodeConfig, model_hashes: Mapping[str, str],
                          refused: dict[str, str]) -> list[Manifest]:
    """With no model at hand: each model the swarm's peers serve, by the manifest `join
    --from-swarm` would trust (client/manifests.py `trusted`: `model_hashes`, the operator's, then
    the pins of the sentinels this node bootstraps from, then agreement among the announcers),
    fetched from them and checked against its hash. A model with no manifest to trust is left
    out, why in `refused`."""
    by_model: dict[str, list[PeerRecord]] = {}
    for pid in node.known_peers():
        record = await node.peer_record(pid)
        if record is not None and record.online and manifests.announced(record) is not None:
            by_model.setdefault(record.model, []).append(record)
    found: list[Manifest] = []
    with tempfile.TemporaryDirectory(prefix="diffuse-manifests-") as tmp:
        for model, records in sorted(by_model.items()):
            fetcher = Fetcher(manifests.opener(node, records))
            try:
                where = Path(tmp) / f"{len(found)}-{len(refused)}"
                where.mkdir()
                found.append((await manifests.trusted(node, config, model_hashes.get(model), records, fetcher,
                                                      where, to_fetch=False)).manifest)
            except DiffuseError as e:
                log.warning("no manifest of %s to trust: %s", model, e)
                refused[model] = str(e)
            finally:
                await fetcher.close()
    return found


async def _evidence(node: Node, peers) -> dict[str, list[dict]]:
    """Verified evidence published against each peer, summarised for people and --json."""
    found: dict[str, list[dict]] = {}

    async def one(pid: str) -> None:
        with trio.move_on_after(EVIDENCE_WAIT_S):
            reports = await reputation.reports(node, pid)
            if reports:
                found[pid] = [{"reporter": e.evidence.reporter, "kind": e.evidence.kind, "start": e.evidence.start,
                               "end": e.evidence.end, "dtype": e.evidence.dtype, "statistic": e.evidence.statistic,
                               "threshold": e.evidence.threshold, "time": e.evidence.timestamp,
                               "detail": dict(e.evidence.detail)} for e in reports]

    async with trio.open_nursery() as nursery:
        for pid in peers:
            nursery.start_soon(one, pid)
    return dict(sorted(found.items()))
