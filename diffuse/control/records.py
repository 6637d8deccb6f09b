"""Signed peer records: what a peer serves, encoded canonically, signed with its Ed25519 key.

Spec: protocols/dht-records.md. In short, a record is a canonical-CBOR map (the payload) and an
Ed25519 signature over a domain tag plus that payload, by the key embedded in the record's own
peer id. A DHT value is a CBOR array of such records (a *record set*), so one format serves both
key kinds: `/diffuse/peer/<peerid>` (at most that peer's record) and `/diffuse/blocks/<model>`
(every peer serving blocks of the model). Sets merge by "latest record per peer wins", which is
commutative, associative and idempotent: DHT nodes and readers can merge in any order and agree.

No pickle: a value is untrusted bytes from anyone on the network. Decoding is bounded in size,
every field is type-checked, and a payload must be in canonical form (so one record has one
byte string, and signatures cannot be malleated into look-alike duplicates).
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Generic, Literal, TypeVar

import cbor2
import msgspec
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.records.validator import Validator
from msgspec import Meta

from diffuse.control.signed import check_signature, decode_payload, decode_signed_set, sign_payload
from diffuse.errors import DiffuseError
from diffuse.validate import Count, Finite, Hash, Int64, Malformed, PeerIdBytes, Text, convert

RECORD_VERSION = 1
SIG_DOMAIN = b"diffuse/peer-record/v1\x00"
NAMESPACE = "diffuse"
PEER_PREFIX = f"/{NAMESPACE}/peer/"
BLOCKS_PREFIX = f"/{NAMESPACE}/blocks/"
RELAYS_PREFIX = f"/{NAMESPACE}/relays/"
WINDOW_PREFIX = f"/{NAMESPACE}/window/"
WINDOW_BLOCKS = 8  # blocks per window key (layout 2): a span of L blocks touches at most ceil(L/8)+1 windows
ONLINE, OFFLINE = "online", "offline"

MAX_CLOCK_SKEW_S = 60.0  # a record issued further in the future is refused
MAX_TTL_S = 3600.0  # a record may not claim to live longer than this past its issue time
MAX_PAYLOAD_BYTES = 16 * 1024
MAX_SET_RECORDS = 64  # per stored value: a node keeps a bounded sample (dht.MergingValueStore)
MAX_VALUE_BYTES = MAX_SET_RECORDS * (MAX_PAYLOAD_BYTES + 128)  # ~1 MiB, under py-libp2p's 4 MiB messages
VERIFIED = 4096  # signed records whose check is remembered (verify): a few MiB at most
MAX_COUNTED = 1 << 15  # owners a node counts per window key (dht.MergingValueStore): past it, it stops counting
MAX_BLOCKS = 256
MAX_ADDRS = 16
MAX_EXTRA = 32


Item = TypeVar("Item")


class InvalidRecord(DiffuseError, ValueError):
    """Forged, tampered, stale, malformed, or not allowed under the key it was stored at."""


@dataclass(frozen=True)
class PeerRecord:
    """What one peer serves, as it announces it. Times are UNIX seconds (ms resolution on the wire)."""

    peer_id: str
    model: str
    num_blocks: int  # blocks in the whole model, so a reader knows what "covered" means
    start: int  # serves blocks [start, end)
    end: int
    block_hashes: tuple[str, ...]  # hex SHA-256 of blocks start..end-1 (manifest commitments)
    dtype: str
    throughput: float  # estimated tokens/s one sequence gets through the whole span
    cache_tokens: int  # free KV-cache capacity, in tokens
    addrs: tuple[str, ...]  # dialable multiaddrs without /p2p
    timestamp: float  # issued at (the heartbeat); orders records of one peer
    expires: float
    started: float  # when the peer began serving: its age
    state: str = ONLINE  # OFFLINE = withdrawn (a tombstone that outranks older records)
    protocols: tuple[str, ...] = ()  # stream protocols served (e.g. /diffuse/inference/1.0.0)
    software: str = ""
    version: int = RECORD_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)  # data-plane fields, signed too

    @property
    def online(self) -> bool:
        return self.state == ONLINE

    def fresh(self, now: float | None = None) -> bool:
        return self.expires > (time.time() if now is None else now)

    def serves(self, block: int) -> bool:
        return self.start <= block < self.end

    def to_payload(self) -> dict[str, Any]:
        return {
            "v": self.version, "peer": ID.from_base58(self.peer_id).to_bytes(),
            "model": self.model, "nblocks": self.num_blocks, "start": self.start, "end": self.end,
            "hashes": [bytes.fromhex(h) for h in self.block_hashes], "dtype": self.dtype,
            "tput": float(self.throughput), "cache": self.cache_tokens, "addrs": list(self.addrs),
            "proto": list(self.protocols), "sw": self.software, "state": self.state,
            "started": _ms(self.started), "ts": _ms(self.timestamp), "exp": _ms(self.expires),
            "ext": dict(self.extra),
        }

    @classmethod
    def from_payload(cls, d: Any) -> "PeerRecord":
        """Strict: every field present with its exact type and within bounds (`RecordPayload`)."""
        try:
            p = convert(d, RecordPayload)
        except Malformed as e:
            raise InvalidRecord(f"malformed record: {e}") from None
        return cls(
            peer_id=ID(p.peer).to_base58(), model=p.model, num_blocks=p.nblocks, start=p.start, end=p.end,
            block_hashes=tuple(h.hex() for h in p.hashes), dtype=p.dtype, throughput=p.tput,
            cache_tokens=p.cache, addrs=tuple(p.addrs), protocols=tuple(p.proto), software=p.sw,
            state=p.state, started=p.started / 1000, timestamp=p.ts / 1000, expires=p.exp / 1000,
            version=p.v, extra=p.ext,
        )


Scalar = bool | Int64 | Finite | Text  # an extension value: what CBOR and JSON both carry losslessly


class RecordPayload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The signed map as it is on the wire (protocols/dht-records.md); the Ed25519 key inside
    `peer` is checked in verify()."""

    v: Literal[RECORD_VERSION]
    peer: PeerIdBytes
    model: Text
    nblocks: Count
    start: Count
    end: Count
    hashes: list[Hash]  # as many as the block range spans (__post_init__)
    dtype: Text
    tput: Annotated[float, Meta(ge=0, le=sys.float_info.max)]
    cache: Count
    addrs: Annotated[list[Text], Meta(max_length=MAX_ADDRS)]
    proto: Annotated[list[Text], Meta(max_length=MAX_ADDRS)]
    sw: Text
    state: Literal[ONLINE, OFFLINE]
    started: Count
    ts: Count
    exp: Count
    ext: Annotated[dict[Annotated[str, Meta(max_length=64)], Scalar], Meta(max_length=MAX_EXTRA)]

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.nblocks <= MAX_BLOCKS:
            raise ValueError(f"bad block range [{self.start}, {self.end}) of {self.nblocks}")
        if len(self.hashes) != self.end - self.start:
            raise ValueError("block hashes do not match the block range")


