"""Every adaptation of py-libp2p, listed once and checked before any is made.

Diffuse runs on py-libp2p 0.8.1 and adapts it in three ways: process-global patches (a name in
one of its modules or classes replaced for the whole process), subclasses that override or read
its private members, and attributes set on its objects. Each is listed below with the names it
replaces or relies on, the module of ours that does it, and the upstream defect it answers,
written up with a reproduction in docs/libp2p.md under that anchor. `install()`, which every
host runs before it is built, checks the installed version and every listed name (and the
parameters of each overridden method), then makes the process-global patches. Any mismatch is
an `UpstreamChanged` naming each difference, at start-up: an upgrade fails loudly instead of
silently bringing back the defects these work around.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from importlib import metadata

from diffuse.control import pnet, quick_io, whole_writes
from diffuse.errors import DiffuseError

WRITTEN_FOR = "0.8.1"
PATCH, OVERRIDE, RELIES = "patch", "override", "relies"
LOG_ENV = "DIFFUSE_LIBP2P_LOG"  # a level (e.g. DEBUG): py-libp2p's own log lines on stderr


class UpstreamChanged(DiffuseError):
    """The installed py-libp2p is not the one these adaptations were written for."""


@dataclass(frozen=True)
class Adaptation:
    """`kind` PATCH: `names` of `owner` are replaced process-wide by `by`; OVERRIDE: a subclass
    (`by`) overrides these methods, whose parameters must still be `params`; RELIES: `by` reads
    or sets these members of `owner`'s instances (class attributes, or set by its __init__)."""

    kind: str
    owner: str  # "module:Class", or "module" for a module-level name
    names: tuple[str, ...]
    by: str
    defect: str  # the anchor of its write-up in docs/libp2p.md
    params: tuple[str, ...] = ()


_YAMUX = "libp2p.stream_muxer.yamux.yamux"
_DCUTR = "libp2p.relay.circuit_v2.dcutr:DCUtRProtocol"
ADAPTATIONS: tuple[Adaptation, ...] = (
    # process-global patches: ten names replaced and the `libp2p` logger given a handler (eleven)
    Adaptation(PATCH, "libp2p.network.stream.net_stream:NetStream", ("__init__",), "quick_io", "yield-per-lock"),
    Adaptation(PATCH, f"{_YAMUX}:YamuxStream", ("__init__",), "quick_io", "yield-per-lock"),
    Adaptation(PATCH, f"{_YAMUX}:Yamux", ("__init__",), "quick_io", "yield-per-lock"),
    Adaptation(PATCH, "libp2p.stream_muxer.rw_lock:ReadWriteLock", ("__init__",), "quick_io", "yield-per-lock"),
    Adaptation(PATCH, "libp2p.io.trio:TrioTCPStream", ("__init__",), "quick_io", "yield-per-lock"),
    Adaptation(PATCH, f"{_YAMUX}:Yamux", ("_write_frame",), "quick_io", "checkpoint-after-frame"),
    Adaptation(PATCH, "libp2p.io.trio:TrioTCPStream", ("read",), "quick_io", "split-noise-reads"),
    Adaptation(PATCH, f"{_YAMUX}:YamuxStream", ("_auto_tune_and_send_window_update",), "quick_io",
               "window-update-per-read"),
    Adaptation(PATCH, "libp2p.security.secure_session:SecureSession", ("write",), "whole_writes",
               "cancelled-write-desyncs-noise"),
    Adaptation(PATCH, "libp2p.network.swarm", ("new_protected_conn",), "pnet", "pnet-short-read"),
    Adaptation(PATCH, "libp2p.network.swarm", ("new_protected_conn",), "pnet", "pnet-wrapped-twice"),
    Adaptation(PATCH, "logging", ("getLogger",), "upstream.tame_logging", "warnings-on-stderr"),  # "libp2p"'s
    # subclasses overriding private methods
    Adaptation(OVERRIDE, "libp2p.relay.circuit_v2.protocol:CircuitV2Protocol", ("_relay_data",), "nat.Relay",
               "relay-half-closed-circuit",
               ("self", "src_stream", "dst_stream", "peer_id", "deadline", "circuit_data_limit")),
    Adaptation(OVERRIDE, "libp2p.relay.circuit_v2.protocol:CircuitV2Protocol", ("_handle_connect",), "nat.Relay",
               "relay-full-says-no-reservation", ("self", "stream", "msg")),
    Adaptation(OVERRIDE, _DCUTR, ("_auto_drive_loop",), "nat.Punch", "dcutr-both-sides-start", ("self",)),
    Adaptation(OVERRIDE, _DCUTR, ("_try_unilateral_upgrade",), "nat.Punch", "dcutr-private-wait",
               ("self", "peer_id")),
    Adaptation(OVERRIDE, _DCUTR, ("_close_relayed_conns_after_grace",), "nat.Punch", "dcutr-closes-busy-circuit",
               ("self", "peer_id", "grace")),
    Adaptation(OVERRIDE, "libp2p.host.autonat.autonat:AutoNATService", ("_try_dial",), "nat.DialBack",
               "autonat-reuses-connection", ("self", "peer_id", "addrs")),
    Adaptation(OVERRIDE, "libp2p.kad_dht.value_store:ValueStore", ("put_record", "get"), "dht.MergingValueStore",
               "values-overwritten", ("self", "key")),
    # private members read or set on py-libp2p's objects
    Adaptation(RELIES, "libp2p.relay.circuit_v2.protocol:CircuitV2Protocol", ("_active_relays",), "nat.Relay",
               "relay-book-closes-other-circuits"),
    Adaptation(RELIES, "libp2p.relay.circuit_v2.protocol:CircuitV2Protocol", ("resource_manager", "_send_status"),
               "nat.Relay", "relay-full-says-no-reservation"),
    Adaptation(RELIES, _DCUTR, ("_nursery", "_in_progress", "_direct_connections", "_hole_punch_attempts",
                                "dial_timeout", "_dial_peer", "_verify_direct_connection", "initiate_hole_punch"),
               "nat.Punch", "dcutr-both-sides-start"),
    Adaptation(RELIES, "libp2p.relay.circuit_v2.transport:CircuitV2Transport", ("_make_reservation",),
               "nat.Relaying", "no-reservation-on-chosen-relay"),
    Adaptation(RELIES, "libp2p.kad_dht.kad_dht:KadDHT", ("_inbound_limiter",), "dht.make_dht", "kad-inbound-limit"),
    Adaptation(RELIES, "libp2p.kad_dht.kad_dht:KadDHT", ("add_peer",), "dht.make_dht", "kad-clients-in-table"),
    Adaptation(RELIES, "libp2p.kad_dht.value_store:ValueStore", ("_store_at_peer", "_get_from_peer", "store"),
               "dht.put_set", "no-per-peer-values"),
    Adaptation(RELIES, "libp2p.discovery.mdns.mdns:MDNSDiscovery", ("_cleanup_cancel_scope",), "mdns.LanDiscovery",
               "mdns-stop-from-thread"),
    Adaptation(RELIES, "libp2p.network.swarm:Swarm", ("retry_config",), "host.make_host", "dial-retries"),
    Adaptation(RELIES, "libp2p.network.swarm:Swarm", ("auto_connector",), "host.make_host", "auto-connector-redials"),
    Adaptation(RELIES, "libp2p.network.swarm:Swarm", ("unblock_peer", "get_connections", "remove_conn"), "dial",
               "stale-connection-reused"),
    Adaptation(RELIES, "libp2p.host.basic_host:BasicHost", ("connect", "upgrade_outbound_connection"),
               "nat.Relaying", "circuit-addresses-dropped"),
    Adaptation(RELIES, "libp2p.network.swarm", ("new_protected_conn",), "nat.Relaying", "relayed-dial-not-private"),
    Adaptation(RELIES, "libp2p.peer.peerstore:PeerStore", ("clear_addrs",), "host.connect_at",
               "peerstore-first-address"),
)


