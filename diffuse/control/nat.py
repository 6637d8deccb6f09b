"""Peers behind NATs: reachability (AutoNAT), circuit relay v2, dialing through relays, DCUtR.

All of it is py-libp2p 0.8.1's own protocols (`libp2p.host.autonat`, `libp2p.relay.circuit_v2`),
with six defects of that version worked around here (others are in control/pnet.py and
control/host.py, `connect_at`):

1. AutoNAT's server dials the requester back with `host.connect`, which returns at once when a
   connection to that peer exists, and one always does: the request came over it. So every
   verdict is "reachable". `DialBack` dials a fresh TCP connection to each candidate address
   instead (only addresses at the requester's observed IP, as the spec demands).
2. The swarm's `dial_peer` drops every /p2p-circuit address ("this node has no relay
   transport", even when one is configured), so `host.connect` can never reach a relayed peer.
   `Relaying.install` wraps the host's `connect`: direct addresses first, then each circuit
   address through `CircuitV2Transport`.
3. A relayed connection is wrapped in the private-network layer on the listening side (the
   swarm's inbound upgrade applies the psk) but not on the dialing side (the outbound upgrade
   does not), so in a private swarm no relayed handshake can succeed. Our dial wraps the raw
   circuit in the same layer (control/pnet.py) before Noise.
4. The relay books circuits by one peer id each and, when a circuit ends, closes whatever is
   booked under that id: a client's other circuits too (`Relay`).
5. Without that book, the end of one side of a circuit no longer ended the other side's stream,
   which then forwarded nothing (`Relay._relay_data` resets both).
6. DCUtR starts from both ends of a relayed connection at once, and the crossing sessions
   sometimes punch nothing; the spec has the side that accepted the connection start (`Punch`).

Hole punching: with `hole_punch` (every node's default), py-libp2p's DCUtR runs on the host
(both ends must): over a relayed connection the two exchange their predicted public addresses
and dial each other at once from their listen ports (TCP simultaneous open), which
port-preserving NATs let through. A dialer waits up to PUNCH_WAIT_S after a relayed dial for the
direct connection, so its first streams already use it; through a symmetric NAT the prediction
fails and streams stay relayed. `Punch` closes a relayed connection, once a punched one is up,
only when no stream runs on it (py-libp2p's closes it a minute later whatever it carries): a
session is bound to its stream and finishes where it started. (The responder's side of the
punch met another defect, the private-network layer applied twice: control/pnet.py,
`protected_conn`.)

Relays: every node answers STOP (it can be reached through a relay); a sentinel, or a peer with
`--relay`, also serves HOP with reservations bounded in count, lifetime and bytes per circuit
(RELAY_LIMITS); such a peer, when publicly reachable, says so in its record (ext "relay") and is
listed under the DHT's relays key. A peer that AutoNAT finds unreachable reserves a slot on up to
WANT_RELAYS relays (its bootstrap peers first, then relays the DHT lists), refreshes each
every RESERVE_EVERY_S (reconnecting and reserving again after a relay restarts), and announces
/ip4/<relay>/tcp/<port>/p2p/<relay>/p2p-circuit addresses only: its own private addresses route
nowhere outside its LAN, and dialing them would cost every client a timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from libp2p.relay.circuit_v2 import CircuitV2Protocol, CircuitV2Transport, RelayLimits
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS as MAX_ATTEMPTS
from libp2p.relay.circuit_v2.dcutr import RELAY_CLOSE_GRACE_PERIOD, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.tools.anyio_service import background_trio_service

from diffuse.control.host import connect_at
from diffuse.control.records import PeerRecord

log = logging.getLogger(__name__)

PUBLIC, RELAYED, UNKNOWN, PRIVATE = "public", "relayed", "unknown", "private"
DIAL_BACK_TIMEOUT_S = 3.0
AUTONAT_TIMEOUT_S = 10.0
DIRECT_FIRST_S = 2.0  # a dialer tries a relayed peer's direct addresses this long before its relays
PUNCH_WAIT_S = 3.0  # after a relayed dial, how long the dialer waits for hole punching to succeed
HOLE_PUNCHED = "hole-punched"
RESERVE_EVERY_S = 20.0  # refresh (or re-make) each reservation this often
UNILATERAL_PRIVATE_S = 1.0  # DCUtR's first, plain dial, when the other side announces only private addresses
IDLE_CHECK_S = 5.0  # after a punch, how often a relayed connection still carrying streams is looked at
WANT_RELAYS = 2  # slots held at once: losing one relay leaves the peer reachable through another
RETRY_REFUSED_S = 60.0  # a relay that refused a reservation is asked again after this long
RELAY_LIMITS = RelayLimits(
    duration=2 * 3600,  # seconds one circuit may live (an inference session rarely lasts minutes)
    data=1 << 30,  # bytes one circuit may carry, both directions together
    max_circuit_conns=16,  # circuits open at once to one reserved peer
    max_reservations=32,  # peers holding a slot on this relay
    reservation_ttl=120,  # seconds a slot lives unless refreshed
)


def is_circuit(addr: multiaddr.Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(addr)


class _Unbooked(dict):
    """A dict that keeps nothing (see `Relay`)."""

    def __setitem__(self, key, value) -> None:
        return None


class Relay(CircuitV2Protocol):
    """py-libp2p's circuit relay v2 protocol without its per-peer circuit book (defect 4).

    `_active_relays` is keyed by one peer id per circuit, the source's or the destination's,
    and the end of any circuit closes the streams booked under its key. A client with circuits
    to two peers (a route and its replica) has both booked under its own id, so when one peer
    dies, the relay closes the client's circuit to the other: the failover fails. Nothing else
    reads the book. Without it, the end of one side must still end the circuit: when either
    relaying task stops (its source closed or reset, its destination failed, a limit hit), both
    of the circuit's streams are reset, so the other side sees its connection end at once
    rather than writing into a circuit that forwards nothing (each request on it then waited
    out a 10 s negotiation timeout: a peer's heartbeats stalled past its record's expiry)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._active_relays = _Unbooked()

    async def _handle_connect(self, stream: INetStream, msg) -> None:
        """A CONNECT to a peer whose circuits here are all open (RELAY_LIMITS.max_circuit_conns)
        is refused as RESOURCE_LIMIT_EXCEEDED; py-libp2p answers NO_RESERVATION, as if the peer
        held no slot here, which tells the dialer the wrong thing."""
        dst = ID(msg.peer.id)
        slot = self.resource_manager.get_reservation(dst)
        if slot is not None and not slot.is_expired() and not slot.can_accept_connection():
            log.info("relay: refused a circuit to %s: its %d circuits here are open", dst, slot.active_connections)
            await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "the destination's circuits are full")
            await trio.sleep(0.5)  # as the library does: time for the status to be read before the reset
            await stream.reset()
            return
        await super()._handle_connect(stream, msg)

    async def _relay_data(self, src_stream, dst_stream, *args, **kwargs) -> None:
        try:
            await super()._relay_data(src_stream, dst_stream, *args, **kwargs)
        finally:
            with trio.CancelScope(shield=True):
                for stream in (src_stream, dst_stream):
                    with trio.move_on_after(1.0):
                        try:
                            await stream.reset()
                        except Exception:  # noqa: BLE001 - already closed or reset: nothing to end
                            pass


