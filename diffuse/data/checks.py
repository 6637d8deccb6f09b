"""What a layer above may do around a remote span's steps, declared here so the data plane works alone.

A client that does not trust its peers (the trust plane) vets each new hop before it carries
traffic, checks some steps' outputs, and may reject a hop; the data plane only has to run every
step through `StepChecks.step`, replace a rejected hop like a failed one, and rewind when a
check behind the generation fails. `NoChecks` does nothing, which is what a private swarm of
one's own peers needs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from torch import Tensor

from diffuse.control.routing import Hop
from diffuse.data.hop import HopSession, Sent
from diffuse.errors import DiffuseError

OpenSession = Callable[[Hop, int], Awaitable[HopSession]]  # a fresh session on a hop, room for n tokens


class Rejected(DiffuseError):
    """A layer above judged a hop's output wrong. The hop is replaced by a replica rebuilt from
    `inputs` (what it had committed before the bad step); when the bad step was already used
    (a check behind the generation), every stage also rolls back to `length` tokens."""

    def __init__(self, message: str, session: HopSession | None, inputs: list[Sent], length: int | None = None):
        super().__init__(message)
        self.session, self.inputs, self.length = session, inputs, length


class ChecksUnavailable(DiffuseError):
    """The layer above cannot judge any peer on these blocks: the session must not open."""


class StepChecks(Protocol):
    """Per-step work of a layer above, called by RemoteSpan. Sessions are identified by their
    own `session_id`; each is forgotten once closed or replaced."""

    commitments: bool  # open sessions with WANT_COMMITMENTS and check every reply's commitment
    max_lag: int  # tokens a check behind the generation may trail it before forward() waits

    def excluded(self) -> set[str]: ...
    async def vet(self, hop: Hop, open_session: OpenSession) -> None: ...
    def opened(self, session: HopSession) -> None: ...
    async def step(self, session: HopSession, h: Tensor, positions: Tensor, mask: Tensor | None,
                   commit: bool, behind: bool) -> Tensor: ...
    def unverified_from(self, sessions: Sequence[HopSession]) -> int | None: ...
    async def settle(self, sessions: Sequence[HopSession], wait: bool) -> None: ...
    def forget(self, session: HopSession) -> None: ...
    def note_step(self, seconds: float, positions: int) -> None: ...
    async def closed(self, hops: Sequence[Hop], open_session: OpenSession) -> None: ...


class NoChecks:
    """Trust every peer: each step is just sent."""

    commitments = False
    max_lag = 0

    def excluded(self) -> set[str]:
        return set()

    async def vet(self, hop: Hop, open_session: OpenSession) -> None:
        return None

    def opened(self, session: HopSession) -> None:
        return None

    async def step(self, session: HopSession, h: Tensor, positions: Tensor, mask: Tensor | None,
                   commit: bool, behind: bool) -> Tensor:
        return await session.step(h, positions, mask, commit)

    def unverified_from(self, sessions: Sequence[HopSession]) -> int | None:
        return None

    async def settle(self, sessions: Sequence[HopSession], wait: bool) -> None:
        return None

    def forget(self, session: HopSession) -> None:
        return None

    def note_step(self, seconds: float, positions: int) -> None:
        return None

    async def closed(self, hops: Sequence[Hop], open_session: OpenSession) -> None:
        return None
