"""LAN discovery by mDNS: nodes started with no bootstrap peer find each other on a LAN.

This is py-libp2p 0.8.1's own mDNS discovery (`libp2p.discovery.mdns`, on zeroconf), with
three things adapted here:

- Its broadcaster, given the host, advertises the host's *listen* addresses as they are, so a
  node listening on 0.0.0.0 (join's default) announces /ip4/0.0.0.0/..., which nobody can dial.
  We give it no host, and our advertised addresses instead (control/host.py expands wildcards).
- It reports discoveries through a process-wide event bus (`peerDiscovery`) from zeroconf's
  own threads. We read its per-instance table (`listener.discovered_services`) from trio
  instead, so two nodes in one process never see each other's findings.
- The service type is Diffuse's own, `_diffuse._udp.local.`, not libp2p's `_p2p._udp`: a
  Diffuse node must not join the DHT of an IPFS node on the same LAN (both speak /ipfs/kad).
  In both modes the type is the same: a private swarm's key fingerprint is never put on the LAN.
  Only nodes with the same key can finish a handshake with a private node (control/pnet.py), so
  an mDNS answer reveals a port and a peer id, nothing about the swarm; a node of another swarm
  that we find fails its dial at the first bytes and is ignored.

A client (`ask`, `status`) only listens; a peer (`join`) answers as well.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.peerinfo import PeerInfo

log = logging.getLogger(__name__)

SERVICE_TYPE = "_diffuse._udp.local."
POLL_S = 0.25  # how often the discovered table is read (zeroconf fills it from its threads)
ADDR_TTL_S = 120


def _mdns_classes():
    from libp2p.discovery.mdns.mdns import MDNSDiscovery  # imports zeroconf: only when used

    return MDNSDiscovery


class LanDiscovery:
    """Answer (if `advertise`) and browse mDNS on every interface; `run` calls `found(info)`
    once for each new peer seen, until cancelled."""

    def __init__(self, host: IHost, addrs: Sequence[str], *, advertise: bool,
                 service_type: str = SERVICE_TYPE) -> None:
        self.host, self.advertise, self.service_type = host, advertise, service_type
        self.addrs = [a for a in addrs if "/p2p-circuit" not in a and not a.startswith("/ip4/127.")]
        self.seen: set[str] = set()  # mDNS service names: a peer that restarts has a new one
        self._discovery = None

    def _port(self) -> int:
        for a in self.addrs:
            try:
                return int(multiaddr.Multiaddr(a).value_for_protocol("tcp"))
            except Exception:  # noqa: BLE001 - an address without tcp: look at the next
                continue
        return 0

    def _open(self):
        MDNSDiscovery = _mdns_classes()
        return MDNSDiscovery(self.host.get_network(), port=self._port(), listen_addrs=list(self.addrs),
                             service_type=self.service_type, ttl=ADDR_TTL_S, host=None)

    async def run(self, found: Callable[[PeerInfo], Awaitable[None]], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        discovery = await trio.to_thread.run_sync(self._open)  # Zeroconf() binds sockets: blocking
        self._discovery = discovery
        me = self.host.get_id()
        try:
            if self.advertise and self.addrs:
                discovery.start()  # registers our service (and spawns the library's cleanup task)
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    for name, (pid, _) in list(discovery.listener.discovered_services.items()):
                        if pid == me or name in self.seen:
                            continue
                        try:
                            addrs = self.host.get_peerstore().addrs(pid)
                        except Exception:  # noqa: BLE001 - PeerStoreError: its addresses expired
                            addrs = []
                        if not addrs:
                            continue
                        self.seen.add(name)
                        log.info("found %s on the LAN at %s", pid, ", ".join(map(str, addrs)))
                        nursery.start_soon(found, PeerInfo(pid, list(addrs)))
                    await trio.sleep(POLL_S)
        finally:
            self._discovery = None
            if discovery._cleanup_cancel_scope is not None:  # a trio scope: cancelled from trio, not a thread
                discovery._cleanup_cancel_scope.cancel()
            with trio.CancelScope(shield=True), trio.move_on_after(3.0):
                await trio.to_thread.run_sync(self._close, discovery, abandon_on_cancel=True)

    def _close(self, discovery) -> None:
        try:
            if self.advertise and self.addrs:
                discovery.broadcaster.unregister()  # a goodbye packet: others forget us at once
            discovery.listener.stop()
            discovery.zeroconf.close()
        except Exception as e:  # noqa: BLE001 - leaving: nothing to do about a failed goodbye
            log.debug("mDNS shutdown: %s", e)
