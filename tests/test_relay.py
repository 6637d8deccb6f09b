"""Reachability and circuit relay v2 between in-process nodes on loopback (control/nat.py): the
AutoNAT dial-back really dials, a peer held unreachable announces only /p2p-circuit addresses
at its relay, and a client reaches it through them, in a private swarm."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2 import RelayLimits

from control_helpers import fake_hashes
from diffuse.control import nat
from diffuse.control.announce import Serving
from diffuse.control.host import parse_multiaddr
from diffuse.control.node import NodeConfig, open_node
from diffuse.control.swarm_key import SwarmKey

LOOP = ["/ip4/127.0.0.1/tcp/0"]
MODEL = "SmolLM2-135M-Instruct"
ECHO = "/diffuse-test/echo/1"
pytestmark = pytest.mark.timeout(60)


async def echo(stream, remote: str) -> None:
    data = await stream.read(64)
    await stream.write(b"echo:" + data)
    await stream.close()


ECHOES = "/diffuse-test/echoes/1"


async def echoes(stream, remote: str) -> None:
    """Echo every read until the stream ends (a circuit's later bytes meet its limits)."""
    try:
        while data := await stream.read(1 << 16):
            await stream.write(data)
    except Exception:  # noqa: BLE001 - the relay reset the circuit: nothing more to echo
        pass


def test_dial_back_tells_a_listening_address_from_a_closed_one():
    key = SwarmKey.generate()

    async def main():
        async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=True)) as server:
            async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, server=False)) as me:
                info = PeerInfo(ID.from_base58(server.peer_id), [parse_multiaddr(server.addrs()[0])])
                await me.host.connect(info)
                assert await me.relaying.check([info], me.addrs()) == nat.PUBLIC
                # py-libp2p's own AutoNAT server would say "reachable" here too: a connection exists.
                closed = [me.addrs()[0].rsplit("/", 1)[0] + "/1"]
                assert await me.relaying.check([info], closed) == nat.PRIVATE

    trio.run(main)


@asynccontextmanager
async def behind_nat(monkeypatch, key: SwarmKey, boot: str, **kw) -> AsyncIterator:
    """A serving node whose reachability check finds it unreachable (only while it starts, so the
    nodes opened after it check as usual): it reserves a slot on its bootstrap relay."""
    async def unreachable(self, servers, candidates):
        return nat.PRIVATE

    async with AsyncExitStack() as stack:
        with monkeypatch.context() as m:
            m.setattr(nat.Relaying, "check", unreachable)
            config = NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot], reach_check=True, **kw)
            handlers = {ECHO: echo, ECHOES: echoes}
            peer = await stack.enter_async_context(open_node(create_new_key_pair(), config, handlers=handlers))
        yield peer


def test_unreachable_peer_is_reached_through_its_relay(monkeypatch):
    key = SwarmKey.generate()

    async def main():
        async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=True)) as relay:
            boot = relay.full_addrs()[0]
            async with behind_nat(monkeypatch, key, boot) as peer:
                assert peer.reach.state == nat.RELAYED and peer.reach.relays == (relay.peer_id,)
                assert peer.dht.mode == DHTMode.CLIENT
                assert peer.addrs() == [f"{relay.addrs()[0]}/p2p/{relay.peer_id}/p2p-circuit"]
                async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot],
                                                                       server=False)) as client:
                    pid = ID.from_base58(peer.peer_id)
                    await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in peer.addrs()]))
                    [conn] = client.host.get_network().get_connections(pid)
                    stream = await client.host.new_stream(pid, [TProtocol(ECHO)])
                    await stream.write(b"through the relay")
                    assert await stream.read(64) == b"echo:through the relay"
                    assert [str(a) for a in conn.get_transport_addresses()] == [
                        f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{peer.peer_id}"]  # through the relay

    trio.run(main)


def test_a_dead_direct_address_gives_way_to_the_relay(monkeypatch):
    """A peer announces a direct address that takes connections and never answers (a crashed
    host's port, or a router that swallows them) and a relayed one that works: the dialer stops
    waiting on the direct one after DIRECT_FIRST_S and goes through the relay, and says why."""
    key = SwarmKey.generate()

    async def main():
        with socket.socket() as dead:
            dead.bind(("127.0.0.1", 0))
            dead.listen(8)  # the kernel completes handshakes; nobody ever reads or answers
            silent = f"/ip4/127.0.0.1/tcp/{dead.getsockname()[1]}"
            async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=True)) as relay:
                async with behind_nat(monkeypatch, key, relay.full_addrs()[0]) as peer, \
                        open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key,
                                                                    server=False)) as client:
                    pid = ID.from_base58(peer.peer_id)
                    with trio.fail_after(30):  # a hang guard: without the bound the dial never returns
                        await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in [silent, *peer.addrs()]]))
                    stream = await client.host.new_stream(pid, [TProtocol(ECHO)])
                    await stream.write(b"around the dead address")
                    assert await stream.read(64) == b"echo:around the dead address"
                    reached = client.relaying.reached(peer.peer_id)
                    assert reached["state"] == "relayed" and reached["via"] == relay.peer_id
                    assert reached["direct"] == f"no connection in {nat.DIRECT_FIRST_S:g} s", reached

    trio.run(main)


