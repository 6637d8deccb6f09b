"""A Diffuse node: host, DHT, bootstrap and heartbeat, all inside one trio nursery.

Other planes plug in here. The data plane registers its stream handlers through `handlers=`
(installed before the host listens, so no peer reaches a half-configured node), starts serving
with `await node.serve(Serving(...))`, and reports live numbers (free KV-cache tokens, measured
throughput) through `status_fn`, called at every heartbeat. The route builder reads
`await node.records(model)` / `await node.coverage(model)`.

    async with open_node(key_pair, bootstrap=[addr], handlers={PROTO: handle}) as node:
        await node.serve(Serving(...))
        await trio.sleep_forever()   # cancelling withdraws the announcement first

With `swarm_key` the node belongs to that private swarm (control/modes.py) and only nodes with
the key can connect; with `allow` it stores, reads and returns records only of the peers on
that allow-list.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from collections import Counter
from contextlib import asynccontextmanager
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import PROTOCOL_ID as KAD_PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service

from diffuse.control.announce import Announcer, Serving, StatusFn
from diffuse.control.coverage import Coverage, coverage
from diffuse.control.dht import PREFIX, QUERY_TIMEOUT_S, MergingValueStore, bootstrap, fetch_set, make_dht, put_set
from diffuse.control.host import (
    advertised_addrs,
    connect_at,
    make_host,
    parse_multiaddr,
    parse_peer_addr,
)
from diffuse.control.identity import peer_id as peer_id_of
from diffuse.control.mdns import LanDiscovery
from diffuse.control.node_config import NodeConfig
from diffuse.control.modes import PRIVATE as PRIVATE_SWARM
from diffuse.control.modes import PUBLIC as PUBLIC_SWARM
from diffuse.control.nat import PRIVATE, PUBLIC, RELAY_LIMITS, RELAYED, Reach, Relaying, relay_infos
from diffuse.control.reads import SharedReads
from diffuse.control.records import PeerRecord, SetCodecs, SignedRecord, merge, peer_key, relays_key
from diffuse.control.windows import WindowSample, read_model, with_estimates
from diffuse.control.upnp import PortMapping, map_ports
from diffuse.errors import DiffuseError

log = logging.getLogger(__name__)


class ListenError(DiffuseError):
    """No listen address could be bound."""


StreamHandler = Callable[[INetStream, str], Awaitable[None]]  # (stream, the remote peer id)
WITHDRAW_TIMEOUT_S = 5.0  # the tombstone must get out even from a starved process
STOP_TIMEOUT_S = WITHDRAW_TIMEOUT_S + 2.0  # withdraw, then close connections
REACH_TIMEOUT_S = 10.0  # `reach_peers`: a dial (and a hole punch) to one peer, at most
REACH_AT_ONCE = 16  # `reach_peers`: peers dialled at once


def _with_peer(handler: StreamHandler) -> Callable[[INetStream], Awaitable[None]]:
    """py-libp2p's handler shape, passing on the peer id its secure channel authenticated."""
    async def handle(stream: INetStream) -> None:
        await handler(stream, stream.muxed_conn.peer_id.to_base58())
    return handle


DEFAULTS = NodeConfig()  # a node of the public swarm with every optional service off


