"""Model configuration: the few numbers a Llama-family block engine needs, read from config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from diffuse.errors import ModelError

# HF `model_type` values this engine runs; qwen2 differs only by q/k/v biases.
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(
                f"unsupported architecture {arch!r}: Diffuse runs {', '.join(SUPPORTED_ARCHS)}"
            )
        # transformers >= 5 nests RoPE settings in rope_parameters; older files keep rope_theta flat.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelError(f"RoPE scaling {rope!r} is not supported yet")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            return cls(
                arch=arch,
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                vocab_size=int(d["vocab_size"]),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"config.json is missing or has a bad field: {e}") from None

    @classmethod
    def load(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"no config.json in {model_dir}: not a model directory")
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} is not valid JSON: {e}") from None

    def to_hf(self) -> dict:
        """The config.json a converter writes; transformers reads it too."""
        d = asdict(self)
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        return {
            "architectures": [arch[self.arch]],
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": d["attention_bias"],
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
