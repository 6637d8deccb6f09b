"""Tiny random Llama-family models, written in HF layout for engine and data-plane tests."""

from __future__ import annotations

from pathlib import Path

import torch

from diffuse.model.weights import write_manifest


def make_tiny(path: Path, arch: str = "llama", layers: int = 4, seed: int = 0) -> Path:
    """A random 4-block model with GQA (and q/k/v biases for qwen2), saved with a manifest."""
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero: make them matter
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    write_manifest(path)
    return path


def load_reference(path: Path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


class Sync:
    """Drive an async Pipeline from synchronous test code, one trio.run per call."""

    def __init__(self, pipe):
        self.pipe = pipe

    def __getattr__(self, name):
        import functools
        import inspect

        import trio

        attr = getattr(self.pipe, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **k: trio.run(functools.partial(attr, *a, **k))
        return attr
