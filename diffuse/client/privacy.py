"""Noise on what leaves the client: a candidate defence against inversion, measured, not a default.

`NoisyStage` wraps the stage whose output the swarm receives (the client's front blocks) and adds
Gaussian noise to every row it returns, `sigma` times the row's RMS, from a generator seeded from
os.urandom that no peer can know. Its own cache holds the clean states (the noise is added after
the span ran), so the client's later positions see the true prefix; the swarm's peers compute on
the noisy rows, and so does everything downstream of them.

Exact search with the public weights (scripts/eval_privacy.py, A3) matches the observed state to
the nearest candidate's, so noise defeats it only once it is comparable to the distance between
the states of different tokens. Measured (--local-blocks 1,0, SmolLM2-135M, 12 prompts): at sigma
0.1 A3 still recovers 100% of prompt tokens while greedy answers keep only 48% of their tokens
before diverging; at sigma 1, 100% and 0%; at sigma 3, 81% and 0%. It does nothing against the
last peer's read-out of generated tokens (the client reads what that peer returns). So it is not a
defence, is off by default (0) and has no command-line flag: it exists to be measured.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from diffuse.errors import DiffuseError


class NoisyStage:
    """A stage whose outputs get secret noise of `sigma` x each row's RMS (the stage protocol of
    client/pipeline.py: forward, commit, rollback and close pass through)."""

    def __init__(self, inner, sigma: float, seed: int | None = None):
        if not sigma > 0:
            raise DiffuseError(f"noise must be positive, got {sigma}")
        self.inner, self.sigma = inner, float(sigma)
        self.start, self.end = getattr(inner, "start", None), getattr(inner, "end", None)
        self.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "big") if seed is None else seed)

    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor:
        return add_noise(await self.inner.forward(h, positions, tree_mask, commit), self.sigma, self.gen)

    async def commit(self, keep: Sequence[int] | None) -> None:
        await self.inner.commit(keep)

    async def rollback(self, length: int) -> None:
        await self.inner.rollback(length)

    async def close(self) -> None:
        await self.inner.close()


class EmbedNoise:
    """The same noise where no front block runs locally: the stage before the swarm is the embedding."""

    def __init__(self, sigma: float, seed: int | None = None):
        self.noisy = NoisyStage(_Identity(), sigma, seed)

    def __getattr__(self, name):
        return getattr(self.noisy, name)


class _Identity:
    async def forward(self, h: Tensor, positions: Tensor, tree_mask: Tensor | None, commit: bool) -> Tensor:
        return h

    async def commit(self, keep: Sequence[int] | None) -> None:
        return None

    async def rollback(self, length: int) -> None:
        return None

    async def close(self) -> None:
        return None


def add_noise(h: Tensor, sigma: float, gen: torch.Generator) -> Tensor:
    x = h.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    return (x + sigma * rms * noise).to(h.dtype)


def wrap_front(stages: list, front_is_local: bool, sigma: float) -> list:
    """The session's stages with noise on what the swarm receives: the first local stage's output,
    or the embeddings (a stage of its own) when the client runs no front block."""
    if not sigma:
        return stages
    if front_is_local:
        return [NoisyStage(stages[0], sigma), *stages[1:]]
    return [EmbedNoise(sigma), *stages]


__all__ = ["NoisyStage", "EmbedNoise", "add_noise", "wrap_front"]
