"""What a layer above may do around a remote span's hops, declared here so the data plane works alone.

A client that does not trust its peers (the trust plane) vets each new hop before its session
opens and steps every hop session through a wrapper of its own, which may check outputs and
reject the hop. The data plane asks three things of it (`HopChecks`: vet a hop, wrap a session,
hear that a span closed) and knows two answers: `Rejected`, upon which it replaces the hop as it
replaces a failed one, and `errors.Rewind`, which it lets through to the pipeline (outputs
already used were judged wrong). `NoChecks` does nothing, which is what a private swarm of one's
own peers needs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from diffuse.control.routing import Hop
from diffuse.data.hop import HopSession, Session
from diffuse.errors import DiffuseError

OpenSession = Callable[[Hop, int], Awaitable[HopSession]]  # a fresh session on a hop, room for n tokens


class Rejected(DiffuseError):
    """A layer above judged a hop's outputs wrong from its `length`-th committed token on: the
    span replaces the hop by a replica rebuilt from the inputs it had committed before that
    token, then redoes the step. `behind`: judged behind the generation, which has been rewound
    to `length` already (the wrapper raised Rewind first and rejects from then on)."""

    def __init__(self, message: str, length: int, behind: bool = False):
        super().__init__(message)
        self.length, self.behind = length, behind


class ChecksUnavailable(DiffuseError):
    """The layer above cannot judge any peer on these blocks: the session must not open."""


class HopChecks(Protocol):
    """A layer above's part in a remote span. Peers it never trusts are kept out by the span's
    route callable, whose builder knows them."""

    commitments: bool  # open sessions with WANT_COMMITMENTS: checks hold a hop to its commitments

    async def vet(self, hop: Hop, probe: OpenSession) -> None:
        """Before a new hop's session opens (Rejected: route around it)."""

    def wrap(self, session: HopSession) -> Session:
        """The session the span steps through, instead of `session` (not opened yet)."""

    async def closed(self, hops: Sequence[Hop], probe: OpenSession) -> None:
        """The span closed with `hops` as its route."""


class NoChecks:
    """Trust every peer: each step is just sent."""

    commitments = False

    async def vet(self, hop: Hop, probe: OpenSession) -> None:
        return None

    def wrap(self, session: HopSession) -> Session:
        return session

    async def closed(self, hops: Sequence[Hop], probe: OpenSession) -> None:
        return None
