"""Weight-only quantized linear layers: int8 per output channel, int4 in groups of 32.

A quantized weight has a canonical form, the same bytes on every machine, which is what a
variant's files hold and its hashes cover (`QWeight.tensors`):

- int8: values int8 [N, K] in [-127, 127] and one bf16 scale per row [N]; w = q * scale.
- int4: values 0..15, two per byte in row-major order (column 2j in the low nibble, 2j+1 in the
  high one) as uint8 [N, K/2], and per row and group of GROUP columns a bf16 scale and zero
  [N, K/GROUP]; w = (q - 8) * scale + zero, the form PyTorch's int4 kernels compute.

The kernels' own layouts are built from it when a span loads, per device (`pack`): on a CPU
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (after `_convert_weight_to_int4pack_for_cpu`),
on CUDA `_weight_int4pack_mm` (tinygemm, after `_convert_weight_to_int4pack`; bf16 activations). PyTorch has no
int8 weight-only CUDA kernel: there an int8 weight is widened to the activations' dtype inside
the product (memory as int8, speed as bf16). Quantizing uses only elementwise IEEE operations
and exact reductions (min, max), so a source gives the same canonical bytes everywhere.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from diffuse.errors import ModelError

SCHEMES = ("none", "int8", "int4")
GROUP = 32  # int4 columns per scale and zero (GGUF's Q4_0/Q4_1/Q4_K sub-blocks are 32 too)
BETTER = {"none": ("none",), "int8": ("int8", "none"), "int4": ("int4", "int8", "none")}
INT4_TILES = (8, 4, 2)  # inner K tiles of the CUDA int4 layout, the most that divide K / 16 (32 | K: 2 always)


def parse_scheme(name: str) -> str:
    if name not in SCHEMES:
        raise ModelError(f"unknown quantization {name!r}: choose {', '.join(SCHEMES)}")
    return name


def compute_name(dtype: torch.dtype | str, scheme: str) -> str:
    """What a peer declares it computes in (OPEN_OK): "bfloat16", or "bfloat16+int4" for a variant."""
    name = str(dtype).removeprefix("torch.")
    return name if scheme == "none" else f"{name}+{scheme}"


def split_name(name: str) -> tuple[str, str]:
    """compute_name's inverse: ("bfloat16", "int4")."""
    dtype, _, scheme = name.partition("+")
    return dtype, scheme or "none"


def parse_accept(text: str | None, own: str) -> tuple[str, ...]:
    """`--accept-quant`: a comma-separated list of schemes, `any`, or None for the client's own
    scheme and those of more bits (an int4 client accepts int4, int8 and unquantized peers)."""
    if text is None:
        return BETTER[parse_scheme(own)]
    if text.strip().lower() == "any":
        return SCHEMES
    got = tuple(dict.fromkeys(parse_scheme(s.strip()) for s in text.split(",") if s.strip()))
    if not got:
        raise ModelError("--accept-quant needs a list of none, int8, int4, or `any`")
    return got


def weight_bytes(n: int, k: int, scheme: str, scale_bytes: int = 2) -> int:
    """Bytes an [n, k] weight holds in a kernel's layout: values, and scales (and zeros)."""
    if scheme == "int8":
        return n * k + n * scale_bytes
    return n * k // 2 + 2 * n * (k // GROUP) * scale_bytes


