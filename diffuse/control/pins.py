"""Pins: the manifest a sentinel vouches for, per model, signed and kept in the DHT.

A private swarm's operator runs its sentinels; `diffuse sentinel --model-hash MODEL=SHA256`
makes one publish, under a key of its own peer id, a signed map of model ids to manifest hashes
(the manifest's SHA-256, or its model hash). A node fetching a model from the swarm reads the
pins of the sentinels it bootstraps from (peer ids it was given, not found) and trusts the
manifest they name, whatever the announcing peers say (protocols/dht-records.md, Pins).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import cbor2
import msgspec
import trio
from msgspec import Meta

from diffuse.control.identity import KeyPair, peer_id, peer_id_bytes, peer_id_from_bytes
from diffuse.control.records import NAMESPACE, SetCodec, tag
from diffuse.control.signed import check_signature, decode_payload, decode_signed_set, sign_payload
from diffuse.errors import DiffuseError
from diffuse.validate import Count, Malformed, PeerIdBytes, Text, convert

log = logging.getLogger(__name__)
PINS_PREFIX = f"/{NAMESPACE}/pins/"
SIG_DOMAIN = b"diffuse/pins/v1\x00"
MAX_PINS, MAX_PAYLOAD_BYTES = 32, 8 * 1024
# A pin lives an hour and is stored anew every minute: a small PUT, so DHT nodes that joined
# since hold it soon, and a sentinel's restart with other pins takes effect within a minute.
PIN_TTL_S, REPUBLISH_S, MAX_SKEW_S = 3600.0, 60.0, 60.0
_HEX64 = re.compile(r"[0-9a-f]{64}")


class InvalidPins(DiffuseError, ValueError):
    """Forged, modified, malformed, stale or misplaced pins."""


class PinsPayload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The signed map as it is on the wire (protocols/dht-records.md, Pins)."""

    v: Literal[1]
    signer: PeerIdBytes
    ts: Count
    exp: Count
    pins: Annotated[dict[Text, Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]], Meta(max_length=MAX_PINS)]


@dataclass(frozen=True)
class SignedPins:
    signer: str
    pins: Mapping[str, str]  # model id -> manifest SHA-256 or model hash (64 lowercase hex digits)
    timestamp: float
    expires: float
    payload: bytes  # exactly what was signed
    signature: bytes


def pins_key(signer: str) -> str:
    """Where a sentinel's pins live: a key of its own, that nobody else's items may take."""
    return PINS_PREFIX + tag("pins:" + signer)


def parse(pairs: Iterable[str]) -> dict[str, str]:
    """`--model-hash MODEL=SHA256` values as {model: hash}; a DiffuseError naming a bad one."""
    out: dict[str, str] = {}
    for pair in pairs:
        model, _, sha = pair.partition("=")
        sha = sha.strip().lower()
        if not model.strip() or len(model) > 256 or not _HEX64.fullmatch(sha) or model in out:
            raise DiffuseError(f"--model-hash {pair!r}: give MODEL=SHA256, the model id and 64 hex digits of its "
                               "manifest's SHA-256 (or model hash), once per model")
        out[model] = sha
    if len(out) > MAX_PINS:
        raise DiffuseError(f"--model-hash: at most {MAX_PINS} models")
    return out


def sign(pins: Mapping[str, str], key_pair: KeyPair, now: float | None = None) -> SignedPins:
    now = time.time() if now is None else now
    me = peer_id(key_pair).to_base58()
    fields = {"v": 1, "signer": peer_id_bytes(me), "ts": int(now * 1000), "exp": int((now + PIN_TTL_S) * 1000),
              "pins": dict(pins)}
    payload, signature = sign_payload(fields, key_pair, me, SIG_DOMAIN, MAX_PAYLOAD_BYTES, "pins")
    return verify(payload, signature, now)


