"""UPnP port mapping: a peer behind a home router that offers UPnP IGD maps its listening port.

py-libp2p's `UpnpManager` (over miniupnpc) finds the router by SSDP, asks it for its external
address and maps our TCP listening ports to the same external ports. The node then offers the
external addresses to AutoNAT's dial-back first: if a bootstrap peer reaches us there, the peer
is public and announces them (and needs no relay); if not (a router that maps but sits behind
another NAT), the relay path takes over as without UPnP. Mappings are removed when the node stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost

log = logging.getLogger(__name__)
DISCOVER_TIMEOUT_S = 8.0  # SSDP discovery takes ~4 s when no router answers; SOAP calls are quick


@dataclass
class PortMapping:
    """The router's external address and the ports mapped there (empty: no UPnP router)."""

    external_ip: str = ""
    ports: list[int] = field(default_factory=list)
    manager: object | None = None

    @property
    def addrs(self) -> list[str]:
        return [f"/ip4/{self.external_ip}/tcp/{p}" for p in self.ports]

    async def remove(self) -> None:
        for port in self.ports:
            try:
                await self.manager.remove_port_mapping(port, "TCP")
            except Exception as e:  # noqa: BLE001 - a router gone since: its mapping expires there
                log.info("UPnP: could not remove the mapping of port %d: %s", port, e)
        self.ports = []


def listen_ports(host: IHost) -> list[int]:
    """TCP ports we listen on beyond loopback (a router cannot forward to a loopback listener)."""
    ports = []
    for a in host.get_transport_addrs():
        try:
            if not a.value_for_protocol("ip4").startswith("127."):
                ports.append(int(a.value_for_protocol("tcp")))
        except Exception:  # noqa: BLE001 - not a TCP/IPv4 address
            continue
    return sorted(set(ports))


async def map_ports(host: IHost, timeout: float = DISCOVER_TIMEOUT_S) -> PortMapping:
    """Map the host's TCP listening ports on the LAN's UPnP router, if there is one."""
    ports = listen_ports(host)
    if not ports:
        return PortMapping()
    try:
        from libp2p.discovery.upnp.upnp import UpnpManager
    except ImportError as e:  # miniupnpc missing: said once, and the relay path still works
        log.warning("UPnP unavailable (%s): not mapping a port", e)
        return PortMapping()
    manager = UpnpManager()
    found = False
    quiet = logging.getLogger("libp2p.discovery.upnp.upnp")
    level, quiet.level = quiet.level, logging.CRITICAL  # "no valid IGD" is an error there, normal here
    try:
        with trio.move_on_after(timeout):
            found = await manager.discover()
    finally:
        quiet.setLevel(level)
    if not found:
        log.info("UPnP: no gateway on this network offers port mapping")
        return PortMapping()
    mapping = PortMapping(manager.get_external_ip() or "", manager=manager)
    for port in ports:
        if await manager.add_port_mapping(port, "TCP"):
            mapping.ports.append(port)
    log.info("UPnP: router %s maps %s", mapping.external_ip, ", ".join(mapping.addrs) or "nothing")
    return mapping
