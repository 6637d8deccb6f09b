"""Automatic block choice (`--blocks auto`): strengthen the weakest blocks first (Petals' rule).

A joining peer that can hold L blocks looks at how many replicas each block has and takes the
window of L consecutive blocks whose replica counts, sorted ascending, are lexicographically
smallest ("leximin"): first the window holding the most uncovered blocks, then the most blocks
with one replica, and so on; ties go to the lowest start, so the choice is deterministic.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

from diffuse.errors import DiffuseError
from diffuse.model.config import ModelConfig
from diffuse.model.engine import block_parameters, family
from diffuse.model.kernels import Linear, reorders
from diffuse.model.meta import on_meta
from diffuse.model.quant import weight_bytes

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class PlacementError(DiffuseError):
    """A bad --blocks / --max-memory / --num-blocks value."""


def choose_span(replicas: Sequence[float], length: int) -> tuple[int, int]:
    """[start, end) of `length` consecutive blocks that best covers the least-served blocks."""
    n = len(replicas)
    if n == 0:
        raise PlacementError("the model has no blocks")
    length = max(1, min(length, n))
    best_key: list[float] | None = None
    best = 0
    for s in range(n - length + 1):
        key = sorted(replicas[s:s + length])
        if best_key is None or key < best_key:
            best_key, best = key, s
    return best, best + length


def requested_blocks(blocks: str, num_blocks: int | None, max_memory: str | None, cfg: ModelConfig,
                     dtype: str, quant: str = "none") -> tuple[tuple[int, int] | None, int]:
    """What `--blocks / --num-blocks / --max-memory` ask for: an explicit span (None for `auto`)
    and, for auto, how many blocks to take; PlacementError for a bad or contradictory request."""
    if blocks.strip().lower() != "auto":
        if num_blocks is not None or max_memory is not None:
            raise PlacementError("--num-blocks / --max-memory only apply with --blocks auto")
        span = parse_span(blocks, cfg.num_layers)
        return span, span[1] - span[0]
    if num_blocks is not None and max_memory is not None:
        raise PlacementError("give --num-blocks or --max-memory, not both")
    if num_blocks is not None:
        if num_blocks < 1:
            raise PlacementError("--num-blocks must be at least 1")
        return None, min(num_blocks, cfg.num_layers)
    if max_memory is not None:
        return None, blocks_for_budget(parse_size(max_memory), cfg, dtype, quant)
    return None, cfg.num_layers


def parse_span(text: str, num_blocks: int) -> tuple[int, int]:
    """`A:B` -> [A, B); either side may be omitted (`:10`, `20:`)."""
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", text)
    if not m:
        raise PlacementError(f"bad --blocks {text!r}: use A:B (serves blocks A..B-1) or auto")
    start = int(m.group(1)) if m.group(1) else 0
    end = int(m.group(2)) if m.group(2) else num_blocks
    if not (0 <= start < end <= num_blocks):
        raise PlacementError(f"bad --blocks {text!r}: the model has blocks 0..{num_blocks - 1}")
    return start, end


def parse_size(text: str) -> int:
    """`2GiB`, `1.5G`, `500MB`, `800M`, `123456` -> bytes (K/M/G/T are powers of 1000,
    Ki/Mi/Gi/Ti powers of 1024; a trailing B is optional)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    try:
        value = float(m.group(1)) if m else -1.0
    except ValueError:
        value = -1.0
    if not m or value <= 0:
        raise PlacementError(f"bad memory size {text!r}: use e.g. 800MiB or 2GB")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(value * (1024 if m.group(3) else 1000) ** power)


def block_bytes(cfg: ModelConfig, dtype: str, quant: str = "none") -> int:
    """Weight bytes of the model's largest transformer block in `dtype` (every expert of a
    mixture included: a peer holds whole blocks), twice that where products keep a reordered copy
    of each weight (model/kernels.py, `reorders`: fp32, and bf16 on CPUs with native bf16). A
    quantized variant's blocks: their kernels' real bytes (`held_bytes`)."""
    if quant != "none":
        return max(held_bytes(cfg, layer, quant, DTYPE_BYTES.get(dtype, 4)) for layer in range(cfg.num_layers))
    per = DTYPE_BYTES.get(dtype, 4) * (2 if reorders(getattr(torch, dtype, torch.float32)) else 1)
    return max(block_parameters(cfg, layer) for layer in range(cfg.num_layers)) * per


def held_bytes(cfg, layer: int, scheme: str, dtype_bytes: int) -> int:
    """Bytes block `layer` holds as variant `scheme` computing in a dtype of `dtype_bytes`: its
    projections quantized, its norms (and biases) in the dtype. Counted on the meta device."""
    with on_meta():
        block = family(cfg).block(cfg, layer)
    mats = [m for m in block.modules() if isinstance(m, Linear)]
    rest = sum(p.numel() for p in block.parameters()) - sum(m.weight.numel() for m in mats)
    return sum(weight_bytes(*m.weight.shape, scheme, dtype_bytes) for m in mats) + rest * dtype_bytes


def blocks_for_budget(budget: int, cfg: ModelConfig, dtype: str, quant: str = "none") -> int:
    """How many blocks fit in `budget` bytes of weights (KV cache is budgeted by the data plane)."""
    per = block_bytes(cfg, dtype, quant)
    n = budget // per
    if n < 1:
        raise PlacementError(
            f"--max-memory {budget / 2**20:.0f} MiB cannot hold one block ({per / 2**20:.1f} MiB)")
    return int(min(n, cfg.num_layers))


def available_memory() -> int:
    """Bytes of memory available now (free plus reclaimable, as Linux's MemAvailable says)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
