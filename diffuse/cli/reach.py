"""Options on how a node finds the swarm and is reached: LAN discovery by mDNS (and, for
peers, relays, hole punching and UPnP). Shared by `join`, `status`, `ask` and `api`."""

from __future__ import annotations

import argparse

from diffuse.errors import DiffuseError


def add_discovery_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mdns", action=argparse.BooleanOptionalAction, default=None,
                   help="find nodes of the swarm on the LAN by mDNS (default: on when no --bootstrap is "
                        "given); in a private swarm only nodes with its key can connect")


def use_mdns(args: argparse.Namespace, bootstrap: list[str]) -> bool:
    """--mdns as given, else on exactly when there is no bootstrap peer; refuses a node with
    neither (it could never find anyone)."""
    mdns = args.mdns if getattr(args, "mdns", None) is not None else not bootstrap
    if not bootstrap and not mdns:
        raise DiffuseError("no bootstrap peer: give --bootstrap ADDR (a sentinel's full multiaddr), "
                           "or drop --no-mdns to find the swarm on the LAN")
    return mdns


def add_relay_options(p: argparse.ArgumentParser, default: bool) -> None:
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=default,
                   help="serve circuit relay v2 hops for peers behind NAT, with bounded reservations "
                        f"(default: {'on' if default else 'off'})")


def add_hole_punch_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hole-punch", action=argparse.BooleanOptionalAction, default=True,
                   help="over a relayed connection, try DCUtR hole punching to open a direct one through both "
                        "routers (both ends must; a client then listens on every interface, as its dials must "
                        "leave from a port its router maps; default: on)")


def add_upnp_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upnp", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the LAN's router to map this peer's port (UPnP IGD) and, if the swarm can dial it "
                        "there, announce the router's external address instead of using a relay (default: on)")