def verify(payload: Any, signature: Any, now: float | None = None) -> SignedPins:
    """Pins from anyone: canonical, well-formed, fresh, signed by the signer they name."""
    try:
        p = convert(decode_payload(payload, signature, MAX_PAYLOAD_BYTES, InvalidPins, "pins"), PinsPayload)
        signer = peer_id_from_bytes(p.signer)
    except (Malformed, ValueError) as e:
        raise InvalidPins(f"malformed pins: {e}") from None
    check_signature(signer, SIG_DOMAIN, payload, signature, InvalidPins, f"pins of {signer}")
    now = time.time() if now is None else now
    if p.exp <= now * 1000 or p.ts > (now + MAX_SKEW_S) * 1000 or not 0 < p.exp - p.ts <= PIN_TTL_S * 1000:
        raise InvalidPins(f"pins of {signer} are stale, dated in the future, or live implausibly long")
    return SignedPins(signer, dict(p.pins), p.ts / 1000, p.exp / 1000, payload, signature)


def decode_set(value: bytes, key: str, *, now: float | None = None, strict: bool = True) -> list[SignedPins]:
    def check(payload: Any, signature: Any) -> SignedPins:
        item = verify(payload, signature, now)
        if pins_key(item.signer) != key:
            raise InvalidPins("pins stored under another peer's key")
        return item

    return decode_signed_set(value, check, max_items=1, max_bytes=MAX_PAYLOAD_BYTES + 128, error=InvalidPins,
                             noun="pins", strict=strict)


def merge_set(items: list[SignedPins], now: float | None = None) -> list[SignedPins]:
    """The signer's latest unexpired pins (one signer per key)."""
    now = time.time() if now is None else now
    live = [p for p in items if p.expires > now]
    return [max(live, key=lambda p: (p.timestamp, p.payload))] if live else []


def encode_set(items: list[SignedPins]) -> bytes:
    return cbor2.dumps([[p.payload, p.signature] for p in items], canonical=True)


def contributes(new: list[SignedPins], old: list[SignedPins]) -> bool:
    latest = max((p.timestamp for p in old), default=-1.0)
    return any(p.timestamp > latest for p in new)


PIN_SETS: SetCodec[SignedPins] = SetCodec(decode_set, merge_set, encode_set, contributes, InvalidPins,
                                          lambda p: p.signer, 1)


async def publish(node: Any, key_pair: KeyPair, pins: Mapping[str, str]) -> None:
    """A sentinel's loop: its pins, signed anew and stored every REPUBLISH_S, until cancelled.
    With none, it withdraws what an earlier run of it pinned: an empty map, newer, stored until
    the old one has expired everywhere."""
    key, until = pins_key(peer_id(key_pair).to_base58()), float("inf")
    if not pins:
        with trio.move_on_after(30.0):
            until = max((p.expires for p in await _held(node, key) if p.pins), default=0.0)
        if until == float("inf"):
            until = time.time() + PIN_TTL_S  # not read in time: withdraw anyway
    while time.time() < until:
        try:
            stored = await node.put_set(key, [sign(pins, key_pair)])
            log.info("pins of %d model(s) stored at %d node(s)", len(pins), stored)
        except Exception as e:  # noqa: BLE001 - py-libp2p fails stores in types of its own; tried again
            log.warning("pins not stored this time: %s", e)
        await trio.sleep(REPUBLISH_S)


async def _held(node: Any, key: str) -> list[SignedPins]:
    try:
        return await node.fetch_set(key)
    except Exception as e:  # noqa: BLE001 - as above
        log.warning("pins of an earlier run not read: %s", e)
        return []


def bootstrap_ids(bootstrap: Iterable[Any]) -> list[str]:
    """The peer ids of bootstrap addresses (multiaddrs with /p2p/, or PeerInfo): the sentinels
    this node was told to trust as its entry points."""
    from diffuse.control.host import parse_peer_addr

    return [(parse_peer_addr(b) if isinstance(b, str) else b).peer_id.to_base58() for b in bootstrap]


async def read(node: Any, sentinels: Iterable[str], model: str) -> dict[str, str]:
    """{sentinel: hash} of `model`, from each of `sentinels` that pins it."""
    found: dict[str, str] = {}
    for sentinel in sentinels:
        with trio.move_on_after(10.0):
            for item in await node.fetch_set(pins_key(sentinel)):
                if item.signer == sentinel and model in item.pins:
                    found[sentinel] = item.pins[model]
    return found
