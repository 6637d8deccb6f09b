"""Evidence of misbehaviour, signed so others can check who claims what, and a local ban list.

An `Evidence` record says who accuses whom of what, when, with which numbers (statistic and
the threshold it crossed), and which step outputs it is about (their output commitments, and
optionally Merkle openings of the disputed chunks). It is encoded as canonical CBOR and signed
with the reporter's Ed25519 key, the key inside the reporter's peer id (as peer records are,
control/records.py), so anyone can verify it without trusting whoever relayed it, and no
byte of it can be changed without the signature failing.

A signature proves who *claims* the peer cheated, not that it did: a Sybil can sign anything.
So a node bans on its own verdicts only; evidence from others is kept and counted (per
distinct reporter) for routing to weigh. Canary evidence is the kind a third party could
re-check in full, since a canary is synthetic text that can be published (its tokens, inputs
and the accused's committed outputs) once it is retired.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping

import cbor2
import msgspec
from msgspec import Meta

from diffuse.control.identity import KeyPair, peer_id_bytes, peer_id_from_bytes
from diffuse.control.node import Node
from diffuse.control.pins import PIN_SETS, PINS_PREFIX
from diffuse.control.records import NAMESPACE, SetCodec, SetCodecs, tag
from diffuse.control.signed import check_signature, decode_payload, decode_signed_set, sign_payload
from diffuse.data.commitments import MerkleTree, Opening, StepBinding, chunks_of_token
from diffuse.errors import DiffuseError
from diffuse.trust.canary import CanaryVerdict
from diffuse.trust.spotcheck import SpotVerdict
from diffuse.validate import Count, Hash, Malformed, PeerIdBytes, Text, convert

EVIDENCE_VERSION = 1
SIG_DOMAIN = b"diffuse/evidence/v1\x00"
MAX_PAYLOAD_BYTES = 48 * 1024
MAX_ITEMS = 64


class InvalidEvidence(DiffuseError, ValueError):
    """Forged, modified, malformed or oversized evidence."""


@dataclass(frozen=True)
class Evidence:
    kind: str  # "canary" (statistic = log10 p, threshold = log10 alpha) or "spotcheck" (relative errors)
    accused: str  # peer id, base58
    reporter: str
    model: str
    start: int  # the accused served blocks [start, end)
    end: int
    timestamp: float
    dtype: str  # the compute dtype the accused declared
    statistic: float
    threshold: float
    # The step outputs it is about: what each commitment binds, and the commitment itself.
    steps: tuple[tuple[StepBinding, bytes], ...] = ()
    openings: tuple[tuple[int, Opening], ...] = ()  # (index into steps, chunk of that output)
    detail: Mapping[str, float | int | str] = field(default_factory=dict)

    def openings_verify(self) -> bool:
        """Whether every opened chunk is part of the output its step's commitment commits to.

        With the accused's signature on that commitment this proves what the accused sent."""
        return all(k < len(self.steps) and self.steps[k][0].verify(self.steps[k][1], o)
                   for k, o in self.openings)

    def to_payload(self) -> dict[str, Any]:
        return {
            "v": EVIDENCE_VERSION, "kind": self.kind, "accused": peer_id_bytes(self.accused),
            "reporter": peer_id_bytes(self.reporter), "model": self.model,
            "start": self.start, "end": self.end, "ts": int(round(self.timestamp * 1000)),
            "dtype": self.dtype, "stat": float(self.statistic), "thr": float(self.threshold),
            "steps": [[b.session_id, b.step, b.input_commitment, b.header, b.n_bytes, b.chunk_size, c]
                      for b, c in self.steps],
            "openings": [[k, o.index, o.chunk, list(o.path)] for k, o in self.openings],
            "detail": dict(self.detail),
        }

    @classmethod
    def from_payload(cls, d: Any) -> "Evidence":
        """Strict: every field present, with its type, within bounds (`EvidencePayload`)."""
        try:
            p = convert(d, EvidencePayload)
        except Malformed as e:
            raise InvalidEvidence(f"malformed evidence: {e}") from None
        steps = tuple((StepBinding(*s[:6]), s[6]) for s in p.steps)
        openings = tuple((k, Opening(i, chunk, tuple(path))) for k, i, chunk, path in p.openings)
        return cls(p.kind, _peer(p.accused), _peer(p.reporter), p.model, p.start, p.end, p.ts / 1000, p.dtype,
                   p.stat, p.thr, steps, openings, p.detail)


Few = Meta(max_length=MAX_ITEMS)  # lists and maps: at most MAX_ITEMS entries
# [session, step, input commitment, header, bytes, chunk size, output commitment]
Step = tuple[Annotated[bytes, Meta(min_length=16, max_length=16)], Count, Hash, Annotated[bytes, Meta(max_length=64)],
             Count, Annotated[int, Meta(ge=1, le=2**53 - 1)], Hash]
