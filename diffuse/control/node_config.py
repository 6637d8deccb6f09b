"""What a node is and which services it runs, apart from the node itself: a command fills one
in (it parses; the library builds the node, control/node.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2 import RelayLimits

from diffuse.control.allow import AllowList
from diffuse.control.announce import DEFAULT_HEARTBEAT_S
from diffuse.control.host import DEFAULT_LISTEN
from diffuse.control.swarm_key import SwarmKey


@dataclass(frozen=True)
class NodeConfig:
    """What a node is and which services it runs; every caller (join, sentinel, clients) fills
    one in and hands it over, so the defaults live here once.

    server=False: a DHT client (status, pure clients) that stores nothing for others.
    `swarm_key`: a node of that private swarm (None: public). `allow`: only these peers serve.
    `mdns`: find (and, a DHT server, be found by) nodes on the LAN (control/mdns.py); each one
    found that shares our swarm joins the routing table as a bootstrap peer would. `relay`: serve
    circuit relay v2 hops (control/nat.py) for peers behind NAT, within `relay_limits` (None:
    nat.RELAY_LIMITS). `reach_check` (default: a DHT server with bootstrap peers and no
    `announce_addrs`): ask the bootstrap peers to dial us back;
    unreachable, the node becomes a DHT client, reserves relay slots on them and announces its
    /p2p-circuit addresses only. `hole_punch`: run DCUtR, so relayed connections to or from peers
    that run it too turn direct where the NATs allow. `upnp`: with the reach check, first map our
    port on the LAN's UPnP router (control/upnp.py) and offer its external address to the
    dial-back."""

    listen: Sequence[str] = (DEFAULT_LISTEN,)
    bootstrap: Sequence[str | PeerInfo] = ()
    server: bool = True
    heartbeat: float = DEFAULT_HEARTBEAT_S
    ttl: float | None = None
    announce_addrs: Sequence[str] = ()
    bootstrap_timeout: float = 5.0
    swarm_key: SwarmKey | None = None
    allow: AllowList | None = None
    mdns: bool = False
    relay: bool = False
    relay_limits: RelayLimits | None = None
    reach_check: bool | None = None
    hole_punch: bool = False
    upnp: bool = False
