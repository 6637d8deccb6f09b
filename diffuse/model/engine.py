"""The block engine: spans of decoder blocks, their KV cache, and the client's head.

gpt-fast style: a static KV cache indexed by explicit positions, so that a peer can run any
contiguous slice of blocks on hidden states that arrive from elsewhere, and so that a step can
carry several candidate tokens (a tree with a caller-supplied mask) whose accepted entries are
committed and the rest discarded. Which block a model gets is its family's (llama.py, gemma.py,
phi3.py, qwen3_moe.py), chosen here from the config when the span is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from diffuse.errors import ModelError
from diffuse.model import gemma, llama, phi3, qwen3_moe, rope
from diffuse.model.config import ModelConfig
from diffuse.model.kernels import Linear
from diffuse.model.layers import DecoderBlock, Family, Segment, visible

FAMILIES: dict[str, Family] = {
    "llama": llama.FAMILY,
    "mistral": llama.FAMILY,
    "qwen2": llama.FAMILY,
    "qwen3": llama.FAMILY,
    "phi3": phi3.FAMILY,
    "gemma2": gemma.FAMILY,
    "gemma3_text": gemma.FAMILY,
    "qwen3_moe": qwen3_moe.FAMILY,
}


# Rows of a committed prefill computed at once. A fixed number, not a time budget, so a step
# splits the same way everywhere and on every replay (the same shapes take the same kernels). On a
# 2-core CPU a 32-row chunk through 15 SmolLM2 blocks costs ~1.5-2x a one-token step.
PREFILL_CHUNK = 32


class KVCache:
    """Keys and values of one session for one span of blocks.

    Slots [0, length) hold committed tokens, slot i holding position i. A forward with
    commit=False leaves its T tokens pending in slots [length, length+T) until `commit(keep)`
    moves the accepted ones into place (or `rollback` drops them). Sliding-window layers keep
    every slot too (their window is a mask), so one rollback serves all layers.

    The memory is allocated, not written: pages are touched only as tokens arrive (nothing ever
    reads a slot past `length + pending`), so a reservation that is never used costs nothing, and
    `wipe` zeroes only the slots that were written (`touched`).
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", exact: bool = False):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.touched = 0  # slots [0, touched) have been written
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
        """Zero what was written: activations of a private session must not outlive it."""
        self.k[:, :, :, :self.touched].zero_()
        self.v[:, :, :, :self.touched].zero_()
        self.length = self.pending = self.touched = 0


def family(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.arch]


@functools.cache
def block_parameters(cfg: ModelConfig, layer: int) -> int:
    """Weights (numbers) of block `layer`, counted on the meta device: all of its experts included.
    Kept per (config, layer): building the modules costs ~0.7 ms a block, which every session a
    client opens would pay (its rescue budget counts its span's weights)."""
    with torch.device("meta"):
        return sum(p.numel() for p in family(cfg).block(cfg, layer).parameters())


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model: hidden states in, hidden states out."""

    def __init__(self, cfg: ModelConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"block span [{start}, {end}) is outside the model's {cfg.num_layers} blocks")
        self.cfg, self.start, self.end = cfg, start, end
        self.blocks = nn.ModuleList(family(cfg).block(cfg, i) for i in range(start, end))
        self.freqs = _freqs(cfg, self.blocks)

    def view(self, start: int, end: int) -> "BlockSpan":
        """Blocks [start, end) of this span, sharing its weights: a peer may serve a sub-range."""
        if not self.start <= start < end <= self.end:
            raise ValueError(f"blocks [{start}, {end}) are not within [{self.start}, {self.end})")
        sub = BlockSpan.__new__(BlockSpan)
        nn.Module.__init__(sub)
        sub.cfg, sub.start, sub.end = self.cfg, start, end
        sub.blocks = nn.ModuleList(self.blocks[start - self.start:end - self.start])
        sub.freqs = _freqs(self.cfg, sub.blocks)
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

        A committed causal step of more than PREFILL_CHUNK tokens runs PREFILL_CHUNK at a time, in
        every engine (client, peer, replay, referee), so a serving peer can schedule other
        sessions' steps between chunks and still compute the bits any other engine does.
        """
        t = h.shape[1]
        if commit and tree_mask is None and t > PREFILL_CHUNK:
            return torch.cat([self(h[:, a:a + PREFILL_CHUNK], positions[a:a + PREFILL_CHUNK], cache)
                              for a in range(0, t, PREFILL_CHUNK)], 1)
        return self.forward_batch([SpanStep(h, positions, cache, tree_mask, commit)])[0]

    @torch.inference_mode()
    def forward_batch(self, steps: Sequence["SpanStep"]) -> list[Tensor]:
        """Several sessions' steps in one pass through the span: the norms, projections and MLPs
        over all their rows at once, each session's attention against its own cache. Outputs in
        the order of `steps`. All must share the kernels (`cache.exact`); in exact sessions every
        row's bits are those it gets alone (kernels.exact_linear is batch-invariant), in others
        they may differ in the last bits. A committed causal step must be one prefill chunk at
        most (`forward` splits longer ones)."""
        exact = steps[0].cache.exact
        segments, rows = [], 0
        for st in steps:
            t, start = st.h.shape[1], st.cache.length
            if st.cache.exact != exact:
                raise ValueError("exact and fast sessions cannot share a batch: their kernels differ")
            if st.commit and st.tree_mask is None and t > PREFILL_CHUNK:
                raise ValueError(f"a committed step of {t} tokens: batch it in chunks of {PREFILL_CHUNK}")
            if st.cache.pending:
                raise ValueError("commit or roll back the pending candidate tokens before the next step")
            if start + t > st.cache.max_len:
                raise ValueError(f"session is full: {start} + {t} tokens exceed its {st.cache.max_len}-token cache")
            limit = self.cfg.context_limit
            if limit is not None and t and int(st.positions.max()) >= limit:
                raise ModelError(f"position {int(st.positions.max())} is past the {limit} tokens this model's "
                                 f"{self.cfg.rope_scaling.type} RoPE runs with a KV cache (see rope.py)")
            segments.append(self._segment(st, rows))
            rows += st.h.shape[0] * t
        x = torch.cat([st.h.reshape(1, -1, st.h.shape[-1]) for st in steps], 1) if len(steps) > 1 \
            else steps[0].h.reshape(1, -1, steps[0].h.shape[-1])
        for i, block in enumerate(self.blocks):
            x = block(x, [seg.at(block, i) for seg in segments], exact)
        outs = []
        for st, seg in zip(steps, segments):
            outs.append(x[0, seg.rows].view_as(st.h))
            t, start = st.h.shape[1], st.cache.length
            st.cache.pending, st.cache.touched = t, max(st.cache.touched, start + t)
            if st.commit:
                st.cache.commit()
        return outs

    def _segment(self, st: "SpanStep", first_row: int) -> "_Rows":
        """What every block needs of one step: its rows, rotary tables and visible keys."""
        h, device, start = st.h, st.h.device, st.cache.length
        tables = {}
        for key, (inv, scale) in self.freqs.items():
            if inv.device != device:
                self.freqs[key] = (inv := inv.to(device), scale)
            tables[key] = rope.tables(st.positions.to(device), inv, scale, h.dtype)
        seen = {w: visible(start, st.positions, st.tree_mask, w, st.cache.exact, device)
                for w in {b.window for b in self.blocks}}
        b, t = h.shape[0], h.shape[1]
        return _Rows(slice(first_row, first_row + b * t), b, t, start, st.cache, tables, seen)


