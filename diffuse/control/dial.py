"""Streams to a peer named by its id and announced addresses: what other planes need of a host.

The data and client planes speak of peers as base58 ids and addresses as strings; only here do they
become py-libp2p's objects. A route's record may predate the peer's restart on new ports, and a
connection to its previous run may still be listed as open, so a stream is opened in steps: dial
the cached addresses when no connection is open (the fresh record's on failure), open the stream
within a deadline (a frozen peer negotiates nothing; that is not redialled), and once, when the
stream fails on a connection that is in fact dead, drop that connection and dial the fresh record.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from diffuse.control.host import connect_at, parse_multiaddr

log = logging.getLogger(__name__)

Addrs = Sequence[str]
FreshAddrs = Callable[[], Awaitable[Addrs]]


def connected(host: Any, peer_id: str) -> bool:
    return any(not c.is_closed for c in host.get_network().get_connections(ID.from_base58(peer_id)))


async def connect(host: Any, peer_id: str, addrs: Addrs) -> None:
    """Dial `peer_id` at `addrs` and nowhere else (control/host.py: connect_at)."""
    await connect_at(host, ID.from_base58(peer_id), [parse_multiaddr(a) for a in addrs])


async def open_stream(host: Any, peer_id: str, protocol: str, addrs: Addrs, *, timeout: float | None = None,
                      fresh: FreshAddrs | None = None) -> Any:
    """A stream of `protocol` to `peer_id`, dialled at `addrs` when no connection is open.

    `fresh`: the addresses of the peer's record read now, tried when the cached ones fail.
    `timeout`: the bound on opening the stream once connected (trio.TooSlowError past it)."""
    peer, proto = ID.from_base58(peer_id), [TProtocol(protocol)]
    network = host.get_network()
    if addrs and not connected(host, peer_id):
        try:
            await connect(host, peer_id, addrs)
        except Exception:  # noqa: BLE001 - the cached record may predate a restart on new ports
            again = tuple(await fresh()) if fresh else tuple(addrs)
            if again == tuple(addrs):
                raise
            log.info("%s is not at its cached addresses: dialling its fresh record's", peer_id)
            await connect(host, peer_id, again)
    try:
        with trio.fail_after(timeout if timeout is not None else float("inf")):
            return await host.new_stream(peer, proto)
    except trio.TooSlowError:
        raise
    except Exception as e:  # noqa: BLE001 - a connection to its previous self, not yet seen closed
        if not addrs:
            raise
        log.info("stream to %s failed (%s): redialling its announced addresses", peer_id, e)
        with trio.move_on_after(1.0):
            await network.close_peer(peer)
        for conn in network.get_connections(peer):  # still listed: host.connect would reuse it and not dial
            network.remove_conn(conn)
        await connect(host, peer_id, tuple(await fresh()) if fresh else addrs)
        return await host.new_stream(peer, proto)
