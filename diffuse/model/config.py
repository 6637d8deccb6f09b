"""Model configuration: what the block engine needs to know about a model, read from config.json.

Every setting that changes what a model computes is either implemented or refused by name: a
config the engine would run differently from its reference must fail at load, not answer wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from diffuse.errors import ModelError
from diffuse.model.rope import RopeScaling, context_limit

# HF `model_type` -> the HF class its checkpoints are written for.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SUPPORTED_ARCHS = tuple(ARCHITECTURES)
FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA = ("gemma2", "gemma3_text")

# Per-architecture defaults of the HF config classes for keys a config.json may leave out.
_DEFAULTS: dict[str, dict] = {
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "qwen3": {"head_dim": 128},
    "mistral": {"sliding_window": 4096},
}
# Keys that would change the computation in ways this engine does not implement, with the value
# at which they change nothing.
_INERT = {"mlp_bias": False, "use_bidirectional_attention": False, "quantization_config": None}


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
    attention_bias: bool = False  # q/k/v biases
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    o_proj_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # full-attention layers
    local_rope_theta: float | None = None  # sliding layers' own base (Gemma 3), never scaled
    partial_rotary_factor: float = 1.0
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = all FULL
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power instead of head_dim's
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ModelError(unsupported(self.arch))
        if self.hidden_act not in ACTIVATIONS:
            raise ModelError(f"activation {self.hidden_act!r} is not supported (Diffuse runs {', '.join(ACTIVATIONS)})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise ModelError(f"layer type(s) {', '.join(bad)} are not supported (Diffuse runs {FULL}, {SLIDING})")
        if self.partial_rotary_factor != 1.0 and self.arch != "phi3":
            raise ModelError(f"partial_rotary_factor {self.partial_rotary_factor} is supported for phi3 only")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelError(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty rotary dim")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelError(f"{self.num_experts_per_tok} experts per token of {self.num_experts}")

    # Per-layer facts the engine reads.

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int | None:
        """Keys a query at position p sees are those at p - window < k <= p (None: all)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def rope(self, layer: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of a layer's rotary embedding."""
        if self.layer_type(layer) == SLIDING and self.local_rope_theta is not None:
            return self.local_rope_theta, RopeScaling()
        return self.rope_theta, self.rope_scaling

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def context_limit(self) -> int | None:
        """First position this model cannot run (its RoPE variant changes past it): see rope.py."""
        return context_limit(self.rope_scaling, self.max_position_embeddings)

    @property
    def rope_description(self) -> str:
        text = f"theta {_number(self.rope_theta)}, {self.rope_scaling.describe()}"
        if self.local_rope_theta is not None:
            text += f"; sliding layers theta {_number(self.local_rope_theta)}"
        if self.rotary_dim != self.head_dim:
            text += f"; {self.rotary_dim} of {self.head_dim} dims"
        return text

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        arch = d.get("model_type")
        if arch == "gemma3" and "text_config" in d:
            raise ModelError("gemma3 with a vision tower (Gemma 3 4B and larger) is not supported: "
                             "Diffuse runs the text-only gemma3_text checkpoints (Gemma 3 270M, 1B)")
        if arch not in ARCHITECTURES:
            raise ModelError(unsupported(arch))
        d = _DEFAULTS.get(arch, {}) | d  # an explicit null (e.g. Mistral v0.2's window) stays null
        for key, inert in _INERT.items():
            if d.get(key) not in (inert, None):
                raise ModelError(f"{arch} config sets {key}={d[key]!r}, which Diffuse does not implement")
        try:
            return cls(**_fields(arch, d))
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
        """The config.json a converter writes; transformers reads it as the same model."""
        d = {
            "architectures": [ARCHITECTURES[self.arch]],
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
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.rope_scaling.type != "default":
            d["rope_scaling"] = self.rope_scaling.to_hf()
        d["hidden_activation" if self.arch in GEMMA else "hidden_act"] = self.hidden_act
        if self.arch in ("llama", "qwen3", "qwen3_moe", *GEMMA):
            d["attention_bias"] = self.attention_bias
        sliding = SLIDING in self.layer_types
        if self.arch in ("qwen2", "qwen3", "qwen3_moe"):
            d["use_sliding_window"] = sliding
        if sliding or self.arch in GEMMA:
            d["sliding_window"] = self.sliding_window
        if self.layer_types and self.arch not in ("mistral", "phi3", "qwen3_moe"):
            d["layer_types"] = list(self.layer_types)
        if self.arch == "phi3":
            d["partial_rotary_factor"] = self.partial_rotary_factor
            if self.rope_scaling.original_max_position_embeddings:
                d["original_max_position_embeddings"] = self.rope_scaling.original_max_position_embeddings
        if self.arch in GEMMA:
            scalar = self.query_pre_attn_scalar
            d |= {"query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
                  "final_logit_softcapping": self.final_logit_softcapping,
                  "attn_logit_softcapping": self.attn_logit_softcapping}
        if self.local_rope_theta is not None:
            d["rope_local_base_freq"] = self.local_rope_theta
        if self.arch == "qwen3_moe":
            d |= {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                  "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                  "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)}
        return d


def _number(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:g}"


def unsupported(arch: object) -> str:
    return f"unsupported architecture {arch!r}: Diffuse runs {', '.join(SUPPORTED_ARCHS)}"


def _rope(arch: str, d: dict) -> tuple[float, RopeScaling, float | None]:
    """(theta, scaling of full-attention layers, sliding layers' theta) from either config format:
    transformers >= 5 nests them in rope_parameters (per layer type for Gemma 3), older files keep
    rope_theta / rope_scaling / rope_local_base_freq flat."""
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING)
    else:
        full, local = params or d.get("rope_scaling") or {}, None
    theta = float(full.get("rope_theta", d.get("rope_theta", 10000.0)))
    local_theta = None
    if local is not None:
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ModelError(f"RoPE scaling on sliding-window layers ({local!r}) is not supported")
        local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    elif arch == "gemma3_text":
        local_theta = float(d["rope_local_base_freq"])
    original = d.get("original_max_position_embeddings") if arch == "phi3" else None
    scaling = RopeScaling.parse(full, int(d.get("max_position_embeddings", 4096)), original)
    return theta, scaling, local_theta


