"""Usage receipts: a client's signed word that a peer computed for it (protocols/credits.md).

A receipt is the DHT records' format put to another use: a canonical-CBOR payload and an Ed25519
signature over a domain tag plus that payload, by the key inside the client's peer id. Whoever
counts receipts checks them here (form, signature, expiry, a client paying itself); duplicates by
session id are the counter's to refuse (trust/credits.py), since only it knows what it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import cbor2
import msgspec
import trio
from libp2p.crypto.keys import KeyPair

from diffuse.control.dial import open_stream

from diffuse.control.identity import peer_id, peer_id_bytes, peer_id_from_bytes
from diffuse.control.signed import check_signature, decode_payload, sign_payload
from diffuse.errors import DiffuseError
from diffuse.validate import Count, Malformed, PeerIdBytes, Text, convert

log = logging.getLogger(__name__)

RECEIPT_VERSION = 1
SIG_DOMAIN = b"diffuse/credit-receipt/v1\x00"
PROTOCOL = "/diffuse/credits/1.0.0"
MAX_PAYLOAD_BYTES = 1024
MAX_CLOCK_SKEW_S = 60.0
LIFETIME_S = 30 * 86400.0  # a receipt counts for a month: standing follows recent work
MAX_BATCH = 64  # receipts in one delivery
MAX_MESSAGE = MAX_BATCH * (MAX_PAYLOAD_BYTES + 80)


class InvalidReceipt(DiffuseError, ValueError):
    """Forged, altered, expired, self-signed, replayed or malformed."""


@dataclass(frozen=True)
class Receipt:
    """`client` says `peer` computed blocks [start, end) of `model` for `tokens` positions of
    session `session`, over `seconds` of compute, at `issued` (UNIX seconds)."""

    peer: str
    client: str
    model: str
    start: int
    end: int
    tokens: int
    seconds: float
    session: bytes
    issued: float
    expires: float

    @property
    def work(self) -> int:
        """What the receipt is worth: block-tokens computed."""
        return (self.end - self.start) * self.tokens


class ReceiptPayload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The signed map as on the wire; times in ms."""

    v: Literal[RECEIPT_VERSION]
    peer: PeerIdBytes
    client: PeerIdBytes
    model: Text
    blocks: tuple[Count, Count]
    tokens: Count
    ms: Count  # compute time
    sid: bytes
    ts: Count
    exp: Count


@dataclass(frozen=True)
class Signed:
    """A checked receipt with its exact bytes, as it is kept and presented to others."""

    receipt: Receipt
    payload: bytes
    signature: bytes

    def wire(self) -> list[bytes]:
        return [self.payload, self.signature]


def sign(r: Receipt, key_pair: KeyPair) -> Signed:
    fields: dict[str, Any] = {
        "v": RECEIPT_VERSION, "peer": peer_id_bytes(r.peer), "client": peer_id_bytes(r.client), "model": r.model,
        "blocks": [r.start, r.end], "tokens": r.tokens, "ms": round(r.seconds * 1000), "sid": r.session,
        "ts": round(r.issued * 1000), "exp": round(r.expires * 1000)}
    if peer_id(key_pair).to_base58() == r.peer:
        raise ValueError("a client cannot sign a receipt for itself")
    payload, signature = sign_payload(fields, key_pair, r.client, SIG_DOMAIN, MAX_PAYLOAD_BYTES, "a receipt")
    return Signed(r, payload, signature)


def issue(key_pair: KeyPair, peer: str, model: str, start: int, end: int, tokens: int, seconds: float,
          session: bytes, now: float | None = None) -> Signed:
    """A receipt signed now by this client, living LIFETIME_S."""
    now = time.time() if now is None else now
    return sign(Receipt(peer, peer_id(key_pair).to_base58(), model, start, end, tokens, seconds, session, now,
                        now + LIFETIME_S), key_pair)


