"""Rotary position embeddings: the inverse frequencies of each RoPE variant, and their tables.

The frequencies follow transformers' `modeling_rope_utils` formula for formula (fp32, same
operation order), so that a model with `llama3`, `yarn` or `linear` scaling computes what its
reference does. `dynamic` (NTK) and `longrope` recompute their frequencies from the length of
the sequence seen so far: a KV cache shared by decode steps, speculative trees and failover
replays cannot follow that (a replayed chunk would rotate its keys by other frequencies than
the steps that first computed them). Both are exactly the static table below their switch point
(`context_limit`), so they run up to it and a position past it is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffuse.errors import ModelError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A `rope_scaling` / `rope_parameters` entry, validated for its type."""

    type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    attention_factor: float | None = None  # yarn, longrope
    short_factor: tuple[float, ...] = field(default=())  # longrope
    long_factor: tuple[float, ...] = field(default=())  # longrope

    # Keys a rope dict may carry that change nothing here (theta and the rotary fraction are read
    # by the config itself).
    _IGNORED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
    _KEYS = {
        "default": (),
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim", "truncate", "attention_factor"),
        "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor",
                     "long_factor"),
    }

    @classmethod
    def parse(cls, d: dict | None, max_positions: int, original: int | None = None) -> "RopeScaling":
        """From an HF rope dict; `original` is a top-level original_max_position_embeddings (Phi-3)."""
        d = dict(d or {})
        kind = d.get("rope_type", d.get("type", "default"))
        if kind not in cls._KEYS:
            raise ModelError(f"RoPE type {kind!r} is not supported (Diffuse runs {', '.join(ROPE_TYPES)})")
        unknown = sorted(set(d) - set(cls._IGNORED) - set(cls._KEYS[kind]))
        if unknown:
            raise ModelError(f"RoPE {kind!r} setting(s) {', '.join(unknown)} are not supported")
        try:
            kw: dict = {k: d[k] for k in cls._KEYS[kind] if d.get(k) is not None}
            for k, v in kw.items():
                kw[k] = tuple(float(x) for x in v) if k in ("short_factor", "long_factor") \
                    else bool(v) if k == "truncate" else float(v)
            if kind in ("llama3", "yarn", "longrope"):
                kw["original_max_position_embeddings"] = int(
                    original or kw.get("original_max_position_embeddings") or max_positions)
            if kind in ("linear", "dynamic", "llama3") and "factor" not in kw:
                raise ModelError(f"RoPE {kind!r} needs a factor")
            if kind == "longrope" and not (kw.get("short_factor") and kw.get("long_factor")):
                raise ModelError("RoPE 'longrope' needs short_factor and long_factor")
            return cls(type=kind, **kw)
        except (TypeError, ValueError) as e:
            raise ModelError(f"bad RoPE settings {d!r}: {e}") from None

    def to_hf(self) -> dict:
        out: dict = {"rope_type": self.type}
        for k in self._KEYS[self.type]:
            v = getattr(self, k)
            if isinstance(v, tuple):
                if v:
                    out[k] = list(v)
            elif v is not None:
                out[k] = v
        return out

    def describe(self) -> str:
        """One line for `diffuse model info`."""
        if self.type == "default":
            return "default"
        detail = {"factor": self.factor, "original": self.original_max_position_embeddings}
        return f"{self.type} (" + ", ".join(f"{k} {v:g}" for k, v in detail.items() if v is not None) + ")"


def context_limit(scaling: RopeScaling, max_positions: int) -> int | None:
    """First position a static table cannot serve for this variant (None: no such limit)."""
    if scaling.type == "dynamic":
        return max_positions
    if scaling.type == "longrope":
        return scaling.original_max_position_embeddings
    return None


def inv_freq(theta: float, dim: int, scaling: RopeScaling, max_positions: int) -> tuple[Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32, on the CPU even while modules are built on the meta
    device) for `dim` rotary dims, and the factor on cos/sin."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    base = 1.0 / (theta ** exponents)
    kind = scaling.type
    if kind in ("default", "dynamic"):
        return base, 1.0
    if kind == "linear":
        return base / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, scaling, max_positions)
    return _longrope_short(theta, dim, scaling, max_positions)


def _llama3(inv: Tensor, s: RopeScaling) -> Tensor:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling, max_positions: int) -> tuple[Tensor, float]:
    old = s.original_max_position_embeddings
    factor = s.factor if s.factor is not None else max_positions / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: avoids a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope_short(theta: float, dim: int, s: RopeScaling, max_positions: int) -> tuple[Tensor, float]:
    """The short-factor table, which the reference uses while the sequence fits the original length."""
    old = s.original_max_position_embeddings
    factor = s.factor if s.factor is not None else max_positions / old
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    if len(s.short_factor) != dim // 2:
        raise ModelError(f"longrope short_factor has {len(s.short_factor)} entries, the rotary dims need {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32, device="cpu") * theta ** shape), float(attention)


def tables(positions: Tensor, inv: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 2 * len(inv)] at `positions` in `dtype`.

    Computed in fp64 and rounded once, so the same position gets the same bits whatever the number
    of positions beside it (torch may vectorise fp32 cos by size).
    """
    freqs = positions.to(inv.device, torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1).double()
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] dims of x [..., T, D] (half-split layout); the rest pass."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
