"""Put a Hugging Face model (Hub repo id or local HF-layout directory) into the model store.

Files are hard-linked out of the HF cache when it shares a filesystem with the store (no extra
disk, and unlike symlinks the store survives `hf cache delete`), copied otherwise. A local
directory is always copied, so later edits to it cannot change a model peers are serving.
"""

from __future__ import annotations

import json
import os
import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable

from diffuse.errors import ModelError
from diffuse.model.config import ModelConfig
from diffuse.model.gguf_import import replace_dir

# Only what the engine reads: no .bin/.pt/.gguf duplicates of the weights.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
    # Licence terms travel with the weights (some licences, e.g. Gemma's, require it of every copy).
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY*",
]
# Subfolders (onnx/, original/) and Mistral's consolidated.safetensors duplicate the weights.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]

Progress = Callable[[str], None]


def wanted(name: str) -> bool:
    return any(fnmatch(name, p) for p in ALLOW_PATTERNS) and not any(fnmatch(name, p) for p in IGNORE_PATTERNS)


def _offline() -> bool:
    """Read at call time: huggingface_hub reads HF_HUB_OFFLINE only once, at import."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download(repo_id: str, revision: str | None, allow: list[str] | None = None) -> Path:
    """The repo's files that `allow` (default ALLOW_PATTERNS) matches, in the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=allow or ALLOW_PATTERNS,
                ignore_patterns=IGNORE_PATTERNS,
                cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                local_files_only=_offline(),
            )
        )
    except GatedRepoError:
        raise ModelError(f"{repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo_id} not found on the Hugging Face Hub (if private, set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise ModelError(
            f"{repo_id} is not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline, HF_HUB_OFFLINE=1, or a network failure)"
        ) from None
    except HFValidationError:
        raise ModelError(f"{repo_id!r} is neither a local directory nor a valid Hub repo id (org/name)") from None
    except Exception as e:  # noqa: BLE001 - HTTP, proxy, TLS, disk errors: say what failed, not where
        raise ModelError(f"downloading {repo_id} failed: {type(e).__name__}: {e}") from None


def _validate(src: Path, label: str) -> ModelConfig:
    try:
        cfg = ModelConfig.load(src)
    except ModelError as e:
        raise ModelError(f"{label}: {e}") from None
    files = {p.name for p in src.iterdir()}
    if "tokenizer.json" not in files:
        raise ModelError(f"{label}: no tokenizer.json (the engine needs a fast tokenizer)")
    index = src / "model.safetensors.index.json"
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{label}: bad model.safetensors.index.json ({type(e).__name__}: {e})") from None
    if not any(n.endswith(".safetensors") for n in files) or not shards <= files:
        raise ModelError(f"{label}: safetensors weights are missing (other formats are not supported)")
    return cfg


def place(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src.resolve(), dst)
            return
        except OSError:  # another filesystem, or no hard links there
            pass
    shutil.copyfile(src, dst)


def pull_hf(repo_id: str, models_dir: Path, revision: str | None = None, progress: Progress | None = None) -> Path:
    """Fetch `repo_id` (or copy a local HF directory) into `models_dir/<name>`; returns that path.

    Honours HF_TOKEN, HF_HUB_CACHE and HF_HUB_OFFLINE. The config is validated before anything
    lands in the store, so an unsupported architecture fails fast with a ModelError.
    """
    say = progress or (lambda _msg: None)
    local = Path(repo_id).expanduser()
    if local.is_dir():
        src, name, link = local.resolve(), local.resolve().name, False
    elif repo_id.startswith((".", "/", "~")):
        raise ModelError(f"{repo_id}: no such directory")
    else:
        say(f"fetching {repo_id}" + (f"@{revision}" if revision else ""))
        src, name, link = download(repo_id, revision), repo_id.rstrip("/").split("/")[-1], True
    cfg = _validate(src, repo_id)
    dest = Path(models_dir) / name
    if dest.exists() and dest.resolve() == src:
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = sorted(p for p in src.iterdir() if p.is_file() and wanted(p.name))
    try:
        for p in files:
            say(f"{'linking' if link else 'copying'} {p.name}")
            place(p, tmp / p.name, link)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot write {tmp}: {e}") from None
    replace_dir(tmp, dest)
    say(f"{name}: {cfg.arch}, {cfg.num_layers} layers, in {dest}")
    return dest
