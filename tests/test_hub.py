"""pull_hf against a hand-built offline HF cache and local directories (the real Hub is unreachable here)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading

import numpy as np
import pytest
from safetensors.numpy import save
from tokenizers import pre_tokenizers

from diffuse.errors import ModelError
from diffuse.model.config import ModelConfig
from diffuse.model.hub import pull_hf
from diffuse.model.tokenizer import build_tokenizer_json

COMMIT = "0123456789abcdef0123456789abcdef01234567"
WANTED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def model_files(model_type: str = "llama") -> dict[str, bytes]:
    cfg = ModelConfig("llama", 8, 16, 1, 2, 1, 4, 256).to_hf() | {"model_type": model_type}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return {
        "config.json": json.dumps(cfg).encode(),
        "tokenizer.json": build_tokenizer_json(alphabet, [], [1] * 256).encode(),
        "tokenizer_config.json": b"{}",
        "model.safetensors": save({"model.embed_tokens.weight": np.zeros((256, 8), dtype=np.float32)}),
        # Not wanted in the store: other weight formats, docs, subfolders, Mistral's duplicate.
        "pytorch_model.bin": b"x",
        "README.md": b"x",
        "consolidated.safetensors": b"x",
        "onnx/model.safetensors": b"x",
    }


def make_cache(cache, repo="org/tiny", files=None) -> None:
    """The layout huggingface_hub writes: blobs by hash, snapshot symlinks, refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    files = files if files is not None else model_files()
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 set after huggingface_hub was imported; a local 'Hub' checks it is never called."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls: list[tuple] = []
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub.settimeout(0.05)
        stop = threading.Event()

        def serve() -> None:  # count and drop connections, so a regression fails fast instead of hanging
            while not stop.is_set():
                try:
                    conn, addr = hub.accept()
                except TimeoutError:
                    continue
                calls.append(addr)
                conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
        yield cache
        stop.set()
        thread.join()
    assert calls == [], "HF_HUB_OFFLINE=1 was ignored: the Hub was contacted"


def test_pull_from_cache_links_wanted_files(offline_cache, tmp_path):
    make_cache(offline_cache)
    lines: list[str] = []
    dest = pull_hf("org/tiny", tmp_path / "models", progress=lines.append)
    assert dest == tmp_path / "models" / "tiny"
    assert sorted(os.listdir(dest)) == WANTED
    assert ModelConfig.load(dest).num_layers == 1
    blob = (offline_cache / "models--org--tiny" / "snapshots" / COMMIT / "config.json").resolve()
    assert not (dest / "config.json").is_symlink() and os.path.samefile(dest / "config.json", blob)
    assert lines[0] == "fetching org/tiny" and "linking config.json" in lines
    assert sorted(os.listdir(tmp_path / "models")) == ["tiny"]


def test_pull_by_commit_and_repull_replaces(offline_cache, tmp_path):
    make_cache(offline_cache)
    first = pull_hf("org/tiny", tmp_path / "models")
    (first / "stale.txt").write_text("from an older pull")
    dest = pull_hf("org/tiny", tmp_path / "models", revision=COMMIT)
    assert sorted(os.listdir(dest)) == WANTED
    assert sorted(os.listdir(tmp_path / "models")) == ["tiny"]


def test_missing_repo_offline(offline_cache, tmp_path):
    make_cache(offline_cache)
    with pytest.raises(ModelError, match="org/absent is not in the local Hugging Face cache"):
        pull_hf("org/absent", tmp_path / "models")
    with pytest.raises(ModelError, match="org/tiny is not in the local"):
        pull_hf("org/tiny", tmp_path / "models", revision="v2")
    assert not (tmp_path / "models").exists()


def test_unsupported_or_incomplete_repo(offline_cache, tmp_path):
    make_cache(offline_cache, "org/gpt", model_files("gpt2"))
    with pytest.raises(ModelError, match="org/gpt: unsupported architecture 'gpt2'"):
        pull_hf("org/gpt", tmp_path / "models")
    files = model_files()
    del files["model.safetensors"], files["consolidated.safetensors"], files["onnx/model.safetensors"]
    make_cache(offline_cache, "org/binonly", files)
    with pytest.raises(ModelError, match="safetensors weights are missing"):
        pull_hf("org/binonly", tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_invalid_repo_id(offline_cache, tmp_path):
    with pytest.raises(ModelError, match="neither a local directory nor a valid Hub repo id"):
        pull_hf("not a repo!!", tmp_path / "models")
    with pytest.raises(ModelError, match="no such directory"):
        pull_hf("./missing-dir", tmp_path / "models")


def test_pull_local_directory_copies(tmp_path):
    src = tmp_path / "My-Model"
    for name, data in (model_files()).items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    dest = pull_hf(str(src), tmp_path / "models")
    assert dest == tmp_path / "models" / "My-Model"
    assert sorted(os.listdir(dest)) == WANTED
    assert os.stat(dest / "config.json").st_ino != os.stat(src / "config.json").st_ino
    (src / "config.json").write_text("{}")  # later edits to the source do not reach the store
    assert ModelConfig.load(dest).arch == "llama"
    assert pull_hf(str(dest), tmp_path / "models") == dest  # pulling the store's own copy is a no-op


def test_unreachable_hub_is_a_model_error(tmp_path, monkeypatch):
    """Online mode with the Hub endpoint pointed at a closed local port: a network failure."""
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelError, match="Hub cannot be reached"):
        pull_hf("org/tiny", tmp_path / "models")