@dataclass(frozen=True)
class SignedRecord:
    """A verified record with the exact bytes it was signed as (re-sent verbatim, never re-encoded)."""

    record: PeerRecord
    payload: bytes
    signature: bytes

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    @property
    def order(self) -> tuple[int, bytes]:
        """Total order among one peer's records: newest wins; bytes break ties deterministically."""
        return (_ms(self.record.timestamp), self.payload)


def sign(record: PeerRecord, key_pair: KeyPair) -> SignedRecord:
    payload, signature = sign_payload(record.to_payload(), key_pair, record.peer_id, SIG_DOMAIN, MAX_PAYLOAD_BYTES,
                                      "a record")
    return SignedRecord(PeerRecord.from_payload(cbor2.loads(payload)), payload, signature)


def verify(payload: bytes, signature: bytes) -> SignedRecord:
    """Check a (payload, signature) pair; the signer is the key inside the record's peer id.
    The same bytes always verify the same way, so the last VERIFIED pairs that passed are
    remembered: a DHT node decodes a key's whole record set again at every PUT to it, and every
    read checks each record it is handed."""
    if type(payload) is bytes and type(signature) is bytes:
        return _verified(payload, signature)
    return _verify(payload, signature)  # not bytes: refused, naming why


def _verify(payload: bytes, signature: bytes) -> SignedRecord:
    rec = PeerRecord.from_payload(decode_payload(payload, signature, MAX_PAYLOAD_BYTES, InvalidRecord, "a record"))
    check_signature(rec.peer_id, SIG_DOMAIN, payload, signature, InvalidRecord, f"the record of {rec.peer_id}")
    return SignedRecord(rec, payload, signature)


