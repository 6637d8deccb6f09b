"""A sentinel: a DHT server that serves no blocks, at a stable address peers bootstrap from.

It stores and serves records like any peer's DHT node does, so a swarm needs no central server:
sentinels are only well-known entry points, several of them can run, and each can bootstrap
from the others (--bootstrap) so they form one DHT. See bootstrap/README.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import trio
from libp2p.crypto.keys import KeyPair

from diffuse.control.allow import AllowList
from diffuse.control.dht import bootstrap as dial
from diffuse.control.host import parse_peer_addr
from diffuse.control.node import Node, NodeConfig
from diffuse.control.pins import PINS_PREFIX, publish
from diffuse.control.records import SetCodecs
from diffuse.control.swarm_key import SwarmKey

log = logging.getLogger(__name__)


async def run_sentinel(
    key_pair: KeyPair,
    listen: Sequence[str],
    bootstrap: Sequence[str] = (),
    ready: Callable[[list[str]], None] | None = None,
    announce: Sequence[str] = (),
    codecs: SetCodecs | None = None,
    swarm_key: SwarmKey | None = None,
    allow: AllowList | None = None,
    relay: bool = True,
    mdns: bool = False,
    started: Callable[[Node], None] | None = None,
    pins: Mapping[str, str] | None = None,
) -> None:
    """Run until cancelled; `ready` gets the full multiaddrs (with /p2p/) once listening;
    `codecs`: what its DHT stores (default: peer records only); `swarm_key`: a sentinel of that
    private swarm; `allow`: it stores records only of the peers on that allow-list; `relay`: it
    serves circuit relay v2 hops, with bounded reservations, to peers behind NAT (control/nat.py);
    `mdns`: it answers and browses mDNS, so nodes on its LAN find it with no bootstrap address;
    `started`: called with the node once it runs (for metrics); `pins`: {model id: manifest hash}
    it signs and keeps stored in the DHT where its codecs hold pins (control/pins.py; none:
    it withdraws those an earlier run stored).

    Unreachable fellow sentinels are not fatal: a sentinel is often the first node up.
    """
    node = Node(key_pair, NodeConfig(listen=listen, bootstrap=(), server=True, announce_addrs=announce,
                                     swarm_key=swarm_key, allow=allow, relay=relay, mdns=mdns), codecs=codecs)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        if started is not None:
            started(node)
        if ready is not None:
            ready(node.full_addrs())
        if bootstrap:
            try:
                await dial(node.host, node.dht, [parse_peer_addr(a) for a in bootstrap], 5.0)
            except Exception as e:  # noqa: BLE001 - fellow sentinels may be down; they dial us when they start
                log.warning("no fellow sentinel reached yet (they will dial us when they start): %s", e)
        if codecs is not None and PINS_PREFIX in codecs.by_prefix:  # pins, or none where it pinned before
            nursery.start_soon(publish, node, key_pair, pins or {})
        await trio.sleep_forever()
