"""diffuse.control.whole_writes: a writer cancelled on a real Noise (+ pnet) connection leaves it
usable, and a write to a peer that stopped reading ends in a closed connection, not a hang."""

from __future__ import annotations

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import IOException
from libp2p.security import secure_session

from support.procs import swarm_key
from diffuse.control import whole_writes
from diffuse.control.host import make_host, parse_peer_addr

pytestmark = pytest.mark.timeout(60)

LOCAL = "/ip4/127.0.0.1/tcp/0"
ECHO = TProtocol("/diffuse/test-echo/1")


async def _echo(stream) -> None:
    while data := await stream.read(65536):
        await stream.write(data)


async def _read(stream, n: int) -> bytes:
    got = b""
    while len(got) < n:
        got += await stream.read(n - len(got))
    return got


@pytest.mark.parametrize("private", [True, False], ids=["pnet+noise", "noise"])
def test_a_cancelled_write_sends_nothing_and_the_connection_goes_on(private):
    """The write is cancelled before it starts (no checkpoint between the cancel and the write:
    py-libp2p's own first one, with quick_io's locks, is the socket send after encryption). It
    must send nothing, and what follows on that stream and on a new one must arrive intact."""
    key = swarm_key() if private else None
    server, client = (make_host(create_new_key_pair(), [LOCAL], swarm_key=key) for _ in range(2))
    server.set_stream_handler(ECHO, _echo)

    async def main() -> None:
        with trio.fail_after(30):
            loopback = [multiaddr.Multiaddr(LOCAL)]
            async with server.run(loopback), client.run(loopback):
                info = parse_peer_addr(f"{server.get_addrs()[0]}")
                await client.connect(info)
                stream = await client.new_stream(info.peer_id, [ECHO])
                await stream.write(b"first")
                assert await _read(stream, 5) == b"first"
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await stream.write(b"lost!")
                assert scope.cancelled_caught
                await stream.write(b"after")
                assert await _read(stream, 5) == b"after"
                other = await client.new_stream(info.peer_id, [ECHO])
                await other.write(b"again")
                assert await _read(other, 5) == b"again"

    trio.run(main)


class _Stalled:
    """A secure session whose peer stopped reading: every write blocks."""

    def __init__(self) -> None:
        self.closed = False

    async def write(self, data: bytes) -> None:
        await trio.sleep_forever()

    async def close(self) -> None:
        self.closed = True


def test_a_write_that_cannot_finish_closes_the_connection_and_raises(monkeypatch):
    monkeypatch.setattr(whole_writes, "WRITE_TIMEOUT_S", 0.2)
    write = whole_writes._whole(_Stalled.write)

    async def main() -> None:
        session = _Stalled()
        with trio.fail_after(10), pytest.raises(IOException, match="connection closed"):
            await write(session, b"x" * 100)
        assert session.closed

    trio.run(main)


def test_a_write_cancelled_midway_finishes_then_the_cancel_lands():
    sent: list[bytes] = []

    async def slow(self, data: bytes) -> None:
        await trio.sleep(0.2)
        sent.append(data)

    write = whole_writes._whole(slow)

    async def main() -> None:
        with trio.move_on_after(0.05) as scope:
            await write(object(), b"whole")
            await trio.sleep(0)  # the caller's next checkpoint
        assert scope.cancelled_caught and sent == [b"whole"]

    trio.run(main)


def test_apply_is_idempotent_and_refuses_a_py_libp2p_without_the_method(monkeypatch):
    whole_writes.apply()
    installed = secure_session.SecureSession.write
    whole_writes.apply()
    assert secure_session.SecureSession.write is installed and getattr(installed, whole_writes.MARK)
    monkeypatch.delattr(secure_session.SecureSession, "write")
    with pytest.raises(RuntimeError, match="SecureSession.write"):
        whole_writes.apply()
