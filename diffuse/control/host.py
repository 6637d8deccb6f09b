"""The libp2p host every Diffuse node runs: TCP, Noise only, yamux, fast dials, quiet logs.

py-libp2p 0.8.1's defaults are wrong for us in five ways:
`new_host()` also offers TLS, SECIO and *plaintext* and accepts a plaintext dialer; every dial
waits a hard-coded 250 ms unless the per-peer connection limit is 1; the auto-connector redials
every known peer (departed ones too) every 30 s; and warnings go straight to stderr, ~100 lines
a run; and a refused dial is retried for 0.7 s, which every DHT lookup pays for each departed
peer still in a routing table. `make_host` fixes all five, and turns off yamux's window update
after every read (`PY_YAMUX_RELEASE_ON_READ=0`: CPU on each side every round trip; updates
still flow at half a window), which inference sessions pay on every token
(figures: docs/measurements.md, 'Figures once quoted in module comments').

With a swarm key, every connection is first wrapped in the private-network layer
(control/pnet.py: libp2p's pnet spec, not py-libp2p's own variant), below Noise.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from diffuse.control import upstream
from diffuse.control.swarm_key import SwarmKey
from diffuse.errors import DiffuseError

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
PEERSTORE_TTL_S = 600  # how long addresses a dial was given stay in the peerstore


class AddressError(DiffuseError):
    """A multiaddr given by the user is malformed or lacks a part we need."""


def parse_multiaddr(text: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as e:  # noqa: BLE001 - the multiaddr package raises several unrelated types
        raise AddressError(f"bad multiaddr {text!r}: {e}") from None


def parse_peer_addr(text: str) -> PeerInfo:
    """A dialable peer address: /ip4/HOST/tcp/PORT/p2p/PEERID (the /p2p part is required,
    because Noise authenticates the peer against it)."""
    addr = parse_multiaddr(text)
    try:
        pid = addr.value_for_protocol("p2p")
    except Exception:  # noqa: BLE001 - as above: no /p2p part, whatever multiaddr raises
        pid = None
    if not pid:
        raise AddressError(f"{text!r} lacks the /p2p/PEERID part: use the full address the peer printed")
    try:
        peer = ID.from_base58(pid)
        transport = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{pid}"))
    except Exception as e:  # noqa: BLE001 - as above, for a malformed peer id
        raise AddressError(f"bad peer id in {text!r}: {e}") from None
    if "tcp" not in [p.name for p in transport.protocols()]:
        raise AddressError(f"{text!r} is not a TCP address")
    return PeerInfo(peer, [transport])


def make_host(key_pair: KeyPair, listen_addrs: Sequence[str | multiaddr.Multiaddr] = (DEFAULT_LISTEN,),
              announce: Sequence[str] = (), swarm_key: SwarmKey | None = None) -> IHost:
    """A host that speaks only Noise + yamux over TCP; call `host.run(listen_addrs)` to listen.
    `announce` replaces the listen addresses in identify too, so the DHT hands out only those.
    `swarm_key`: a node of that private swarm, which only nodes with the same key can reach.

    Handlers of other planes must be set with `host.set_stream_handler` before `run`, so no
    peer ever reaches a half-configured node.
    """
    upstream.install(private=swarm_key is not None)
    addrs = [a if isinstance(a, multiaddr.Multiaddr) else parse_multiaddr(a) for a in listen_addrs]
    for a in addrs:
        if "tcp" not in [p.name for p in a.protocols()]:
            raise AddressError(f"listen address {a} is not TCP: Diffuse listens on TCP only")
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},  # the ONLY security protocol: no plaintext, TLS, SECIO
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        listen_addrs=addrs,
        # One connection per peer: py-libp2p skips its 250 ms happy-eyeballs wait at the limit.
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        announce_addrs=[parse_multiaddr(a) for a in announce] or None,
        psk=swarm_key.psk if swarm_key is not None else None,
    )
    _disable_auto_connector(host)
    # A refused dial is retried 3 times with 0.1-0.4 s back-off by default: 0.7 s per dead peer
    # on every DHT lookup that meets one (departed peers linger in routing tables). One retry.
    host.get_network().retry_config = RetryConfig(max_retries=1, initial_delay=0.05)
    return host


def _disable_auto_connector(host: IHost) -> None:
    """The auto-connector dials every peer in the peerstore until 50 connections are open,
    departed peers included; routes and the DHT dial what they need, so keep it from starting."""
    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is not None:
        async def _never_start() -> None:
            return None

        connector.start = _never_start  # leaves _started False: no loop, no event-driven dials


def local_ipv4(towards: Iterable[str] = ()) -> list[str]:
    """Best-effort non-loopback IPv4 addresses of this machine (for wildcard listeners): the
    one the default route leaves from, and the one that routes to each address in `towards`
    (our bootstrap peers: a machine may have no default route, only a LAN or a VPN)."""
    ips: list[str] = []
    for target in ("192.0.2.1", *towards):  # TEST-NET-1: routing lookup only, nothing is sent
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                ips.append(s.getsockname()[0])
        except OSError:
            pass
    return list(dict.fromkeys(ip for ip in ips if not ip.startswith("127.")))


def advertised_addrs(host: IHost, announce: Iterable[str] = (), towards: Iterable[str] = ()) -> list[str]:
    """Addresses others can dial, without /p2p: explicit --announce addresses win; a wildcard
    listener (0.0.0.0) is expanded to this machine's addresses (local_ipv4) and loopback."""
    explicit = [str(parse_multiaddr(a)) for a in announce]
    if explicit:
        return explicit
    out: list[str] = []
    for a in host.get_transport_addrs():
        text = str(a)
        if text.startswith("/ip4/0.0.0.0/"):
            rest = text[len("/ip4/0.0.0.0"):]
            out += [f"/ip4/{ip}{rest}" for ip in local_ipv4(towards)] + [f"/ip4/127.0.0.1{rest}"]
        elif not text.startswith("/ip6/::/"):
            out.append(text)
    return list(dict.fromkeys(out))


def full_addrs(host: IHost, announce: Iterable[str] = ()) -> list[str]:
    """`advertised_addrs` with /p2p/PEERID appended: what a sentinel prints for operators."""
    return [f"{a}/p2p/{host.get_id()}" for a in advertised_addrs(host, announce)]


async def connect_at(host: IHost, peer: ID, addrs: Sequence[multiaddr.Multiaddr]) -> None:
    """Connect to `peer` at `addrs` (those of its signed record, or a bootstrap address) and at
    nothing else. py-libp2p dials one TCP address of the peerstore's, the first, and the
    peerstore also holds what the DHT and identify learned: a departed run's ports, or the
    source port a peer dialled us from. One such dial failing marks the peer failed for a while
    (its negative cache), which would refuse our dial too. So: forget the old addresses and the
    failure first."""
    host.get_peerstore().clear_addrs(peer)
    host.get_peerstore().add_addrs(peer, list(addrs), PEERSTORE_TTL_S)
    host.get_network().unblock_peer(peer)
    await host.connect(PeerInfo(peer, list(addrs)))