REFUSALS = {  # what a relay's status code means to the dialer
    StatusCode.RESOURCE_LIMIT_EXCEEDED: "the peer's circuits on this relay are all open, or the relay is at its limits",
    StatusCode.NO_RESERVATION: "the peer holds no slot on this relay",
    StatusCode.CONNECTION_FAILED: "the relay could not reach the peer",
    StatusCode.PERMISSION_DENIED: "the relay refused us",
}


def refusal(e: Exception) -> str:
    """A failed relayed dial in words: py-libp2p names a relay's refusal by its number alone."""
    text = str(e)
    found = re.search(r"status (\d{3})\b", text)
    try:
        status = StatusCode(int(found.group(1))) if found else None
    except ValueError:  # a number the spec does not define
        status = None
    if status is None:
        return text
    return f"{text} ({status.name}: {REFUSALS[status]})" if status in REFUSALS else f"{text} ({status.name})"


def _private(addr: multiaddr.Multiaddr) -> bool:
    """An address that routes only inside its own network: loopback, RFC 1918, link-local, unspecified."""
    try:
        return ipaddress.ip_address(addr.value_for_protocol("ip4")).is_private
    except Exception:  # noqa: BLE001 - not /ip4: not judged private
        return False


def _relay_of(conn: object) -> str | None:
    """The relay a connection runs through (its peer id), None for a direct one."""
    try:
        addrs = [str(a) for a in conn.get_transport_addresses()]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a connection without address info counts as direct
        addrs = []
    circuit = next((a for a in addrs if is_circuit(a)), None)
    return None if circuit is None else circuit.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1]


