"""Canaries: secret inputs with known outputs, mixed into traffic to measure each peer's drift.

A canary for blocks [a, b) is the hidden state a real request would carry into block a: text
sampled from the model itself (natural-looking, and free of any user's data), run through
blocks [0, a) by the client, sent in the wire dtype; its reference output is blocks [a, b) in
fp32 on exactly those wire-dtype inputs. A peer that cannot tell canaries from real requests
corrupts them as often as it corrupts anything.

Honest peers do not return the reference either: bf16 and fp16 round, and other hardware sums in
another order. So the drift of a peer is judged against the drift honest peers would show on the
same canary. The client measures that itself (`benign_outputs`): it recomputes every canary in
each dtype the swarm uses, several times, each time with the hidden and MLP dimensions permuted,
which is the same arithmetic summed in another order - how one GPU's kernels differ from
another's - and stepped as canaries are sent (a prefill, then single-token steps; one
realization each canary alone, the other all batched, as peers serve). Per canary this gives the
benign mean drift, and from the spread between realizations the noise, in two parts fitted
separately: per canary, and per peer (a shift shared by all of one peer's canaries, e.g. its
hardware). A peer's residuals against the per-canary means are paired: canary-to-canary
variation (sd ~0.03 in log10 drift on SmolLM2) cancels, leaving realization noise (~0.011), so
the test is ~3x tighter than against the pooled benign distribution. They are combined two ways
- their mean, for weak tampering on every request, and their maximum, for strong tampering on a
few - each at half the false-positive budget. No threshold on drift itself is fixed: only the
budget `alpha`, and floors on the noise (MIN_SIGMA, MIN_TAU) for differences one machine cannot
measure.

Limits: the permutation model of hardware noise is checked here only against another
implementation (scripts/eval_integrity.py), not against GPUs; a peer whose kernels are
systematically sloppier (TF32 matmuls declared as fp32) will look like a tamperer, which is
why honest peers must declare the dtype they compute in.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from diffuse.model.engine import BlockSpan, Head
from diffuse.model.quant import group_permutation

ALPHA = 1e-4  # false-positive budget per peer, over all of its canaries
DECODE_TAIL = 4  # a canary's last tokens, sent (and calibrated) as single-token steps after its prefill
# Floors on the measured noise, in log10 units of drift. Between realizations the per-canary
# noise of bf16 on SmolLM2 is ~0.011 and the shared (per-peer) shift <= 0.004; transformers'
# own layers sat within 0.003 of the engine's. fp32 peers measure ~0 (wire rounding dominates).
# The floors leave room for kernels this machine cannot run (GPUs): a peer-level shift of
# 0.01 (2.3% more drift) is still called honest.
MIN_SIGMA = 0.005
MIN_TAU = 0.01
FLOOR = 1e-9  # drift of an exact copy, so log10 stays finite


@dataclass(frozen=True)
class Canary:
    tokens: Tensor  # [T] the text it was made from: secret until published as evidence
    hidden: Tensor  # [T, H] input of the span, in the wire dtype
    reference: Tensor  # [T, H] output of the span's blocks in fp32 on `hidden`
    prefix: int = 0  # leading tokens all canaries of the set share (a chat header): not scored


def _dtype(span: BlockSpan) -> torch.dtype:
    return span.blocks[0].wo.weight.dtype


@torch.inference_mode()
def forward(span: BlockSpan, hidden: Tensor) -> Tensor:
    """Run a batch of whole sequences [B, T, H] from position 0 through `span` (fresh cache)."""
    b, t, _ = hidden.shape
    return span(hidden.to(_dtype(span)), torch.arange(t), span.new_cache(t, b))


@torch.inference_mode()
def forward_as_sent(span: BlockSpan, hidden: Tensor, alone: bool, exact: bool = False) -> Tensor:
    """`hidden` [B, T, H] through `span` the way a client sends a canary: a prefill, then the
    last DECODE_TAIL tokens one step each. A peer's kernels depend on how many rows a product
    has, so single-token steps drift otherwise than a prefill does (on SmolLM2 in bf16, ~5% more
    relative error). `alone`: each sequence's steps computed by themselves (a peer serving one
    session); otherwise all B sequences' steps together (a peer batching sessions). `exact`: on
    the batch-invariant kernels an exact session's canaries are computed with; those give every
    row the bits it has alone, so `alone` computes them together there (a decode step of one row
    costs a whole padded block of rows)."""
    if alone and not exact:
        return torch.cat([forward_as_sent(span, hidden[i:i + 1], False, exact) for i in range(hidden.shape[0])])
    b, t, _ = hidden.shape
    first, x, cache = max(1, t - DECODE_TAIL), hidden.to(_dtype(span)), span.new_cache(t, b, exact)
    outs = [span(x[:, :first], torch.arange(first), cache)]
    outs += [span(x[:, j:j + 1], torch.tensor([j]), cache) for j in range(first, t)]
    return torch.cat(outs, 1)


@torch.inference_mode()
def natural_tokens(head: Head, blocks: BlockSpan, prompt: Sequence[int], n: int, length: int,
                   generator: torch.Generator, temperature: float = 1.0) -> Tensor:
    """n sequences of `length` tokens: `prompt` then text sampled from the model (all blocks).

    Sampled text reads like real traffic to anyone inverting the activations, unlike random
    tokens, and holds no user data, so a canary can be published as evidence.
    """
    if blocks.start != 0 or blocks.end != blocks.cfg.num_layers:
        raise ValueError("sampling needs every block of the model")
    ids = torch.tensor([list(prompt)] * n, dtype=torch.long)
    cache = blocks.new_cache(length, n)
    h = blocks(head.embed_tokens(ids), torch.arange(ids.shape[1]), cache)
    while ids.shape[1] < length:
        logits = head.logits(h[:, -1]) / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt], 1)
        if ids.shape[1] < length:
            h = blocks(head.embed_tokens(nxt), torch.tensor([ids.shape[1] - 1]), cache)
    return ids


def make_canaries(tokens: Tensor, inputs: Tensor, span: BlockSpan | None, wire_dtype: torch.dtype,
                  reference: Tensor | None = None) -> list[Canary]:
    """Canaries for `span` (fp32 blocks) from token sequences [n, T] and their span inputs [n, T, H]
    (or with references [n, T, H] computed before, and no span)."""
    sent = inputs.to(wire_dtype)
    if reference is None:
        if span is None or _dtype(span) != torch.float32:
            raise ValueError("references are computed in fp32")
        reference = forward(span, sent.float())
    ref = reference
    # Tokens every canary shares have one drift per peer, not one per canary: scoring them
    # would correlate the canaries' scores and break the test's independence.
    same = (tokens == tokens[:1]).all(0).tolist() + [False]
    prefix = min(same.index(False), tokens.shape[1] - 1)
    return [Canary(tokens[i], sent[i], ref[i], prefix) for i in range(len(tokens))]


def _permute(span: BlockSpan, seed: int) -> Tensor:
    """Permute the span's hidden and MLP dimensions in place; returns the hidden permutation."""
    g = torch.Generator().manual_seed(seed)
    cfg = span.cfg
    # an int4 variant's columns keep their groups (its scales and zeros are per group)
    perm = group_permutation if span.quant == "int4" else torch.randperm
    p, q = perm(cfg.hidden_size, generator=g), perm(cfg.intermediate_size, generator=g)
    for block in span.blocks:  # each family knows its own weights (sandwich norms, experts)
        block.permute_(p, q)
    return p


