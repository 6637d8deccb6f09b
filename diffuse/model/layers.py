"""The pieces every family's decoder block is built from: norms, projections, attention, MLP.

A block keeps its weights as flat attributes with the same names in every family (`attn_norm`,
`wqkv`, `wo`, `mlp_norm`, `w_gate_up`, `w_down`): the data and trust planes read them. q/k/v and
gate/up are fused into one matmul each (on a CPU decoding one token, the number of kernel
launches, not FLOPs, sets the speed). A block takes the rows of one or several sessions at once
(`Segment`s of one flat input): the norms, projections, rotations and the MLP run over all rows
together, while each session's rows are cached and attend to its own keys (selective batching, as
Orca does). Short steps of sessions whose caches are slots of one slab (`Together`) write and
attend with one call per layer for all of them, not one per session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffuse.errors import ModelError
from diffuse.model import rope
from diffuse.model.config import ModelConfig
from diffuse.model import quant
from diffuse.model.kernels import Linear, exact_attention
from diffuse.model.quant import QWeight

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, cast, then scale (the reference's order, for bf16 parity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True)
class Segment:
    """One session's rows of a block's flat input [1, N, H]: `rows` of them, `batch` x `tokens`,
    its layer's cache, the slot its tokens go to, and which cached keys they see."""

    rows: slice
    batch: int
    tokens: int
    k_cache: Tensor
    v_cache: Tensor
    start: int
    seen: "Visible"


@dataclass(frozen=True)
class Together:
    """Steps of up to T tokens of sessions whose caches are slots of one slab (`rows`: theirs,
    one session after another): their layer's keys and values for the slab's slots [first, first
    + R) as k, v [R, KV, cap, D]; for each row, its session's place in that range (`places`) and
    the cache slot its token goes to (`cols`); `at`: each row's place among the R x T query rows
    (None: the rows are all of them, one token per slot); `mask` [R, 1, G x T, end] for the G query
    heads of a key head by T tokens (True = may attend; a padded row sees its key 0)."""

    rows: slice
    k: Tensor
    v: Tensor
    places: Tensor
    cols: Tensor
    at: Tensor | None
    tokens: int
    mask: Tensor
    end: int


@dataclass(frozen=True)
class Rows:
    """What a block needs of a batch: the rotary tables of all its rows (cos, sin [N, 1, rot])
    and its parts, in row order."""

    rot: tuple[Tensor, Tensor]
    parts: list[Segment | Together]


@dataclass(frozen=True)
class Visible:
    """Which cached keys the T new tokens of a step see: slots [lo, start + T) and `allow`
    [T, start + T - lo] (True = may attend); allow None means all of them, or causal if `causal`."""

    lo: int
    allow: Tensor | None
    causal: bool


def visible(start: int, positions: Tensor, tree_mask: Tensor | None, window: int | None, exact: bool,
            device: torch.device) -> Visible:
    """The keys a step sees: committed slots [0, start) hold positions 0..start-1, the new tokens
    sit at `positions` and see each other as `tree_mask` says (None: causally). With a sliding
    window a query at position p sees keys at p - window < k <= p, as transformers masks them;
    slots no query can see are cut off (`lo`), the rest masked."""
    t = positions.numel()
    pos = positions.cpu()
    lo = 0 if window is None else min(start, max(0, int(pos.min()) - window + 1))
    new = tree_mask.bool().cpu() if tree_mask is not None else torch.ones(t, t, dtype=torch.bool).tril_()
    allow = torch.cat([torch.ones(t, start - lo, dtype=torch.bool), new], dim=1)
    needed = tree_mask is not None or (start > 0 and t > 1) or (exact and t > 1)
    if window is not None:
        keys = torch.cat([torch.arange(lo, start), pos])
        inside = pos[:, None] - keys[None, :] < window
        if not bool(inside.all()):
            allow, needed = allow & inside, True
    if not needed:
        return Visible(lo, None, causal=t > 1)
    return Visible(lo, allow.to(device), causal=False)


