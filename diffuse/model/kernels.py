"""Matmul paths for a few rows on a CPU: what decoding, speculation and prefill cost depends on them.

torch's default `x @ W.T` is not the fastest product for every row count, and which one is
depends on the CPU, so the paths are chosen once per process by what it has (`profile`).

Rules, by CPU (figures: docs/figures.md; the timing tables behind them: docs/measurements.md):

- AVX2 (`AVX2`): a few fp32 rows by `x @ W.T` cost far more than one row, and MKL's threaded GEMV
  (one row) is slower than its single-threaded one, so fp32 takes `(W @ x.T).T` up to
  FP32_UP_TO_ROWS rows, one row doubled into a 2-row GEMM when torch has several threads. Without
  native bf16 kernels a bf16 product's cost grows linearly with the rows, so from WIDEN_FROM_ROWS
  rows the weights are widened to fp32 (fp32 accumulation, as a bf16 kernel would do; rounded back
  to bf16). MKL's fp32 GEMM is fast there only for row counts that are multiples of 8 (its AVX2
  register block), so zero rows are appended up to the next multiple of 8 from seven rows on.
- AVX-512 (`AVX512`): MKL's threaded GEMV is fast and the AVX2 tricks cost more than they save, so
  fp32 uses `x @ W.T` up to three rows. From four rows fp32 products go through oneDNN with the
  weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, kept
  beside the weight and redone if the weight changes): MKL's GEMM repacks the weight on every
  call, which is most of the cost of a few rows (without oneDNN, fp32 takes `(W @ x.T).T` from
  four rows, padded to 16, the best MKL did). One bf16 row by torch.mv (a GEMV kernel) beats
  oneDNN's GEMM with the same bits, where a weight has no reordered copy.
- AMD's AVX-512 CPUs (`AVX512_AMD`, by vendor id): MKL's few-row fp32 products are slow, so fp32
  takes the reordered weight at every row count.
- Native bf16 (AVX512-BF16 / AMX): the reordered weight wins at every row count (torch's own bf16
  product reorders the weight on every call, and one row by torch.mv is slower still), with the
  very same bits as torch.mv and F.linear (same oneDNN kernel; checked by a test). So bf16
  products always take it.

The reordered copy costs the weight's memory again, so it is made only when a product first uses
the weight, and a peer's memory budget counts it (`reorders`, placement, `model info`): bf16 spans
on native-bf16 CPUs count their weights twice, as fp32 ones do.

`padded_rows` says how many rows a product really costs, so that a caller choosing how many
rows to send (the speculation planner) can fill the padding with useful ones.

None of these paths is batch-invariant: a row's result changes in the last bits with the number
of rows beside it, because MKL picks its kernel by shape (see `exact_form`). Speculation
computes a position in a tree of 2-64 rows that plain decoding computes alone, so an fp32 near-tie
could resolve differently. A session that asks for exact kernels gets `exact_linear` (one product
form, padded so that every row count takes the same kernel, checked on this machine) and
`exact_attention` (fp64, rounded back). Then a position's output bits depend only on its inputs,
and greedy speculation, plain decoding and a replay chunk produce the same tokens and KV cache.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDEN_FROM_ROWS = 8  # bf16/fp16 rows from which widening to fp32 beats the emulated kernel
FP32_UP_TO_ROWS = 64  # fp32 rows up to which (W @ x.T).T beats x @ W.T
EXACT_QUERY_BLOCK = 128  # query rows per fp64 score matrix (bounds its memory during a prefill)
BUCKET_ROWS = 16  # oneDNN products of more rows than this run on a multiple of it (`_onednn`)
CHUNK_ROWS = 256  # and of more rows than this, in chunks of it
WIDEN_BLOCK = 2048  # weight rows widened at once, so the fp32 copy stays in cache (an LM head's would not)


@dataclass(frozen=True)
class Profile:
    """How a CPU computes products of a few rows fastest (see the module docstring)."""

    name: str
    wide_from: int  # fp32 products of wide_from..FP32_UP_TO_ROWS rows take the form (W @ x.T).T
    double_one_row: bool  # fp32: one row is doubled into a 2-row GEMM when torch has several threads
    pad_from: int  # from this many rows, fp32 products are padded with zero rows to a multiple of pad_to
    pad_to: int
    bf16_gemv: bool  # one bf16 row by torch.mv (where the CPU has native bf16)
    reorder_from: int | None = None  # fp32 products of this many rows and more: oneDNN, weight reordered once


AVX2 = Profile("avx2", wide_from=2, double_one_row=True, pad_from=7, pad_to=8, bf16_gemv=False)
AVX512 = Profile("avx512", wide_from=4, double_one_row=False, pad_from=4, pad_to=16, bf16_gemv=True,
                 reorder_from=4)
AVX512_AMD = Profile("avx512-amd", wide_from=4, double_one_row=False, pad_from=4, pad_to=16, bf16_gemv=True,
                     reorder_from=1)


@functools.cache
def profile() -> Profile:
    """The paths for this CPU: AVX512 where torch's kernels run AVX-512 (AVX512_AMD on AMD's CPUs,
    where MKL's few-row products are slow), else AVX2's."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return AVX2
    return AVX512_AMD if cpu_vendor() == "AuthenticAMD" else AVX512


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD), from /proc/cpuinfo; '' where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 / AMX), so torch's own path wins."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def reorders(dtype: torch.dtype = torch.float32) -> bool:
    """Whether products of `dtype` weights here keep a reordered copy of their weight, so that a
    span's weights cost twice their size: fp32 products from `reorder_from` rows, and every bf16
    product where the CPU has native bf16 (see the module docstring)."""
    if profile().reorder_from is None or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def describe() -> str:
    """One line on the chosen paths, for benchmarks' headers."""
    p = profile()
    if reorders():
        fp32 = (f"fp32 x @ W.T up to {p.reorder_from - 1} rows, oneDNN with reordered weights from "
                f"{p.reorder_from}" if p.reorder_from > 1 else "fp32 oneDNN with reordered weights")
        return (f"{p.name}: {fp32}; " + ("native bf16, oneDNN with reordered weights" if native_bf16() else
                                          f"bf16 widened to fp32 from {WIDEN_FROM_ROWS} rows"))
    bf16 = "native bf16" + (", one row by GEMV" if p.bf16_gemv else "") if native_bf16() else \
        f"bf16 widened to fp32 from {WIDEN_FROM_ROWS} rows"
    return (f"{p.name}: fp32 (W @ x.T).T for {p.wide_from}-{FP32_UP_TO_ROWS} rows padded to multiples of "
            f"{p.pad_to} from {p.pad_from}{', one row doubled' if p.double_one_row else ''}; {bf16}")


