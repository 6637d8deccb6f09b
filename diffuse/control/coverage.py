"""Coverage: which peers serve which blocks of a model, and whether the model is servable.

A pure function of the records read from the DHT, so the route builder, `diffuse status` and
block placement all see the same picture, and tests need no network.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffuse.model.store import block_ranges
from diffuse.control.records import PeerRecord


@dataclass(frozen=True)
class Coverage:
    model: str
    num_blocks: int
    peers: dict[str, PeerRecord]  # online, fresh, consistent peers by id
    blocks: list[list[str]]  # blocks[i]: ids of the peers serving block i, oldest first
    excluded: dict[str, str] = field(default_factory=dict)  # peer id -> why it does not count
    now: float = 0.0
    evidence: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # peer id -> reports against it
    reached: dict[str, dict[str, Any]] = field(default_factory=dict)  # peer id -> how we reached it (reach_peers)
    estimated: list[float] | None = None  # per block, where the DHT sampled: the peers implied (control/windows.py)

    @property
    def replicas(self) -> list[int]:
        return [len(p) for p in self.blocks]

    @property
    def counts(self) -> list[float]:
        """Replicas per block: the estimate where the DHT's nodes kept samples, else the peers seen."""
        return self.estimated if self.estimated is not None else [float(n) for n in self.replicas]

    @property
    def missing(self) -> list[int]:
        return [i for i, p in enumerate(self.blocks) if not p]

    @property
    def servable(self) -> bool:
        """Every block has at least one peer: a route through the whole model exists."""
        return self.num_blocks > 0 and not self.missing

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `diffuse status --json` (one entry of its "models" list)."""
        return {
            "model": self.model,
            "num_blocks": self.num_blocks,
            "servable": self.servable,
            "missing": self.missing,
            "min_replicas": min(self.replicas, default=0),
            "blocks": [{"block": i, "replicas": len(p), "peers": p} |
                       ({"estimated_replicas": round(self.estimated[i], 1)} if self.estimated is not None else {})
                       for i, p in enumerate(self.blocks)],
            "peers": [_peer_dict(r, self.now) | ({"reached": self.reached[r.peer_id]} if r.peer_id in self.reached
                                                 else {}) for r in sorted(self.peers.values(), key=lambda r: r.start)],
            "excluded": self.excluded,
            "evidence": self.evidence,
        }


def coverage(
    records: Iterable[PeerRecord],
    model: str,
    num_blocks: int,
    *,
    expected_hashes: Sequence[str] | None = None,
    now: float | None = None,
    variants: Mapping[str, Sequence[str]] | None = None,
) -> Coverage:
    """The block map of `model` from peer records (any mix of models, states and ages).

    Withdrawn and expired records are ignored. `num_blocks` and `expected_hashes` (the
    manifest's per-block SHA-256) come from the model's manifest, never from the records: a peer
    announcing another block count, or other weights for any block it serves, is excluded rather
    than counted or routed through. Without hashes (tests of the map alone) only the block
    count is checked. `variants` (scheme -> block hashes): the quantized variants accepted, a
    peer announcing another (its record's ext "quant") excluded.
    """
    now = time.time() if now is None else now
    recs = [r for r in records if r.model == model and r.online and r.fresh(now)]
    if expected_hashes is not None and len(expected_hashes) != num_blocks:
        raise ValueError(f"{len(expected_hashes)} hashes for a model of {num_blocks} blocks")
    peers: dict[str, PeerRecord] = {}
    excluded: dict[str, str] = {}
    for r in sorted(recs, key=lambda r: (r.started, r.peer_id)):
        why = _mismatch(r, num_blocks, expected_hashes, variants)
        if why:
            excluded[r.peer_id] = why
        else:
            peers[r.peer_id] = r
    blocks: list[list[str]] = [[] for _ in range(num_blocks)]
    for r in peers.values():
        for i in range(r.start, r.end):
            blocks[i].append(r.peer_id)
    return Coverage(model, num_blocks, peers, blocks, excluded, now)


def _mismatch(r: PeerRecord, num_blocks: int, expected: Sequence[str] | None,
              variants: Mapping[str, Sequence[str]] | None = None) -> str:
    if r.num_blocks != num_blocks:
        return f"announces {r.num_blocks} blocks, the model has {num_blocks}"
    scheme = str(r.extra.get("quant", "none"))
    if variants is not None:
        if scheme not in variants:
            return f"serves the {scheme} variant, which is not accepted here"
        expected = variants[scheme]
    elif scheme != "none":
        return f"serves the {scheme} variant, whose hashes are not checked here"
    if expected is not None:
        bad = [i for i, h in zip(range(r.start, r.end), r.block_hashes) if h != expected[i]]
        if bad:
            return f"announces other weights for blocks {block_ranges(bad)}"
    return ""


def _peer_dict(r: PeerRecord, now: float) -> dict[str, Any]:
    return {
        "peer_id": r.peer_id,
        "start": r.start,
        "end": r.end,
        "addrs": list(r.addrs),
        "dtype": r.dtype,
        "mode": r.extra.get("mode"),  # the swarm mode the peer announces: private or public
        "quant": str(r.extra.get("quant", "none")),  # the variant whose blocks it holds
        "throughput": r.throughput,
        "cache_tokens": r.cache_tokens,
        "age_s": round(max(0.0, now - r.started), 1),
        "last_heartbeat_s": round(max(0.0, now - r.timestamp), 1),
        "expires_in_s": round(r.expires - now, 1),
        "protocols": list(r.protocols),
        "software": r.software,
        "extra": dict(r.extra),
        "reach": reach_of(r),
    }


def reach_of(r: PeerRecord) -> dict[str, Any]:
    """How a peer is reached, from its record: `direct` (it announces routable addresses) or
    `relayed` via the relays named in its /p2p-circuit addresses (control/nat.py)."""
    via = list(dict.fromkeys(a.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1]
                             for a in r.addrs if "/p2p-circuit" in a))
    return {"state": "relayed", "via": via} if via and len(via) == len(r.addrs) else {"state": "direct", "via": via}


def format_text(cov: Coverage) -> str:
    """Human summary: servability, block runs with their peers, then one line per peer."""
    reps = cov.replicas
    head = (f"model {cov.model}: " + ("servable" if cov.servable else "NOT servable") +
            f" ({cov.num_blocks - len(cov.missing)}/{cov.num_blocks} blocks covered, "
            f"min replicas {min(reps, default=0)}, {len(cov.peers)} peers)")
    lines = [head] + ([f"  the DHT kept samples: about {min(cov.estimated, default=0):.0f} to "
                       f"{max(cov.estimated, default=0):.0f} replicas per block, estimated"]
                      if cov.estimated is not None else []) + ["  blocks      replicas  peers"]
    i = 0
    while i < cov.num_blocks:
        j = i
        while j + 1 < cov.num_blocks and cov.blocks[j + 1] == cov.blocks[i]:
            j += 1
        span = f"{i}" if i == j else f"{i}-{j}"
        who = ", ".join(_short(p) for p in cov.blocks[i]) or "-- uncovered --"
        lines.append(f"  {span:<11} {reps[i]:>8}  {who}")
        i = j + 1
    if cov.peers:
        lines.append("  peer          blocks            age  heartbeat  mode     tokens/s  cache  reached  addrs")
    for r in sorted(cov.peers.values(), key=lambda r: (r.start, r.peer_id)):
        d = _peer_dict(r, cov.now)
        span = f"[{r.start},{r.end})" + (f" {d['quant']}" if d["quant"] != "none" else "")
        lines.append(
            f"  {_short(r.peer_id):<13} {span:<16} {_dur(d['age_s']):>5}  {_dur(d['last_heartbeat_s']):>6} ago"
            f"  {d['mode'] or '?':<7}  {r.throughput:>8.1f}  {r.cache_tokens:>5}  "
            f"{_reached(cov.reached.get(r.peer_id, d['reach']))}"
            f"  {' '.join(r.addrs)}"
        )
    for pid, why in cov.excluded.items():
        lines.append(f"  excluded {_short(pid)}: {why}")
    for pid, reports in cov.evidence.items():
        for e in reports:
            lines.append(f"  EVIDENCE against {_short(pid)}: failed a {e['kind']} check on blocks "
                         f"{e['start']}-{e['end'] - 1} ({e['dtype']}), statistic {e['statistic']:.3g} vs "
                         f"threshold {e['threshold']:.3g}, reported by {_short(e['reporter'])} "
                         f"{_dur(max(0.0, cov.now - e['time']))} ago")
    return "\n".join(lines)


def _reached(reach: dict[str, Any]) -> str:
    """`reach` (from a record: via lists the relays) or `reached` (from a dial: via names one)."""
    via = reach["via"] if isinstance(reach["via"], list) else [reach["via"]] if reach["via"] else []
    if reach["state"] in ("relayed", "hole-punched"):
        direct = f" (direct address: {reach['direct'][:40]})" if reach.get("direct") else ""
        return f"{reach['state']} via " + ", ".join(_short(p) for p in via) + direct
    if reach["state"] == "unreachable":
        return f"UNREACHABLE from here ({reach.get('error', '')[:60]})"
    return "direct "


def _short(pid: str) -> str:
    return pid[:6] + ".." + pid[-4:]


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"
