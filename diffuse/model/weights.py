"""Safetensors access by block: partial loading and per-block SHA-256 weight commitments.

A peer serving blocks [a, b) opens the model's safetensors files and reads only the tensors of
those blocks (plus embeddings / final norm / head when asked), so its memory grows with its span,
not with the model. The same per-block view gives the weight commitments: a SHA-256 over a
canonical encoding of each block's tensors, listed in the model's manifest.json.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from diffuse.errors import ModelError
from diffuse.model.config import ModelConfig

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
BLOCK_PREFIX = "model.layers."
HEAD_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class ModelFiles:
    """Which safetensors file holds which tensor, from model.safetensors.index.json or the headers."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.config = ModelConfig.load(self.dir)
        self.where: dict[str, Path] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelError(f"{index} is malformed: {e}") from None
            self.where = {name: self.dir / f for name, f in weight_map.items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelError(f"no *.safetensors files in {self.dir}")
            for f in files:
                with _open(f) as st:
                    self.where.update({name: f for name in st.keys()})

    def block_names(self, i: int) -> list[str]:
        prefix = f"{BLOCK_PREFIX}{i}."
        names = sorted(n for n in self.where if n.startswith(prefix))
        if not names:
            raise ModelError(f"{self.dir.name} has no tensors for block {i}")
        return names

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read only the named tensors, grouped per file; a damaged file raises ModelError."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.where:
                raise ModelError(f"{self.dir.name} lacks tensor {n}")
            by_file.setdefault(self.where[n], []).append(n)
        out = {}
        for f, group in by_file.items():
            with _open(f) as st:
                for n in group:
                    try:
                        out[n] = st.get_tensor(n)
                    except Exception as e:  # safetensors raises several types for damaged data
                        raise ModelError(f"{f} is corrupt or truncated (tensor {n}): {e}") from None
        return out

    def read_block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors keyed by their name inside the block (e.g. 'self_attn.q_proj.weight')."""
        prefix = f"{BLOCK_PREFIX}{i}."
        return {n[len(prefix):]: t for n, t in self.read(self.block_names(i)).items()}

    def read_head(self) -> dict[str, torch.Tensor]:
        names = [n for n in HEAD_TENSORS if n in self.where]
        return self.read(names)


def _open(path: Path):
    if not path.is_file():
        raise ModelError(f"missing weights file {path}")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        raise ModelError(f"{path} is not a valid safetensors file: {e}") from None


def tensor_digest(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    """Feed one tensor into a hash canonically: name, dtype, shape, then its little-endian bytes."""
    header = f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{','.join(map(str, t.shape))}\0"
    h.update(header.encode())
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def block_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a block's tensors in name order: the weight commitment peers announce."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor_digest(h, name, tensors[name])
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What a model is, by content: per-block hashes anyone with the files can recompute."""

    model_id: str
    arch: str
    num_layers: int
    dtype: str
    block_hashes: list[str]
    head_hash: str
    format: int = MANIFEST_FORMAT

    @property
    def model_hash(self) -> str:
        """One hash naming this exact model (blocks and head), for DHT keys and trust."""
        return hashlib.sha256("".join(self.block_hashes + [self.head_hash]).encode()).hexdigest()


def compute_manifest(model_dir: Path) -> Manifest:
    files = ModelFiles(model_dir)
    cfg = files.config
    hashes, dtype = [], None
    for i in range(cfg.num_layers):
        block = files.read_block(i)
        dtype = dtype or str(next(iter(block.values())).dtype).removeprefix("torch.")
        hashes.append(block_hash(block))
    return Manifest(
        model_id=Path(model_dir).name,
        arch=cfg.arch,
        num_layers=cfg.num_layers,
        dtype=dtype or "float32",
        block_hashes=hashes,
        head_hash=block_hash(files.read_head()),
    )


def write_manifest(model_dir: Path) -> Manifest:
    m = compute_manifest(model_dir)
    d = asdict(m) | {"model_hash": m.model_hash}
    (Path(model_dir) / MANIFEST).write_text(json.dumps(d, indent=1) + "\n")
    return m


def load_manifest(model_dir: Path) -> Manifest:
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise ModelError(f"{model_dir} has no {MANIFEST}: re-import the model (diffuse model pull)")
    try:
        d = json.loads(path.read_text())
        d.pop("model_hash", None)
        return Manifest(**d)
    except (json.JSONDecodeError, TypeError) as e:
        raise ModelError(f"{path} is malformed: {e}") from None


def verify_blocks(files: ModelFiles, manifest: Manifest, start: int, end: int,
                  loaded: dict[int, dict[str, torch.Tensor]]) -> None:
    """Refuse to serve weights that differ from the manifest the peer announces."""
    for i in range(start, end):
        got = block_hash(loaded[i])
        if got != manifest.block_hashes[i]:
            raise ModelError(
                f"block {i} of {files.dir.name} does not match its manifest "
                f"(sha256 {got[:12]}… != {manifest.block_hashes[i][:12]}…): the files are damaged or altered"
            )
