"""Quantized variants: a model of its own beside its source in the store (`NAME@int4`, `NAME@int8`).

A variant directory holds the source's config and tokenizer, one safetensors file per block
with its weights in canonical quantized form (model/quant.py: values, scales, zeros; norms and
biases as in the source), and a manifest naming its source (model hash and store name), its
scheme and group size, what each tensor became, and its per-block hashes over those canonical
tensors, so that quantizing one source gives the same bytes and hashes on every machine. The
head (embeddings, final norm, LM head) is not quantized: it stays the client's, read from the
source, in the client's dtype (`--quant` covers the blocks only).

Made once, on first use (`resolve`), from the source's weights by round-to-nearest; a GGUF
import also writes the variant its file maps to exactly (`keep_gguf`): Q4_0, Q4_1 and Q4_K
tensors become int4 groups of 32 with scale and zero (exact up to the bf16 rounding of the
scales), Q5_K, Q6_K and Q8_0 ones int8 per row.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from diffuse.errors import ModelError
from diffuse.model import quant
from diffuse.model.config import ModelConfig
from diffuse.model.quant import GROUP, QWeight
from diffuse.model.weights import MANIFEST, MANIFEST_FORMAT, BLOCK_PREFIX, Manifest, ModelFiles, block_hash, \
    load_manifest

SEP = "@"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")  # one q/k/v/o + gate/up/down layout
QUANTIZED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
Progress = Callable[[str], None]
Block = dict[str, "torch.Tensor | QWeight"]


def variant_dir(source: Path, scheme: str) -> Path:
    return source.parent / f"{source.name}{SEP}{scheme}"


def source_dir(variant: Path, manifest: Manifest) -> Path:
    """The store directory of a variant's source (where its head is read from)."""
    src = variant.parent / manifest.source_id
    if not (src / MANIFEST).is_file() or load_manifest(src).model_hash != manifest.source:
        raise ModelError(f"{variant.name} is a variant of {manifest.source_id} ({manifest.source[:16]}…), "
                         f"which is not in {variant.parent}: pull it again")
    return src


def resolve(model_dir: Path, scheme: str, progress: Progress | None = None) -> Path:
    """The directory whose blocks a process holding `scheme` loads: the model itself for
    `none`, else its variant, made now from the source if the store lacks it."""
    quant.parse_scheme(scheme)
    model_dir = Path(model_dir)
    if scheme == "none" and not (model_dir / MANIFEST).is_file():
        return model_dir  # a directory without commitments (tests' models): as it is
    own = load_manifest(model_dir)
    if own.quant == scheme:
        return model_dir
    if own.quant != "none":
        model_dir = source_dir(model_dir, own)
    if scheme == "none":
        return model_dir
    dest = variant_dir(model_dir, scheme)
    if not (dest / MANIFEST).is_file():
        make_variant(model_dir, scheme, progress)
    return dest


def make_variant(source: Path, scheme: str, progress: Progress | None = None) -> Path:
    """Quantize the source's blocks (round to nearest, model/quant.py) into its variant directory."""
    files = ModelFiles(source)
    _check_family(files.config)

    def blocks() -> Iterator[Block]:
        for i in range(files.config.num_layers):
            yield {n: quant.quantize(t, scheme) if n in QUANTIZED else t for n, t in files.read_block(i).items()}

    return write_variant(source, scheme, blocks(), progress)


def _check_family(cfg: ModelConfig) -> None:
    if cfg.arch not in FAMILIES or cfg.num_experts:
        raise ModelError(f"quantized blocks are supported for {', '.join(FAMILIES)} models, not {cfg.arch}")