class Node:
    """A host and its DHT, composed with the services its config asks for: circuit relay,
    AutoNAT and hole punching (`Relaying`), the reach check with UPnP, mDNS and, once it
    serves, the announcer; each runs in the node's nursery and ends with it.

    `handlers`: the data plane's stream handlers by protocol, installed before the host
    listens. `status_fn`: the live numbers each heartbeat announces. `codecs`: what the DHT
    accepts under /diffuse/ (default: peer records only)."""

    def __init__(self, key_pair: KeyPair, config: NodeConfig = DEFAULTS, *,
                 handlers: Mapping[str, StreamHandler] | None = None, status_fn: StatusFn | None = None,
                 codecs: SetCodecs | None = None) -> None:
        self.config, self.key_pair, self.status_fn = config, key_pair, status_fn
        self.peer_id = peer_id_of(key_pair).to_base58()
        self.bootstrap_peers = [parse_peer_addr(a) if isinstance(a, str) else a for a in config.bootstrap]
        self._listen = [parse_multiaddr(a) for a in config.listen]
        self.mode = PRIVATE_SWARM if config.swarm_key is not None else PUBLIC_SWARM
        self.allow, self.server = config.allow, config.server
        self.host = make_host(key_pair, self._listen, config.announce_addrs, config.swarm_key)
        self.relaying = Relaying(self.host, hop=config.relay, limits=config.relay_limits or RELAY_LIMITS,
                                 hole_punch=config.hole_punch)
        self.relaying.install()
        self.reach_check = (config.server and not config.announce_addrs) if config.reach_check is None \
            else config.reach_check
        self.mapping = PortMapping()  # our ports on the router's external address, if UPnP mapped them
        for proto, handler in (handlers or {}).items():
            self.host.set_stream_handler(TProtocol(proto), _with_peer(handler))
        self.codecs = codecs or SetCodecs()
        if config.allow is not None:
            self.codecs = self.codecs.allowing(config.allow.ids)
        self.dht = make_dht(self.host, self.codecs, server=config.server)
        self._reads = SharedReads(self._read_records)
        self.support: dict[str, Counter[str]] = {}  # model -> peer -> DHT answers of the last read holding it
        self.samples: dict[str, dict[int, WindowSample]] = {}  # model -> window -> what the last read sampled
        self.num_blocks: dict[str, int] = {}  # model -> its manifest's block count, once a caller said it
        self.signed: dict[str, SignedRecord] = {}  # peer -> the newest record read of it, as signed (chains name it)
        self.lan_peers: list[str] = []  # peers found by mDNS that share our swarm
        self.announcer: Announcer | None = None
        self._announcing = trio.CancelScope()  # the announcer task's
        self._nursery: trio.Nursery | None = None
        self._scope: trio.CancelScope | None = None
        self._stop = trio.Event()
        self._first_slot = trio.Event()  # behind NAT: set once a relay holds a slot for us

    # ---- addresses ----

    def addrs(self) -> list[str]:
        """Dialable addresses, without /p2p (what records carry): behind NAT, only the
        /p2p-circuit addresses at our relays."""
        if self.reach.state in (RELAYED, PRIVATE):
            return list(self.relaying.circuit_addrs.values())
        return list(dict.fromkeys(self.mapping.addrs + advertised_addrs(self.host, self.config.announce_addrs,
                                                                          self._towards())))

    def _towards(self) -> list[str]:
        """IPv4 addresses of our bootstrap peers: a wildcard listener is announced at the
        address that routes to them, even on a machine with no default route."""
        ips = []
        for info in self.bootstrap_peers:
            for a in info.addrs:
                try:
                    ips.append(a.value_for_protocol("ip4"))
                except Exception:  # noqa: BLE001 - not an /ip4 address
                    continue
        return [ip for ip in dict.fromkeys(ips) if ip and not ip.startswith("127.")]

    @property
    def reach(self) -> Reach:
        """How others reach this node: public, relayed (via which relays), private, unknown."""
        return self.relaying.reach

    def full_addrs(self) -> list[str]:
        """Dialable addresses with /p2p/PEERID (what operators pass as --bootstrap)."""
        return [f"{a}/p2p/{self.peer_id}" for a in self.addrs()]

    # ---- lifecycle ----

    async def run(self, *, task_status: trio.TaskStatus["Node"] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, join the DHT through the bootstrap peers, report started, run until
        cancelled or `stop()`ped; either way, withdraw the announcement before closing.

        Cancelling this task is the graceful path: the host and DHT live in a shielded scope,
        so they are still up while the tombstone goes out (a plain cancel would tear the
        connections down under it), and `stop()` bounds that shutdown with a deadline.
        """
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(self._main)
                task_status.started(self)
                await trio.sleep_forever()
            finally:
                self.stop()

    def stop(self) -> None:
        """Ask a running node to withdraw and shut down (sync, idempotent, bounded)."""
        self._stop.set()
        if self._scope is not None:
            self._scope.deadline = min(self._scope.deadline, trio.current_time() + STOP_TIMEOUT_S)

    async def _main(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope(shield=True) as self._scope:
            if self._stop.is_set():  # stopped before we even began
                self._scope.deadline = trio.current_time() + STOP_TIMEOUT_S
            async with self.host.run(self._listen):
                if not self.host.get_transport_addrs():
                    raise ListenError(f"cannot listen on {', '.join(map(str, self._listen))}: "
                                      "address in use or not an address of this machine")
                async with background_trio_service(self.dht):
                    async with trio.open_nursery() as tasks:  # every service's tasks
                        self._nursery = tasks
                        await self._join(tasks)
                        task_status.started()
                        await self._stop.wait()
                        tasks.cancel_scope.cancel()
                    self._nursery = None
                    await self._leave()
                # Close explicitly: py-libp2p's own stop path runs its cleanup under cancellation,
                # which aborts at the first await and leaves the listener accepting connections.
                with trio.move_on_after(STOP_TIMEOUT_S - WITHDRAW_TIMEOUT_S):
                    await self.host.close()

    async def _join(self, tasks: trio.Nursery) -> None:
        """Start the services in order: relaying, the reach check (with UPnP), the DHT's
        bootstrap, a first relay slot when behind NAT (so our first record is routable), mDNS."""
        await tasks.start(self.relaying.run)
        if self.bootstrap_peers and self.reach_check:
            await self._check_reach(tasks)
        if self.bootstrap_peers:
            await bootstrap(self.host, self.dht, self.bootstrap_peers, self.config.bootstrap_timeout)
        if self.reach.state == PRIVATE:
            with trio.move_on_after(self.config.bootstrap_timeout * 2):
                await self._first_slot.wait()
        if self.config.mdns:
            lan = LanDiscovery(self.host, self.addrs(), advertise=self.server)
            await tasks.start(lan.run, self._lan_peer)

    async def _leave(self) -> None:
        """With the services stopped and the host still up: the tombstone, then the router's mapping."""
        with trio.move_on_after(WITHDRAW_TIMEOUT_S):
            await self.withdraw()
        with trio.move_on_after(STOP_TIMEOUT_S - WITHDRAW_TIMEOUT_S):
            await self.mapping.remove()

    async def serve(self, serving: Serving) -> PeerRecord:
        """Announce `serving` now and on every heartbeat until the node stops, or until it
        withdraws and serves something else (join --model auto moving)."""
        if self._nursery is None:
            raise RuntimeError("Node.serve() needs a running node")
        if self.announcer is not None:
            if not self.announcer.withdrawn:
                raise RuntimeError("this node already serves: withdraw before serving another span")
            self._announcing.cancel()
        announcer = self.announcer = Announcer(
            self.dht, self.key_pair, serving, self.addrs,
            heartbeat=self.config.heartbeat, ttl=self.config.ttl, status_fn=self._status, mode=self.mode,
        )
        self._announcing = await self._nursery.start(self._announce, announcer)
        return announcer.current.record

    async def _announce(self, announcer: Announcer, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            await announcer.run(on_lonely=self._rebootstrap, task_status=_Started(task_status, scope))

    def _status(self) -> dict[str, Any]:
        """The data plane's live numbers, how we are reached (ext "reach" in the record), and
        whether we serve relay hops to peers behind NAT (ext "relay": only once AutoNAT found
        us publicly reachable, so no one reserves on a relay they could not dial)."""
        relay = {"relay": True} if self.relaying.hop and self.reach.state == PUBLIC else {}
        return {**(self.status_fn() if self.status_fn else {}), "reach": self.reach.state, **relay}

    def amend(self, **changes: Any) -> None:
        """Change what the current announcement says (Serving's fields, e.g. a draft head trained
        since it began) from its next heartbeat on: no tombstone, so no gap in which readers drop us."""
        if self.announcer is not None and not self.announcer.withdrawn:
            self.announcer.serving = dataclasses.replace(self.announcer.serving, **changes)

    async def withdraw(self) -> None:
        """Publish a tombstone for our record (idempotent); readers drop us at once."""
        if self.announcer is not None:
            await self.announcer.withdraw()

    async def _check_reach(self, tasks: trio.Nursery) -> None:
        """Before joining the DHT: connect to the bootstrap peers and ask them (AutoNAT) to
        dial us back. Unreachable, become a DHT client (no one could dial us for queries) and
        hold relay slots on them or on relays the DHT lists (`relays`); our records then carry
        /p2p-circuit addresses only."""
        reached: list[PeerInfo] = []

        async def one(info: PeerInfo) -> None:
            with trio.move_on_after(self.config.bootstrap_timeout):
                try:
                    await self.host.connect(info)
                    reached.append(info)
                except Exception as e:  # noqa: BLE001 - bootstrap() says why, below
                    log.debug("bootstrap peer %s: %s", info.peer_id, e)

        async def map_our_ports() -> None:
            self.mapping = await map_ports(self.host)

        async with trio.open_nursery() as nursery:  # the router's answer comes while we connect
            for info in self.bootstrap_peers:
                nursery.start_soon(one, info)
            if self.config.upnp:
                nursery.start_soon(map_our_ports)
        if not reached:
            return
        candidates = self.mapping.addrs + advertised_addrs(self.host, (), self._towards())
        state = await self.relaying.check(reached, candidates)
        self.reach.state = state
        self.reach.upnp = state == PUBLIC and bool(self.mapping.ports)
        if state == PRIVATE:
            self.dht.mode = DHTMode.CLIENT  # as switch_mode, without emptying the routing table
            self.host.remove_stream_handler(KAD_PROTOCOL_ID)
            tasks.start_soon(self._hold_relays, list(self.bootstrap_peers))
        log.info("reachability: %s", self.reach.describe())

    async def _hold_relays(self, bootstrap: list[PeerInfo]) -> None:
        async def changed() -> None:
            self._first_slot.set()
            if self.announcer is not None:
                try:
                    await self.announcer.publish()
                except Exception as e:  # noqa: BLE001 - the next heartbeat tries again
                    log.warning("re-announcement failed: %s", e)

        async def relays() -> list[PeerInfo]:
            return bootstrap + [r for r in await self.relays() if r.peer_id not in {b.peer_id for b in bootstrap}]

        await self.relaying.keep_reservations(relays, changed)

    async def relays(self) -> list[PeerInfo]:
        """Peers the DHT lists as relays (publicly reachable, serving HOP), longest-serving
        first; none while the DHT has no one to ask, or the read fails."""
        if self.dht.get_routing_table_size() == 0:
            return []
        try:
            with trio.move_on_after(QUERY_TIMEOUT_S * 2):
                found, _ = await fetch_set(self.dht, relays_key())
                return relay_infos([s.record for s in found], self.peer_id)
        except Exception as e:  # noqa: BLE001 - the DHT is not ours: no relays found this round
            log.debug("reading the relays key failed: %s", e)
        return []

    async def _lan_peer(self, info: PeerInfo) -> None:
        """A node mDNS found: dial it as a bootstrap peer; one of another swarm (or another
        mode) fails its handshake at once and is left alone."""
        try:
            if await bootstrap(self.host, self.dht, [info], self.config.bootstrap_timeout):
                self.lan_peers.append(info.peer_id.to_base58())
                self.bootstrap_peers.append(info)  # re-dialled, like a sentinel, if we lose the swarm
                log.info("joined LAN peer %s", info.peer_id)
        except Exception as e:  # noqa: BLE001 - not one of ours, or gone: nothing to join
            log.info("LAN peer %s not joined: %s", info.peer_id, str(e).splitlines()[-1] if str(e) else e)

    async def _rebootstrap(self) -> None:
        """Nobody took our records: we lost the swarm (a sentinel restarted?). Dial again."""
        if self.bootstrap_peers and self.dht.get_routing_table_size() == 0:
            try:
                await bootstrap(self.host, self.dht, self.bootstrap_peers, self.config.bootstrap_timeout)
            except Exception as e:  # noqa: BLE001 - dialing fails in py-libp2p's many ways; retried next beat
                log.warning("re-bootstrap failed: %s", e)

    # ---- reading the swarm ----

    @property
    def record(self) -> PeerRecord | None:
        """This node's latest announced record, if it serves."""
        cur = self.announcer.current if self.announcer else None
        return cur.record if cur else None

    def may_serve(self, peer_id: str) -> bool:
        """Whether this node's allow-list (as the file is now) lets `peer_id` serve."""
        return self.allow is None or peer_id in self.allow

    def stored_records(self) -> int:
        """Items this node's DHT store holds, over every key (each Diffuse set counted item by
        item): what a long-running node must keep bounded."""
        store = self.dht.value_store
        return sum(len(store.records(k)) if isinstance(store, MergingValueStore) and k.startswith(PREFIX) else 1
                   for k in list(store.store))

    async def records(self, model: str, *, include_offline: bool = False) -> list[PeerRecord]:
        """Fresh records of every peer serving blocks of `model`: concurrent callers share one
        DHT read, and a peer a read misses keeps its record until it expires (control/reads.py),
        unless it has left the allow-list."""
        found = await self._reads.records(model, include_offline=include_offline)
        if self.allow is None:
            return found
        allowed = self.allow.ids()
        return [r for r in found if r.peer_id in allowed]

    async def _read_records(self, model: str) -> list[PeerRecord]:
        found, support, self.samples[model] = await read_model(self.dht, model, self.num_blocks.get(model))
        self.support[model] = support
        self.signed = {r.peer_id: r for r in merge([*self.signed.values(), *found])}  # unexpired, newest
        return [s.record for s in found if s.record.model == model]

    def signed_record(self, peer_id: str) -> SignedRecord | None:
        """The newest unexpired record read of `peer_id`, with the bytes it was signed as."""
        got = self.signed.get(peer_id)
        return got if got is not None and got.record.fresh() else None

    def known_peers(self) -> list[str]:
        """The DHT servers this node knows of (its routing table): peers and sentinels."""
        return [p.to_base58() for p in self.dht.routing_table.get_peer_ids()]

    async def peer_record(self, peer_id: str) -> PeerRecord | None:
        """A peer's current record by id (online or withdrawn), or None if none is fresh."""
        found, _ = await fetch_set(self.dht, peer_key(peer_id))
        return found[0].record if found else None

    async def put_set(self, key: str, items: Sequence[Any]) -> int:
        """Store signed items under `key` (a prefix the node's codecs know) here and at the k
        closest DHT nodes; returns how many of them accepted."""
        return await put_set(self.dht, key, items)

    async def fetch_set(self, key: str) -> list[Any]:
        """Every valid item under `key` the k closest DHT nodes or this node hold, merged."""
        return (await fetch_set(self.dht, key))[0]

    async def coverage(self, model: str, num_blocks: int, expected_hashes: Sequence[str]) -> Coverage:
        """The block map of `model`, judged against its manifest (block count and hashes), so
        records that claim another model shape or other weights cannot distort it."""
        self.num_blocks[model] = num_blocks
        cov = coverage(await self.records(model), model, num_blocks, expected_hashes=expected_hashes)
        return with_estimates(cov, self.samples.get(model, {}))

    async def reach_peers(self, records: Sequence[PeerRecord],
                          timeout: float = REACH_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """How this node reaches each peer of `records` now, as a client's dial would: direct
        addresses first, then through its relays, waiting for a hole punch where both ends
        run DCUtR. {peer id: Relaying.reached's answer, or {"state": "unreachable", "via":
        None, "error": why}}; at most REACH_AT_ONCE dials at a time, each within `timeout`."""
        found: dict[str, dict[str, Any]] = {}
        limit = trio.CapacityLimiter(REACH_AT_ONCE)

        async def one(rec: PeerRecord) -> None:
            pid, error = ID.from_base58(rec.peer_id), "announces no address"
            async with limit:
                with trio.move_on_after(timeout) as scope:
                    try:
                        if rec.addrs:
                            if not self.relaying.connected(pid):
                                await connect_at(self.host, pid, [parse_multiaddr(a) for a in rec.addrs])
                            found[rec.peer_id] = self.relaying.reached(rec.peer_id)
                            return
                    except Exception as e:  # noqa: BLE001 - py-libp2p's many dial failures: say which
                        error = str(e) or type(e).__name__
                if scope.cancelled_caught:
                    error = f"no connection within {timeout:.0f} s"
                found[rec.peer_id] = {"state": "unreachable", "via": None, "error": error}

        async with trio.open_nursery() as nursery:
            for rec in {r.peer_id: r for r in records}.values():
                nursery.start_soon(one, rec)
        return found


class _Started:
    """A task status that reports `value` when the task says it has started."""

    def __init__(self, status: trio.TaskStatus, value: object):
        self.status, self.value = status, value

    def started(self, _: object = None) -> None:
        self.status.started(self.value)


@asynccontextmanager
async def open_node(key_pair: KeyPair, config: NodeConfig = DEFAULTS, **services: Any) -> AsyncIterator[Node]:
    """Run a Node for the duration of the block; leaving it withdraws and shuts down.
    `services`: Node's handlers, status_fn and codecs."""
    async with trio.open_nursery() as nursery:
        node = await nursery.start(Node(key_pair, config, **services).run)
        try:
            yield node
        finally:
            nursery.cancel_scope.cancel()