@dataclass(frozen=True)
class SpanStep:
    """One session's step for `BlockSpan.forward_batch`: as the arguments of `forward`."""

    h: Tensor
    positions: Tensor
    cache: KVCache
    tree_mask: Tensor | None = None
    commit: bool = True


@dataclass(frozen=True)
class _Rows:
    """A step's place in a batch, and what each of its blocks' Segments is made of."""

    rows: slice
    batch: int
    tokens: int
    start: int
    cache: KVCache
    tables: dict
    seen: dict

    def at(self, block: DecoderBlock, i: int) -> Segment:
        return Segment(self.rows, self.batch, self.tokens, self.tables[block.rope_key], self.cache.k[i],
                       self.cache.v[i], self.start, self.seen[block.window])


def _freqs(cfg: ModelConfig, blocks: Sequence[DecoderBlock]) -> dict:
    """Inverse frequencies (fp32, plain attributes: they must not be cast with the blocks) and the
    cos/sin factor of each distinct RoPE among `blocks`."""
    out = {}
    for block in blocks:
        if block.rope_key not in out:
            theta, scaling = block.rope_key
            out[block.rope_key] = rope.inv_freq(theta, cfg.rotary_dim, scaling, cfg.max_position_embeddings)
    return out


class Head(nn.Module):
    """What stays on the client: token embeddings, final norm and the LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        fam = family(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = fam.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied = cfg.tie_word_embeddings
        self.embed_scale = fam.embed_scale(cfg) if fam.embed_scale else None
        self.softcap = cfg.final_logit_softcapping

    def load_hf(self, t: dict[str, Tensor]) -> None:
        names = ("model.embed_tokens.weight", "model.norm.weight") + (() if self.tied else ("lm_head.weight",))
        missing = [n for n in names if n not in t]
        if missing:
            raise ModelError(f"the head lacks tensor(s) {', '.join(missing)}")
        with torch.no_grad():
            self.embed.weight.copy_(t["model.embed_tokens.weight"])
            self.norm.weight.copy_(t["model.norm.weight"])
            if self.tied:
                self.lm_head.weight = self.embed.weight
            else:
                self.lm_head.weight.copy_(t["lm_head.weight"])

    @torch.inference_mode()
    def embed_tokens(self, ids: Tensor) -> Tensor:
        e = self.embed(ids)
        if self.embed_scale is not None:  # rounded to the weights' dtype first, as the reference does
            e = e * torch.tensor(self.embed_scale).to(e.dtype)
        return e

    @torch.inference_mode()
    def logits(self, h: Tensor, exact: bool = False) -> Tensor:
        """Logits in fp32; callers pass only the positions whose logits they need. exact: each
        row's logits independent of the other rows (see kernels.exact_linear)."""
        out = self.lm_head(self.norm(h), exact).float()
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out