def test_a_peer_behind_nat_finds_a_relay_through_the_dht(monkeypatch):
    """The sentinel serves no relay hops; a publicly reachable peer with relay=True lists itself
    under the DHT's relays key (ext "relay"); a peer behind NAT, refused by the sentinel, finds
    it there, reserves a slot and announces its /p2p-circuit address; a client reaches the peer
    through it. A public peer without relay=True is not listed."""
    key = SwarmKey.generate()
    serving = Serving(MODEL, 30, 0, 30, fake_hashes(30), "bfloat16")

    async def main():
        async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=False)) as sentinel:
            boot = sentinel.full_addrs()[0]
            async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot],
                                                                   relay=True, reach_check=True)) as relay, \
                    open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot],
                                                                reach_check=True)) as plain:
                assert relay.reach.state == plain.reach.state == nat.PUBLIC
                await relay.serve(serving)
                await plain.serve(serving)
                assert relay.record.extra["relay"] is True and "relay" not in plain.record.extra
                assert [i.peer_id.to_base58() for i in await sentinel.relays()] == [relay.peer_id]
                async with behind_nat(monkeypatch, key, boot) as peer:
                    assert peer.reach.state == nat.RELAYED and peer.reach.relays == (relay.peer_id,)
                    assert peer.addrs() == [f"{relay.addrs()[0]}/p2p/{relay.peer_id}/p2p-circuit"]
                    async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot],
                                                                           server=False)) as client:
                        pid = ID.from_base58(peer.peer_id)
                        await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in peer.addrs()]))
                        assert client.relaying.reached(peer.peer_id) == {"state": "relayed",
                                                                              "via": relay.peer_id}
                        stream = await client.host.new_stream(pid, [TProtocol(ECHO)])
                        await stream.write(b"found in the DHT")
                        assert await stream.read(64) == b"echo:found in the DHT"

    trio.run(main)


def test_a_circuit_ends_for_both_sides_when_one_side_goes(monkeypatch):
    """When a client that reached a peer through the relay goes away, the relay ends the circuit
    on the peer's side too: the peer's relayed connection to it closes, instead of staying open
    and forwarding nothing (where every request waited out its timeout)."""
    key = SwarmKey.generate()

    async def main():
        async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=True)) as relay:
            boot = relay.full_addrs()[0]
            async with behind_nat(monkeypatch, key, boot) as peer:
                async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot],
                                                                       server=False)) as client:
                    pid, cid = ID.from_base58(peer.peer_id), ID.from_base58(client.peer_id)
                    await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in peer.addrs()]))
                    with trio.fail_after(5):
                        while not peer.relaying.connected(cid):
                            await trio.sleep(0.05)
                with trio.fail_after(5):  # the client is gone
                    while peer.relaying.connected(cid):
                        await trio.sleep(0.05)

    trio.run(main)