def padded_rows(rows: int, exact: bool = False) -> int:
    """Rows a CPU product of `rows` rows computes (and costs): see the module docstring. exact:
    in an exact session, products run in blocks of EXACT_ROWS rows: one row costs what sixteen do."""
    if exact:
        return max(1, -(-rows // EXACT_ROWS)) * EXACT_ROWS
    if reorders():
        return _onednn_rows(rows)
    p = profile()
    if rows < p.pad_from:
        return rows
    return -(-rows // p.pad_to) * p.pad_to


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), by the fastest path on this device for x's number of rows."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if x.device.type != "cpu" or rows == 0:
        return F.linear(x, weight, bias)
    p = profile()
    flat = x.reshape(rows, x.shape[-1])
    if (not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))  # no autograd there
            and _takes_reordered(weight, rows)):
        return _onednn(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    if weight.dtype == torch.float32 and rows == 1 and p.double_one_row and torch.get_num_threads() > 1:
        out = (weight @ torch.cat([flat, flat]).t())[:, :1].t()  # a threaded GEMM beats MKL's threaded GEMV
    elif weight.dtype == torch.float32 and p.wide_from <= rows <= FP32_UP_TO_ROWS:
        out = (weight @ _padded(flat).t())[:, :rows].t()
    elif weight.dtype == torch.bfloat16 and rows == 1 and p.bf16_gemv and native_bf16():
        out = torch.mv(weight, flat[0])[None]
    elif weight.dtype in (torch.bfloat16, torch.float16) and rows >= WIDEN_FROM_ROWS and not native_bf16():
        out = _widened(_padded(flat.float()).t(), weight)[:rows].to(x.dtype)
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def _takes_reordered(weight: Tensor, rows: int) -> bool:
    """Whether a product of `rows` rows with `weight` takes oneDNN with the weight reordered (not
    for a tensor made in inference mode: it has no version counter to tell a stale copy by)."""
    if weight.is_inference():
        return False
    if weight.dtype == torch.bfloat16:
        return reorders(torch.bfloat16)
    return weight.dtype == torch.float32 and reorders() and rows >= profile().reorder_from


_REORDERING = threading.Lock()  # batches compute on worker threads


def reordered(weight: Tensor) -> Tensor:
    """`weight` in oneDNN's blocked layout, kept on the weight itself (it lives as long), made
    once and again whenever the weight changes in place (its version counter: a load, a canary's
    permutation, a test's tampering)."""
    with _REORDERING:
        hit = getattr(weight, "_diffuse_reordered", None)
        if hit is None or hit[0] != weight._version:
            hit = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16))
            weight._diffuse_reordered = hit  # type: ignore[attr-defined]
        return hit[1]