def write_variant(source: Path, scheme: str, blocks: Iterator[Block], progress: Progress | None = None) -> Path:
    """Write the variant of `source` whose blocks (quantized weights as QWeight) `blocks` yields,
    atomically: a finished directory appears, or nothing (another process may race us to it)."""
    say = progress or (lambda _msg: None)
    base = load_manifest(source)
    dest = variant_dir(source, scheme)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.partial")
    tmp.mkdir(parents=True)
    try:
        for f in source.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (MANIFEST,
                                                                                    "model.safetensors.index.json"):
                shutil.copyfile(f, tmp / f.name)
        hashes, sizes, kinds = [], [], {}
        for i, block in enumerate(blocks):
            tensors = {}
            for name, t in sorted(block.items()):
                full = f"{BLOCK_PREFIX}{i}.{name}"
                if isinstance(t, QWeight):
                    tensors |= {f"{BLOCK_PREFIX}{i}.{k}": v for k, v in t.tensors(name).items()}
                    kinds[full] = t.origin
                else:
                    tensors[full] = t.contiguous()
            save_file(tensors, tmp / f"block-{i:05d}.safetensors")
            local = {k.removeprefix(f"{BLOCK_PREFIX}{i}."): v for k, v in tensors.items()}
            hashes.append(block_hash(local))
            sizes.append(sum(v.numel() * v.element_size() for v in local.values()))
            if i % 10 == 0:
                say(f"  {scheme}: block {i}")
        # Format 1 whatever the source's: a format-2 source's sizes and files are not the variant's
        # (model/blockfiles.py `complete` upgrades it with its own).
        manifest = replace(base, dtype=base.dtype, block_hashes=hashes, quant=scheme,
                           group_size=GROUP if scheme == "int4" else 0, source=base.model_hash,
                           source_id=source.name, tensors=kinds, block_bytes=sizes, format=MANIFEST_FORMAT,
                           block_sizes=[], head_size=0, files={})
        (tmp / MANIFEST).write_text(json.dumps(asdict(manifest) | {"model_hash": manifest.model_hash}, indent=1) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:  # made meanwhile by another process: the same bytes, keep theirs
            if not (dest / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"{dest.name}: {scheme} variant of {source.name}, model hash {load_manifest(dest).model_hash[:16]}…")
    return dest


def gather(tensors: dict[str, torch.Tensor]) -> Block:
    """A variant block's stored tensors with each quantized weight's parts as one QWeight."""
    out: Block = {}
    for name in tensors:
        if name.endswith(".q"):
            out[name[:-2]] = QWeight.from_tensors(tensors, name[:-2])
        elif not name.endswith((".scale", ".zero")):
            out[name] = tensors[name]
    return out


# ---- GGUF: what a file's quantization becomes when it is kept ----

KEPT_INT4 = ("Q4_0", "Q4_1", "Q4_K")
KEPT_INT8 = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def kept(data: np.ndarray, type_name: str, n: int, k: int) -> QWeight | None:
    """A GGUF tensor [n, k] of type `type_name` in canonical form: int4 for Q4_0/Q4_1/Q4_K,
    whose groups of 32 hold one scale and one offset each (w = d * q + m becomes scale d and
    zero m + 8 d, rounded to bf16); None for other types (they are requantized)."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(-1, size)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if type_name == "Q4_1" else -8 * d
        qs = b[:, size - 16:]
        values = np.concatenate([qs & 15, qs >> 4], axis=1)  # elements 0..15 low nibbles, 16..31 high
    elif type_name == "Q4_K":
        from gguf.quants import Q4_K

        b = raw.reshape(-1, 144)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        d, m = (d * sc.astype(np.float32)).reshape(-1), (-dmin * mn.astype(np.float32)).reshape(-1)
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        values = (qs & 15).reshape(-1, 32)
    else:
        return None
    scale = torch.from_numpy(d).to(torch.bfloat16).view(n, k // GROUP)
    zero = torch.from_numpy(m + 8 * d).to(torch.bfloat16).view(n, k // GROUP)
    return QWeight("int4", torch.from_numpy(values.astype(np.uint8)).reshape(n, k), scale, zero,
                   f"int4 g{GROUP} (gguf {type_name}, kept)")


def kept_scheme(types: list[str]) -> str | None:
    """The variant a GGUF's block matrices map to: int4 if any is a 4-bit type, int8 if all are
    of more bits, None if none is quantized."""
    if any(t in KEPT_INT4 for t in types):
        return "int4"
    return "int8" if any(t in KEPT_INT8 for t in types) else None
