"""The host speaks Noise only: plaintext, TLS and SECIO dialers are refused by peers and sentinels;
dials skip py-libp2p's 250 ms stall; the auto-connector is off; libp2p warnings stay off stderr."""

from __future__ import annotations

import logging

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network import swarm as libp2p_swarm
from libp2p.network.config import RetryConfig
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.secio.transport import ID as SECIO_ID
from libp2p.security.secio.transport import Transport as SecioTransport
from libp2p.security.tls.transport import PROTOCOL_ID as TLS_ID
from libp2p.security.tls.transport import TLSTransport

from control_helpers import fake_hashes
from diffuse.control.announce import Serving
from diffuse.control.host import make_host
from diffuse.control.upstream import tame_logging
from diffuse.control.node import NodeConfig, open_node

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
LOOPBACK = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]


def foreign_dialer(kind: str):
    """A stock py-libp2p host offering only one non-Noise security protocol."""
    kp = create_new_key_pair()
    sec = {"plaintext": {PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)},
           "tls": {TLS_ID: TLSTransport(kp)},
           "secio": {SECIO_ID: SecioTransport(kp)}}[kind]
    host = new_host(key_pair=kp, sec_opt=sec, listen_addrs=LOOPBACK)
    host.get_network().retry_config = RetryConfig(max_retries=0)  # fail once, fast
    return host


async def try_connect(dialer, target: PeerInfo) -> bool:
    with trio.move_on_after(10):
        try:
            await dialer.connect(target)
        except Exception:  # noqa: BLE001 - any dial failure is the refusal this test wants
            return False
        return target.peer_id in dialer.get_connected_peers()
    return False


@pytest.mark.timeout(90)
def test_only_noise_dialers_reach_peers_and_sentinels():
    async def main() -> None:
        async with open_node(create_new_key_pair(), NodeConfig(listen=LISTEN)) as sentinel, \
                open_node(create_new_key_pair(), NodeConfig(listen=LISTEN, bootstrap=sentinel.full_addrs())) as peer:
            await peer.serve(Serving("m", 4, 0, 4, fake_hashes(4), "bfloat16"))
            for node in (sentinel, peer):
                target = PeerInfo(node.host.get_id(), node.host.get_transport_addrs())
                for kind in ("plaintext", "tls", "secio"):
                    dialer = foreign_dialer(kind)
                    async with dialer.run(LOOPBACK):
                        assert not await try_connect(dialer, target), f"a {kind} dialer got in"
                    assert dialer.get_id() not in node.host.get_connected_peers()
                # Positive control: the same target accepts a Noise dialer.
                good = make_host(create_new_key_pair(), LISTEN)
                async with good.run(LOOPBACK):
                    assert await try_connect(good, target)
                    assert good.get_id() in node.host.get_connected_peers()

    trio.run(main)


@pytest.mark.timeout(60)
def test_dials_skip_the_happy_eyeballs_wait_and_autoconnector_is_off(monkeypatch):
    """py-libp2p holds every dial for its happy-eyeballs delay (250 ms) unless the connection that
    came fills the per-peer limit, which make_host sets to 1: with the delay made endless here, the
    dials still return (a dial that waited it would trip the guard)."""
    monkeypatch.setattr(libp2p_swarm, "_HAPPY_EYEBALLS_DELAY", 10_000.0)

    async def main() -> None:
        hosts = [make_host(create_new_key_pair(), LISTEN) for _ in range(6)]
        async with trio.open_nursery() as nursery:
            for h in hosts:
                await nursery.start(_run_host, h)
            with trio.fail_after(30):  # a hang guard, not a speed claim (scripts/bench_transport.py)
                for target in hosts[1:]:
                    await hosts[0].connect(PeerInfo(target.get_id(), target.get_transport_addrs()))
            assert len(hosts[0].get_connected_peers()) == 5
            assert not hosts[0].get_network().auto_connector._started
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _run_host(host, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with host.run(LOOPBACK):
        task_status.started()
        await trio.sleep_forever()


def test_libp2p_warnings_do_not_reach_stderr(capfd, monkeypatch):
    monkeypatch.delenv("LIBP2P_DEBUG", raising=False)
    tame_logging()
    logging.getLogger("libp2p.kad_dht.kad_dht").warning("Failed to read DHT message from stream")
    assert "Failed to read" not in capfd.readouterr().err