class Punch(DCUtRProtocol):
    """py-libp2p's DCUtR with the roles of the spec, and what a session bound to its stream needs.

    1. Only the side that *accepted* a relayed connection starts DCUtR on it (the spec's B), at
       once when it opens and again every 2 s while no direct path exists; py-libp2p's loop has
       both sides start, and two sessions crossing each other sometimes left neither connection
       up. The dialer waits for the punch (`Relaying.install`, PUNCH_WAIT_S).
    2. The first step, a plain dial of the other side's announced addresses, waits at most
       UNILATERAL_PRIVATE_S for private ones (a LAN answers in milliseconds; another home's
       192.168.x address never answers), not 10 s, before the punch proper.
    3. A direct connection that opens next to a relayed one is remembered as punched, with its
       relay, so the hop reads `hole-punched` after the relayed connection is gone.
    4. After a punch the relayed connection is closed only when no stream runs on it.
    """

    def __init__(self, host: IHost) -> None:
        super().__init__(host)
        self.punched: weakref.WeakKeyDictionary[object, str | None] = weakref.WeakKeyDictionary()
        host.get_network().register_notifee(_Upgrades(self))

    def _open(self, peer: ID) -> list:
        return [c for c in self.host.get_network().get_connections(peer) if not getattr(c, "is_closed", False)]

    def accepted_relayed(self, conn: object) -> bool:
        """A relayed connection the other side dialled (we are the spec's B: we start DCUtR)."""
        secured = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
        return _relay_of(conn) is not None and getattr(secured, "is_initiator", True) is False

    def start(self, peer: ID) -> None:
        if self._nursery is not None and peer not in self._in_progress:
            self._nursery.start_soon(self.initiate_hole_punch, peer)

    async def _auto_drive_loop(self) -> None:
        while True:
            await trio.sleep(2.0)
            for peer, conns in list(self.host.get_network().connections.items()):
                if (peer in self._direct_connections or self._hole_punch_attempts.get(peer, 0) >= MAX_ATTEMPTS
                        or not any(self.accepted_relayed(c) for c in conns if not c.is_closed)
                        or any(_relay_of(c) is None for c in conns if not c.is_closed)):
                    continue
                self.start(peer)

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        try:
            addrs = [a for a in self.host.get_peerstore().addrs(peer_id) if not is_circuit(a)]
        except PeerStoreError:  # nothing known of it but the relayed connection
            return False
        if not addrs:
            return False
        wait = self.dial_timeout if any(not _private(a) for a in addrs) else UNILATERAL_PRIVATE_S
        with trio.move_on_after(wait):
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(self._dial_peer, peer_id, addr)
        return await self._verify_direct_connection(peer_id)

    async def _close_relayed_conns_after_grace(self, peer_id: ID, grace: float = RELAY_CLOSE_GRACE_PERIOD) -> None:
        await trio.sleep(grace)
        while True:
            conns = self._open(peer_id)
            relayed = [c for c in conns if _relay_of(c) is not None]
            if not relayed or len(relayed) == len(conns):  # nothing to close, or no direct path left
                return
            for conn in relayed:
                if not conn.get_streams():
                    log.info("closing the relayed connection to %s: it carries no stream, a direct one is up",
                             peer_id)
                    await conn.close()
            await trio.sleep(IDLE_CHECK_S)


class _Upgrades(INotifee):
    """Marks a direct connection that opens while a relayed one to the same peer is up (DCUtR
    upgraded it: a hole punch, or its direct dial first, whichever side started it), and starts
    DCUtR on a relayed connection the other side dialled."""

    def __init__(self, punch: Punch) -> None:
        self.punch = punch

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        relays = [r for r in map(_relay_of, self.punch._open(peer)) if r is not None]
        if relays and _relay_of(conn) is None:
            self.punch.punched[conn] = relays[0]
        elif self.punch.accepted_relayed(conn):
            self.punch.start(peer)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class DialBack(AutoNATService):
    """AutoNAT's server with a dial-back that really dials (defect 1 above)."""

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        for raw in addrs:
            try:
                addr = multiaddr.Multiaddr(raw)
                ip, port = addr.value_for_protocol("ip4"), int(addr.value_for_protocol("tcp"))
            except Exception:  # noqa: BLE001 - not /ip4/.../tcp/...: not ours to dial
                continue
            with trio.move_on_after(DIAL_BACK_TIMEOUT_S):
                try:
                    stream = await trio.open_tcp_stream(ip, port)
                except OSError:
                    continue
                await stream.aclose()
                return bytes(raw)
        return None