_verified = functools.lru_cache(maxsize=VERIFIED)(_verify)


def check_time(rec: PeerRecord, now: float | None = None) -> None:
    """Stale (expired), from the future, or living implausibly long: refused."""
    now = time.time() if now is None else now
    if rec.expires <= now:
        raise InvalidRecord(f"stale record of {rec.peer_id} (expired {now - rec.expires:.1f} s ago)")
    if rec.timestamp > now + MAX_CLOCK_SKEW_S:
        raise InvalidRecord(f"record of {rec.peer_id} is dated in the future")
    if rec.expires - rec.timestamp > MAX_TTL_S or rec.started > rec.timestamp:
        raise InvalidRecord(f"record of {rec.peer_id} has implausible times")


# ---- DHT keys ----

def tag(text: str) -> str:
    """128 bits of SHA-256, hex. Keys carry tags, not names: py-libp2p 0.8.1 refuses FIND_NODE
    targets over 50 bytes that are not multihashes, and model ids may be long or contain '/'."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def peer_key(peer_id: str) -> str:
    return PEER_PREFIX + tag("peer:" + peer_id)


def blocks_key(model: str) -> str:
    return BLOCKS_PREFIX + tag("model:" + model)


def window_key(model: str, window: int) -> str:
    """Layout 2: the records of every peer whose span touches blocks [8w, 8w+8) of `model`."""
    return WINDOW_PREFIX + tag(f"window:{model}:{window}")


def windows_of(start: int, end: int) -> range:
    """The windows that blocks [start, end) touch."""
    return range(start // WINDOW_BLOCKS, (end - 1) // WINDOW_BLOCKS + 1)


def relays_key() -> str:
    """Where peers that serve circuit relay hops to the swarm are listed (ext "relay")."""
    return RELAYS_PREFIX + tag("relays")


def check_key(key: str, rec: PeerRecord) -> None:
    """A record may only be stored under its own peer key, its own model's blocks key, the
    window keys its span touches, or, if it says it serves relay hops, the relays key."""
    if key.startswith(PEER_PREFIX):
        if key != peer_key(rec.peer_id):
            raise InvalidRecord(f"record of {rec.peer_id} stored under another peer's key")
    elif key.startswith(BLOCKS_PREFIX):
        if key != blocks_key(rec.model):
            raise InvalidRecord(f"record for model {rec.model!r} stored under another model's key")
    elif key.startswith(WINDOW_PREFIX):
        if key not in {window_key(rec.model, w) for w in windows_of(rec.start, rec.end)}:
            raise InvalidRecord(f"record of {rec.peer_id} stored under a window its span does not touch")
    elif key.startswith(RELAYS_PREFIX):
        if key != relays_key() or rec.extra.get("relay") is not True:
            raise InvalidRecord(f"record of {rec.peer_id}, which serves no relay, stored under the relays key")
    else:
        raise InvalidRecord(f"unknown Diffuse key {key!r}")


# ---- record sets (DHT values) ----

def encode_set(records: Iterable[SignedRecord], count: int | None = None) -> bytes:
    """A DHT value; a node storing a window key puts first its `count` of the owners it holds
    unexpired records of, kept or not (layout 2, "Counts" in protocols/dht-records.md)."""
    items: list = [[r.payload, r.signature] for r in sorted(records, key=lambda r: r.peer_id)]
    return cbor2.dumps(items if count is None else [count, *items], canonical=True)


def value_count(value: bytes) -> int | None:
    """The owner count a node put first in a window key's value, if it did (and it is sane)."""
    try:
        items = cbor2.loads(value) if len(value) <= MAX_VALUE_BYTES else None
    except Exception:  # noqa: BLE001 - cbor2 raises many types on hostile bytes; decode_set names them
        return None
    if isinstance(items, list) and items and type(items[0]) is int and 0 <= items[0] <= MAX_COUNTED:
        return items[0]
    return None


