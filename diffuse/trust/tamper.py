"""FOR TESTING ONLY: ways a dishonest serving peer corrupts what it computes.

Nothing in the client or in an honest server imports this module. It exists so the detectors
(canaries, spot checks) can be measured against concrete attacks, in-process
(scripts/eval_integrity.py, tests/test_trust.py) and in a live swarm (`diffuse join --tamper
KIND --tamper-rate P`, which should wrap the served span with `Tamper(...).wrap(span)`).

Kinds and what `strength` means for each:

| kind      | acts on     | strength                                                        |
|-----------|-------------|-----------------------------------------------------------------|
| noise     | activations | SNR in dB of added Gaussian noise, per token (20 = 10% RMS)     |
| scale     | activations | factor applied to SCALED_DIMS fixed hidden dimensions           |
| signflip  | activations | number of fixed hidden dimensions whose sign is flipped         |
| zero      | activations | fraction of output elements zeroed (fresh positions each time)  |
| replay    | activations | lag: the output of the request this many requests back is sent  |
| skip      | weights     | number of blocks of the span skipped (made identities)          |
| quant     | weights     | bits of symmetric per-row integer fake quantisation (8 = int8)  |
| minifloat | weights     | mantissa bits kept, exponent untouched (3 ~ fp8 e4m3, 2 ~ e5m2) |
| lowrank   | weights     | Frobenius norm of a rank-LOWRANK_RANK edit of one block's       |
|           |             | down projection, relative to that weight's norm                 |
| forward   | forwarding  | SNR in dB of noise added only to what a chained hop forwards to |
|           |             | the next peer, its copy to the client left honest (altered_forward) |

`rate` is the fraction of requests tampered with, drawn per request from `seed`, so a run is
reproducible. The fixed dimensions / blocks / edit directions are drawn from `seed` too: a real
cheat would keep one manipulation, not a fresh one per request. With `after` = N, a request that
starts below position N is served honestly (a session's prefill among them): a cheat that passes
every canary shorter than N tokens and tampers only with the later steps of real sessions.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffuse.model.engine import BlockSpan, KVCache, SpanStep
from diffuse.model.quant import pack, quantize

ACTIVATION_KINDS = ("noise", "scale", "signflip", "zero", "replay")
WEIGHT_KINDS = ("skip", "quant", "minifloat", "lowrank")
KINDS = ACTIVATION_KINDS + WEIGHT_KINDS
# A strength that is detectable but not absurd, per kind: what `KIND` alone means on the CLI.
DEFAULT_STRENGTH = {"noise": 20.0, "scale": 8.0, "signflip": 8.0, "zero": 0.1, "replay": 1.0,
                    "skip": 1.0, "quant": 4.0, "minifloat": 2.0, "lowrank": 0.1}
SCALED_DIMS = 4
LOWRANK_RANK = 4


FORWARD_KIND = "forward"  # not a Tamper: the data plane's forwarding takes it (altered_forward)


def altered_forward(snr_db: float, seed: int = 0):
    """What a chained hop forwards instead of its output: the output plus Gaussian noise at
    `snr_db`, while the copy it sends the client (and commits to) stays honest."""
    gen = torch.Generator().manual_seed(seed)

    def alter(out: Tensor) -> Tensor:
        x = out.float()
        rms = x.pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(x.shape, generator=gen) * rms * 10 ** (-snr_db / 20)
        return (x + noise).to(out.dtype)

    return alter


def parse_spec(text: str) -> tuple[str, float]:
    """`KIND[:STRENGTH]` -> (kind, strength); ValueError naming what is wrong."""
    kind, _, strength = text.partition(":")
    if kind == FORWARD_KIND:
        return kind, float(strength) if strength else 20.0
    if kind not in KINDS:
        raise ValueError(f"unknown tamper kind {kind!r}: choose one of {', '.join(KINDS + (FORWARD_KIND,))}")
    try:
        return kind, float(strength) if strength else DEFAULT_STRENGTH[kind]
    except ValueError:
        raise ValueError(f"tamper strength must be a number, not {strength!r}") from None


@dataclass
class Tamper:
    kind: str
    strength: float
    rate: float = 1.0
    seed: int = 0
    after: int = 0
    _draws: random.Random = field(init=False, repr=False)
    _gen: torch.Generator = field(init=False, repr=False)
    _past: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown tamper kind {self.kind!r}: choose one of {', '.join(KINDS)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("tamper rate must be in [0, 1]")
        self._draws = random.Random(self.seed)
        self._gen = torch.Generator().manual_seed(self.seed)
        if self.kind == "replay" and self.strength < 1:
            raise ValueError("replay strength is a lag of at least 1 request")
        self._past = deque(maxlen=int(self.strength) if self.kind == "replay" else 1)

    @property
    def on_weights(self) -> bool:
        return self.kind in WEIGHT_KINDS

    def hits(self, positions: Tensor) -> bool:
        """Draw whether the next request (at `positions`) is tampered with."""
        if positions.numel() and int(positions.min()) < self.after:
            return False
        return self._draws.random() < self.rate

    def observe(self, out: Tensor) -> Tensor:
        """Note an untampered reply (a replayer keeps them to replay later); returns it unchanged."""
        if self.kind == "replay":
            self._past.append(out)
        return out

    def _dims(self, hidden: int, n: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed + 1)
        return torch.randperm(hidden, generator=g)[:n]

    def apply_output(self, out: Tensor) -> Tensor:
        """The tampered version of one request's output [B, T, H] (activation kinds)."""
        k, s = self.kind, self.strength
        if k == "noise":
            rms = out.float().pow(2).mean(-1, keepdim=True).sqrt()
            noise = torch.randn(out.shape, generator=self._gen).to(out.device) * rms * 10 ** (-s / 20)
            return (out.float() + noise).to(out.dtype)
        if k in ("scale", "signflip"):
            dims = self._dims(out.shape[-1], SCALED_DIMS if k == "scale" else int(s))
            res = out.clone()
            res[..., dims.to(out.device)] *= s if k == "scale" else -1
            return res
        if k == "zero":
            keep = (torch.rand(out.shape, generator=self._gen) >= s).to(out.device)
            return out * keep.to(out.dtype)
        if k == "replay":
            old = self._past[0] if len(self._past) == self._past.maxlen else None
            self._past.append(out)
            return out if old is None else _fit(old, out.shape)
        raise ValueError(f"{k} tampers with weights: use apply_weights")

    def apply_weights(self, span: BlockSpan) -> BlockSpan:
        """Tamper with the span's weights in place (weight kinds) and return it."""
        k, s = self.kind, self.strength
        g = torch.Generator().manual_seed(self.seed + 2)
        with torch.no_grad():
            if k == "skip":
                for i in torch.randperm(len(span.blocks), generator=g)[:int(s)].tolist():
                    for w in _outputs(span.blocks[i]):  # residual + 0: the block is an identity
                        w.zero_()
            elif k in ("quant", "minifloat"):
                if k == "quant":
                    _fewer_bits(span, int(s))
                for block in span.blocks:
                    for w in block.parameters():
                        if w.dim() >= 2:  # every matrix (experts included), not the norms
                            w.copy_(_quantise(w.float(), int(s)) if k == "quant" else _minifloat(w.float(), int(s)))
            elif k == "lowrank":
                w = _outputs(span.blocks[int(torch.randint(len(span.blocks), (1,), generator=g))])[-1]
                w = w if w.dim() == 2 else w[0]  # a mixture's first expert
                u = torch.randn(w.shape[0], LOWRANK_RANK, generator=g)
                v = torch.randn(LOWRANK_RANK, w.shape[1], generator=g)
                edit = u @ v
                w.add_((edit * (s * w.float().norm().item() / edit.norm())).to(w.device, w.dtype))
            else:
                raise ValueError(f"{k} tampers with activations: use apply_output")
        return span

    def wrap(self, span: BlockSpan) -> "TamperedSpan":
        """A drop-in replacement for `span` that tampers with a fraction `rate` of requests."""
        tampered = None
        if self.on_weights:
            tampered = self.apply_weights(span if self.rate >= 1.0 else copy.deepcopy(span))
        return TamperedSpan(self, span, tampered)


