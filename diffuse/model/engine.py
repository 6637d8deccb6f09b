"""The block engine: spans of decoder blocks, their KV cache, and the client's head.

gpt-fast style: a static KV cache indexed by explicit positions, so that a peer can run any
contiguous slice of blocks on hidden states that arrive from elsewhere, and so that a step can
carry several candidate tokens (a tree with a caller-supplied mask) whose accepted entries are
committed and the rest discarded. Which block a model gets is its family's (llama.py, gemma.py,
phi3.py, qwen3_moe.py), chosen here from the config when the span is built.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from diffuse.errors import ModelError
from diffuse.model import gemma, llama, phi3, qwen3_moe, rope
from diffuse.model.config import ModelConfig
from diffuse.model.kernels import Linear
from diffuse.model.layers import DecoderBlock, Family, Rows, Segment, Together, visible
from diffuse.model.meta import on_meta

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
# splits the same way everywhere and on every replay (the same shapes take the same kernels). A
# chunk costs a small multiple of a one-token step, so a decode step queued behind a long prompt
# waits for one chunk, not the prompt (figures: docs/figures.md).
PREFILL_CHUNK = 32


class KVCache:
    """Keys and values of one session for one span of blocks: k, v [layers, batch, KV, max_len, D].

    Slots [0, length) hold committed tokens, slot i holding position i. A forward with
    commit=False leaves its T tokens pending in slots [length, length+T) until `commit(keep)`
    moves the accepted ones into place (or `rollback` drops them). Sliding-window layers keep
    every slot too (their window is a mask), so one rollback serves all layers.

    The memory is allocated, not written: pages are touched only as tokens arrive (nothing ever
    reads a slot past `length + pending`, except a shared attention, which zeroes the slots it
    reads first), so a reservation that is never used costs nothing, and `wipe` zeroes only the
    slots that were written (`touched`). A cache may be a slot of a `Slab` (`slab`, `slot`).
    """

    def __init__(self, k: Tensor, v: Tensor, exact: bool = False, slab: "Slab | None" = None, slot: int = -1):
        self.k, self.v = k, v
        self.max_len = k.shape[3]
        self.touched = 0  # slots [0, touched) have been written (or zeroed)
        self.exact = exact  # batch-invariant kernels for this session (kernels.exact_linear)
        self.slab, self.slot = slab, slot
        self.length = 0
        self.pending = 0

    @classmethod
    def empty(cls, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
              device: torch.device | str = "cpu", exact: bool = False) -> "KVCache":
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device),
                   exact)

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

    def clean(self, end: int) -> None:
        """Make its slab slot's slots [0, end) finite, past max_len too: zero those never written,
        for an attention that reads them masked (a masked score's weight is 0, and 0 times a NaN
        left in reused memory is NaN)."""
        if self.slab is not None and self.touched < end:
            for t in (self.slab.k, self.slab.v):
                t[self.slot, :, :, self.touched:end].zero_()
            self.touched = end

    def wipe(self) -> None:
        """Zero what was written: activations of a private session must not outlive it."""
        self.k[:, :, :, :self.touched].zero_()
        self.v[:, :, :, :self.touched].zero_()
        self.length = self.pending = self.touched = 0


# One-row caches of up to SLAB_MAX_LEN tokens are slots of slabs of SLAB_SLOTS (fewer where a slab
# would pass SLAB_BYTES of address space), each slot's length a power of two from SLAB_MIN_LEN.
SLAB_SLOTS = 16
SLAB_MAX_LEN = 4096
SLAB_MIN_LEN = 64
SLAB_BYTES = 1 << 30
SLABS_ENV = "DIFFUSE_SLABS"  # "0": every cache in memory of its own (for before/after comparisons)


class Slab:
    """Up to `slots` one-row caches of one span in one tensor pair [slots, layers, KV, cap, D].

    A batch of their sessions' one-token steps writes its keys and attends with one call per
    layer for all of them (`layers.Together`) instead of one per session, whose Python and
    dispatch were a large share of a many-session step (`scripts/bench_slabs.py` measures both;
    figures: docs/figures.md).
    A slab is allocated, not written, like any cache; a slot whose cache is gone is zeroed and
    its whole pages handed back to the OS (`release_pages`), so a slab holds what its open
    sessions touched, and the last one gone frees it.
    """

    def __init__(self, home: "Slabs", key: tuple, slots: int, n_layers: int, n_kv_heads: int, head_dim: int,
                 cap: int, dtype: torch.dtype, device: torch.device):
        shape = (slots, n_layers, n_kv_heads, cap, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.home, self.key, self.free = home, key, list(range(slots))

    def take(self, max_len: int) -> KVCache:
        """A cache in the lowest free slot (the caller holds the home's lock and saw one free):
        sessions open together sit side by side, so their shared attention pads nothing."""
        slot = self.free.pop(0)
        k, v = (t[slot:slot + 1, :, :, :max_len].transpose(0, 1) for t in (self.k, self.v))
        cache = KVCache(k, v, slab=self, slot=slot)
        weakref.finalize(cache, self._give, slot).atexit = False
        return cache

    def _give(self, slot: int) -> None:
        release_pages(self.k[slot])
        release_pages(self.v[slot])
        with self.home.lock:
            bisect.insort(self.free, slot)
            if len(self.free) == self.k.shape[0]:
                self.home.slabs[self.key].remove(self)


class Slabs:
    """The slabs of one model's spans, shared by the views a peer opens sessions on."""

    def __init__(self) -> None:
        # Reentrant: a garbage collection while `cache` holds it may finalize a cache in a reference
        # cycle (a traceback's frames), whose slot is given back on the same thread.
        self.lock = threading.RLock()
        self.slabs: dict[tuple, list[Slab]] = {}

    def __deepcopy__(self, memo: dict) -> "Slabs":
        return Slabs()  # a copy of a span (a tampered one, in the trust plane's tests) has no sessions yet

    def cache(self, span: "BlockSpan", max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        cfg, n = span.cfg, len(span.blocks)
        cap = max(SLAB_MIN_LEN, 1 << (max_len - 1).bit_length())
        key = (span.start, span.end, cap, dtype, device)
        slot_bytes = 2 * n * cfg.num_kv_heads * cap * cfg.head_dim * dtype.itemsize
        slots = max(2, min(SLAB_SLOTS, SLAB_BYTES // slot_bytes))
        with self.lock:
            slabs = self.slabs.setdefault(key, [])
            slab = next((s for s in slabs if s.free), None)
            if slab is None:
                slab = Slab(self, key, slots, n, cfg.num_kv_heads, cfg.head_dim, cap, dtype, device)
                slabs.append(slab)
            return slab.take(max_len)


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_DONTNEED = 4
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def release_pages(t: Tensor) -> None:
    """Zero t (contiguous, in CPU memory), handing the pages wholly inside it back to the OS
    (madvise MADV_DONTNEED: read again, a private page is zero), so the memory no longer counts."""
    if _LIBC is None:
        t.zero_()
        return
    start, size = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-start // PAGE) * PAGE, (start + size) // PAGE * PAGE
    if hi <= lo or _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) != 0:
        t.zero_()
        return
    flat = t.view(-1)
    flat[:(lo - start) // t.element_size()].zero_()
    flat[(hi - start) // t.element_size():].zero_()


def family(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.arch]


@functools.cache
def block_parameters(cfg: ModelConfig, layer: int) -> int:
    """Weights (numbers) of block `layer`, counted on the meta device: all of its experts included.
    Kept per (config, layer): building the modules costs time that every session a client opens
    would otherwise pay (its rescue budget counts its span's weights)."""
    with on_meta():
        return sum(p.numel() for p in family(cfg).block(cfg, layer).parameters())


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model: hidden states in, hidden states out."""

    quant = "none"  # the variant its weights are (model/variants.py), set by load_span

    def __init__(self, cfg: ModelConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"block span [{start}, {end}) is outside the model's {cfg.num_layers} blocks")
        self.cfg, self.start, self.end = cfg, start, end
        self.blocks = nn.ModuleList(family(cfg).block(cfg, i) for i in range(start, end))
        self.freqs = _freqs(cfg, self.blocks)
        self.slabs = Slabs()

    def view(self, start: int, end: int) -> "BlockSpan":
        """Blocks [start, end) of this span, sharing its weights: a peer may serve a sub-range."""
        if not self.start <= start < end <= self.end:
            raise ValueError(f"blocks [{start}, {end}) are not within [{self.start}, {self.end})")
        sub = BlockSpan.__new__(BlockSpan)
        nn.Module.__init__(sub)
        sub.cfg, sub.start, sub.end = self.cfg, start, end
        sub.blocks = nn.ModuleList(self.blocks[start - self.start:end - self.start])
        sub.freqs = _freqs(self.cfg, sub.blocks)
        sub.slabs, sub.quant = self.slabs, self.quant
        return sub

    def new_cache(self, max_len: int, batch: int = 1, exact: bool = False) -> KVCache:
        """A cache for `max_len` tokens of `batch` rows: a slab's slot where its steps may attend
        together (one row, fast kernels, no soft-capped scores) and memory is taken as it is
        touched (a CPU: a GPU would hold a whole slab at once), else memory of its own."""
        p = self.blocks[0].wo.weight
        if batch == 1 and not exact and max_len <= SLAB_MAX_LEN and self.shares_attention \
                and p.device.type == "cpu" and os.environ.get(SLABS_ENV) != "0":
            return self.slabs.cache(self, max_len, p.dtype, p.device)
        return KVCache.empty(len(self.blocks), batch, self.cfg.num_kv_heads, self.cfg.head_dim,
                             max_len, p.dtype, p.device, exact)

    @property
    def shares_attention(self) -> bool:
        """Whether sessions' one-token steps may attend in one call (SDPA cannot soft-cap scores)."""
        return self.cfg.attn_logit_softcapping is None

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
        over all their rows at once, each session's attention against its own cache (one-token
        steps of sessions in one slab: one attention call for them all). Outputs in the order of
        `steps`. All must share the kernels (`cache.exact`); in exact sessions every row's bits
        are those it gets alone (kernels.exact_linear is batch-invariant), in others they may
        differ in the last bits. A committed causal step must be one prefill chunk at most
        (`forward` splits longer ones)."""
        exact = steps[0].cache.exact
        for st in steps:
            self._check(st, exact)
        groups = _together(steps)
        grouped = {i for g in groups for i in g}
        order = [i for g in groups for i in g] + [i for i in range(len(steps)) if i not in grouped]
        parts: list[_Rows | _Group] = []
        rows, where = 0, {}
        for g in groups:
            parts.append(self._group([steps[i] for i in g], rows))
            for i in g:
                where[i] = slice(rows, rows + steps[i].h.shape[1])
                rows = where[i].stop
        for i in order[len(grouped):]:
            parts.append(seg := self._segment(steps[i], rows))
            where[i] = seg.rows
            rows = seg.rows.stop
        width = steps[0].h.shape[-1]
        x = torch.cat([steps[i].h.reshape(1, -1, width) for i in order], 1) if len(steps) > 1 \
            else steps[0].h.reshape(1, -1, width)
        tables = {key: self._row_tables([steps[i] for i in order], key) for key in self.freqs}
        for i, block in enumerate(self.blocks):
            x = block(x, Rows(tables[block.rope_key], [p.part(block, i) for p in parts]), exact)
        outs = [x[0, where[i]].view_as(st.h) for i, st in enumerate(steps)]
        for st in steps:
            t, start = st.h.shape[1], st.cache.length
            st.cache.pending, st.cache.touched = t, max(st.cache.touched, start + t)
            if st.commit:
                st.cache.commit()
        return outs

    def _check(self, st: "SpanStep", exact: bool) -> None:
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

    def _row_tables(self, steps: Sequence["SpanStep"], key: tuple) -> tuple[Tensor, Tensor]:
        """cos, sin [N, 1, rot] of RoPE `key` for the rows of `steps` in order (a step's batch rows
        share its positions), in one call: each position's bits are those it gets alone (rope.tables)."""
        inv, scale = self.freqs[key]
        device, dtype = steps[0].h.device, steps[0].h.dtype
        if inv.device != device:
            self.freqs[key] = (inv := inv.to(device), scale)
        rows = [st.positions.repeat(st.h.shape[0]) if st.h.shape[0] > 1 else st.positions for st in steps]
        cos, sin = rope.tables((rows[0] if len(rows) == 1 else torch.cat(rows)).to(device), inv, scale, dtype)
        return cos[:, None], sin[:, None]

    def _segment(self, st: "SpanStep", first_row: int) -> "_Rows":
        """What every block needs of one step: its rows and visible keys."""
        start = st.cache.length
        seen = {w: visible(start, st.positions, st.tree_mask, w, st.cache.exact, st.h.device)
                for w in {b.window for b in self.blocks}}
        b, t = st.h.shape[0], st.h.shape[1]
        return _Rows(slice(first_row, first_row + b * t), b, t, start, st.cache, seen)

    def _group(self, steps: Sequence["SpanStep"], first_row: int) -> "_Group":
        """What every block needs of short steps of sessions in one slab (increasing slots): the
        slab's slots from the first member's to the last's, each row's place and cache slot, each
        window's mask over the slots they read (made finite first), padded to the longest step."""
        slab, device = steps[0].cache.slab, steps[0].h.device
        first, last = steps[0].cache.slot, steps[-1].cache.slot
        r, t = last - first + 1, max(st.h.shape[1] for st in steps)
        places = [st.cache.slot - first for st in steps]
        sizes = [st.h.shape[1] for st in steps]
        end = max(st.cache.length + n for st, n in zip(steps, sizes))
        for st in steps:
            st.cache.clean(end)
        place_rows = torch.tensor([p for p, n in zip(places, sizes) for _ in range(n)], device=device)
        cols = torch.cat([torch.arange(st.cache.length, st.cache.length + n) for st, n in zip(steps, sizes)]).to(device)
        at = None
        if t > 1 or r > len(steps):
            at = torch.cat([torch.arange(p * t, p * t + n) for p, n in zip(places, sizes)]).to(device)
        heads = self.cfg.num_heads // self.cfg.num_kv_heads
        masks = {w: _mask(steps, places, r, t, end, w).expand(r, heads, t, end).reshape(r, 1, heads * t, end)
                 .to(device) for w in {b.window for b in self.blocks}}
        return _Group(slice(first_row, first_row + len(place_rows)), slab, first, last + 1, place_rows, cols, at, t,
                      masks, end)


def _mask(steps: Sequence["SpanStep"], places: list[int], r: int, t: int, end: int, window: int | None) -> Tensor:
    """[R, 1, T, end]: which slots each step's tokens see (`visible`), at their slab places; a
    padded row sees slot 0 (all masked, a softmax row would be NaN)."""
    mask = torch.zeros(r, 1, t, end, dtype=torch.bool)
    mask[:, 0, :, 0] = True
    for st, p in zip(steps, places):
        n, start = st.h.shape[1], st.cache.length
        seen = visible(start, st.positions, st.tree_mask, window, False, torch.device("cpu"))
        allow = seen.allow
        if allow is None:
            new = torch.ones(n, n, dtype=torch.bool)
            old = torch.ones(n, start - seen.lo, dtype=torch.bool)
            allow = torch.cat([old, new.tril_() if seen.causal else new], 1)
        mask[p, 0, :n] = False
        mask[p, 0, :n, seen.lo:start + n] = allow
    return mask


TOGETHER_TOKENS = 16  # steps this short (decoding, speculation trees) attend together in a slab


def _together(steps: Sequence["SpanStep"]) -> list[list[int]]:
    """Indices of the steps that attend together, per slab and kind, in increasing slots: steps
    of at most TOGETHER_TOKENS tokens of one-row sessions, one-token steps apart from longer ones
    (which would pad them), at least two in a group (a lone step keeps the bits it has alone)."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, st in enumerate(steps):
        b, t = st.h.shape[:2]
        if st.cache.slab is not None and b == 1 and t <= TOGETHER_TOKENS:
            groups.setdefault((id(st.cache.slab), t == 1), []).append(i)
    return [sorted(g, key=lambda i: steps[i].cache.slot) for g in groups.values() if len(g) > 1]


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
    seen: dict

    def part(self, block: DecoderBlock, i: int) -> Segment:
        return Segment(self.rows, self.batch, self.tokens, self.cache.k[i], self.cache.v[i], self.start,
                       self.seen[block.window])


@dataclass(frozen=True)
class _Group:
    """Short steps of sessions in one slab, slots [first, stop): what each block's Together is made of."""

    rows: slice
    slab: Slab
    first: int
    stop: int
    places: Tensor
    cols: Tensor
    at: Tensor | None
    tokens: int
    masks: dict
    end: int

    def part(self, block: DecoderBlock, i: int) -> Together:
        return Together(self.rows, self.slab.k[self.first:self.stop, i], self.slab.v[self.first:self.stop, i],
                        self.places, self.cols, self.at, self.tokens, self.masks[block.window], self.end)


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