OpeningItem = tuple[Count, Count, bytes, Annotated[list[Hash], Few]]  # [step, index, chunk, Merkle path]


class EvidencePayload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The signed evidence map as it is on the wire (protocols/dht-records.md, Evidence)."""

    v: Literal[EVIDENCE_VERSION]
    kind: Literal["canary", "spotcheck"]
    accused: PeerIdBytes
    reporter: PeerIdBytes
    model: Text
    start: Count
    end: Count
    ts: Count
    dtype: Text
    stat: float
    thr: float
    steps: Annotated[list[Step], Few]
    openings: Annotated[list[OpeningItem], Few]
    detail: Annotated[dict[str, bool | int | float | str], Few]

    def __post_init__(self) -> None:
        if not self.start < self.end:
            raise ValueError("bad block range")
        if math.isnan(self.stat) or math.isnan(self.thr):
            raise ValueError("statistic and threshold must be numbers (not NaN)")


def canary_evidence(verdict: CanaryVerdict, accused: str, reporter: str, model: str, start: int, end: int,
                    dtype: str, steps: tuple[tuple[StepBinding, bytes], ...] = (),
                    now: float | None = None) -> Evidence:
    """Evidence from a canary test: the p-value against the budget, the z-scores behind it, and
    optionally the commitments of the canary steps' outputs."""
    return Evidence("canary", accused, reporter, model, start, end, time.time() if now is None else now,
                    dtype, verdict.log10_p, verdict.log10_alpha, steps,
                    detail={"z_mean": verdict.z_mean, "z_max": verdict.z_max, "m": verdict.m})


def spot_evidence(verdict: SpotVerdict, accused: str, reporter: str, model: str, start: int, end: int,
                  dtype: str, referee: str, binding: StepBinding, tree: MerkleTree,
                  now: float | None = None) -> Evidence:
    """Evidence from a failed spot check: the worst token's error against its tolerance, the
    step's output commitment, and the chunks holding that token opened."""
    row, token = verdict.token
    chunks = chunks_of_token(binding.shape, binding.dtype, row, token, binding.chunk_size)
    openings = tuple((0, tree.open(i)) for i in chunks)
    return Evidence("spotcheck", accused, reporter, model, start, end, time.time() if now is None else now,
                    dtype, verdict.statistic, verdict.threshold, ((binding, binding.commit(tree.root)),),
                    openings, {"row": row, "token": token, "referee": referee})


@dataclass(frozen=True)
class SignedEvidence:
    evidence: Evidence
    payload: bytes  # exactly what was signed: re-published verbatim, never re-encoded
    signature: bytes

    def encode(self) -> bytes:
        return cbor2.dumps([self.payload, self.signature], canonical=True)


def sign(evidence: Evidence, key_pair: KeyPair) -> SignedEvidence:
    payload, signature = sign_payload(evidence.to_payload(), key_pair, evidence.reporter, SIG_DOMAIN,
                                      MAX_PAYLOAD_BYTES, "evidence")
    return SignedEvidence(Evidence.from_payload(cbor2.loads(payload)), payload, signature)


def verify(payload: bytes, signature: bytes) -> SignedEvidence:
    """Check evidence from anyone: canonical, well-formed, signed by the reporter it names."""
    ev = Evidence.from_payload(decode_payload(payload, signature, MAX_PAYLOAD_BYTES, InvalidEvidence, "evidence"))
    check_signature(ev.reporter, SIG_DOMAIN, payload, signature, InvalidEvidence,
                    f"evidence reported by {ev.reporter}")
    if not ev.openings_verify():  # the reporter's own claim must hold together before anyone keeps it
        raise InvalidEvidence(f"evidence reported by {ev.reporter}: its Merkle openings are not parts of the "
                              "outputs its step commitments commit to")
    return SignedEvidence(ev, payload, signature)


def decode(value: bytes) -> SignedEvidence:
    """The inverse of SignedEvidence.encode, verifying on the way."""
    try:
        item = cbor2.loads(value)
    except Exception:  # noqa: BLE001 - cbor2 raises many types on hostile bytes
        raise InvalidEvidence("evidence is not valid CBOR") from None
    if not isinstance(item, list) or len(item) != 2:
        raise InvalidEvidence("evidence is [payload, signature]")
    return verify(item[0], item[1])