def _fewer_bits(span: BlockSpan, bits: int) -> None:
    """A quantized span's weights requantized to int4 (bits <= 4) or int8: a peer holding
    fewer bits than the variant it announces."""
    scheme = "int4" if bits <= 4 else "int8"
    for block in span.blocks:
        for m in block.modules():
            if getattr(m, "packed", None) is not None:
                m.packed = pack(quantize(m.packed.canonical().dequantize(), scheme), m.weight.dtype, m.weight.device)


def _outputs(block: torch.nn.Module) -> list[Tensor]:
    """The weights that write into the residual stream: attention's output, the MLP's (or experts') down."""
    return [w for name, w in block.named_parameters() if name in ("wo.weight", "w_down.weight", "w_down_experts")]


def _fit(old: Tensor, shape: torch.Size) -> Tensor:
    """An earlier output's token rows, cycled to the requested [B, T, H] shape."""
    rows = old.reshape(-1, old.shape[-1])
    n = shape[0] * shape[1]
    idx = torch.arange(n) % rows.shape[0]
    return rows[idx].reshape(shape).clone()


def _quantise(w: Tensor, bits: int) -> Tensor:
    levels = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / levels
    return (w / scale).round().clamp(-levels, levels) * scale


def _minifloat(w: Tensor, mantissa_bits: int) -> Tensor:
    m, e = torch.frexp(w)  # w = m * 2**e, |m| in [0.5, 1)
    step = 2.0 ** (mantissa_bits + 1)
    return torch.ldexp((m * step).round() / step, e)


class TamperedSpan:
    """Quacks like a BlockSpan for BlockServer: same call, view, new_cache, blocks and bounds."""

    def __init__(self, tamper: Tamper, honest: BlockSpan, tampered: BlockSpan | None):
        self.tamper, self.honest, self.tampered = tamper, honest, tampered
        self.cfg, self.start, self.end, self.blocks = honest.cfg, honest.start, honest.end, honest.blocks
        self.quant = honest.quant  # it declares the variant it announces, as an honest peer of it does

    def view(self, start: int, end: int) -> "TamperedSpan":
        t = self.tampered
        return TamperedSpan(self.tamper, self.honest.view(start, end),
                            None if t is None else t.view(start, end))

    def new_cache(self, max_len: int, batch: int = 1, exact: bool = False) -> KVCache:
        return self.honest.new_cache(max_len, batch, exact)

    def forward_batch(self, steps: Sequence[SpanStep]) -> list[Tensor]:
        """Each session's step on its own: a cheat need not batch."""
        return [self(st.h, st.positions, st.cache, st.tree_mask, st.commit) for st in steps]

    def __call__(self, h: Tensor, positions: Tensor, cache: KVCache, tree_mask: Tensor | None = None,
                 commit: bool = True) -> Tensor:
        hit = self.tamper.hits(positions)
        span = self.tampered if hit and self.tampered is not None else self.honest
        out = span(h, positions, cache, tree_mask, commit)
        if hit and not self.tamper.on_weights:
            return self.tamper.apply_output(out)
        return self.tamper.observe(out)
