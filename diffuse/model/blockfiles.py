"""Blocks as files: the canonical bytes a block's weight commitment is the SHA-256 of.

`weights.block_hash` hashes, per tensor in name order, `name \\0 dtype \\0 shape \\0` and the
tensor's little-endian bytes. That byte string is a file whose SHA-256 is the block hash the
manifest lists, so a block travels under its commitment: a peer serves it without storing it
(its tensors' bytes lie in its safetensors files, the headers are made on the fly: `segments`),
and a receiver that checked the hash rewrites it as one safetensors file per block
(`to_safetensors`), the layout a partial store holds (`block-00007.safetensors`,
`head.safetensors`). The head (embeddings, final norm, LM head) travels the same way under the
head hash, its tensors under their full names.

A manifest of format 2 (`complete`) adds what a receiver checks before it trusts a byte: each
block's and the head's canonical size, and the size and SHA-256 of every other file of the model
(config, tokenizer): the SHA-256 of manifest.json then names everything a peer needs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import BinaryIO, Union

from diffuse.errors import ModelError
from diffuse.model.weights import BLOCK_PREFIX, HEAD_TENSORS, MANIFEST, Manifest, ModelFiles, SafetensorsFile, \
    block_hash, load_manifest

Segment = Union[bytes, tuple[Path, int, int]]  # literal bytes, or (file, offset, length) of its bytes
HEAD_FILE = "head.safetensors"
FORMAT = 2
NOT_FILES = (MANIFEST, "model.safetensors.index.json")  # what a manifest's `files` never lists
_ST = {str(t).removeprefix("torch."): code for code, t in SafetensorsFile.DTYPES.items()}  # float32 -> F32
_ITEM = {str(t).removeprefix("torch."): t.itemsize for t in SafetensorsFile.DTYPES.values()}
MAX_FIELD = 1024  # bytes of one name, dtype or shape in a canonical header
MAX_TENSORS = 4096  # tensors in one block (experts included)


def block_file(model_dir: Path, i: int) -> Path:
    return Path(model_dir) / f"block-{i:05d}.safetensors"


def _header(name: str, dtype: str, shape: list[int]) -> bytes:
    return f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode()


def _segments(files: ModelFiles, names: list[str], prefix: str) -> list[Segment]:
    out: list[Segment] = []
    for full in sorted(names, key=lambda n: n[len(prefix):]):
        f = files._file(files.where[full])
        dtype, shape, begin, end = f.entries[full]
        out.append(_header(full[len(prefix):], str(dtype).removeprefix("torch."), shape))
        if end > begin:
            out.append((f.path, f.base + begin, end - begin))
    return out


def segments(files: ModelFiles, block: int | None) -> list[Segment]:
    """The canonical bytes of block `block` (None: the head) as pieces of the store's files."""
    if block is None:
        return _segments(files, [n for n in HEAD_TENSORS if n in files.where], "")
    return _segments(files, files.block_names(block), f"{BLOCK_PREFIX}{block}.")


def size(segs: list[Segment]) -> int:
    return sum(len(s) if isinstance(s, bytes) else s[2] for s in segs)


def held(model_dir: Path) -> tuple[set[int], bool]:
    """The blocks whose tensors the store holds, and whether it holds the head: the embeddings,
    final norm and LM head (tied to the embeddings where the config says so), not one of them
    alone (a shard of the Hub may hold the embeddings and not the rest)."""
    if not any(Path(model_dir).glob("*.safetensors")):
        return set(), False
    files = ModelFiles(model_dir)
    names = files.where
    blocks = {int(m.group(1)) for n in names if (m := re.match(rf"{re.escape(BLOCK_PREFIX)}(\d+)\.", n))}
    head = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if files.config.tie_word_embeddings
                                                                  else {"lm_head.weight"})
    return blocks, head <= names.keys()