def decode_set(value: bytes, key: str, *, now: float | None = None, strict: bool = True) -> list[SignedRecord]:
    """The records of a DHT value. strict: any bad record refuses the whole value (store path);
    lenient: bad records are dropped one by one, so one forged entry cannot hide honest ones."""
    seen: set[str] = set()

    def check(payload: Any, signature: Any) -> SignedRecord:
        sr = verify(payload, signature)
        check_time(sr.record, now)
        check_key(key, sr.record)
        if sr.peer_id in seen:
            raise InvalidRecord(f"two records of {sr.peer_id} in one value")
        seen.add(sr.peer_id)
        return sr

    return decode_signed_set(value, check, max_items=MAX_SET_RECORDS, max_bytes=MAX_VALUE_BYTES,
                             error=InvalidRecord, noun="record", strict=strict)


def merge(records: Iterable[SignedRecord], now: float | None = None) -> list[SignedRecord]:
    """Latest record per peer; expired ones dropped (tombstones are kept until they expire, so
    they keep outranking the older online record they withdraw)."""
    now = time.time() if now is None else now
    best: dict[str, SignedRecord] = {}
    for r in records:
        if r.record.expires <= now:
            continue
        cur = best.get(r.peer_id)
        if cur is None or r.order > cur.order:
            best[r.peer_id] = r
    return sorted(best.values(), key=lambda r: r.peer_id)


def contributes(new: Iterable[SignedRecord], old: Iterable[SignedRecord]) -> bool:
    """Whether merging `new` into `old` changes anything (i.e. `new` is not a replay)."""
    have = {r.peer_id: r.order for r in old}
    return any(r.peer_id not in have or r.order > have[r.peer_id] for r in new)


@dataclass(frozen=True)
class SetCodec(Generic[Item]):
    """How the values under one key prefix decode, merge, encode and grow: sets of signed items,
    merged by a rule that is commutative and idempotent (so DHT nodes agree whatever the order)."""

    decode: Callable[..., list[Item]]  # (value, key, *, now=None, strict=True) -> items; raises `invalid`
    merge: Callable[[list[Item], float | None], list[Item]]  # (items, now) -> the set to keep
    encode: Callable[..., bytes]  # (items) -> value; record sets also take a node's count (encode_set)
    contributes: Callable[[list[Item], list[Item]], bool]  # (new, old): not a replay
    invalid: type[Exception]  # what decode raises for a bad value
    owner: Callable[[Item], str]  # whose item it is: one per owner in a set
    capacity: int  # items a DHT node keeps per value


RECORD_SETS: SetCodec[SignedRecord] = SetCodec(decode_set, merge, encode_set, contributes, InvalidRecord,
                                               lambda r: r.peer_id, MAX_SET_RECORDS)