def _layer_types(arch: str, d: dict, layers: int) -> tuple[tuple[str, ...], int | None]:
    """Which layers attend through a sliding window, and its width, as transformers decides."""
    window = d.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not d.get("use_sliding_window", False):
        window = None
    if arch == "llama":
        return (), None
    if arch in ("mistral", "phi3", "qwen3_moe"):  # one window for every layer, when set
        if arch == "mistral" and d.get("layer_types"):
            raise ModelError("a mistral config with layer_types (alternating attention) is not supported")
        return ((SLIDING,) * layers, window) if window else ((), None)
    if d.get("layer_types"):
        if len(d["layer_types"]) != layers:
            raise ModelError(f"layer_types lists {len(d['layer_types'])} layers, the model has {layers}")
        return tuple(d["layer_types"]), window
    if arch in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers", 28))
        return tuple(SLIDING if window and i >= first else FULL for i in range(layers)), window
    pattern = 2 if arch == "gemma2" else int(d.get("sliding_window_pattern", 6))
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers)), window


def _fields(arch: str, d: dict) -> dict:
    heads, hidden, layers = int(d["num_attention_heads"]), int(d["hidden_size"]), int(d["num_hidden_layers"])
    eos = d.get("eos_token_id")
    theta, scaling, local_theta = _rope(arch, d)
    layer_types, window = _layer_types(arch, d, layers)
    bias = bool(d.get("attention_bias", False))
    partial = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    out = dict(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        vocab_size=int(d["vocab_size"]),
        rope_theta=theta,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bias and arch not in ("mistral", "phi3"),
        o_proj_bias=bias and arch in ("llama", "qwen3", "qwen3_moe", *GEMMA),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        hidden_act=str(d.get("hidden_activation" if arch in GEMMA else "hidden_act",
                             d.get("hidden_act", "silu"))),
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        partial_rotary_factor=float(partial),
        layer_types=layer_types if set(layer_types) - {FULL} else (),
        sliding_window=int(window) if window and SLIDING in layer_types else None,
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
    )
    if arch in GEMMA:
        cap = d.get("attn_logit_softcapping")
        final = d.get("final_logit_softcapping")
        out |= dict(query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
                    attn_logit_softcapping=float(cap) if cap else None,
                    final_logit_softcapping=float(final) if final else None)
    if arch == "qwen3_moe":
        out |= dict(num_experts=int(d.get("num_experts", d.get("num_local_experts", 128))),
                    num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                    decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                    mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
    return out
