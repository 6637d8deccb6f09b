"""Llama-family decoder blocks (Llama, Mistral, Qwen2) in plain PyTorch.

One file, gpt-fast style: a static KV cache indexed by explicit positions, so that a peer can run
any contiguous slice of blocks on hidden states that arrive from elsewhere, and so that a step can
carry several candidate tokens (a tree with a caller-supplied mask) whose accepted entries are
committed and the rest discarded. q/k/v and gate/up projections are fused into one matmul each:
on a CPU decoding one token, the number of kernel launches, not FLOPs, sets the speed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffuse.model.config import ModelConfig
from diffuse.model.kernels import Linear, exact_attention


class KVCache:
    """Keys and values of one session for one span of blocks.

    Slots [0, length) hold committed tokens, slot i holding position i. A forward with
    commit=False leaves its T tokens pending in slots [length, length+T) until `commit(keep)`
    moves the accepted ones into place (or `rollback` drops them).
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", exact: bool = False):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.exact = exact  # batch-invariant kernels for this session (kernels.exact_linear)
        self.length = 0
        self.pending = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def commit(self, keep: Sequence[int] | None = None) -> None:
        """Commit the pending tokens listed in `keep` (increasing indices); None keeps all."""
        if keep is None:
            self.length, self.pending = self.length + self.pending, 0
            return
        keep = list(keep)
        if any(not 0 <= j < self.pending for j in keep) or keep != sorted(set(keep)):
            raise ValueError(f"keep {keep} must be increasing indices below {self.pending}")
        n, base = len(keep), self.length
        if keep != list(range(n)):
            src = torch.tensor(keep, device=self.k.device) + base
            self.k[:, :, :, base:base + n] = self.k[:, :, :, src]
            self.v[:, :, :, base:base + n] = self.v[:, :, :, src]
        self.length, self.pending = base + n, 0

    def rollback(self, length: int) -> None:
        """Forget pending tokens and every committed token at position >= length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} tokens are committed")
        self.length, self.pending = length, 0

    def wipe(self) -> None:
        """Zero the memory: activations of a private session must not outlive it."""
        self.k.zero_()
        self.v.zero_()
        self.length = self.pending = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Same op order as the reference (normalise in fp32, cast, then scale) for bf16 parity.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = Linear(cfg.hidden_size, qkv, bias=cfg.attention_bias)
        self.wo = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def load_hf(self, t: dict[str, Tensor]) -> None:
        """Take HF tensor names (relative to the block) into the fused layout."""
        a, m = "self_attn.", "mlp."
        with torch.no_grad():
            self.attn_norm.weight.copy_(t["input_layernorm.weight"])
            self.wqkv.weight.copy_(torch.cat([t[a + f"{p}_proj.weight"] for p in "qkv"]))
            if self.wqkv.bias is not None:
                self.wqkv.bias.copy_(torch.cat([t[a + f"{p}_proj.bias"] for p in "qkv"]))
            self.wo.weight.copy_(t[a + "o_proj.weight"])
            self.mlp_norm.weight.copy_(t["post_attention_layernorm.weight"])
            self.w_gate_up.weight.copy_(torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]]))
            self.w_down.weight.copy_(t[m + "down_proj.weight"])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                start: int, mask: Tensor | None, exact: bool = False) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x), exact).split(
            [self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = _rope(q.view(b, t, self.n_heads, self.hd).transpose(1, 2), cos, sin)
        k = _rope(k.view(b, t, self.n_kv, self.hd).transpose(1, 2), cos, sin)
        k_cache[:, :, start:start + t] = k
        v_cache[:, :, start:start + t] = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        end = start + t
        if exact:
            y = exact_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], mask)
        else:
            causal = mask is None and start == 0 and t > 1
            y = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end],
                                               attn_mask=mask, is_causal=causal, enable_gqa=True)
        h = x + self.wo(y.transpose(1, 2).reshape(b, t, -1), exact)
        gate, up = self.w_gate_up(self.mlp_norm(h), exact).chunk(2, dim=-1)
        return h + self.w_down(F.silu(gate) * up, exact)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model: hidden states in, hidden states out."""

    def __init__(self, cfg: ModelConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"block span [{start}, {end}) is outside the model's {cfg.num_layers} blocks")
        self.cfg, self.start, self.end = cfg, start, end
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(start, end))
        # A plain attribute, not a buffer: it must stay fp32 when the blocks are cast to bf16.
        self.inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device="cpu") / cfg.head_dim)

    def view(self, start: int, end: int) -> "BlockSpan":
        """Blocks [start, end) of this span, sharing its weights: a peer may serve a sub-range."""
        if not self.start <= start < end <= self.end:
            raise ValueError(f"blocks [{start}, {end}) are not within [{self.start}, {self.end})")
        sub = BlockSpan.__new__(BlockSpan)
        nn.Module.__init__(sub)
        sub.cfg, sub.start, sub.end, sub.inv_freq = self.cfg, start, end, self.inv_freq
        sub.blocks = nn.ModuleList(self.blocks[start - self.start:end - self.start])
        return sub

    def new_cache(self, max_len: int, batch: int = 1, exact: bool = False) -> KVCache:
        p = self.blocks[0].wo.weight
        return KVCache(len(self.blocks), batch, self.cfg.num_kv_heads, self.cfg.head_dim,
                       max_len, p.dtype, p.device, exact)

    @torch.inference_mode()
    def forward(self, h: Tensor, positions: Tensor, cache: KVCache, tree_mask: Tensor | None = None,
                commit: bool = True) -> Tensor:
        """Run T new tokens h [B, T, H] at `positions` [T] against the committed cache.

        tree_mask [T, T] (bool, True = may attend) says which new tokens see which; None means
        causal. With commit=False the tokens stay pending in the cache (see KVCache.commit).
        """
        if cache.pending:
            raise ValueError("commit or roll back the pending candidate tokens before the next step")
        t, start = h.shape[1], cache.length
        if start + t > cache.max_len:
            raise ValueError(f"session is full: {start} + {t} tokens exceed its {cache.max_len}-token cache")
        if self.inv_freq.device != h.device:
            self.inv_freq = self.inv_freq.to(h.device)
        freqs = positions.to(h.device, torch.float32)[:, None] * self.inv_freq
        # cos/sin in fp64, rounded: the same bits whatever T (torch may vectorise fp32 cos by size).
        emb = torch.cat((freqs, freqs), dim=-1).double()
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        mask = None
        if tree_mask is not None or (start > 0 and t > 1) or (cache.exact and t > 1):
            new = tree_mask if tree_mask is not None else torch.ones(t, t, dtype=torch.bool).tril_()
            mask = torch.cat([torch.ones(t, start, dtype=torch.bool), new.bool().cpu()], dim=1).to(h.device)
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, cache.k[i], cache.v[i], start, mask, cache.exact)
        cache.pending = t
        if commit:
            cache.commit()
        return h


class Head(nn.Module):
    """What stays on the client: token embeddings, final norm and the LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied = cfg.tie_word_embeddings

    def load_hf(self, t: dict[str, Tensor]) -> None:
        with torch.no_grad():
            self.embed.weight.copy_(t["model.embed_tokens.weight"])
            self.norm.weight.copy_(t["model.norm.weight"])
            if self.tied:
                self.lm_head.weight = self.embed.weight
            else:
                self.lm_head.weight.copy_(t["lm_head.weight"])

    @torch.inference_mode()
    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.embed(ids)

    @torch.inference_mode()
    def logits(self, h: Tensor, exact: bool = False) -> Tensor:
        """Logits in fp32; callers pass only the positions whose logits they need. exact: each
        row's logits independent of the other rows (see kernels.exact_linear)."""
        return self.lm_head(self.norm(h), exact).float()
