"""Routes pinned to chosen peers, for tests and benchmarks that compare route shapes over the same
peers: the client's own planner, kept to those peers while they can serve (failovers go anywhere)."""

from __future__ import annotations

from diffuse.client.swarm import SwarmClient
from diffuse.control.routing import NoRoute


def pin_route(client: SwarmClient, everyone: set[str], allowed: set[str]) -> None:
    """Route `client`'s sessions over the peers `allowed` of `everyone` (peer ids)."""
    plan = SwarmClient.route.__get__(client)
    others = everyone - allowed

    async def route(start: int, end: int, exclude: set[str]):
        try:
            return await plan(start, end, exclude | others)
        except NoRoute:
            return await plan(start, end, exclude)

    client.route = route