def allowed_only(codec: SetCodec[SignedRecord], allowed: Callable[[], Set[str]]) -> SetCodec[SignedRecord]:
    """`codec` for a swarm where only the peers in `allowed()` (an allow-list as it is now) may
    serve: a stored value naming another peer is refused, and reads and merges drop such records,
    so a peer removed from the list vanishes from values already held."""

    def decode(value: bytes, key: str, *, now: float | None = None, strict: bool = True) -> list[SignedRecord]:
        records, ok = codec.decode(value, key, now=now, strict=strict), allowed()
        barred = [r.peer_id for r in records if r.peer_id not in ok]
        if barred and strict:
            raise InvalidRecord(f"{barred[0]} is not on this swarm's allow-list")
        return [r for r in records if r.peer_id in ok]

    def merge(items: list[SignedRecord], now: float | None) -> list[SignedRecord]:
        ok = allowed()
        return [r for r in codec.merge(items, now) if r.peer_id in ok]

    return replace(codec, decode=decode, merge=merge)


class SetCodecs:
    """The value formats a node accepts under /diffuse/, by key prefix. Whoever builds the node
    fills it in: peer and blocks keys always, and what upper planes store (trust's evidence)."""

    def __init__(self, extra: Mapping[str, SetCodec] | None = None) -> None:
        self.by_prefix: dict[str, SetCodec] = {PEER_PREFIX: RECORD_SETS, BLOCKS_PREFIX: RECORD_SETS,
                                               WINDOW_PREFIX: RECORD_SETS, RELAYS_PREFIX: RECORD_SETS,
                                               **(extra or {})}
        self.invalid: tuple[type[Exception], ...] = tuple({c.invalid for c in self.by_prefix.values()})

    def allowing(self, allowed: Callable[[], Set[str]]) -> "SetCodecs":
        """These formats, with peer records only of the peers in `allowed()` (`allowed_only`)."""
        return SetCodecs({p: allowed_only(c, allowed) if c is RECORD_SETS else c for p, c in self.by_prefix.items()})

    def for_key(self, key: str) -> SetCodec:
        for prefix, codec in self.by_prefix.items():
            if key.startswith(prefix):
                return codec
        raise InvalidRecord(f"unknown Diffuse key {key!r}")


class RecordValidator(Validator):
    """The DHT validator of the /diffuse/ namespace, run on store (PUT) and on every read.

    `select` is merge-aware: py-libp2p stores a PUT only if select([existing, new]) == 1, so it
    returns the last value that adds a record newer than all earlier values hold. A replayed or
    older record adds nothing and is refused; DHT nodes then merge the new records in
    (dht.MergingValueStore), so one key holds every peer's latest record.
    """

    def __init__(self, codecs: SetCodecs, clock: Callable[[], float] = time.time) -> None:
        self.codecs, self.clock = codecs, clock

    def validate(self, key: str, value: bytes) -> None:
        try:
            self.codecs.for_key(key).decode(value, key, now=self.clock(), strict=True)
        except self.codecs.invalid as e:
            raise InvalidRecord(str(e)) from None

    def select(self, key: str, values: list[bytes]) -> int:
        now, codec = self.clock(), self.codecs.for_key(key)
        best, known = 0, []
        for i, v in enumerate(values):
            try:
                recs = codec.decode(v, key, now=now, strict=False)
            except self.codecs.invalid:
                continue
            if i > 0 and codec.contributes(recs, codec.merge(known, now)):
                best = i
            known += recs
        return best


def withdrawn(rec: PeerRecord, now: float, ttl: float) -> PeerRecord:
    """The tombstone of `rec`: newer, OFFLINE, and alive at least as long as `rec` was."""
    ts = max(now, rec.timestamp + 0.001)
    return replace(rec, state=OFFLINE, timestamp=ts, expires=max(rec.expires, ts + ttl))


# ---- field helpers ----

def _ms(t: float) -> int:
    return int(round(t * 1000))


def is_scalar(v: Any) -> bool:
    """Whether `v` may be an extension value (`Scalar`); a float subclass (numpy's) counts as the float it is."""
    try:
        convert(float(v) if isinstance(v, float) else v, Scalar)
    except Malformed:
        return False
    return True