@asynccontextmanager
async def punched(monkeypatch, key: SwarmKey) -> AsyncIterator:
    """A relay, a hole-punching peer behind it, and a hole-punching client that has connected to
    the peer through the relay and punched: (relay, peer, client).

    On loopback both ends' punch dials share one address pair (each dials from its listen port
    to the other's), and once, beside a busy test worker, every dial of a run failed with
    EADDRNOTAVAIL, that pair being held; between two NATs the pairs differ. So the nodes start
    again on fresh ports if the first punch fails, at most three times."""
    for attempt in range(3):
        async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=True)) as relay:
            boot = relay.full_addrs()[0]
            async with behind_nat(monkeypatch, key, boot, hole_punch=True) as peer:
                async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, bootstrap=[boot],
                                                                       server=False, hole_punch=True)) as client:
                    pid = ID.from_base58(peer.peer_id)
                    await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in peer.addrs()]))
                    if client.relaying.reached(peer.peer_id)["state"] == "hole-punched" or attempt == 2:
                        yield relay, peer, client
                        return


def test_hole_punching_over_the_relay_opens_a_direct_connection(monkeypatch):
    """DCUtR between two hole-punching nodes of a private swarm (on loopback every punch
    succeeds): the dialer's connect returns once the direct connection is up, and streams use it."""
    key = SwarmKey.generate()

    async def main():
        async with punched(monkeypatch, key) as (relay, peer, client):
            pid = ID.from_base58(peer.peer_id)
            assert client.relaying.reached(peer.peer_id) == {"state": "hole-punched", "via": relay.peer_id}
            stream = await client.host.new_stream(pid, [TProtocol(ECHO)])
            [carrier] = [c for c in client.host.get_network().get_connections(pid)
                         if c.muxed_conn is stream.muxed_conn]
            assert not any("/p2p-circuit" in str(a) for a in carrier.get_transport_addresses())
            await stream.write(b"punched")
            assert await stream.read(64) == b"echo:punched"

    trio.run(main)


def test_after_a_punch_the_relayed_connection_closes_only_once_no_stream_runs_on_it(monkeypatch):
    """py-libp2p's DCUtR closes the relayed connection a minute after a punch, whatever runs on
    it; a session bound to a stream there would break. `Punch` waits until it carries no stream,
    and the hop still reads as hole-punched (via its relay) once it is gone."""
    key = SwarmKey.generate()
    monkeypatch.setattr(nat, "IDLE_CHECK_S", 0.05)

    async def main():
        async with punched(monkeypatch, key) as (relay, peer, client):
            pid = ID.from_base58(peer.peer_id)
            conns = client.host.get_network().get_connections(pid)
            [relayed] = [c for c in conns if "/p2p-circuit" in str(c.get_transport_addresses()[0])]
            stream = await relayed.new_stream()  # a session that started before the punch
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.relaying.punch._close_relayed_conns_after_grace, pid, 0.0)
                await trio.sleep(0.5)
                assert not relayed.is_closed  # it carries a stream
                await stream.reset()
                with trio.fail_after(5):
                    while not relayed.is_closed:
                        await trio.sleep(0.05)
            assert client.relaying.reached(peer.peer_id) == {"state": "hole-punched", "via": relay.peer_id}

    trio.run(main)


def test_a_relay_holds_a_peer_to_its_circuit_limit_and_keeps_serving(monkeypatch):
    """RELAY_LIMITS at work: a peer behind NAT takes at most max_circuit_conns (16) circuits on its
    relay at once. Seventeen clients: sixteen reach it, the seventeenth is refused as over the
    limit (not as a peer without a slot); the sixteen still reach it, and once one leaves, the
    seventeenth gets its circuit."""
    key = SwarmKey.generate()
    limit = nat.RELAY_LIMITS.max_circuit_conns

    async def through(client, peer, text: bytes) -> bytes:
        pid = ID.from_base58(peer.peer_id)
        await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in peer.addrs()]))
        stream = await client.host.new_stream(pid, [TProtocol(ECHO)])
        await stream.write(text)
        return await stream.read(64)

    async def main() -> dict:
        seen: dict = {}
        async with open_node(create_new_key_pair(), NodeConfig(listen=LOOP, swarm_key=key, relay=True)) as relay, \
                behind_nat(monkeypatch, key, relay.full_addrs()[0]) as peer, AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(open_node(create_new_key_pair(), NodeConfig(
                listen=LOOP, swarm_key=key, server=False))) for _ in range(limit + 1)]
            *admitted, last = clients
            with trio.fail_after(45):
                seen["first"] = [await through(c, peer, b"%d" % i) for i, c in enumerate(admitted)]
                try:
                    seen["refused"] = await through(last, peer, b"one too many")
                except Exception as e:  # noqa: BLE001 - the refusal, read below
                    seen["refused"] = str(e)
                seen["again"] = [await through(c, peer, b"again %d" % i) for i, c in enumerate(admitted)]
                await admitted[0].host.disconnect(ID.from_base58(peer.peer_id))  # one leaves: its circuit ends
                while "after" not in seen:
                    try:
                        seen["after"] = await through(last, peer, b"after one left")
                    except Exception:  # noqa: BLE001 - until the relay has seen the circuit end
                        await trio.sleep(0.2)
        return seen

    seen = trio.run(main)
    assert seen["first"] == [b"echo:%d" % i for i in range(limit)]
    assert "status 201 (RESOURCE_LIMIT_EXCEEDED: the peer's circuits on this relay are all open" \
        in str(seen["refused"]), seen["refused"]
    assert seen["again"] == [b"echo:again %d" % i for i in range(limit)]  # the relay still carries them all
    assert seen["after"] == b"echo:after one left"


