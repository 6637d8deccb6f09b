"""Helpers for control-plane tests: a SmolLM2-shaped fake model store, without weights. The
processes tests start come from scripts/support (support.procs, support.swarm)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from diffuse.home import DEFAULT_MODEL, models_dir
from diffuse.model.config import ModelConfig

SMOLLM2_CONFIG = dict(arch="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def fake_hashes(n: int, tag: str = "w") -> list[str]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def make_fake_model(home: Path, name: str = DEFAULT_MODEL, layers: int = 30) -> Path:
    """config.json + manifest.json of a SmolLM2-135M-shaped model, without weights: all the
    control plane reads (join announces; loading blocks is the data plane's job)."""
    from diffuse.model.weights import Manifest

    d = models_dir(home) / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(**(SMOLLM2_CONFIG | {"num_layers": layers}))
    (d / "config.json").write_text(json.dumps(cfg.to_hf()))
    m = Manifest(model_id=name, arch="llama", num_layers=layers, dtype="bfloat16",
                 block_hashes=fake_hashes(layers), head_hash=hashlib.sha256(b"head").hexdigest())
    (d / "manifest.json").write_text(json.dumps(asdict(m) | {"model_hash": m.model_hash}))
    return d
