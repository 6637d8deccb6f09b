"""Spot checks: recompute a few randomly chosen steps and compare, with a calibrated tolerance.

With probability `rate` (0.1 by default) a step of a peer is picked, after its reply has come
back, so the peer cannot know which replies will be checked; the pick must come from a source
the peer cannot predict (the system CSPRNG unless a test seeds it). The step is recomputed by
the client's own blocks or by another replica, and the two outputs are compared token by token.

The statistic is the per-token relative L2 error, each token against its own threshold.
Honest peers disagree with each other by their dtypes' rounding (bf16 against fp32 reaches
~1e-1 on a few tokens of SmolLM2; fp32 against fp32 ~1e-4 once sent in fp16), so the
tolerance is per pair of dtypes (and early/later positions), measured: the errors between
honest outputs of each pair (canary.benign_outputs, different realizations) are fitted with a
log-normal (upper body only, see _upper), and the threshold is the quantile that leaves a
false-positive probability `alpha` per token, never below the largest error actually seen.
Both outputs are compared as sent on the wire (a local recomputation is rounded to the wire
dtype first), as in the calibration. A spot check is a single sample, so it catches gross
tampering; subtle tampering is the canaries' job.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Mapping, Sequence

import torch
from torch import Tensor

from diffuse.trust.canary import FLOOR, drift, dtype_name

DEFAULT_RATE = 0.1
SPOT_ALPHA = 1e-6  # false-positive probability per checked token
# No threshold below fp16's relative spacing (2^-10): one rounding flip per element of a token
# that two honest fp32 computations summed in different orders (a decode step against a batched
# recomputation, another thread count) stays under it, while the gross tampering spot checks are
# for (1% noise and up) sits 10x above it. Fitted fp32 thresholds came out near 1e-6 and accused
# an honest fp32 peer at 5e-6 in testing.
SPOT_FLOOR = 1e-3


class SpotChecker:
    """Decides which steps to check: each independently with probability `rate`."""

    def __init__(self, rate: float = DEFAULT_RATE, rng: random.Random | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError("spot-check rate must be in [0, 1]")
        self.rate, self.rng = rate, rng or random.SystemRandom()

    def pick(self) -> bool:
        return self.rng.random() < self.rate


EARLY = 4  # positions below this (attention sinks, chat headers) err several times more


def _key(a: torch.dtype | str, b: torch.dtype | str, early: bool) -> tuple[str, str, str]:
    x, y = sorted((dtype_name(a), dtype_name(b)))
    return x, y, "early" if early else "body"


@dataclass(frozen=True)
class Tolerance:
    """Largest honest per-token relative error, per unordered pair of dtypes and position class.

    The first EARLY positions get their own thresholds: on SmolLM2 their bf16-vs-fp32 errors
    run 3-5x those of later tokens, and one threshold for both would be loose everywhere.
    """

    thresholds: Mapping[tuple[str, str, str], float]
    alpha: float

    def threshold(self, a: torch.dtype | str, b: torch.dtype | str, position: int) -> float:
        try:
            return self.thresholds[_key(a, b, position < EARLY)]
        except KeyError:
            raise ValueError(f"no tolerance calibrated for {_key(a, b, position < EARLY)[:2]}") from None

    @classmethod
    def from_outputs(cls, outputs: Mapping[str, Sequence[Tensor]], alpha: float = SPOT_ALPHA) -> "Tolerance":
        """Fit from honest outputs [n, T, H] of sequences from position 0, per dtype (>= 2 each:
        canary.benign_outputs), with T > EARLY."""
        z = NormalDist().inv_cdf(1 - alpha)
        thresholds = {}
        for a, b in itertools.combinations_with_replacement(sorted(outputs), 2):
            pairs = [(x, y) for x in outputs[a] for y in outputs[b] if x is not y]
            if not pairs:
                raise ValueError(f"{a} against itself needs two realizations")
            err = torch.stack([drift(x, y) for x, y in pairs])  # [pairs, n, T]
            if err.shape[-1] <= EARLY:
                raise ValueError(f"calibration sequences need more than {EARLY} tokens")
            for early, part in ((True, err[..., :EARLY]), (False, err[..., EARLY:])):
                thresholds[_key(a, b, early)] = max(_upper(part.flatten(), z), SPOT_FLOOR)
        return cls(thresholds, alpha)


def _upper(err: Tensor, z: float) -> float:
    """z sds above the median of a log-normal fitted to the upper body of `err`, never below
    the largest error seen.

    The log-normal is fitted through the median and the 99th percentile, not the mean and sd:
    the lower tail (tokens two realizations round almost alike, as fp32 peers do once sent in
    fp16) spans decades, says nothing about large errors, and would inflate an sd fit tenfold.
    """
    err = err[err > 0]  # tokens sent identically: no information about the spread
    if err.numel() < 2:
        return FLOOR
    log = err.double().log10()
    median, q99 = torch.quantile(log, 0.5), torch.quantile(log, 0.99)
    sigma = float(q99 - median) / NormalDist().inv_cdf(0.99)
    return 10 ** max(float(median) + z * sigma, float(log.max()))


@dataclass(frozen=True)
class SpotVerdict:
    ok: bool
    statistic: float  # relative error of the token furthest over (or nearest to) its threshold
    threshold: float  # that token's threshold
    token: tuple[int, int]  # (batch row, token) of the worst error: the chunk to open as evidence


def compare(peer_out: Tensor, ref_out: Tensor, tolerance: Tolerance, peer_dtype: torch.dtype | str,
            ref_dtype: torch.dtype | str, positions: Sequence[int]) -> SpotVerdict:
    """Compare a peer's output [B, T, H] for tokens at `positions` with a recomputation of the
    step, both in the wire dtype."""
    if len(positions) != ref_out.shape[1]:
        raise ValueError(f"{len(positions)} positions for {ref_out.shape[1]} tokens")
    thr = torch.tensor([tolerance.threshold(peer_dtype, ref_dtype, int(p)) for p in positions])
    if peer_out.shape != ref_out.shape:
        return SpotVerdict(False, math.inf, float(thr.min()), (0, 0))
    err = drift(peer_out, ref_out)
    err = torch.where(err.isfinite(), err, torch.full_like(err, math.inf))
    worst = int((err / thr).flatten().argmax())
    row, tok = divmod(worst, err.shape[-1])
    stat, limit = float(err[row, tok]), float(thr[tok])
    return SpotVerdict(stat <= limit, stat, limit, (row, tok))
