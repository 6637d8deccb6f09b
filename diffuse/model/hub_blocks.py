"""`diffuse model pull ORG/NAME --blocks A:B`: from the Hugging Face Hub, only the safetensors
shards that hold blocks A..B-1, as `model.safetensors.index.json` maps tensors to shards.

The store then holds a partial model: config, tokenizer, the shards pulled and an index naming
only the tensors they hold; blocks (or the head) fetched from peers may lie beside them as files
of their own (model/blockfiles.py), and a pull fetches only the shards of blocks held by neither.
Its manifest lists the hashes of the blocks it holds and leaves the others empty (they cannot be
computed without their weights), so its model hash is not the model's: such a peer announces its
span's block hashes, which clients check against their own manifests, and no manifest of its own
(peer/offer.py); `--from-swarm` replaces it with the swarm's where the hashes it has agree. A
later pull of another span fetches the shards it lacks and adds their blocks; on a store whose
manifest came from peers (format 2), that manifest stays, and each block pulled is checked
against it. A model in one file has nothing to choose: it is pulled whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from diffuse.errors import ModelError
from diffuse.model import blockfiles, hub
from diffuse.model.config import ModelConfig
from diffuse.model.weights import BLOCK_PREFIX, HEAD_TENSORS, MANIFEST, Manifest, ModelFiles, block_hash, load_manifest

INDEX = "model.safetensors.index.json"
Progress = Callable[[str], None]


def span(text: str, num_layers: int) -> range:
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", text)
    start, end = (int(m.group(1) or 0), int(m.group(2) or num_layers)) if m else (0, -1)
    if not 0 <= start < end <= num_layers:
        raise ModelError(f"--blocks wants A:B with 0 <= A < B <= {num_layers}, got {text!r}")
    return range(start, end)


def shards_for(weight_map: dict[str, str], blocks: range) -> set[str]:
    """The shards holding any tensor of `blocks`."""
    return {f for n, f in weight_map.items() if (m := re.match(rf"{re.escape(BLOCK_PREFIX)}(\d+)\.", n))
            and int(m.group(1)) in blocks}


def pull_blocks(repo_id: str, models_dir: Path, blocks: str, progress: Progress | None = None) -> Path:
    """Pull the shards of `repo_id` holding `blocks` (A:B) into `models_dir/<name>`, beside any
    the store holds already; returns the model's directory."""
    say = progress or (lambda _msg: None)
    small = [p for p in hub.ALLOW_PATTERNS if p != "*.safetensors"]
    say(f"fetching {repo_id}: config, tokenizer and index")
    src = hub.download(repo_id, None, small)
    if not (src / INDEX).is_file():
        say(f"{repo_id} is one safetensors file: pulling it whole")
        return hub.pull_hf(repo_id, models_dir, progress=progress)
    cfg = ModelConfig.load(src)
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    dest = Path(models_dir) / repo_id.rstrip("/").split("/")[-1]
    held_blocks = blockfiles.held(dest)[0] if (dest / MANIFEST).is_file() else set()
    wanted = span(blocks, cfg.num_layers)
    if not set(wanted) - held_blocks:
        say(f"{dest.name} holds blocks {blocks} already in {dest}")
        return dest
    have = {p.name for p in dest.glob("*.safetensors")} if dest.is_dir() else set()
    need = sorted(shards_for(weight_map, [b for b in wanted if b not in held_blocks])
                  - have)
    say(f"{len(need)} of {len(set(weight_map.values()))} shards hold blocks {blocks} the store lacks: "
        f"{', '.join(need) or 'none'}")
    if need:
        src = hub.download(repo_id, None, small + need)
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and hub.wanted(p.name) and p.name != INDEX and (p.name in need or not p.name.endswith(
                ".safetensors")):
            say(f"linking {p.name}")
            tmp = dest / f".{p.name}.tmp"
            tmp.unlink(missing_ok=True)
            hub.place(p, tmp, True)
            tmp.replace(dest / p.name)
    held = {p.name for p in dest.glob("*.safetensors")}
    index = {"metadata": {}, "weight_map": {n: f for n, f in weight_map.items() if f in held}}
    (dest / f".{INDEX}.tmp").write_text(json.dumps(index, indent=1))
    (dest / f".{INDEX}.tmp").replace(dest / INDEX)
    _manifest(dest, cfg)
    return dest


def _manifest(dest: Path, cfg: ModelConfig) -> Manifest:
    """The partial manifest: the hashes of the blocks (and head) the store holds, empty for others.
    A manifest fetched from peers (format 2: it names every block) is kept, and every block and
    the head pulled now are checked against it: a ModelError names one that differs."""
    files = ModelFiles(dest)
    old = load_manifest(dest) if (dest / MANIFEST).is_file() else None
    blocks, has_head = blockfiles.held(dest)
    if old is not None and old.format >= blockfiles.FORMAT:
        indexed = {f for f in files.where.values() if f.name != blockfiles.HEAD_FILE
                   and not f.name.startswith("block-")}
        for i in sorted(blocks):
            if any(files.where[n] in indexed for n in files.block_names(i)) and \
                    block_hash(files.read_block(i)) != old.block_hashes[i]:
                raise ModelError(f"block {i} of {dest.name} as pulled from the Hub is not the one its manifest "
                                 f"(fetched from peers) names: {old.block_hashes[i]}")
        if has_head and any(files.where[n] in indexed for n in HEAD_TENSORS if n in files.where) and \
                block_hash(files.read_head()) != old.head_hash:
            raise ModelError(f"the head of {dest.name} as pulled from the Hub is not the one its manifest "
                             f"(fetched from peers) names: {old.head_hash}")
        return old
    hashes, dtype = [], None
    for i in range(cfg.num_layers):
        if not any(n.startswith(f"{BLOCK_PREFIX}{i}.") for n in files.where):
            hashes.append("")
        elif old is not None and old.block_hashes[i]:
            hashes.append(old.block_hashes[i])
        else:
            block = files.read_block(i)
            dtype = dtype or str(next(iter(block.values())).dtype).removeprefix("torch.")
            hashes.append(block_hash(block))
    head = block_hash(files.read_head()) if has_head else ""
    m = Manifest(dest.name, cfg.arch, cfg.num_layers, old.dtype if old else dtype or "float32", hashes, head)
    (dest / f".{MANIFEST}.tmp").write_text(json.dumps(asdict(m) | {"model_hash": m.model_hash}, indent=1) + "\n")
    (dest / f".{MANIFEST}.tmp").replace(dest / MANIFEST)
    return m