class BanList:
    """Peers this node refuses to route through: banned by its own verdicts, for `ttl` seconds.

    Others' evidence is counted by distinct reporter (`reports`) for routing to weigh, never
    turned into a ban on its own: a few Sybil identities could otherwise exclude anyone.
    """

    def __init__(self, me: str, ttl: float = 24 * 3600.0, clock: Callable[[], float] = time.time):
        self.me, self.ttl, self.clock = me, ttl, clock
        self.until: dict[str, float] = {}
        self.evidence: dict[str, list[SignedEvidence]] = {}

    def add(self, ev: SignedEvidence) -> bool:
        """Record verified evidence; True if it bans the accused (this node reported it)."""
        accused = ev.evidence.accused
        self.evidence.setdefault(accused, []).append(ev)
        if ev.evidence.reporter != self.me:
            return False
        self.until[accused] = max(self.until.get(accused, 0.0), self.clock() + self.ttl)
        return True

    def banned(self, peer: str) -> bool:
        return self.until.get(peer, 0.0) > self.clock()

    def active(self) -> set[str]:
        now = self.clock()
        return {p for p, t in self.until.items() if t > now}

    def reports(self, peer: str) -> int:
        """How many distinct others have published evidence against `peer`."""
        return len({e.evidence.reporter for e in self.evidence.get(peer, ())} - {self.me})


def _peer(v: bytes) -> str:
    try:
        return peer_id_from_bytes(v)
    except ValueError:
        raise InvalidEvidence("malformed evidence: bad peer id") from None


# ---- evidence sets: the DHT value under evidence_key(accused) ----

EVIDENCE_PREFIX = f"/{NAMESPACE}/evidence/"
MAX_EVIDENCE = 32  # per accused: the latest report of each of the most recent reporters
EVIDENCE_TTL_S = 7 * 24 * 3600.0


def evidence_key(accused: str) -> str:
    """Where evidence against one peer collects."""
    return EVIDENCE_PREFIX + tag("evidence:" + accused)


def encode_set(items: list[SignedEvidence]) -> bytes:
    return cbor2.dumps([[e.payload, e.signature] for e in items], canonical=True)


def decode_set(value: bytes, key: str, *, now: float | None = None, strict: bool = True) -> list[SignedEvidence]:
    """The verified evidence of a DHT value stored at `key` (strict / lenient as for record sets)."""
    def check(payload: Any, signature: Any) -> SignedEvidence:
        ev = verify(payload, signature)
        if evidence_key(ev.evidence.accused) != key:
            raise InvalidEvidence("evidence stored under another peer's key")
        return ev

    return decode_signed_set(value, check, max_items=MAX_EVIDENCE, max_bytes=MAX_EVIDENCE * (MAX_PAYLOAD_BYTES + 128),
                             error=InvalidEvidence, noun="evidence", strict=strict)


def merge_set(items: list[SignedEvidence], now: float | None = None) -> list[SignedEvidence]:
    """Latest report per reporter, none older than EVIDENCE_TTL_S, the newest MAX_EVIDENCE kept."""
    now = time.time() if now is None else now
    best: dict[str, SignedEvidence] = {}
    for e in items:
        ev = e.evidence
        if ev.timestamp < now - EVIDENCE_TTL_S or ev.timestamp > now + 60:
            continue
        cur = best.get(ev.reporter)
        if cur is None or (ev.timestamp, e.payload) > (cur.evidence.timestamp, cur.payload):
            best[ev.reporter] = e
    newest = sorted(best.values(), key=lambda e: -e.evidence.timestamp)[:MAX_EVIDENCE]
    return sorted(newest, key=lambda e: e.evidence.reporter)


def contributes(new: list[SignedEvidence], old: list[SignedEvidence]) -> bool:
    have = {e.evidence.reporter: e.evidence.timestamp for e in old}
    return any(e.evidence.timestamp > have.get(e.evidence.reporter, -1.0) for e in new)


EVIDENCE_SETS: SetCodec[SignedEvidence] = SetCodec(decode_set, merge_set, encode_set, contributes, InvalidEvidence,
                                                   lambda e: e.evidence.reporter, MAX_EVIDENCE)


def swarm_codecs() -> SetCodecs:
    """What a node of a swarm whose clients publish evidence stores: peer records, evidence and
    the sentinels' pins (control/pins.py)."""
    return SetCodecs({EVIDENCE_PREFIX: EVIDENCE_SETS, PINS_PREFIX: PIN_SETS})


async def publish(node: Node, evidence: SignedEvidence) -> int:
    """Store signed evidence under its accused's key; returns how many DHT nodes took it."""
    return await node.put_set(evidence_key(evidence.evidence.accused), [evidence])


async def reports(node: Node, peer_id: str) -> list[SignedEvidence]:
    """Verified evidence anyone has published against `peer_id`, latest per reporter."""
    return await node.fetch_set(evidence_key(peer_id))
