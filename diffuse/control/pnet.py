"""libp2p's private-network layer (pnet, PSK v1) as its spec has it, in place of py-libp2p's own.

A node of a private swarm wraps every TCP connection, below multistream-select and Noise, in
XSalsa20 keyed by the swarm's 32-byte pre-shared key: each side first writes 24 random nonce
bytes, then all it sends XORed with the XSalsa20(key, nonce) keystream (one stream per direction
for the life of the connection). A node without the key cannot finish a handshake, so it cannot
read the DHT or learn who serves what.

py-libp2p 0.8.1's protector (`libp2p.security.pnet`) is not that layer: it runs Salsa20 with an
8-byte nonce, so no other libp2p implementation can talk to it, and reads the nonce with a single
`read(8)`, which a short read breaks. `install` replaces the name `new_protected_conn` in
`libp2p.network.swarm`, the module whose three call sites (dial, responder dial, listen) wrap
each raw connection when the swarm has a `psk`.

Failing fast: the first bytes any libp2p node sends on a connection are multistream-select's
header. Decrypted with the wrong key they are noise, so the first bytes that do not match raise
`KeyMismatch` at once; arriving as plaintext where the nonce belongs, they mean a node without a
key (`PlainPeer`). Both are `IOException`s, which py-libp2p's handshake code turns into an
ordinary failed upgrade (and chains, so the dialer can say why).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import struct

import libp2p
import trio
from Crypto.Cipher import Salsa20
from libp2p.abc import ConnectionType, IRawConnection
from libp2p.io.exceptions import IOException
from libp2p.transport.exceptions import SecurityUpgradeFailure
from multiaddr import Multiaddr

from diffuse.errors import DiffuseError

log = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 24
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"  # what every libp2p node writes first
READ_SIZE = 65536  # what one read asks the TCP connection for; the rest waits in a buffer
SWARM_MODULE = "libp2p.network.swarm"
NO_HANDSHAKE = "no libp2p handshake"


class PrivateNetworkError(DiffuseError, IOException):
    """The private-network handshake failed (an IOException, so py-libp2p drops the connection)."""


class KeyMismatch(PrivateNetworkError):
    def __init__(self) -> None:
        super().__init__("the key does not match this swarm")


class PlainPeer(PrivateNetworkError):
    def __init__(self) -> None:
        super().__init__("this node speaks plain libp2p: it is in public mode, not part of this private swarm")


class HandshakeClosed(PrivateNetworkError):
    def __init__(self, what: str) -> None:
        super().__init__(f"the connection closed before the private-network handshake ended ({what})")


# ---- XSalsa20 ----

_SIGMA = struct.unpack("<4I", b"expand 32-byte k")
_MASK = 0xFFFFFFFF


def _quarter(x: list[int], a: int, b: int, c: int, d: int) -> None:
    def rotl(v: int, n: int) -> int:
        v &= _MASK
        return ((v << n) & _MASK) | (v >> (32 - n))

    x[b] ^= rotl(x[a] + x[d], 7)
    x[c] ^= rotl(x[b] + x[a], 9)
    x[d] ^= rotl(x[c] + x[b], 13)
    x[a] ^= rotl(x[d] + x[c], 18)


def hsalsa20(key: bytes, nonce16: bytes) -> bytes:
    """The HSalsa20 core (NaCl's crypto_core_hsalsa20): a 32-byte subkey from a key and 16 bytes.
    Pure Python: it runs once per connection direction."""
    if len(key) != KEY_BYTES or len(nonce16) != 16:
        raise ValueError("HSalsa20 takes a 32-byte key and 16 input bytes")
    k, n = struct.unpack("<8I", key), struct.unpack("<4I", nonce16)
    x = [_SIGMA[0], *k[:4], _SIGMA[1], *n, _SIGMA[2], *k[4:], _SIGMA[3]]
    for _ in range(10):  # 20 rounds: a column round and a row round each time
        for a, b, c, d in ((0, 4, 8, 12), (5, 9, 13, 1), (10, 14, 2, 6), (15, 3, 7, 11),
                           (0, 1, 2, 3), (5, 6, 7, 4), (10, 11, 8, 9), (15, 12, 13, 14)):
            _quarter(x, a, b, c, d)
    return struct.pack("<8I", *(x[i] for i in (0, 5, 10, 15, 6, 7, 8, 9)))


def xsalsa20(key: bytes, nonce: bytes) -> Salsa20.Salsa20Cipher:
    """An XSalsa20 keystream cipher: Salsa20 (pycryptodome, in C) keyed by HSalsa20(key,
    nonce[:16]) with nonce[16:] as its 8-byte nonce. `encrypt`/`decrypt` continue the stream."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"XSalsa20 takes a {NONCE_BYTES}-byte nonce")
    return Salsa20.new(key=hsalsa20(key, nonce[:16]), nonce=nonce[16:])


# ---- the connection ----

class PrivateConn(IRawConnection):
    """A raw connection, encrypted with the swarm key as the pnet spec says. Its first read
    checks that the other side has the key (see the module's docstring)."""

    def __init__(self, conn: IRawConnection, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a swarm key has {KEY_BYTES} bytes")
        self._conn, self._key = conn, key
        self.is_initiator = conn.is_initiator
        self._send: Salsa20.Salsa20Cipher | None = None
        self._recv: Salsa20.Salsa20Cipher | None = None
        self._buf, self._off = b"", 0

    async def write(self, data: bytes) -> None:
        if self._send is None:
            nonce = os.urandom(NONCE_BYTES)
            self._send = xsalsa20(self._key, nonce)
            await self._conn.write(nonce + self._send.encrypt(data))  # one write: the nonce comes first
            return
        await self._conn.write(self._send.encrypt(data))

    async def read(self, n: int | None = None) -> bytes:
        if self._recv is None:
            await self._handshake()
        if self._off >= len(self._buf):
            data = await self._conn.read(READ_SIZE)
            if not data:
                return b""
            self._buf, self._off = self._recv.decrypt(data), 0
        end = len(self._buf) if n is None else min(len(self._buf), self._off + n)
        out, self._off = self._buf[self._off:end], end
        return out

    async def _handshake(self) -> None:
        """Read the other side's nonce (however the bytes arrive), then decrypt until its
        multistream header is complete; whatever came with it stays buffered for `read`."""
        head = len(MULTISTREAM_HEADER)
        nonce = b""
        while len(nonce) < NONCE_BYTES:
            chunk = await self._conn.read(NONCE_BYTES - len(nonce))
            if not chunk:
                raise self._failed(HandshakeClosed(f"{len(nonce)} of {NONCE_BYTES} nonce bytes"))
            nonce += chunk
            if nonce[:head] == MULTISTREAM_HEADER:
                raise self._failed(PlainPeer())
        recv = xsalsa20(self._key, nonce)
        plain = b""
        while len(plain) < head:
            chunk = await self._conn.read(READ_SIZE)
            if not chunk:
                raise self._failed(HandshakeClosed("after the nonce"))
            plain += recv.decrypt(chunk)
            if plain[:head] != MULTISTREAM_HEADER[:len(plain)]:
                raise self._failed(KeyMismatch())
        self._recv, self._buf, self._off = recv, plain, 0

    def _failed(self, error: PrivateNetworkError) -> PrivateNetworkError:
        log.info("private-network handshake with %s failed: %s", self.get_remote_address(), error)
        return error

    async def close(self) -> None:
        await self._conn.close()

    def get_remote_address(self) -> tuple[str, int] | None:
        return self._conn.get_remote_address()

    def get_transport_addresses(self) -> list[Multiaddr]:
        return self._conn.get_transport_addresses()

    def get_connection_type(self) -> ConnectionType:
        return self._conn.get_connection_type()


def dial_failure(error: BaseException) -> str | None:
    """Why a dial failed, when the private-network layer or the libp2p handshake is the reason:
    the message of a `PrivateNetworkError` anywhere in py-libp2p's chain of wrapped errors, or
    NO_HANDSHAKE when the TCP connection opened and the security handshake then failed (what a
    node without the key gets from a private one: ciphertext where multistream belongs)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    upgrade_failed = False
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, PrivateNetworkError):
            return str(e)
        upgrade_failed |= isinstance(e, SecurityUpgradeFailure)
        todo += [e.__cause__, e.__context__, *getattr(e, "errors", ()), *getattr(e, "exceptions", ())]
    return NO_HANDSHAKE if upgrade_failed else None


async def speaks_first(addr: Multiaddr, wait: float = 1.0) -> bool:
    """Whether the node at `addr` (/ip4/../tcp/..) sends a nonce's worth of bytes before we say
    anything: a private-network node does (its nonce), a plain libp2p listener never does (the
    dialer speaks first in multistream-select). Tells "a private swarm we lack the key of" from a
    dial that failed for other reasons when py-libp2p's error chain lost the handshake failure."""
    try:
        stream = await trio.open_tcp_stream(addr.value_for_protocol("ip4"), int(addr.value_for_protocol("tcp")))
    except Exception:  # noqa: BLE001 - not TCP/IPv4, or no one listens: it did not speak
        return False
    got = b""
    async with stream:
        with trio.move_on_after(wait):
            while len(got) < NONCE_BYTES:
                data = await stream.receive_some(NONCE_BYTES)
                if not data:
                    break
                got += data
    return len(got) >= NONCE_BYTES


def protected_conn(conn: IRawConnection, psk: str) -> PrivateConn:
    """What py-libp2p's swarm calls with its `psk` (64 hex digits) for every raw connection.
    A connection already wrapped is returned as it is: py-libp2p 0.8.1's `dial_addr_as_responder`
    (hole punching) wraps the raw connection, then hands it to `upgrade_inbound_raw_conn`, which
    wraps it again; two layers on one side and one on the other can never handshake."""
    if isinstance(conn, PrivateConn):
        return conn
    return PrivateConn(conn, bytes.fromhex(psk))


def install() -> None:
    """Make py-libp2p's swarm wrap connections in `PrivateConn` (idempotent). Refuses, before
    changing anything, a py-libp2p whose swarm no longer calls `new_protected_conn` or whose
    `new_host` takes no `psk`."""
    swarm = importlib.import_module(SWARM_MODULE)
    current = getattr(swarm, "new_protected_conn", None)
    missing = [] if callable(current) else [f"{SWARM_MODULE}.new_protected_conn"]
    missing += [] if "psk" in inspect.signature(libp2p.new_host).parameters else ["libp2p.new_host(psk=...)"]
    missing += [] if "psk" in inspect.signature(swarm.Swarm.__init__).parameters else ["Swarm(psk=...)"]
    if missing:
        raise RuntimeError(f"py-libp2p {getattr(libp2p, '__version__', '?')} lacks {', '.join(missing)}: "
                           "diffuse.control.pnet needs updating before private swarms can run on it")
    swarm.new_protected_conn = protected_conn