@dataclass
class Reach:
    """What a node knows of its own reachability, for its log, `status` and its record."""

    state: str = UNKNOWN  # public | relayed | private (no relay slot yet) | unknown
    relays: tuple[str, ...] = ()  # peer ids of the relays holding a slot for us
    checked: float = 0.0
    upnp: bool = False  # public through a port our router mapped for us (UPnP)

    def describe(self) -> str:
        if self.state == PUBLIC and self.upnp:
            return ("publicly reachable through the router's UPnP port mapping (AutoNAT dial-back succeeded): "
                    "announcing the router's external address")
        if self.state == PUBLIC:
            return "publicly reachable (AutoNAT dial-back succeeded): announcing direct addresses"
        if self.state == RELAYED:
            return f"behind NAT, reachable through relay {', '.join(self.relays)}: announcing /p2p-circuit addresses"
        if self.state == PRIVATE:
            return "behind NAT, no relay slot yet: announcing nothing routable"
        return "reachability unknown (no AutoNAT server answered): announcing direct addresses"


class Relaying:
    """Circuit relay v2 and AutoNAT on one host. `run` it in the node's nursery."""

    def __init__(self, host: IHost, *, hop: bool, limits: RelayLimits = RELAY_LIMITS, hole_punch: bool = False) -> None:
        self.host, self.hop, self.hole_punch = host, hop, hole_punch
        self.protocol = Relay(host, limits, allow_hop=hop)
        # STOP only: this node never reserves behind our back (we reserve explicitly, on the
        # relays we choose) and a client's dial spends no relay slot.
        self.transport = CircuitV2Transport(host, self.protocol, RelayConfig(roles=RelayRole.STOP))
        self.autonat = DialBack(host, serve=True, confirmations=1)
        self.reach = Reach()
        self.circuit_addrs: dict[str, str] = {}  # relay peer id -> our /p2p-circuit address there
        self._held: set[str] = set()  # relays that ever held a slot for us
        self._conn_of: dict[str, object] = {}  # relay -> the connection our slot was made on
        self._nursery: trio.Nursery | None = None
        self.punch = Punch(host) if hole_punch else None
        self.direct_failed: dict[str, str] = {}  # peer -> why its direct addresses failed our last dial

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol), AsyncExitStack() as stack:
            if self.punch is not None:
                await stack.enter_async_context(background_trio_service(self.punch))
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()

    # ---- dialing ----

    def install(self) -> None:
        """Make `host.connect` reach peers through their /p2p-circuit addresses (defect 2)."""
        direct_connect = self.host.connect

        async def connect(info: PeerInfo) -> None:
            circuits = [a for a in info.addrs if is_circuit(a)]
            if not circuits or self.connected(info.peer_id):
                return await direct_connect(PeerInfo(info.peer_id, [a for a in info.addrs if not is_circuit(a)])
                                            if circuits else info)
            direct = [a for a in info.addrs if not is_circuit(a)]
            errors: list[str] = []
            if direct:  # a dead direct address may drop our SYNs: bounded, the relays are the way then
                try:
                    with trio.fail_after(DIRECT_FIRST_S):
                        await direct_connect(PeerInfo(info.peer_id, direct))
                    self.direct_failed.pop(info.peer_id.to_base58(), None)
                    return None
                except trio.TooSlowError:
                    errors.append(f"direct: no connection in {DIRECT_FIRST_S:g} s")
                except Exception as e:  # noqa: BLE001 - py-libp2p's many dial failures: the relays
                    errors.append(f"direct: {type(e).__name__}: {e}")
                self.direct_failed[info.peer_id.to_base58()] = errors[-1].removeprefix("direct: ")
            for addr in circuits:
                try:
                    await self.dial(info.peer_id, addr)
                except Exception as e:  # noqa: BLE001 - as above: the next relay
                    errors.append(f"{addr}: {refusal(e)}")
                    continue
                if self.hole_punch:  # DCUtR starts on the new circuit: give it a moment, so the
                    with trio.move_on_after(PUNCH_WAIT_S):  # first streams already go direct
                        while self.reached(info.peer_id.to_base58())["state"] != HOLE_PUNCHED:
                            await trio.sleep(0.05)
                return None
            raise SwarmException(f"no address of {info.peer_id} worked: " + "; ".join(errors))

        self.host.connect = connect  # type: ignore[method-assign]

    def connected(self, peer: ID) -> bool:
        return any(not getattr(c, "is_closed", False) for c in self.host.get_network().get_connections(peer))

    async def dial(self, peer: ID, addr: multiaddr.Multiaddr) -> None:
        """One relayed connection to `peer` through the relay named in `addr`."""
        relay_part = multiaddr.Multiaddr(str(addr).split("/p2p-circuit")[0])
        relay_id = ID.from_base58(relay_part.value_for_protocol("p2p"))
        relay_addr = relay_part.decapsulate(multiaddr.Multiaddr(f"/p2p/{relay_id}"))
        relay = PeerInfo(relay_id, [relay_addr] if str(relay_addr) else [])
        if relay.addrs and not self.connected(relay_id):  # at the relay's address in `addr`: the
            await connect_at(self.host, relay_id, relay.addrs)  # transport would dial the peerstore's
        raw = await self.transport.dial_peer_info(PeerInfo(peer, [addr]), relay_info=relay)
        psk = getattr(self.host.get_network(), "psk", None)
        if psk is not None:  # defect 3: the listening side unwraps the private-network layer
            from libp2p.network import swarm

            raw = swarm.new_protected_conn(raw, psk)
        await self.host.upgrade_outbound_connection(raw, peer)

    def reached(self, peer_id: str) -> dict[str, object]:
        """How this host reaches `peer_id` now, as new streams go (a direct connection first):
        {"state": "direct" | "hole-punched" | "relayed" | "none", "via": the relay, if any}, and
        relayed, "direct": why its announced direct addresses failed, if they did.
        Hole-punched: a direct connection DCUtR opened next to a relayed one (`Punch`)."""
        try:
            conns = [c for c in self.host.get_network().get_connections(ID.from_base58(peer_id))
                     if not getattr(c, "is_closed", False)]
        except Exception:  # noqa: BLE001 - a malformed id: not connected
            conns = []
        punched = self.punch.punched if self.punch is not None else {}
        direct = [c for c in conns if _relay_of(c) is None]
        relays = [r for r in map(_relay_of, conns) if r is not None]
        hole = next((c for c in direct if c in punched), None)
        if hole is not None:
            return {"state": HOLE_PUNCHED, "via": punched[hole]}
        if direct:
            return {"state": "direct", "via": None}
        if not relays:
            return {"state": "none", "via": None}
        failed = self.direct_failed.get(peer_id)
        return {"state": "relayed", "via": relays[0]} | ({"direct": failed} if failed else {})

    # ---- reachability ----

    async def check(self, servers: Sequence[PeerInfo], candidates: Sequence[str]) -> str:
        """Ask `servers` (already connected) to dial us back at `candidates`: PUBLIC if one
        did, PRIVATE if every one that answered could not, UNKNOWN if none answered."""
        me = self.host.get_id()
        raw = [multiaddr.Multiaddr(a).encapsulate(multiaddr.Multiaddr(f"/p2p/{me}")).to_bytes() for a in candidates
               if not is_circuit(a)]
        verdicts: list[bool] = []

        async def one(server: PeerInfo) -> None:
            try:
                with trio.fail_after(AUTONAT_TIMEOUT_S):
                    status, _ = await self.autonat.query_server(server.peer_id, raw)
                verdicts.append(status == 0)  # Message.OK
            except Exception as e:  # noqa: BLE001 - no AutoNAT there, or gone: no verdict
                log.debug("AutoNAT query to %s failed: %s", server.peer_id, e)

        async with trio.open_nursery() as nursery:
            for s in servers:
                nursery.start_soon(one, s)
        self.reach.checked = time.time()
        if not verdicts:
            return UNKNOWN
        return PUBLIC if any(verdicts) else PRIVATE

    # ---- reservations ----

    async def keep_reservations(self, relays: Callable[[], Awaitable[Sequence[PeerInfo]]], on_change) -> None:
        """Hold a slot on up to WANT_RELAYS of the relays `relays()` lists (in its order of
        preference; asked again every round, so relays found later join): reserve, refresh every
        RESERVE_EVERY_S, reconnect and reserve again when a relay is lost; one that refuses (no
        HOP there) is left alone for RETRY_REFUSED_S, one that held a slot before is asked every
        round (2 s while we hold none). `on_change()` after each change of the set
        of circuit addresses (the node re-announces)."""
        refused: dict[str, float] = {}  # relay -> when it last refused
        while True:
            changed = False
            listed = await relays()
            now_t = trio.current_time()
            held = [r for r in listed if r.peer_id.to_base58() in self.circuit_addrs]
            others = [r for r in listed if r.peer_id.to_base58() not in self.circuit_addrs
                      and now_t - refused.get(r.peer_id.to_base58(), -RETRY_REFUSED_S) >= RETRY_REFUSED_S]
            for relay in held + others:
                key = relay.peer_id.to_base58()
                if key not in self.circuit_addrs and len(self.circuit_addrs) >= WANT_RELAYS:
                    continue
                before = self._conn_of.get(key)
                ok = await self._reserve(relay)
                now = self._conn_of[key] = self._relay_conn(relay.peer_id)
                if ok and key not in self.circuit_addrs:
                    direct = [a for a in relay.addrs if not is_circuit(a)]
                    self.circuit_addrs[key] = f"{direct[0]}/p2p/{key}/p2p-circuit"
                    changed = True
                    (log.warning if key in self._held else log.info)(
                        "relay %s holds a slot for us%s", key, " again" if key in self._held else "")
                    self._held.add(key)
                elif ok and before is not None and now is not before:  # a new connection: the relay restarted
                    # or the path broke (the DHT may have redialled it first), so this is a new slot
                    changed = True
                    log.warning("reserved again on relay %s after reconnecting", key)
                elif not ok and key in self.circuit_addrs:
                    del self.circuit_addrs[key]
                    changed = True
                    log.warning("lost the slot on relay %s; retrying", key)
                elif not ok and key not in self._held:  # never held one: likely no HOP there
                    refused[key] = trio.current_time()
            self.reach.relays = tuple(self.circuit_addrs)
            self.reach.state = RELAYED if self.circuit_addrs else PRIVATE
            if changed:
                await on_change()
            await trio.sleep(RESERVE_EVERY_S if self.circuit_addrs else 2.0)

    def _relay_conn(self, peer: ID) -> object:
        conns = [c for c in self.host.get_network().get_connections(peer) if not getattr(c, "is_closed", False)]
        return conns[0] if conns else None

    async def _reserve(self, relay: PeerInfo) -> bool:
        try:
            with trio.fail_after(AUTONAT_TIMEOUT_S):
                if not self.connected(relay.peer_id):
                    await connect_at(self.host, relay.peer_id, relay.addrs)
                stream = await self.host.new_stream(relay.peer_id, [HOP_PROTOCOL_ID])
                try:
                    return await self.transport._make_reservation(stream, relay.peer_id)
                finally:
                    await stream.close()
        except Exception as e:  # noqa: BLE001 - relay down or not a relay: no slot this round
            log.debug("reservation on %s failed: %s", relay.peer_id, e)
            return False


def relay_infos(records: Sequence[PeerRecord], me: str) -> list[PeerInfo]:
    """The relays among `records` (read under the relays key) that a peer behind NAT can
    reserve on: online and fresh, serving HOP, with a direct address; not `me`; the
    longest-serving first (a relay that has stayed up is likelier to stay)."""
    found = []
    for rec in sorted(records, key=lambda r: r.started):
        direct = [a for a in rec.addrs if not is_circuit(a)]
        if rec.peer_id == me or not rec.online or not rec.fresh() or rec.extra.get("relay") is not True or not direct:
            continue
        try:
            found.append(PeerInfo(ID.from_base58(rec.peer_id), [multiaddr.Multiaddr(a) for a in direct]))
        except Exception:  # noqa: BLE001 - a signed record with an address we cannot parse: skip it
            continue
    return found