def stacks_one_query(q: Tensor, k: Tensor) -> bool:
    """Whether one-query attention stacks a key head's query heads as rows (see `attention`):
    grouped heads in half precision on a CPU. fp32 keeps SDPA's GQA path (as fast there), so its
    bits are what they were."""
    return q.device.type == "cpu" and q.dtype != torch.float32 and k.shape[1] != q.shape[1]


def attention(q: Tensor, k: Tensor, v: Tensor, seen: Visible, scale: float, softcap: float | None,
              exact: bool) -> Tensor:
    """softmax(scale * q k^T (soft-capped), masked) v for q [B, H, T, D], k, v [B, KV, L, D]."""
    if exact:
        return exact_attention(q, k, v, seen.allow, scale, softcap)
    if softcap is None and q.shape[2] == 1 and seen.allow is None and stacks_one_query(q, k):
        # One query per sequence in half precision on a CPU: SDPA's GQA path there is the math
        # kernel with keys and values copied per query head (much slower in bf16, the default
        # dtype; scripts/bench_decode_attention.py, figures: docs/figures.md); a key head's query
        # heads as its rows are not.
        b, h, _, d = q.shape
        return F.scaled_dot_product_attention(q.reshape(b, k.shape[1], -1, d), k, v, scale=scale).view(b, h, 1, d)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen.allow, is_causal=seen.causal,
                                              scale=scale, enable_gqa=True)
    # SDPA cannot soft-cap scores: the reference's eager attention, query heads of a key head stacked.
    b, h, t, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    g = h // kv
    scores = (q.reshape(b, kv, g * t, d) @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    allow = seen.allow
    if allow is None and seen.causal:
        allow = torch.ones(t, length, dtype=torch.bool, device=q.device).tril_(length - t)
    if allow is not None:
        scores.view(b, kv, g, t, length).masked_fill_(~allow, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).view(b, kv, g, t, -1).reshape(b, h, t, -1)


class DecoderBlock(nn.Module):
    """A pre-norm block, the Llama shape: h = x + attn(norm(x)); out = h + mlp(norm(h)).

    Subclasses (one per family) say how HF checkpoint tensors map onto it (`load_hf`), and may
    change the norm (`Norm`), the residual wiring (`forward`) or the MLP (`mlp`).
    """

    Norm: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.rope_key = cfg.rope(layer)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.attn_norm = self.Norm(h, cfg.rms_norm_eps)
        self.wqkv = Linear(h, q + 2 * cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.q_norm = self.Norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = self.Norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.wo = Linear(q, h, bias=cfg.o_proj_bias)
        self.mlp_norm = self.Norm(h, cfg.rms_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]
        if not cfg.is_moe(layer):
            self.w_gate_up = Linear(h, 2 * cfg.intermediate_size, bias=False)
            self.w_down = Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: Tensor, rows: Rows, exact: bool = False) -> Tensor:
        h = x + self.attend(x, rows, exact)
        return h + self.mlp(self.mlp_norm(h), exact)

    def attend(self, x: Tensor, rows: Rows, exact: bool) -> Tensor:
        """The attention sub-block's output for x [1, N, H]: q/k/v, their norms and rotations and
        the output projection over all rows (elementwise or per row: each row's bits as alone),
        then each segment's keys and values into its own cache slots [start, start+T)."""
        n = x.shape[1]
        qkv = self.wqkv(self.attn_norm(x), exact)[0]
        q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q, k, v = q.view(n, self.n_heads, self.hd), k.view(n, self.n_kv, self.hd), v.view(n, self.n_kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rows.rot
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        ys = [self._attend_one(q[p.rows], k[p.rows], v[p.rows], p, exact) if isinstance(p, Segment)
              else self._attend_together(q[p.rows], k[p.rows], v[p.rows], p) for p in rows.parts]
        return self.wo((ys[0] if len(ys) == 1 else torch.cat(ys))[None], exact)

    def _attend_one(self, q: Tensor, k: Tensor, v: Tensor, s: Segment, exact: bool) -> Tensor:
        """One session's attention output [B*T, heads*D] from its rotated rows [B*T, heads, D]."""
        b, t = s.batch, s.tokens
        q, k, v = (y.view(b, t, -1, self.hd).transpose(1, 2) for y in (q, k, v))
        end = s.start + t
        s.k_cache[:, :, s.start:end] = k
        s.v_cache[:, :, s.start:end] = v
        y = attention(q, s.k_cache[:, :, s.seen.lo:end], s.v_cache[:, :, s.seen.lo:end], s.seen, self.scale,
                      self.softcap, exact)
        return y.transpose(1, 2).reshape(b * t, -1)

    def _attend_together(self, q: Tensor, k: Tensor, v: Tensor, s: Together) -> Tensor:
        """Several sessions' attention outputs [N, heads*D] from their rows [N, heads, D]: the new
        keys and values written into their slots and every query attended in one call, the query
        heads of a key head stacked as its query rows."""
        r, t = s.k.shape[0], s.tokens
        s.k[s.places, :, s.cols] = k
        s.v[s.places, :, s.cols] = v
        if s.at is not None:  # [R x T, heads, D], padded
            q = q.new_zeros(r * t, *q.shape[1:]).index_copy_(0, s.at, q)
        q = q.view(r, t, self.n_kv, -1, self.hd).permute(0, 2, 3, 1, 4).reshape(r, self.n_kv, -1, self.hd)
        y = F.scaled_dot_product_attention(q, s.k[:, :, :s.end], s.v[:, :, :s.end], attn_mask=s.mask,
                                           scale=self.scale)
        y = y.view(r, self.n_kv, -1, t, self.hd).permute(0, 3, 1, 2, 4).reshape(r * t, -1)
        return y if s.at is None else y[s.at]

    def mlp(self, x: Tensor, exact: bool) -> Tensor:
        gate, up = self.w_gate_up(x, exact).chunk(2, dim=-1)
        return self.w_down(self.act(gate) * up, exact)

    def norms(self) -> list[nn.Module]:
        """Norms over the hidden dimension (see `permute_`)."""
        return [self.attn_norm, self.mlp_norm]

    @torch.no_grad()
    def permute_(self, hidden: Tensor, inner: Tensor) -> None:
        """Reorder the hidden dimension by `hidden` and the MLP's inner one by `inner`, in place: the
        same function of permuted inputs, every sum taken in another order (trust's canaries model
        another machine's kernels this way)."""
        for norm in self.norms():
            norm.weight.copy_(norm.weight[hidden])
        reindex_(self.wqkv, cols=hidden)
        reindex_(self.wo, rows=hidden)
        if self.wo.bias is not None:
            self.wo.bias.copy_(self.wo.bias[hidden])
        self.permute_mlp_(hidden, inner)

    def permute_mlp_(self, hidden: Tensor, inner: Tensor) -> None:
        reindex_(self.w_gate_up, rows=torch.cat([inner, inner + self.w_down.in_features]), cols=hidden)
        reindex_(self.w_down, rows=hidden, cols=inner)

    def load_hf(self, tensors: dict[str, Tensor]) -> None:
        """Take the block's HF tensors (names relative to the block) into the fused layout."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its checkpoint is laid out")

    def load_attention_hf(self, w: "Weights") -> None:
        """self_attn.{q,k,v,o}_proj (with their biases and q/k norms): the layout most families share."""
        a = "self_attn."
        fill_(self.wqkv, cat_rows([w.take(f"{a}{p}_proj.weight") for p in "qkv"]), a + "qkv weights")
        if self.wqkv.bias is not None:
            copy_(self.wqkv.bias, torch.cat([w.take(f"{a}{p}_proj.bias") for p in "qkv"]), a + "qkv biases")
        fill_(self.wo, w.take(a + "o_proj.weight"), a + "o_proj.weight")
        if self.wo.bias is not None:
            copy_(self.wo.bias, w.take(a + "o_proj.bias"), a + "o_proj.bias")
        if self.q_norm is not None:
            copy_(self.q_norm.weight, w.take(a + "q_norm.weight"), a + "q_norm.weight")
            copy_(self.k_norm.weight, w.take(a + "k_norm.weight"), a + "k_norm.weight")

    def load_mlp_hf(self, w: "Weights", prefix: str = "mlp.") -> None:
        gate, up = w.take(prefix + "gate_proj.weight"), w.take(prefix + "up_proj.weight")
        fill_(self.w_gate_up, cat_rows([gate, up]), prefix + "gate/up_proj.weight")
        fill_(self.w_down, w.take(prefix + "down_proj.weight"), prefix + "down_proj.weight")


class Weights:
    """A block's HF tensors, taken by name: a missing one, or one left over that the engine would
    ignore (a bias it does not add, a tensor of a feature it does not run), is a ModelError."""

    IGNORED = ("self_attn.rotary_emb.inv_freq",)  # a cached buffer older checkpoints saved

    def __init__(self, tensors: dict[str, Tensor], where: str):
        self.left = {k: v for k, v in tensors.items() if k not in self.IGNORED}
        self.where = where

    def take(self, name: str) -> Tensor:
        if name not in self.left:
            raise ModelError(f"{self.where} lacks tensor {name}")
        return self.left.pop(name)

    def done(self) -> None:
        if self.left:
            raise ModelError(f"{self.where} has tensors the engine does not use: {', '.join(sorted(self.left))}")


def copy_(param: Tensor | None, value: Tensor, name: str) -> None:
    """param <- value, refusing a shape mismatch with the tensor's name (a wrong config shows here)."""
    if param is None or tuple(param.shape) != tuple(value.shape):
        want = None if param is None else tuple(param.shape)
        raise ModelError(f"tensor {name} has shape {tuple(value.shape)}, the config implies {want}")
    param.copy_(value)


def cat_rows(parts: list) -> Tensor | QWeight:
    """Weights stacked by rows into a fused one: tensors, or quantized weights (model/quant.py)."""
    return quant.cat(parts) if isinstance(parts[0], QWeight) else torch.cat(parts)


def reindex_(linear: Linear, rows: Tensor | None = None, cols: Tensor | None = None) -> None:
    """linear's weight with its rows and columns reordered, in place (a quantized one repacked)."""
    if linear.packed is not None:
        linear.packed = linear.packed.reindexed(rows, cols)
        return
    w = linear.weight
    w.copy_(w[rows if rows is not None else slice(None)][:, cols if cols is not None else slice(None)])


def widen_(module: nn.Module) -> nn.Module:
    """Every quantized weight of `module` made a float one of its dtype holding the canonical
    values dequantized: the same numbers, computed by the float kernels. For fp32 recomputation
    (a referee): torch's int kernels take fp32 activations on a slow reference path only."""
    for m in module.modules():
        if isinstance(m, Linear) and m.packed is not None:
            w = m.weight
            m.weight = nn.Parameter(m.packed.canonical().dequantize(w.dtype).to(w.device), requires_grad=False)
            m.packed = None
    return module


def fill_(linear: Linear, value: Tensor | QWeight, name: str) -> None:
    """linear's weight <- value; a quantized one is packed for the weight's device and dtype,
    and the float weight left empty (it keeps telling the dtype and device the span computes in)."""
    if not isinstance(value, QWeight):
        copy_(linear.weight, value, name)
        return
    if value.shape != tuple(linear.weight.shape):
        raise ModelError(f"tensor {name} has shape {value.shape}, the config implies {tuple(linear.weight.shape)}")
    w = linear.weight
    linear.packed = quant.pack(value, w.dtype, w.device)
    linear.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)


@dataclass(frozen=True)
class Family:
    """What the engine builds for one model family: its block, the head's norm, and the factor its
    embeddings are multiplied by (None: none)."""

    block: type[DecoderBlock]
    norm: type[nn.Module]
    embed_scale: Callable[[ModelConfig], float] | None = None