def test_a_relay_holds_slots_circuit_lifetimes_and_bytes_to_its_limits(monkeypatch):
    """The other RELAY_LIMITS, made small (NodeConfig.relay_limits): a relay with two slots gives a
    third peer behind NAT none (it stays unreachable, the two keep theirs); a circuit older than
    `duration` is ended at its next bytes, and one that has carried `data` bytes (both directions,
    encryption included) is ended too, while a new circuit to the same peer works."""
    key = SwarmKey.generate()
    limits = RelayLimits(duration=4, data=64 << 10, max_circuit_conns=16, max_reservations=2, reservation_ttl=120)

    async def stream_to(client, peer):
        pid = ID.from_base58(peer.peer_id)
        await client.host.connect(PeerInfo(pid, [parse_multiaddr(a) for a in peer.addrs()]))
        return await client.host.new_stream(pid, [TProtocol(ECHOES)])

    async def exchange(stream, data: bytes) -> bool:
        """Whether `data` came back whole over `stream` (False once its circuit is gone)."""
        try:
            with trio.fail_after(10):
                await stream.write(data)
                got = b""
                while len(got) < len(data):
                    chunk = await stream.read(len(data) - len(got))
                    if not chunk:
                        return False
                    got += chunk
            return got == data
        except trio.TooSlowError:
            raise
        except Exception:  # noqa: BLE001 - reset or closed: the circuit ended
            return False

    async def main() -> dict:
        seen: dict = {}
        relay_config = NodeConfig(listen=LOOP, swarm_key=key, relay=True, relay_limits=limits)
        async with open_node(create_new_key_pair(), relay_config) as relay, AsyncExitStack() as stack:
            boot = relay.full_addrs()[0]
            peers = [await stack.enter_async_context(behind_nat(monkeypatch, key, boot))
                     for _ in range(3)]
            seen["states"] = [(p.reach.state, p.reach.relays) for p in peers]
            client = await stack.enter_async_context(open_node(create_new_key_pair(), NodeConfig(
                listen=LOOP, swarm_key=key, server=False)))
            old = await stream_to(client, peers[0])
            seen["old_at_first"] = await exchange(old, b"early")
            await trio.sleep(limits.duration + 1)
            seen["old_after_duration"] = await exchange(old, b"late")
            big = await stream_to(client, peers[1])
            sent = 0
            while sent < 4 * limits.data and await exchange(big, bytes(4096)):
                sent += 4096
            seen["sent_before_the_end"] = sent
            with trio.fail_after(20):
                while not seen.get("fresh"):  # until the client has seen the old circuit end
                    try:
                        seen["fresh"] = await exchange(await stream_to(client, peers[1]), b"a new circuit")
                    except Exception:  # noqa: BLE001 - its connection was still the old one
                        await trio.sleep(0.2)
        return seen

    seen = trio.run(main)
    assert seen["states"][:2] == [(nat.RELAYED, (seen["states"][0][1][0],))] * 2, seen["states"]
    assert seen["states"][2] == (nat.PRIVATE, ()), seen["states"]  # no slot left for the third
    assert seen["old_at_first"] and not seen["old_after_duration"]
    assert 0 < seen["sent_before_the_end"] * 2 < limits.data, seen  # echoed: each byte crosses twice