def _resolve(owner: str) -> object:
    module, _, qualname = owner.partition(":")
    found: object = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        found = getattr(found, part)
    return found


def _sets(cls: type, name: str) -> bool:
    """Whether a method of `cls` (or of a base) assigns `self.<name>`: an instance attribute."""
    return any(op.opname == "STORE_ATTR" and op.argval == name
               for klass in cls.__mro__ for f in vars(klass).values() if inspect.isfunction(f)
               for op in dis.get_instructions(f))


def problems(version: str | None = None) -> list[str]:
    """What differs from the py-libp2p these adaptations were written for; empty when nothing."""
    version = version or metadata.version("libp2p")
    found = [] if version == WRITTEN_FOR else [f"py-libp2p {version} is installed, not {WRITTEN_FOR}"]
    for a in ADAPTATIONS:
        try:
            owner = _resolve(a.owner)
        except (ImportError, AttributeError) as e:
            found.append(f"{a.owner} is gone ({a.by}, docs/libp2p.md#{a.defect}): {e}")
            continue
        for name in a.names:
            here = hasattr(owner, name) or (a.kind == RELIES and isinstance(owner, type) and _sets(owner, name))
            if not here:
                found.append(f"{a.owner}.{name} is gone ({a.by}, docs/libp2p.md#{a.defect})")
            elif a.kind == OVERRIDE and a.params:
                params = tuple(inspect.signature(getattr(owner, name)).parameters)
                if params[:len(a.params)] != a.params:
                    found.append(f"{a.owner}.{name} now takes {params}, not {a.params} ({a.by})")
    return found


def check() -> None:
    """UpstreamChanged naming every difference, unless there is none."""
    found = problems()
    if found:
        raise UpstreamChanged("py-libp2p is not the version Diffuse's adaptations were written for; update "
                              "diffuse/control/upstream.py and the modules it names:\n  " + "\n  ".join(found))


def tame_logging() -> None:
    """Stop py-libp2p's warnings from reaching stderr unless asked for.

    Its `libp2p` logger has propagate=False and no handler, so Python's last-resort handler
    prints every WARNING (dozens of "Failed to read DHT message" per run). A NullHandler
    silences that; DIFFUSE_LIBP2P_LOG=LEVEL sends them to stderr instead. LIBP2P_DEBUG (the
    library's own switch) is left alone when set.
    """
    log = logging.getLogger("libp2p")
    if os.environ.get("LIBP2P_DEBUG") or getattr(log, "_diffuse_tamed", False):
        return
    log._diffuse_tamed = True  # type: ignore[attr-defined]
    level = os.environ.get(LOG_ENV, "").upper()
    if level in logging.getLevelNamesMapping():
        handler: logging.Handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        log.setLevel(level)
    else:
        handler = logging.NullHandler()
    log.addHandler(handler)


_checked = False


def install(private: bool = False) -> None:
    """Check once per process, then make the process-global patches (each idempotent);
    `private`: also the private-network layer's (pnet), which only private swarms need."""
    global _checked
    if not _checked:
        check()
        _checked = True
    tame_logging()
    whole_writes.apply()
    quick_io.apply()
    if private:
        pnet.install()
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")  # yamux reads it at every read
