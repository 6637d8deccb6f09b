"""The addresses a command is given, checked before anything else happens: the bootstrap peers
(--bootstrap values and the lines of --bootstrap-file, # comments; full multiaddrs with /p2p/)
and the listen addresses (--listen, else the command's default); and whether to look on the LAN."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diffuse.control.host import parse_multiaddr, parse_peer_addr
from diffuse.errors import DiffuseError


def bootstrap_list(given: Sequence[str], path: Path | None, required: bool) -> list[str]:
    addrs = list(given)
    if path is not None:
        try:
            text = path.read_text()
        except OSError as e:
            raise DiffuseError(f"cannot read {path}: {e.strerror or e}") from None
        addrs += [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        addrs = [a for a in addrs if a]
    if required and not addrs:
        raise DiffuseError("no bootstrap peer: give --bootstrap ADDR (a sentinel's full multiaddr)")
    for a in addrs:
        parse_peer_addr(a)
    return addrs


def listen_list(given: Sequence[str], default: str) -> list[str]:
    addrs = list(given) or [default]
    for a in addrs:
        parse_multiaddr(a)
    return addrs


def mdns_wanted(mdns: bool | None, bootstrap: Sequence[str]) -> bool:
    """--mdns as given, else on exactly when there is no bootstrap peer; refuses a node with
    neither (it could never find anyone)."""
    wanted = mdns if mdns is not None else not bootstrap
    if not bootstrap and not wanted:
        raise DiffuseError("no bootstrap peer: give --bootstrap ADDR (a sentinel's full multiaddr), "
                           "or drop --no-mdns to find the swarm on the LAN")
    return wanted
