"""Options on how a node finds the swarm and is reached: LAN discovery by mDNS (and, for
peers, relays, hole punching and UPnP). Shared by `join`, `status`, `ask` and `api`."""

from __future__ import annotations

import argparse


def add_discovery_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mdns", action=argparse.BooleanOptionalAction, default=None, help="find nodes of the swarm on "
                   "the LAN by mDNS (default: on without --bootstrap); in a private swarm only key holders connect")


def add_relay_options(p: argparse.ArgumentParser, default: bool) -> None:
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=default, help="serve circuit relay "
                   f"v2 hops, with bounded reservations, for peers behind NAT (default: {'on' if default else 'off'})")


def add_hole_punch_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hole-punch", action=argparse.BooleanOptionalAction, default=True,
                   help="turn relayed connections direct by DCUtR hole punching where both ends do (a client then "
                        "listens on every interface, so its router maps the port it dials from; default: on)")


def add_upnp_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upnp", action=argparse.BooleanOptionalAction, default=True, help="map this peer's port on "
                   "the LAN's router (UPnP IGD) and, if the swarm dials it there, announce that, not a relay "
                   "(default: on)")