def complete(model_dir: Path) -> Manifest:
    """The manifest, upgraded once (atomically) from format 1 to 2 on a store that made its own and
    holds every block and the head (a variant: its source's head, not held). A format-2 manifest
    is never rewritten: fetched, it is the swarm's, and its SHA-256 is what this peer announces; a
    rewrite from a partial store (no head, other files about) would split the swarm."""
    model_dir = Path(model_dir)
    m = load_manifest(model_dir)
    if m.format >= FORMAT:
        return m
    blocks, head = held(model_dir)
    if not blocks.issuperset(range(m.num_layers)) or not (head or m.quant != "none"):
        return m
    files = ModelFiles(model_dir)
    got = replace(m, format=FORMAT, block_sizes=[size(segments(files, i)) for i in range(m.num_layers)],
                  head_size=size(segments(files, None)) if head else 0, files=other_files(model_dir))
    if got != m:
        write_atomic(model_dir / MANIFEST, (json.dumps(asdict(got) | {"model_hash": got.model_hash},
                                                       indent=1) + "\n").encode())
    return got


def other_files(model_dir: Path) -> dict[str, list]:
    """{name: [size, sha256]} of the model's files other than weights and manifest."""
    out = {}
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" and f.name not in NOT_FILES:
            out[f.name] = [f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()]
    return out


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _field(f: BinaryIO, what: str) -> str:
    out = bytearray()
    while (c := f.read(1)) != b"\0":
        if not c or len(out) >= MAX_FIELD:
            raise ModelError(f"canonical block file: {what} is truncated or too long")
        out += c
    return out.decode()


def parse(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """(name, dtype, shape, offset of its bytes, their length) per tensor of a canonical file."""
    total, out = Path(path).stat().st_size, []
    with open(path, "rb") as f:
        while f.tell() < total:
            name, dtype, shape_text = _field(f, "a name"), _field(f, "a dtype"), _field(f, "a shape")
            if dtype not in _ST or len(out) >= MAX_TENSORS:
                raise ModelError(f"canonical block file: tensor {name!r} has dtype {dtype!r} or one tensor too many")
            shape = [int(x) for x in shape_text.split(",")] if shape_text else []
            length = math.prod(shape) * _ITEM[dtype]
            if f.tell() + length > total:
                raise ModelError(f"canonical block file: tensor {name!r} runs past the end")
            out.append((name, dtype, shape, f.tell(), length))
            f.seek(length, os.SEEK_CUR)
    return out


def to_safetensors(canonical: Path, dest: Path, block: int | None) -> None:
    """Rewrite a checked canonical file as `dest` (a safetensors file, tensors under their full
    names), atomically, copying in bounded pieces."""
    prefix = "" if block is None else f"{BLOCK_PREFIX}{block}."
    tensors = parse(canonical)
    header, at = {}, 0
    for name, dtype, shape, _, length in tensors:
        header[prefix + name] = {"dtype": _ST[dtype], "shape": shape, "data_offsets": [at, at + length]}
        at += length
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, open(canonical, "rb") as src:
            out.write(len(text).to_bytes(8, "little") + text)
            for *_, offset, length in tensors:
                src.seek(offset)
                while length:
                    chunk = src.read(min(length, 1 << 20))
                    out.write(chunk)
                    length -= len(chunk)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verify(model_dir: Path, say) -> int:
    """`diffuse model verify`: re-hash every block and the head the store holds, and every file
    the manifest lists; say each bad one by name. 0 if all match, else 1."""
    model_dir = Path(model_dir)
    m, bad, files = load_manifest(model_dir), [], ModelFiles(model_dir)
    blocks, head = held(model_dir)
    for i in sorted(blocks):
        got = block_hash(files.read_block(i))
        if got != m.block_hashes[i]:
            bad.append(f"block {i} ({', '.join(sorted({files.where[n].name for n in files.block_names(i)}))}): "
                       f"hashes to {got}, the manifest says {m.block_hashes[i]}")
    if head and (got := block_hash(files.read_head())) != m.head_hash:
        bad.append(f"the head: hashes to {got}, the manifest says {m.head_hash}")
    for name, (length, sha) in m.files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != length or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            bad.append(f"{name}: missing, or not the {length} bytes with SHA-256 {sha} the manifest lists")
    for line in bad:
        say(f"bad: {line}")
    say(f"{model_dir.name}: {len(blocks)} block(s){', the head' if head else ''} and {len(m.files)} file(s) checked, "
        f"{len(bad)} bad")
    return 1 if bad else 0