def honest_output(span: BlockSpan, hidden: Tensor, dtype: torch.dtype, seed: int | None,
                  wire_dtype: torch.dtype, exact: bool = False) -> Tensor:
    """What an honest peer computing in `dtype` sends back for canaries `hidden` [B, T, H] (as
    fp32), stepped as a client sends them (forward_as_sent).

    seed None: this machine's kernels, each canary computed alone; an int: the same arithmetic
    with the hidden and MLP dimensions permuted, so every matmul and norm sums in another order,
    and the canaries' steps batched together. The two realizations span both ways a peer serves.
    exact: as a peer computes an exact session's canaries (batch-invariant kernels, attention in
    fp64), whose drift is another distribution than the fast kernels': an exact client is judged
    against exact realizations only.
    """
    peer = copy.deepcopy(span).to(dtype)
    if seed is None:
        return forward_as_sent(peer, hidden, True, exact).to(wire_dtype).float()
    p = _permute(peer, seed)
    return forward_as_sent(peer, hidden[..., p], False, exact)[..., torch.argsort(p)].to(wire_dtype).float()


def benign_outputs(span: BlockSpan, canaries: Sequence[Canary], dtypes: Sequence[torch.dtype],
                   wire_dtype: torch.dtype, realizations: int = 2, exact: bool = False) -> dict[str, list[Tensor]]:
    """Per dtype name, `realizations` honest outputs [n, T, H] of every canary (seed None first)."""
    hidden = torch.stack([c.hidden for c in canaries]).float()
    seeds = [None, *range(1, realizations)]
    return {dtype_name(d): [honest_output(span, hidden, d, s, wire_dtype, exact) for s in seeds] for d in dtypes}


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def drift(out: Tensor, reference: Tensor) -> Tensor:
    """Per-token relative L2 error [..., T] of `out` against `reference`."""
    ref = reference.float()
    return (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(FLOOR)


def score(out: Tensor, canary: Canary) -> float:
    """A peer's drift on one canary: the mean over its own tokens of log10 relative error."""
    err = drift(out[..., canary.prefix:, :], canary.reference[..., canary.prefix:, :])
    return float(err.clamp_min(FLOOR).log10().mean())


@dataclass(frozen=True)
class Benign:
    """Honest drift for one dtype: per-canary mean score, and the noise around it.

    A peer's score on canary i is modelled as mean[i] + u + e_i: u is the peer's own shift
    (its hardware), shared by all its canaries, sd `tau`; e_i is per canary, sd `sigma`.
    """

    mean: Tensor  # [n]
    sigma: float
    tau: float
    realizations: int

    def residual(self, index: int, s: float) -> float:
        return s - float(self.mean[index])

    def sd(self, m: int) -> float:
        """Standard deviation of the mean residual of m canaries of one honest peer."""
        # The calibration mean carries 1/K of the per-canary noise too.
        return math.sqrt(self.tau ** 2 + self.sigma ** 2 * (1 + 1 / self.realizations) / m)


class Calibration:
    """Benign drift per dtype for one canary set (one span): what `decide` tests against."""

    def __init__(self, benign: Mapping[str, Benign]):
        self.benign = dict(benign)

    @classmethod
    def from_outputs(cls, canaries: Sequence[Canary], outputs: Mapping[str, Sequence[Tensor]],
                     min_sigma: float = MIN_SIGMA, min_tau: float = MIN_TAU) -> "Calibration":
        """Fit per dtype from K >= 2 honest realizations [n, T, H] (a two-way analysis of variance)."""
        benign = {}
        for name, outs in outputs.items():
            k, n = len(outs), len(canaries)
            if k < 2 or n < 2:
                raise ValueError("the noise needs at least two realizations and two canaries")
            s = torch.tensor([[score(o[i], c) for i, c in enumerate(canaries)] for o in outs], dtype=torch.float64)
            mean = s.mean(0)
            shift = (s - mean).mean(1, keepdim=True)  # each realization's own shift
            sigma2 = float((s - mean - shift).pow(2).sum()) / ((k - 1) * (n - 1))
            tau2 = float(shift.pow(2).sum()) / (k - 1) - sigma2 / n
            benign[name] = Benign(mean.float(), max(math.sqrt(sigma2), min_sigma),
                                  max(math.sqrt(max(tau2, 0.0)), min_tau), k)
        return cls(benign)

    def for_dtype(self, dtype: torch.dtype | str) -> Benign:
        try:
            return self.benign[dtype_name(dtype)]
        except KeyError:
            raise ValueError(f"no benign calibration for {dtype_name(dtype)}: "
                             f"calibrated {', '.join(self.benign)}") from None


@dataclass(frozen=True)
class CanaryVerdict:
    """The test of one peer after m canaries, with what a reader needs to check it."""

    tampered: bool
    log10_p: float  # p-value of "this peer drifts like an honest peer of its dtype"
    log10_alpha: float
    z_mean: float  # the mean residual in units of its honest sd
    z_max: float  # the largest single residual, likewise
    canaries: tuple[int, ...]
    scores: tuple[float, ...]

    @property
    def m(self) -> int:
        return len(self.canaries)


def decide(benign: Benign, observations: Sequence[tuple[int, float]], alpha: float = ALPHA) -> CanaryVerdict:
    """One-sided test of a peer's canary scores [(canary index, score)] against benign drift.

    Two tests, each at half the budget: the mean residual (weak tampering on every request)
    and the largest one (strong tampering on a few; a union bound, valid however the
    residuals are correlated).
    """
    if not observations:
        raise ValueError("no canary scores to decide on")
    idx, scores = zip(*observations)
    r = [benign.residual(i, s) for i, s in observations]
    m = len(r)
    z_mean, z_max = sum(r) / m / benign.sd(m), max(r) / benign.sd(1)
    log10_p = min(0.0, combined_log10_p(z_mean, z_max, m))
    log10_alpha = math.log10(alpha)
    return CanaryVerdict(log10_p < log10_alpha, log10_p, log10_alpha, z_mean, z_max,
                         tuple(idx), tuple(scores))


class CanaryMonitor:
    """One peer's canaries as they come back; tests after each with alpha spent over the looks.

    Look k uses alpha * 6 / (pi^2 k^2), which sums to alpha over an unbounded run, so testing
    after every canary does not raise the false-positive rate above the budget.
    """

    def __init__(self, benign: Benign, alpha: float = ALPHA):
        self.benign, self.alpha = benign, alpha
        self.observations: list[tuple[int, float]] = []

    def observe(self, index: int, canary: Canary, out: Tensor) -> CanaryVerdict:
        """Score the peer's reply to canary `index` and test everything seen so far."""
        return self.add(index, score(out, canary))

    def add(self, index: int, canary_score: float) -> CanaryVerdict:
        self.observations.append((index, canary_score))
        k = len(self.observations)
        return decide(self.benign, self.observations, self.alpha * 6 / (math.pi ** 2 * k * k))


def log10_sf(z: float) -> float:
    """log10 P(N(0,1) > z), accurate far into the tail (p-values of 1e-300 and beyond)."""
    if z < 30:
        return math.log10(max(0.5 * math.erfc(z / math.sqrt(2)), 1e-300))
    ln = -z * z / 2 - math.log(z * math.sqrt(2 * math.pi)) + math.log1p(-1 / (z * z))
    return ln / math.log(10)


def combined_log10_p(z_mean: float, z_max: float, m: int) -> float:
    """log10 of the Bonferroni p-value of both tests, not capped at 1 (so it still ranks peers)."""
    return math.log10(2) + min(log10_sf(z_mean), _log10_any_of(m, log10_sf(z_max)))


def _log10_any_of(m: int, log10_q: float) -> float:
    """log10 of 1 - (1 - q)^m: the chance that the largest of m null z-scores is this large."""
    if log10_q < -12:
        return math.log10(m) + log10_q
    return math.log10(-math.expm1(m * math.log1p(-10 ** log10_q)))
