"""Build engine modules from a model directory, reading only the tensors they need."""

from __future__ import annotations

from pathlib import Path

import torch

from diffuse.errors import ModelError
from diffuse.model.engine import BlockSpan, Head
from diffuse.model.meta import on_meta
from diffuse.model import variants
from diffuse.model.quant import check_device, trim_heap
from diffuse.model.weights import MANIFEST, ModelFiles, block_hash, load_manifest

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}: choose fp32, bf16 or fp16") from None


def _materialise(module: torch.nn.Module, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Uninitialised storage for a module built `on_meta`, in `dtype` on `device`. (Not
    `to_empty`: its empty_like of a meta tensor imports sympy, which slows every process's start.)"""
    return module.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_span(model_dir: Path, start: int, end: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu", verify: bool = True, quant: str | None = None) -> BlockSpan:
    """Blocks [start, end), reading only their tensors; verify checks them against the manifest.
    quant: hold the blocks of that variant (model/variants.py; made first if the store lacks
    it), computing in `dtype`; None: those of `model_dir` as it is."""
    check_device(device)
    if quant is not None:
        model_dir = variants.resolve(model_dir, quant)
    files = ModelFiles(model_dir)
    cfg = files.config
    if not 0 <= start < end <= cfg.num_layers:
        raise ModelError(f"blocks {start}:{end} are outside {files.dir.name}'s {cfg.num_layers} blocks")
    manifest = load_manifest(model_dir) if verify else None
    quantized = (Path(model_dir) / MANIFEST).is_file() and load_manifest(model_dir).quant != "none"
    with on_meta():
        span = BlockSpan(cfg, start, end)
    _materialise(span, dtype, device)
    for block, i in zip(span.blocks, range(start, end)):
        tensors = files.read_block(i)
        if manifest is not None and block_hash(tensors) != manifest.block_hashes[i]:
            raise ModelError(f"block {i} of {files.dir.name} does not match its manifest: "
                             "the weights are damaged or altered; re-import the model")
        try:
            block.load_hf(variants.gather(tensors) if quantized else tensors)
        except RuntimeError as e:  # e.g. tensors of mismatched shapes concatenated
            raise ModelError(f"block {i} of {files.dir.name} does not fit its config: {e}") from None
        del tensors
    span.quant = load_manifest(model_dir).quant if quantized else "none"
    if quantized:
        trim_heap()  # packing's transient buffers (int32 values) freed: hand their pages back
    return span.eval()


def load_head(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
              verify: bool = True) -> Head:
    """Embeddings, final norm and LM head; verify checks them against the manifest, as blocks are.
    A quantized variant's head is its source's (`--quant` covers the blocks only)."""
    manifest = load_manifest(model_dir) if (Path(model_dir) / MANIFEST).is_file() else None
    if manifest is not None and manifest.quant != "none":
        model_dir = variants.source_dir(Path(model_dir), manifest)
    files = ModelFiles(model_dir)
    tensors = files.read_head()
    if verify and block_hash(tensors) != load_manifest(model_dir).head_hash:
        raise ModelError(f"the head (embeddings, final norm, LM head) of {files.dir.name} does not match its "
                         "manifest: the weights are damaged or altered; re-import the model")
    check_device(device)
    with on_meta():
        head = Head(files.config)
    _materialise(head, dtype, device)
    head.load_hf(tensors)
    return head.eval()
