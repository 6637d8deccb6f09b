"""Tiny random models of every family the engine runs, written in HF layout by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from diffuse.model.weights import write_manifest

WINDOW = 8  # sliding window of the tiny models: tests run sequences longer than it
PREFIX = 12  # > WINDOW: trees and decode steps after it see a window that has slid
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
LEGACY = ("llama", "qwen2")  # plain shapes other tests were calibrated on: built exactly as before
S, F = "sliding_attention", "full_attention"

# name -> (transformers config class, its settings beyond COMMON). Each exercises what its family
# adds: RoPE variants, sliding windows, biases, q/k norms, softcaps, fused checkpoints, experts.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(rope_theta=5000.0)),
    "qwen2": ("Qwen2Config", dict(rope_theta=5000.0)),
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "llama-linear": ("LlamaConfig", dict(attention_bias=True, rope_parameters=dict(
        rope_type="linear", rope_theta=5000.0, factor=4.0))),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, rope_parameters=dict(rope_theta=5000.0))),
    "qwen2-yarn": ("Qwen2Config", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=64))),
    "qwen3": ("Qwen3Config", dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=2, rope_parameters=dict(rope_theta=5000.0))),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                         rope_parameters=dict(rope_theta=5000.0))),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, partial_rotary_factor=0.5, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
                                original_max_position_embeddings=64, rope_parameters=dict(
                                    rope_type="longrope", rope_theta=5000.0, partial_rotary_factor=0.5,
                                    short_factor=[1.0 + i / 8 for i in range(4)],
                                    long_factor=[2.0 + i for i in range(4)]))),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                    final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                                    rope_parameters=dict(rope_theta=5000.0))),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                        layer_types=[S, F], tie_word_embeddings=True,
                                        rope_parameters={F: dict(rope_type="linear", factor=4.0, rope_theta=50000.0),
                                                         S: dict(rope_type="default", rope_theta=1000.0)})),
}


def make_tiny(path: Path, arch: str = "llama", layers: int = 4, seed: int = 0) -> Path:
    """A random model of `arch` (a FAMILIES key) with GQA, saved with a manifest. Biases, which random
    init leaves at 0, are randomised so that they matter; beyond LEGACY, so are norm weights, and
    weights are drawn wider (so that bf16 greedy decoding has few near-ties)."""
    import transformers

    torch.manual_seed(seed)
    cls, extra = FAMILIES[arch]
    if "layer_types" in extra:  # a pattern, repeated over the layers
        extra = extra | {"layer_types": [extra["layer_types"][i % len(extra["layer_types"])] for i in range(layers)]}
    wide = {} if arch in LEGACY else {"initializer_range": 0.08}
    cfg = getattr(transformers, cls)(**(COMMON | {"num_hidden_layers": layers} | wide | extra))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name and arch not in LEGACY:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if "gemma" in arch else 1.0))
    model.save_pretrained(path, safe_serialization=True)
    write_manifest(path)
    return path


def tree() -> tuple[torch.Tensor, torch.Tensor]:
    """Three candidate branches after a root token: r -> a -> b, r -> c, r -> a -> d.

    Layout [r, a, b, c, d]; depths 0,1,2,1,2; parents -, r, a, r, a. Returns (mask, depth).
    """
    parents = [-1, 0, 1, 0, 1]
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask, mask.sum(1) - 1


BRANCHES = ([0, 1, 2], [0, 3], [0, 1, 4])  # the tree's root-to-leaf paths


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
