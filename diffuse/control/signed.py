"""Canonical-CBOR payloads signed by the Ed25519 key inside a peer id.

Peer records (records.py) and evidence (trust/reputation.py) are both this: a payload map
encoded canonically (one map, one byte string, so signatures cannot be malleated into look-alike
duplicates) and an Ed25519 signature over a domain tag plus the payload, by the key embedded in
the peer id the payload names. Anyone can check them without trusting who relayed them.
"""

from __future__ import annotations

from typing import Any, Callable

import cbor2
from libp2p.crypto.ed25519 import Ed25519PublicKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID


def sign_payload(fields: dict[str, Any], key_pair: KeyPair, signer: str, domain: bytes, max_bytes: int,
                 noun: str) -> tuple[bytes, bytes]:
    """(payload, signature) of `fields`, which must name `signer`, the key pair's own peer id."""
    if ID.from_pubkey(key_pair.public_key).to_base58() != signer:
        raise ValueError(f"{noun} must be signed by the key of the peer it names as its signer")
    payload = cbor2.dumps(fields, canonical=True)
    if len(payload) > max_bytes:
        raise ValueError(f"{noun} payload too large ({len(payload)} bytes)")
    return payload, key_pair.private_key.sign(domain + payload)


def decode_payload(payload: Any, signature: Any, max_bytes: int, error: type[Exception], noun: str) -> Any:
    """The payload's CBOR value, once it is bytes within bounds, canonical, with a 64-byte signature."""
    if not isinstance(payload, bytes) or not isinstance(signature, bytes) or len(signature) != 64:
        raise error(f"{noun} is [payload bytes, 64-byte signature]")
    if len(payload) > max_bytes:
        raise error(f"{noun} payload too large")
    try:
        d = cbor2.loads(payload)
        canonical = cbor2.dumps(d, canonical=True) == payload
    except Exception:  # noqa: BLE001 - cbor2 raises many types on hostile bytes
        raise error(f"{noun} payload is not valid CBOR") from None
    if not canonical:
        raise error(f"{noun} payload is not canonical CBOR")
    return d


def check_signature(signer: str, domain: bytes, payload: bytes, signature: bytes, error: type[Exception],
                    noun: str) -> None:
    key = ID.from_base58(signer).extract_public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise error(f"the peer id of {noun} does not embed an Ed25519 key")
    if not key.verify(domain + payload, signature):
        raise error(f"bad signature on {noun}")


def decode_signed_set(value: Any, check: Callable[[Any, Any], Any], *, max_items: int, max_bytes: int,
                      error: type[Exception], noun: str, strict: bool) -> list:
    """The items of a DHT value that is a CBOR list of [payload, signature]; `check(payload,
    signature)` verifies one and returns it, or raises `error`. strict: one bad item refuses the
    whole value (store path); lenient: bad items are dropped one by one, so one forgery cannot
    hide honest ones."""
    if not isinstance(value, bytes) or len(value) > max_bytes:
        raise error(f"{noun} value too large")
    try:
        items = cbor2.loads(value)
    except Exception:  # noqa: BLE001 - cbor2 raises many types on hostile bytes
        raise error(f"{noun} value is not valid CBOR") from None
    if isinstance(items, list) and items and type(items[0]) is int:  # a node's count (records.value_count)
        items = items[1:]
    if not isinstance(items, list) or len(items) > max_items or (strict and not items):
        raise error(f"{noun} value is not a list of [payload, signature]")
    out = []
    for item in items:
        try:
            if not isinstance(item, list) or len(item) != 2:
                raise error(f"a {noun} item is [payload, signature]")
            out.append(check(item[0], item[1]))
        except error:
            if strict:
                raise
    return out