def _onednn_rows(rows: int) -> int:
    """Rows `_onednn` computes for `rows`: chunks of CHUNK_ROWS, the rest padded to a multiple of
    BUCKET_ROWS when it has more than BUCKET_ROWS."""
    full, rest = divmod(rows, CHUNK_ROWS)
    return full * CHUNK_ROWS + (rest if rest <= BUCKET_ROWS else -(-rest // BUCKET_ROWS) * BUCKET_ROWS)


def _onednn(flat: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """flat [rows, K] @ weight.T (+ bias) by oneDNN with the reordered weight, on a bounded set of
    row counts: oneDNN compiles and keeps a kernel per row count it meets, a fraction of a MB
    each, so a long-lived peer that met every row count of its batches and prompts would hold
    hundreds of MB of them. Up to BUCKET_ROWS rows run as they are (decoding's shapes); more are
    padded with zero rows to a multiple of BUCKET_ROWS, and more than CHUNK_ROWS run in chunks of
    CHUNK_ROWS (enough rows per chunk for the kernel's full speed)."""
    rows = flat.shape[0]
    if rows > CHUNK_ROWS:
        return torch.cat([_onednn(flat[s:s + CHUNK_ROWS], weight, bias) for s in range(0, rows, CHUNK_ROWS)])
    extra = _onednn_rows(rows) - rows
    padded = torch.cat([flat, flat.new_zeros(extra, flat.shape[1])]) if extra else flat.contiguous()
    return torch.ops.mkldnn._linear_pointwise(padded, reordered(weight), bias, "none", [], "")[:rows]


def _padded(flat: Tensor) -> Tensor:
    """flat [rows, K] with zero rows appended up to padded_rows(rows)."""
    extra = padded_rows(flat.shape[0]) - flat.shape[0]
    return torch.cat([flat, flat.new_zeros(extra, flat.shape[1])]) if extra else flat


def _widened(xt: Tensor, weight: Tensor) -> Tensor:
    """(weight @ xt).t() in fp32, widening at most WIDEN_BLOCK weight rows at a time: the fp32
    copy of a block stays in cache, where widening a whole LM head (113 MB) would not."""
    if weight.shape[0] <= 2 * WIDEN_BLOCK:
        return (weight.float() @ xt).t()
    out = torch.empty(xt.shape[1], weight.shape[0])
    for s in range(0, weight.shape[0], WIDEN_BLOCK):
        out[:, s:s + WIDEN_BLOCK] = (weight[s:s + WIDEN_BLOCK].float() @ xt).t()
    return out


# Exact products run in blocks of EXACT_ROWS rows, every block the same shape, so MKL takes one
# kernel for all of them whatever the row count (it chooses kernels by shape, and a call whose
# shape grows with the rows is not invariant on every CPU). The two forms
# are (W @ x.T).T ("wide") and x @ W.T ("rows"); the first that passes `exact_form`'s check is used.
EXACT_ROWS = 16
EXACT_FORMS = ("wide", "rows")
EXACT_CHECK_ROWS = (*range(1, 41), 48, 63, 64, 72)


def _exact_product(flat: Tensor, weight: Tensor, form: str) -> Tensor:
    """flat [rows, K] @ weight.T in fp32 by `form`, in zero-padded blocks of EXACT_ROWS rows."""
    rows = flat.shape[0]
    padded = padded_rows(rows, exact=True)
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    blocks = [flat[s:s + EXACT_ROWS] for s in range(0, padded, EXACT_ROWS)]
    outs = [(weight @ b.t()).t() if form == "wide" else F.linear(b, weight) for b in blocks]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:rows]


@functools.cache
def exact_form(n: int, k: int, threads: int) -> str:
    """The first EXACT_FORMS entry whose rows, for an [n, k] weight with `threads` torch threads,
    come out with the same bits whatever the rows beside them: checked once per process on this
    machine's BLAS, because the property is MKL's choice of kernel by shape, not a promise: a
    call whose shape grows with the rows changes a row's bits with its row count, while blocks of
    one fixed shape need not (what was found per CPU: docs/measurements.md)."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(max(EXACT_CHECK_ROWS) + 8, k, generator=g)
    for form in EXACT_FORMS:
        alone = torch.cat([_exact_product(x[i:i + 1], w, form) for i in range(8)])
        if all(torch.equal(_exact_product(x[:m], w, form)[:8], alone[:min(m, 8)]) for m in EXACT_CHECK_ROWS) \
                and torch.equal(_exact_product(x[3:20], w, form)[:5], alone[3:8]):
            return form
    raise RuntimeError(f"no batch-invariant product form for a {n}x{k} weight with {threads} threads "
                       "on this machine: exact sessions are not available")


def exact_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear computed in fp32 so that each output row's bits depend on that row alone.

    Products take the form `exact_form` found batch-invariant here, with their rows padded as it
    requires; bf16/fp16 weights are widened block by block (the check is made for the block's
    shape); the bias is added after the product (addmm fuses it differently).
    """
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    flat = x.reshape(rows, x.shape[-1]).float().contiguous()  # strides pick MKL's kernel too
    n, k = weight.shape
    if weight.dtype == torch.float32:
        out = _exact_product(flat, weight, exact_form(n, k, torch.get_num_threads()))
    else:
        form = exact_form(min(n, WIDEN_BLOCK), k, torch.get_num_threads())
        out = torch.cat([_exact_product(flat, weight[s:s + WIDEN_BLOCK].float(), form)
                         for s in range(0, n, WIDEN_BLOCK)], dim=1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).contiguous().reshape(*x.shape[:-1], n)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None,
                    softcap: float | None = None) -> Tensor:
    """softmax(scale * q k^T) v in fp64, rounded back to q's dtype: batch-invariant attention.

    q [B, H, T, D]; k, v [B, KV, L, D] with H a multiple of KV (query head h reads key head
    h // (H // KV), as in grouped-query attention); mask [T, L] bool, True = may attend, None =
    all; scale defaults to 1/sqrt(D); softcap: scores become softcap * tanh(scores / softcap)
    (Gemma 2). A product of two fp32 numbers is exact in fp64 and sums differ only by ~1e-16 with
    their order, so masked keys, their layout, and the number of query rows leave the fp32 result
    as is. The query heads sharing a key head are stacked as rows of one product per key head, at
    most EXACT_QUERY_BLOCK tokens at a time.
    """
    b, h, t, d = q.shape
    kv = k.shape[1]
    g = h // kv
    scale = d ** -0.5 if scale is None else scale
    q64 = q.double().mul_(scale).view(b, kv, g, t, d)  # [B, KV, query heads per KV head, T, D]
    kt, v64 = k.double().transpose(-1, -2), v.double()
    blocked = ~mask.to(q.device) if mask is not None else None
    out = torch.empty_like(q64)
    for s in range(0, t, EXACT_QUERY_BLOCK):
        rows = min(EXACT_QUERY_BLOCK, t - s)
        scores = q64[:, :, :, s:s + rows].reshape(b, kv, g * rows, d) @ kt  # [B, KV, g * rows, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if blocked is not None:
            scores.view(b, kv, g, rows, -1).masked_fill_(blocked[s:s + rows], float("-inf"))
        out[:, :, :, s:s + rows] = (scores.softmax(-1) @ v64).view(b, kv, g, rows, d)
    return out.reshape(b, h, t, d).to(q.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`, or by
    `exact_linear` for a session that asked for batch-invariant kernels. A quantized weight
    (`packed`, model/quant.py) takes its weight-only kernel; in an exact session, `exact_linear`
    over its canonical values widened to fp32 (the same numbers, the exact kernels' sums)."""

    packed = None  # model.quant.Packed of a quantized weight (the float weight is then empty)

    def forward(self, x: Tensor, exact: bool = False) -> Tensor:
        if self.packed is not None:
            if exact:
                return exact_linear(x, self.packed.canonical().dequantize(), self.bias)
            out = self.packed.matmul(x)
            return out if self.bias is None else out + self.bias
        return exact_linear(x, self.weight, self.bias) if exact else linear(x, self.weight, self.bias)