@dataclass
class QWeight:
    """One weight [N, K] in canonical form (see the module docstring); `values` unpacked."""

    kind: str  # "int8" | "int4"
    values: Tensor  # int8 [N, K] | uint8 [N, K] in 0..15
    scale: Tensor  # bf16 [N] | [N, K/GROUP]
    zero: Tensor | None = None  # bf16 [N, K/GROUP] (int4)
    origin: str = ""  # what it was made from, for `model info` (e.g. "gguf Q4_K")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self.kind == "int8":
            return (self.values.float() * self.scale.float()[:, None]).to(dtype)
        n, k = self.shape
        q = self.values.float().view(n, k // GROUP, GROUP) - 8
        return (q * self.scale.float()[..., None] + self.zero.float()[..., None]).view(n, k).to(dtype)

    def tensors(self, name: str) -> dict[str, Tensor]:
        """The canonical tensors stored (and hashed) for weight `name`."""
        if self.kind == "int8":
            return {name + ".q": self.values, name + ".scale": self.scale}
        v = self.values
        return {name + ".q": (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous(), name + ".scale": self.scale,
                name + ".zero": self.zero}

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor], name: str) -> "QWeight":
        q, scale = t[name + ".q"], t[name + ".scale"]
        if name + ".zero" not in t:
            if q.dtype != torch.int8 or scale.shape != q.shape[:1]:
                raise ModelError(f"tensor {name}: int8 values and per-row scales do not fit")
            return cls("int8", q, scale)
        zero = t[name + ".zero"]
        n, half = q.shape
        if q.dtype != torch.uint8 or scale.shape != (n, 2 * half // GROUP) or zero.shape != scale.shape:
            raise ModelError(f"tensor {name}: int4 values, scales and zeros do not fit (groups of {GROUP})")
        values = torch.stack([q & 15, q >> 4], -1).view(n, 2 * half)
        return cls("int4", values, scale, zero)

    def rows(self, index: Tensor) -> "QWeight":
        """Its rows reordered (llama.cpp's Q/K permutation undone on the kept form)."""
        zero = None if self.zero is None else self.zero[index].contiguous()
        return QWeight(self.kind, self.values[index].contiguous(), self.scale[index].contiguous(), zero, self.origin)


def quantize(w: Tensor, kind: str, origin: str = "") -> QWeight:
    """Round-to-nearest, deterministic: int8 symmetric per row; int4 asymmetric (min/max) per
    group of GROUP columns, its scale and zero rounded to bf16 before the values are chosen."""
    w = w.float()
    n, k = w.shape
    if kind == "int8":
        scale = (w.abs().amax(1) / 127).to(torch.bfloat16)
        s = scale.float().where(scale.float() > 0, torch.ones(()))
        return QWeight("int8", (w / s[:, None]).round().clamp(-127, 127).to(torch.int8), scale, None,
                       origin or "int8 per row")
    if k % GROUP:
        raise ModelError(f"int4 needs rows of a multiple of {GROUP} numbers; a weight has {k}")
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    s = scale.float().where(scale.float() > 0, torch.ones(()))
    values = ((g - zero.float()[..., None]) / s[..., None] + 8).round().clamp(0, 15).to(torch.uint8)
    return QWeight("int4", values.view(n, k), scale, zero, origin or f"int4 g{GROUP}")


def cat(parts: list[QWeight]) -> QWeight:
    """Row-wise concatenation (a fused q/k/v or gate/up weight); parts of different kinds all
    become int8 (a Q4_K_M file holds Q6_K value rows beside Q4_K query rows)."""
    kinds = {p.kind for p in parts}
    if len(kinds) > 1:
        parts = [p if p.kind == "int8" else quantize(p.dequantize(), "int8", f"int8 per row (from {p.origin})")
                 for p in parts]
    first = parts[0]
    zero = torch.cat([p.zero for p in parts]) if first.zero is not None else None
    origin = " + ".join(dict.fromkeys(p.origin for p in parts))
    return QWeight(first.kind, torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), zero, origin)


