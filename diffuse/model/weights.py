"""Safetensors access by block: partial loading and per-block SHA-256 weight commitments.

A peer serving blocks [a, b) opens the model's safetensors files and reads only the tensors of
those blocks (plus embeddings / final norm / head when asked), so its memory grows with its span,
not with the model. The same per-block view gives the weight commitments: a SHA-256 over a
canonical encoding of each block's tensors, listed in the model's manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diffuse.errors import ModelError
from diffuse.model.config import ModelConfig

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
BLOCK_PREFIX = "model.layers."
HEAD_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class SafetensorsFile:
    """Reads single tensors of a .safetensors file with plain seeks and reads.

    Not mmap: pages of a mapped file stay in the process's RSS once touched, so a peer reading
    a third of the model would look (and be accounted) as if it held much more. The format is an
    8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}},
    then the data; every offset is checked against the real file size, so a truncated file is
    named as such instead of failing deep inside a read.
    """

    DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"missing weights file {self.path}")
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if not 2 <= n <= min(size - 8, 100 << 20):
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self.base = 8 + n
            self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
            for name, e in header.items():
                dtype = self.DTYPES[e["dtype"]]
                begin, end = e["data_offsets"]
                count = math.prod(e["shape"])
                if not 0 <= begin <= end or end - begin != count * dtype.itemsize:
                    raise ValueError(f"tensor {name} has inconsistent offsets")
                self.entries[name] = (dtype, list(e["shape"]), begin, end)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise ModelError(f"{self.path} is not a valid safetensors file: {e}") from None
        last = max((e[3] for e in self.entries.values()), default=0)
        if self.base + last > size:
            raise ModelError(f"{self.path} is truncated: its header describes {self.base + last} bytes, "
                             f"the file has {size}")

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        buf = bytearray(end - begin)
        with open(self.path, "rb") as f:
            f.seek(self.base + begin)
            if f.readinto(buf) != len(buf):
                raise ModelError(f"{self.path} is truncated (tensor {name})")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class ModelFiles:
    """Which safetensors file holds which tensor, from model.safetensors.index.json or the headers.
    A partial store may hold both: shards of the index (`model pull --blocks`) and, beside them,
    files the index does not name (a block or the head fetched from peers, model/blockfiles.py),
    whose tensors are read from those files: each holds a whole block or the whole head, checked
    by its hash as it arrived."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.config = ModelConfig.load(self.dir)
        self.files: dict[Path, SafetensorsFile] = {}
        self.where: dict[str, Path] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelError(f"{index} is malformed: {e}") from None
            self.where = {name: self.dir / f for name, f in weight_map.items()}
            indexed = set(self.where.values())
            for f in sorted(self.dir.glob("*.safetensors")):  # a block or the head fetched beside the shards
                if f not in indexed:
                    self.where.update({name: f for name in self._file(f).entries})
        else:
            paths = sorted(self.dir.glob("*.safetensors"))
            if not paths:
                raise ModelError(f"no *.safetensors files in {self.dir}")
            for f in paths:
                self.where.update({name: f for name in self._file(f).entries})

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self.files:
            self.files[path] = SafetensorsFile(path)
        return self.files[path]

    def block_names(self, i: int) -> list[str]:
        prefix = f"{BLOCK_PREFIX}{i}."
        names = sorted(n for n in self.where if n.startswith(prefix))
        if not names:
            raise ModelError(f"{self.dir.name} has no tensors for block {i}")
        return names

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Read only the named tensors; a damaged file raises ModelError naming it."""
        out = {}
        for n in names:
            if n not in self.where:
                raise ModelError(f"{self.dir.name} lacks tensor {n}")
            f = self._file(self.where[n])
            if n not in f.entries:
                raise ModelError(f"{f.path} lacks tensor {n} named in the index")
            out[n] = f.read(n)
        return out

    def read_block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors keyed by their name inside the block (e.g. 'self_attn.q_proj.weight')."""
        prefix = f"{BLOCK_PREFIX}{i}."
        return {n[len(prefix):]: t for n, t in self.read(self.block_names(i)).items()}

    def read_head(self) -> dict[str, torch.Tensor]:
        names = [n for n in HEAD_TENSORS if n in self.where]
        return self.read(names)


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
    # A quantized variant (model/variants.py): its scheme, group size, source (model hash and
    # store name), what each quantized tensor became, and each block's bytes.
    quant: str = "none"
    group_size: int = 0
    source: str = ""
    source_id: str = ""
    tensors: dict[str, str] = field(default_factory=dict)
    block_bytes: list[int] = field(default_factory=list)
    # Format 2 (model/blockfiles.py): each block's and the head's canonical size, and {name: [size,
    # sha256]} of the model's other files, so that the manifest's own SHA-256 names all it needs.
    block_sizes: list[int] = field(default_factory=list)
    head_size: int = 0
    files: dict[str, list] = field(default_factory=dict)

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