def verify(payload: Any, signature: Any, now: float | None = None) -> Signed:
    """A receipt from anyone, checked: canonical form, fields, signature by its client, times,
    and that its client is not the peer it pays."""
    d = decode_payload(payload, signature, MAX_PAYLOAD_BYTES, InvalidReceipt, "a receipt")
    try:
        p = convert(d, ReceiptPayload)
        r = Receipt(peer_id_from_bytes(p.peer), peer_id_from_bytes(p.client), p.model, p.blocks[0], p.blocks[1],
                    p.tokens, p.ms / 1000, p.sid, p.ts / 1000, p.exp / 1000)
    except (Malformed, ValueError) as e:
        raise InvalidReceipt(f"malformed receipt: {e}") from None
    if len(r.session) != 16 or r.start >= r.end:
        raise InvalidReceipt("malformed receipt: a 16-byte session id and blocks start < end are required")
    check_signature(r.client, SIG_DOMAIN, payload, signature, InvalidReceipt, f"the receipt of {r.client}")
    if r.client == r.peer:
        raise InvalidReceipt(f"self-signed receipt: {r.client} cannot pay itself")
    now = time.time() if now is None else now
    if r.expires <= now:
        raise InvalidReceipt(f"expired receipt (session {r.session.hex()})")
    if r.issued > now + MAX_CLOCK_SKEW_S or r.expires - r.issued > LIFETIME_S:
        raise InvalidReceipt(f"receipt with implausible times (session {r.session.hex()})")
    return Signed(r, payload, signature)


def decode_batch(data: bytes) -> list[Any]:
    """The [payload, signature] items of a delivery, unchecked; InvalidReceipt if it is no list."""
    try:
        items = cbor2.loads(data)
    except Exception:  # noqa: BLE001 - cbor2 raises many types on hostile bytes
        raise InvalidReceipt("receipt delivery is not valid CBOR") from None
    if not isinstance(items, list) or len(items) > MAX_BATCH or \
            not all(isinstance(i, list) and len(i) == 2 for i in items):
        raise InvalidReceipt(f"receipt delivery is not a list of at most {MAX_BATCH} [payload, signature]")
    return items



Accept = Callable[[list[Any], str], tuple[int, list[str]]]


async def _read_message(stream: Any) -> bytes:
    """One length-prefixed message (4 bytes big-endian, then at most MAX_MESSAGE bytes)."""
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        if len(data) >= 4 and int.from_bytes(data[:4], "big") > MAX_MESSAGE:
            raise InvalidReceipt("receipt delivery too large")
        chunk = await stream.read(1 << 16)
        if not chunk:
            raise InvalidReceipt("receipt delivery cut short")
        data += chunk
    return data[4:]


async def _close(stream: Any) -> None:
    with trio.move_on_after(1.0):
        try:
            await stream.close()
        except Exception as e:  # noqa: BLE001 - py-libp2p raises types of its own on a dead stream
            log.debug("closing a receipt stream: %s", e)


def _framed(value: Any) -> bytes:
    body = cbor2.dumps(value)
    return len(body).to_bytes(4, "big") + body


def handler(accept: Accept) -> Callable[[Any, str], Awaitable[None]]:
    """The stream handler of PROTOCOL: read one delivery, give its items to `accept(items, sender)`
    (the peer's books), answer what was accepted and why the rest was refused."""
    async def handle(stream: Any, remote: str) -> None:
        try:
            with trio.fail_after(10.0):
                try:
                    accepted, refused = accept(decode_batch(await _read_message(stream)), remote)
                except InvalidReceipt as e:
                    accepted, refused = 0, [str(e)]
                await stream.write(_framed({"accepted": accepted, "refused": refused[:MAX_BATCH]}))
        except Exception as e:  # noqa: BLE001 - a broken or slow stream must not take the peer down
            log.info("receipt delivery from %s failed: %s", remote, e)
        finally:
            await _close(stream)
    return handle


async def deliver(host: Any, peer: str, items: list[Signed], addrs: list[str]) -> dict:
    """Send receipts to `peer` over PROTOCOL; its answer ({"accepted", "refused"})."""
    stream = await open_stream(host, peer, PROTOCOL, addrs, timeout=10.0)
    try:
        with trio.fail_after(10.0):
            await stream.write(_framed([s.wire() for s in items[:MAX_BATCH]]))
            answer = cbor2.loads(await _read_message(stream))
    finally:
        await _close(stream)
    return answer if isinstance(answer, dict) else {}
