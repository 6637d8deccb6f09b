"""The private-network layer (control/pnet.py): XSalsa20 as libsodium computes it, the pnet spec's
bytes on the wire, nonces and headers split across reads, and nodes without the key, with another
key or in public mode refused at once with a reason."""

from __future__ import annotations

import os

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from nacl.secret import SecretBox

from control_helpers import fake_hashes
from diffuse.control import pnet
from diffuse.control.announce import Serving
from diffuse.control.dht import BootstrapError
from diffuse.control.host import parse_multiaddr
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.pnet import MULTISTREAM_HEADER, KeyMismatch, PlainPeer, PrivateConn, xsalsa20
from diffuse.control.swarm_key import SwarmKey

LISTEN = ["/ip4/127.0.0.1/tcp/0"]


def keystream(key: bytes, nonce: bytes, n: int) -> bytes:
    """Bytes 32..32+n of the XSalsa20 keystream, from libsodium: crypto_secretbox (XSalsa20-Poly1305)
    XORs the plaintext with the keystream from byte 32 on (bytes 0..31 key Poly1305), after a
    16-byte tag."""
    return SecretBox(key).encrypt(bytes(n), nonce).ciphertext[16:]


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 70000])
def test_xsalsa20_is_libsodiums(n):
    for _ in range(5):
        key, nonce = os.urandom(32), os.urandom(24)
        ours = xsalsa20(key, nonce)
        ours.encrypt(bytes(32))
        assert ours.encrypt(bytes(n)) == keystream(key, nonce, n)


def test_xsalsa20_stream_continues_across_calls():
    key, nonce = os.urandom(32), os.urandom(24)
    whole = xsalsa20(key, nonce).encrypt(bytes(5000))
    cipher = xsalsa20(key, nonce)
    cuts = [1, 2, 29, 64, 100, 1000, 3804]
    assert b"".join(cipher.encrypt(bytes(c)) for c in cuts) == whole


class Pipe:
    """One direction of a raw connection: what was written, and reads of at most `chunk` bytes."""

    is_initiator = True

    def __init__(self, data: bytes = b"", chunk: int = 1 << 20) -> None:
        self.data, self.chunk, self.written = bytearray(data), chunk, bytearray()

    async def read(self, n: int | None = None) -> bytes:
        take = min(self.chunk, len(self.data), self.chunk if n is None else n)
        out = bytes(self.data[:take])
        del self.data[:take]
        return out

    async def write(self, data: bytes) -> None:
        self.written += data

    def get_remote_address(self):
        return ("127.0.0.1", 1)


def test_the_wire_is_the_pnet_spec():
    """A 24-byte nonce, then the data XORed with the XSalsa20(key, nonce) keystream, as libsodium
    computes it. The first 32 bytes sent are zeros, because libsodium's secretbox shows the stream
    from byte 32 on; a wrong key, nonce or counter would change those bytes too."""
    key = os.urandom(32)
    pipe = Pipe()
    conn = PrivateConn(pipe, key)
    data = [bytes(32), MULTISTREAM_HEADER, b"\x07/noise\n", os.urandom(3000)]

    async def main() -> None:
        for piece in data:
            await conn.write(piece)

    trio.run(main)
    nonce, body = bytes(pipe.written[:24]), bytes(pipe.written[24:])
    plain = b"".join(data)[32:]
    assert len(body) == 32 + len(plain)
    assert bytes(a ^ b for a, b in zip(body[32:], keystream(key, nonce, len(plain)))) == plain


@pytest.mark.parametrize("chunk", [1, 5, 23, 24, 25, 1 << 20])
def test_reads_in_any_pieces(chunk):
    """The nonce and the header may arrive a byte at a time; nothing after them is lost, and a
    read never returns more than it was asked for."""
    key = os.urandom(32)
    out = Pipe()
    sender = PrivateConn(out, key)
    payload = MULTISTREAM_HEADER + os.urandom(5000)

    async def main() -> bytes:
        await sender.write(payload[:7])
        await sender.write(payload[7:])
        receiver = PrivateConn(Pipe(bytes(out.written), chunk), key)
        got = b""
        while len(got) < len(payload):
            piece = await receiver.read(17)
            assert 0 < len(piece) <= 17
            got += piece
        assert await receiver.read() == b""
        return got

    assert trio.run(main) == payload


