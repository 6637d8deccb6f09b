"""The model store: HF-layout model directories under <home>/models, each with a manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diffuse.errors import ModelError
from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.config import ModelConfig
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

    def as_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "arch": self.config.arch,
                "layers": self.config.num_layers, "hidden_size": self.config.hidden_size,
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
    return [info(p) for p in sorted(root.iterdir()) if (p / "config.json").is_file()]


def pull(home: Path, name: str | None, progress: Progress | None = None) -> Path:
    """Install the embedded default (no name) or an HF repo / local HF directory (ORG/NAME or path)."""
    if name in (None, DEFAULT_MODEL):
        from diffuse.model.gguf_import import embedded_gguf_path

        dest = models_dir(home) / DEFAULT_MODEL
        if (dest / MANIFEST).is_file():
            if progress:
                progress(f"{DEFAULT_MODEL} is already installed in {dest}")
            return dest
        return import_gguf(home, embedded_gguf_path(), DEFAULT_MODEL, progress)
    from diffuse.model.hub import pull_hf

    dest = pull_hf(name, models_dir(home), progress=progress)
    _commit(dest, progress)
    return dest


def import_gguf(home: Path, src: Path, name: str | None = None, progress: Progress | None = None) -> Path:
    from diffuse.model import gguf_import

    src = Path(src)
    dest = models_dir(home) / (name or src.name.split(".")[0])
    dest.parent.mkdir(parents=True, exist_ok=True)
    gguf_import.import_gguf(src, dest, progress)
    _commit(dest, progress)
    return dest


def _commit(dest: Path, progress: Progress | None) -> None:
    if progress:
        progress("hashing blocks (weight commitments)")
    write_manifest(dest)
