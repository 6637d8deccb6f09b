"""Open the whole model in this process (the reference, and the fallback when the swarm is down)."""

from __future__ import annotations

from pathlib import Path

from diffuse.client.pipeline import LocalModel
from diffuse.model import store
from diffuse.model.config import ModelConfig
from diffuse.model.load import load_head, load_span, parse_dtype
from diffuse.model.tokenizer import Tokenizer


def open_local(home: Path, name: str | None, dtype: str = "bf16", device: str = "cpu"
               ) -> tuple[LocalModel, Tokenizer]:
    path = store.resolve(home, name)
    cfg = ModelConfig.load(path)
    torch_dtype = parse_dtype(dtype)
    span = load_span(path, 0, cfg.num_layers, torch_dtype, device)
    return LocalModel(load_head(path, torch_dtype, device), [span]), Tokenizer.load(path)