def test_wrong_key_and_plaintext_are_named():
    out = Pipe()
    trio.run(PrivateConn(out, os.urandom(32)).write, MULTISTREAM_HEADER)
    with pytest.raises(KeyMismatch, match="the key does not match this swarm"):
        trio.run(PrivateConn(Pipe(bytes(out.written), 3), os.urandom(32)).read, 100)
    plain = MULTISTREAM_HEADER + b"\x07/noise\n"
    with pytest.raises(PlainPeer, match="in public mode, not part of this private swarm"):
        trio.run(PrivateConn(Pipe(plain, 2), os.urandom(32)).read, 100)


def test_install_refuses_a_py_libp2p_without_the_hook(monkeypatch):
    import libp2p.network.swarm as swarm

    monkeypatch.delattr(swarm, "new_protected_conn")
    with pytest.raises(RuntimeError, match="new_protected_conn"):
        pnet.install()
    assert not hasattr(swarm, "new_protected_conn")  # nothing was changed


async def _bootstrap_error(sentinel_key: SwarmKey | None, client_key: SwarmKey | None) -> str:
    """What a client node with `client_key` gets bootstrapping from a sentinel with `sentinel_key`."""
    async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, swarm_key=sentinel_key)) as sentinel:
        with trio.fail_after(30), pytest.RaisesGroup(BootstrapError, flatten_subgroups=True) as caught:
            async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=sentinel.full_addrs()[-1:],
                                                                   server=False, swarm_key=client_key)):
                pass
    (error,) = caught.value.split(BootstrapError)[0].exceptions
    while isinstance(error, BaseExceptionGroup):
        (error,) = error.exceptions
    return str(error)


@pytest.mark.timeout(120)
def test_private_nodes_reach_only_their_swarm():
    key, other = SwarmKey.generate(), SwarmKey.generate()

    async def main() -> None:
        # Members: a peer announces through a private sentinel, a client reads its record.
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, swarm_key=key)) as sentinel, \
                open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=sentinel.full_addrs(),
                                                            swarm_key=key)) as peer:
            assert (await peer.serve(Serving("m", 4, 0, 4, fake_hashes(4), "bfloat16"))).extra["mode"] == "private"
            async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=sentinel.full_addrs(),
                                                                   server=False, swarm_key=key)) as client:
                with trio.fail_after(20):
                    while not await client.records("m"):
                        await trio.sleep(0.2)
                (rec,) = await client.records("m")
                assert rec.peer_id == peer.peer_id and rec.extra["mode"] == "private"
        # Strangers: each fails at once, saying why.
        assert "the key does not match this swarm" in await _bootstrap_error(key, other)
        assert "no libp2p handshake with /ip4/127.0.0.1/tcp/" in await _bootstrap_error(key, None)
        assert "give its key with --swarm-key FILE" in await _bootstrap_error(key, None)
        assert "it is in public mode, not part of this private swarm" in await _bootstrap_error(None, key)

    trio.run(main)


@pytest.mark.timeout(60)
def test_public_records_say_public():
    async def main() -> None:
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as node:
            assert (await node.serve(Serving("m", 4, 0, 4, fake_hashes(4), "bfloat16"))).extra["mode"] == "public"

    trio.run(main)


def test_a_private_node_is_told_from_a_public_one_by_who_speaks_first():
    """The probe a failed dial falls back on when py-libp2p's error chain lost the handshake
    failure: a private node sends its nonce unprompted, a public one waits for the dialer."""
    from diffuse.control.pnet import speaks_first

    async def main() -> tuple[bool, bool, bool]:
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN,
                                                               swarm_key=SwarmKey.generate())) as private, \
                open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as public:
            closed = "/ip4/127.0.0.1/tcp/9"  # nothing listens there
            return tuple([await speaks_first(parse_multiaddr(a)) for a in (private.addrs()[0], public.addrs()[0],
                                                                         closed)])

    assert trio.run(main) == (True, False, False)