@dataclass
class Packed:
    """A QWeight in the layout its device's kernel takes, and the product by it."""

    kind: str
    n: int
    k: int
    weight: Tensor  # CPU int4: int4pack; CUDA int4: tinygemm layout; int8: the int8 values
    scales: Tensor  # int4: scale and zero [K/GROUP, N, 2]; int8: per-row scales [N] (activations' dtype)
    scale: Tensor  # the canonical bf16 scales and zeros (small), for `canonical`
    zero: Tensor | None
    origin: str

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: Tensor, scales: Tensor | None = None) -> Tensor:
        """x [..., K] @ W.T in x's dtype (with other `scales` than the weight's: `canonical`)."""
        rows = x.numel() // self.k
        flat = x.reshape(rows, self.k).contiguous()
        scales = self.scales if scales is None else scales
        scales = scales if scales.dtype == x.dtype else scales.to(x.dtype)
        if rows == 0:
            out = flat.new_zeros(0, self.n)
        elif self.kind == "int8" and x.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, scales)
        elif self.kind == "int8":
            out = F.linear(flat, self.weight.to(x.dtype)) * scales
        elif x.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, GROUP, scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm(flat, self.weight, GROUP, scales)
        return out.reshape(*x.shape[:-1], self.n)

    def reindexed(self, rows: Tensor | None = None, cols: Tensor | None = None) -> "Packed":
        """The same weight with its rows and columns reordered (trust's canaries permute a span to
        model another machine's sums). An int4 weight's columns move only in whole groups of GROUP,
        each kept together (`group_permutation`), so that scales and zeros still fit."""
        w = self.canonical()
        values, scale, zero = w.values, w.scale, w.zero
        if rows is not None:
            values, scale, zero = values[rows], scale[rows], None if zero is None else zero[rows]
        if cols is not None:
            values = values[:, cols]
            if w.kind == "int4":
                groups = cols.view(-1, GROUP) // GROUP
                if not (groups == groups[:, :1]).all():
                    raise ModelError("an int4 weight's columns are permuted only within whole groups")
                scale, zero = scale[:, groups[:, 0]], zero[:, groups[:, 0]]
        moved = QWeight(w.kind, values.contiguous(), scale.contiguous(),
                        None if zero is None else zero.contiguous(), w.origin)
        return pack(moved, self.scales.dtype, self.weight.device)

    def canonical(self) -> QWeight:
        """The canonical form back (exact sessions, tests, a tampering double): int8 values are
        the kernel's own; int4 values are read out through the kernel, a product by the identity
        with scale 1 and zero 8 in place of the weight's, which gives each integer itself
        (exactly, in bf16: the dtype the kernels are fast in on a CPU, and tinygemm's only one)."""
        if self.kind == "int8":
            return QWeight("int8", self.weight.cpu(), self.scale, None, self.origin)
        dev = self.weight.device
        eye = torch.eye(self.k, dtype=torch.bfloat16, device=dev)
        unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16, device=dev).expand(self.k // GROUP, self.n, 2)
        q = torch.cat([self.matmul(eye[s:s + 256], unit.contiguous()) for s in range(0, self.k, 256)])
        values = q.t().float().round().clamp(0, 15).to(torch.uint8).cpu()
        return QWeight("int4", values.contiguous(), self.scale, self.zero, self.origin)


def group_permutation(n: int, generator: torch.Generator) -> Tensor:
    """A random permutation of n (a multiple of GROUP) that moves whole groups of GROUP and
    shuffles within each: what an int4 weight's columns can take (`Packed.reindexed`)."""
    if n % GROUP:
        raise ModelError(f"{n} columns are not whole groups of {GROUP}: no int4 weight has them")
    groups = torch.randperm(n // GROUP, generator=generator)
    within = torch.stack([torch.randperm(GROUP, generator=generator) for _ in range(n // GROUP)])
    return (groups[:, None] * GROUP + within).flatten()


def trim_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them; RSS would count them as held)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def check_device(device: torch.device | str) -> None:
    """A CUDA device this torch can use, or a ModelError naming what is missing."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: this torch ({torch.__version__}) has no usable CUDA "
                         "(a CPU build, or no GPU/driver): use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")


def pack(w: QWeight, dtype: torch.dtype, device: torch.device | str) -> Packed:
    """The kernel layout of `w` on `device` for activations of `dtype` (built at load)."""
    device = torch.device(device)
    n, k = w.shape
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"quantized blocks run on a CPU or a CUDA GPU, not on {device}")
    if w.kind == "int8":
        check_device(device)
        return Packed("int8", n, k, w.values.to(device), w.scale.to(device, dtype), w.scale, None, w.origin)
    if device.type == "cuda" and (dtype != torch.bfloat16 or n % 8):
        raise ModelError(f"CUDA int4 needs bf16 activations and N a multiple of 8 (a {n}x{k} weight in "
                         f"{dtype}): use --dtype bf16 or --quant int8")
    check_device(device)
    scales = torch.stack([w.scale, w.zero], -1).transpose(0, 1).contiguous().to(device, dtype)
    if device.type == "cpu":
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.values.to(torch.int32), 1)
    else:
        v = w.values.to(device, torch.int32)
        tiles = next(t for t in INT4_TILES if k % (16 * t) == 0)
        weight = torch.ops.aten._convert_weight_to_int4pack(((v[:, ::2] << 4) | v[:, 1::2]).to(torch.uint8), tiles)
    return Packed("int4", n, k, weight, scales, w.scale, w.zero, w.origin)
