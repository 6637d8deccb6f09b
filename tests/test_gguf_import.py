"""GGUF -> HF conversion: the real embedded SmolLM2 (once per module), and tiny GGUFs written the
way llama.cpp's converter writes each family (checked against transformers on the original
weights), k-quant tensors and SentencePiece vocabularies (checked against transformers' own
GGUF tokenizer)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import pre_tokenizers

from diffuse.errors import ModelError
from diffuse.model.config import ModelConfig
from diffuse.model.gguf_import import embedded_gguf_path, import_gguf, unpermute_rotary
from tiny import load_reference, make_tiny


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, copied: what the import must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch="llama", tokenizer_model="gpt2", pre="gpt2", seed=0, metadata=None,
                    **extra_tensors) -> dict:
    """A 1-layer model with F32 tensors; returns the HF-layout weights it should import as."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv, ff = 16, 2, 1, 32  # head_dim 8: the permutation is not its own inverse
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet]
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((len(tokens), hidden), dtype=np.float32),
        "model.norm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((hidden, hidden), dtype=np.float32),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((hidden // heads * kv, hidden), dtype=np.float32),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((hidden // heads * kv, hidden), dtype=np.float32),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((hidden, hidden), dtype=np.float32),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((ff, hidden), dtype=np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((ff, hidden), dtype=np.float32),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, ff), dtype=np.float32),
    }
    gguf_names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * len(alphabet))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, hf_name in gguf_names.items():
        t = hf[hf_name]
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_cpp_permute(t, heads if "attn_q" in name else kv)
        w.add_tensor(name, np.ascontiguousarray(t))
    for key, value in (metadata or {}).items():
        w.add_float32(key, value)
    for name, t in extra_tensors.items():
        w.add_tensor(name.replace("__", "."), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    lines: list[str] = []
    dest = import_gguf(embedded_gguf_path(), tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct", lines.append)
    return dest, lines


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(9 * 64 * 3, dtype=np.float32).reshape(9 * 64, 3)
    permuted = llama_cpp_permute(w, 9)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rotary(permuted, 9), w)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w[:192], 3), 3), w[:192])


@pytest.mark.slow
def test_smollm2_config_and_files(smol):
    dest, lines = smol
    cfg = ModelConfig.load(dest)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (1e5, 1e-5, True)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 8192)
    assert sorted(os.listdir(dest)) == [
        "NOTICE", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"
    ]
    assert (dest / "NOTICE").read_text().startswith("Licence: apache-2.0\nModified files: converted by Diffuse")
    assert not dest.with_name(dest.name + ".partial").exists()
    tc = json.loads((dest / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert tc["chat_template"].startswith("{% for message in messages %}")
    with safe_open(dest / "model.safetensors", "np") as f:
        names = set(f.keys())
        assert len(names) == 272 and "lm_head.weight" not in names
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
        assert f.get_tensor("model.layers.29.self_attn.k_proj.weight").shape == (192, 576)
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == np.float32
    assert lines[1:3] == ["writing tokenizer", "dequantizing 272 tensors to float32"]
    assert sum("/272 tensors" in line for line in lines) >= 10
    assert lines[-2] == "  272/272 tensors" and lines[-1].startswith("done in ")


@pytest.mark.slow
def test_smollm2_transformers_greedy_answers_paris(smol):
    """Proves the Q/K un-permutation on real weights: without it the answer is gibberish."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    dest, _ = smol
    tok = transformers.AutoTokenizer.from_pretrained(dest)
    model = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_weights_round_trip(tmp_path, arch):
    """llama: Q/K come back un-permuted; qwen2: not permuted, biases kept, lm_head when untied."""
    extra = {}
    if arch == "qwen2":
        extra = {
            "blk__0__attn_q__bias": np.arange(16, dtype=np.float32),
            "blk__0__attn_k__bias": np.arange(8, dtype=np.float32),
            "blk__0__attn_v__bias": np.arange(8, dtype=np.float32),
            "output__weight": np.ones((259, 16), dtype=np.float32),
        }
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, **extra)
    dest = import_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny")
    cfg = ModelConfig.load(dest)
    assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (arch, 2, 1, 8, 259)
    assert cfg.tie_word_embeddings == (arch == "llama") and cfg.attention_bias == (arch == "qwen2")
    with safe_open(dest / "model.safetensors", "np") as f:
        for name, want in hf.items():
            np.testing.assert_array_equal(f.get_tensor(name), want, err_msg=name)
        if arch == "qwen2":
            np.testing.assert_array_equal(f.get_tensor("model.layers.0.self_attn.q_proj.bias"), np.arange(16))
            assert f.get_tensor("lm_head.weight").shape == (259, 16)


def test_reimport_replaces_and_interrupted_import_keeps_old(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", seed=1)
    hf = write_tiny_gguf(tmp_path / "b.gguf", seed=2)
    dest = import_gguf(tmp_path / "a.gguf", tmp_path / "m")
    before = (dest / "model.safetensors").read_bytes()

    def die(line: str) -> None:
        if "tensors" in line and "/" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_gguf(tmp_path / "b.gguf", dest, die)
    assert (dest / "model.safetensors").read_bytes() == before
    import_gguf(tmp_path / "b.gguf", dest)
    with safe_open(dest / "model.safetensors", "np") as f:
        np.testing.assert_array_equal(f.get_tensor("model.norm.weight"), hf["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "m"]


def _import_error(src, tmp_path) -> str:
    with pytest.raises(ModelError) as e:
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    assert str(src) in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("size", [3, 200, 5_000, 60_000_000])  # header, metadata, tensor data
def test_truncated_gguf(tmp_path, size):
    src = tmp_path / "cut.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        src.write_bytes(f.read(size))
    assert "corrupt" in _import_error(src, tmp_path)


def test_random_bytes_and_text_file(tmp_path):
    (tmp_path / "rand.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    assert "not a valid GGUF" in _import_error(tmp_path / "rand.gguf", tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a valid GGUF" in _import_error(tmp_path / "notes.txt", tmp_path)


def test_missing_file(tmp_path):
    assert "no such GGUF file" in _import_error(tmp_path / "nope.gguf", tmp_path)


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "unsupported architecture 'gpt2'" in _import_error(tmp_path / "gpt2.gguf", tmp_path)


def test_unsupported_tokenizer_and_tensor(tmp_path):
    write_tiny_gguf(tmp_path / "bert.gguf", tokenizer_model="bert")
    assert "tokenizer model 'bert' is not supported" in _import_error(tmp_path / "bert.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "sp.gguf", tokenizer_model="llama")
    assert "SentencePiece vocabulary without scores" in _import_error(tmp_path / "sp.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "pre.gguf", pre="mystery")
    assert "pre-tokenizer 'mystery'" in _import_error(tmp_path / "pre.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "rope.gguf", rope_freqs__weight=np.array([1, 2, 1, 2], dtype=np.float32))
    assert "rope_freqs does not match any llama3 RoPE scaling" in _import_error(tmp_path / "rope.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "moe.gguf", blk__0__ffn_gate_exps__weight=np.ones((2, 32, 16), dtype=np.float32))
    assert "Mixtral" in _import_error(tmp_path / "moe.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "key.gguf", metadata={"llama.attention.clamp_kqv": 8.0})
    assert "llama metadata attention.clamp_kqv is not supported" in _import_error(tmp_path / "key.gguf", tmp_path)


# --- every family, written as llama.cpp's converter writes it ---------------------------------

GGUF_ARCH = {"llama3": "llama", "qwen2-yarn": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}
PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
GEMMA_PARTS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def llama3_factors(theta, dim, factor, low, high, old):
    """llama.cpp's LlamaModel.generate_extra_tensors: the rope_freqs it writes for Llama 3.x."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_family_gguf(src, path, name) -> None:
    """The tiny HF model at `src` as llama.cpp converts it: its names, Q/K rows permuted (Llama),
    norms stored as 1 + w (Gemma), experts stacked, RoPE scaling as factor tensors or metadata."""
    from safetensors.numpy import load_file

    arch, hf = GGUF_ARCH[name], json.loads((src / "config.json").read_text())
    t = load_file(src / "model.safetensors")
    heads, kv, layers = hf["num_attention_heads"], hf["num_key_value_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = hf.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(full["rope_theta"])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(["<|endoftext|>", *alphabet])
    w.add_token_types([3] + [1] * len(alphabet))
    w.add_token_merges([])
    if full.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(full["rope_theta"], head_dim, full["factor"],
                                                         full["low_freq_factor"], full["high_freq_factor"],
                                                         full["original_max_position_embeddings"]))
    elif full.get("rope_type") in ("yarn", "linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType(full["rope_type"]))
        w.add_rope_scaling_factor(full["factor"])
        if full["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    elif full.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(hf["original_max_position_embeddings"])
        w.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], dtype=np.float32))
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * hf["partial_rotary_factor"]))
        w.add_sliding_window(hf["sliding_window"])
    if arch.startswith("gemma"):
        w.add_sliding_window(hf["sliding_window"])
        w.add_sliding_window_pattern(2)
        w.add_attention_scale(hf["query_pre_attn_scalar"] ** -0.5)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
            w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        else:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "qwen3moe":
        w.add_expert_count(hf["num_local_experts"])
        w.add_expert_used_count(hf["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_tensor("token_embd.weight", t.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", t.pop("model.norm.weight") + (1 if arch.startswith("gemma") else 0))
    if "lm_head.weight" in t:
        w.add_tensor("output.weight", t.pop("lm_head.weight"))
    for i in range(layers):
        p = f"model.layers.{i}."
        experts = sorted({k.split(".")[5] for k in t if k.startswith(p + "mlp.experts.")}, key=int)
        for proj, gguf_name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                ("down_proj", "ffn_down_exps")):
            if experts:
                w.add_tensor(f"blk.{i}.{gguf_name}.weight",
                             np.stack([t.pop(f"{p}mlp.experts.{e}.{proj}.weight") for e in experts]))
        for key in sorted(k for k in t if k.startswith(p)):
            part, kind = key[len(p):].rsplit(".", 1)
            value = t.pop(key)
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj") and kind == "weight":
                value = llama_cpp_permute(value, heads if "q_proj" in part else kv)
            if arch.startswith("gemma") and part.endswith("norm"):
                value = value + 1
            gguf_part = GEMMA_PARTS[part] if arch.startswith("gemma") and part in GEMMA_PARTS else PARTS[part]
            w.add_tensor(f"blk.{i}.{gguf_part}.{kind}", np.ascontiguousarray(value))
    assert not t, sorted(t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_family_gguf_imports_as_its_model(tmp_path, name):
    """A tiny model of each family, converted to GGUF as llama.cpp does and imported back, computes
    what transformers computes on the original weights (past the sliding window where the file
    records one; Qwen3's window, which GGUF does not carry, is not reached)."""
    torch = pytest.importorskip("torch")
    from diffuse.model.load import load_head, load_span

    src = make_tiny(tmp_path / "src", name)
    write_family_gguf(src, tmp_path / "m.gguf", name)
    dest = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    cfg, want = ModelConfig.load(dest), ModelConfig.load(src)
    assert cfg.arch == want.arch and cfg.rope_scaling == want.rope_scaling
    if name != "qwen3":
        assert cfg.layer_types == want.layer_types and cfg.sliding_window == want.sliding_window
    ids = torch.randint(0, 259, (1, 8 if name == "qwen3" else 21), generator=torch.Generator().manual_seed(4))
    head, span = load_head(dest, verify=False), load_span(dest, 0, cfg.num_layers, verify=False)
    got = head.logits(span(head.embed_tokens(ids), torch.arange(ids.shape[1]), span.new_cache(ids.shape[1])))
    with torch.no_grad():
        ref = load_reference(src)(ids).logits
    assert (got - ref).abs().max() < 1e-4


def k_quant_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks of a k-quant type: random quants, with finite fp16 scales in the
    places each layout keeps its super-block scales (gguf-py has no k-quant quantiser)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        data[..., size - 2:] = scales[..., :2]  # d at the end
    else:
        data[..., :4] = scales  # d, dmin first
    return data.reshape(rows, -1)


def test_k_quants_are_dequantized_by_gguf(tmp_path):
    """Q4_K, Q5_K, Q6_K and Q8_0 tensors import as gguf's dequantisation of them (and Q/K rows of a
    llama file un-permuted after it)."""
    from gguf.quants import dequantize, quantize

    q = gguf.GGMLQuantizationType
    raw = {"blk.0.attn_q.weight": (q.Q4_K, k_quant_blocks(q.Q4_K, 256, 256, 1)),
           "blk.0.attn_k.weight": (q.Q5_K, k_quant_blocks(q.Q5_K, 128, 256, 2)),
           "blk.0.ffn_down.weight": (q.Q6_K, k_quant_blocks(q.Q6_K, 256, 512, 3)),
           "blk.0.ffn_up.weight": (q.Q8_0, quantize(np.random.default_rng(4).standard_normal((512, 256),
                                                                                            dtype=np.float32), q.Q8_0))}
    hidden, heads, kv, ff = 256, 4, 2, 512
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", ff), ("attention.head_count", heads), ("attention.head_count_kv", kv)):
        w.add_uint32(f"llama.{key}", value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_token_list(alphabet)
    w.add_token_merges([])
    rng = np.random.default_rng(5)
    for name, shape in (("token_embd.weight", (256, hidden)), ("output_norm.weight", (hidden,)),
                        ("blk.0.attn_norm.weight", (hidden,)), ("blk.0.ffn_norm.weight", (hidden,)),
                        ("blk.0.attn_v.weight", (128, hidden)), ("blk.0.attn_output.weight", (hidden, hidden)),
                        ("blk.0.ffn_gate.weight", (ff, hidden))):
        w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    for name, (qtype, data) in raw.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dest = import_gguf(tmp_path / "k.gguf", tmp_path / "k")
    with safe_open(dest / "model.safetensors", "np") as f:
        for name, hf_name, n_head in (("blk.0.attn_q.weight", "self_attn.q_proj", heads),
                                      ("blk.0.attn_k.weight", "self_attn.k_proj", kv),
                                      ("blk.0.ffn_down.weight", "mlp.down_proj", None),
                                      ("blk.0.ffn_up.weight", "mlp.up_proj", None)):
            qtype, data = raw[name]
            want = dequantize(data, qtype)
            assert np.isfinite(want).all() and np.abs(want).max() > 0
            if n_head:
                want = unpermute_rotary(want, n_head)
            np.testing.assert_array_equal(f.get_tensor(f"model.layers.0.{hf_name}.weight"), want, err_msg=name)


# --- SentencePiece vocabularies --------------------------------------------------------------

SPM_PIECES = ["\u2581", "\u2581t", "th", "he", "\u2581th", "the", "\u2581the", "in", "\u2581a", "an", "nd",
              "and", "\u2581and", "  ", "   ", "\u2581\u2581", "er", "\u2581w", "or", "ld", "wor", "\u2581wor",
              "\u2581world", "ll", "llo", "\u2581he", "\u2581hello", "ab", "bc"]  # "abc": "ab c" or "a bc"


def write_spm_gguf(path, arch: str) -> list[str]:
    """A 1-layer `arch` file with a SentencePiece vocabulary: specials, byte tokens, letters and a
    few merged pieces, scored out of file order; returns the texts to compare."""
    letters = list("abcdefghijklmnopqrstuvwxyz.,!?")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if arch.startswith("gemma") else ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + letters + SPM_PIECES + ["<start_of_turn>", "\n"]
    types = [3] * len(specials) + [6] * 256 + [1] * (len(letters) + len(SPM_PIECES)) + [3, 4]
    n = len(letters) + len(SPM_PIECES)  # 57: scores in another order than the file's (Gemma ignores them)
    scores = [0.0] * (len(specials) + 256) + [-float(i * 7 % n) for i in range(n)] + [0.0, 0.0]
    scores[-4], scores[-3] = -100.0, 1.0  # "bc" outranks "ab" by score, "ab" comes first in the file
    hidden, heads = 16, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(32)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2 if arch.startswith("gemma") else 1)
    w.add_eos_token_id(1 if arch.startswith("gemma") else 2)
    if arch.startswith("gemma"):
        w.add_add_space_prefix(False)
        w.add_sliding_window(8)
    rng = np.random.default_rng(0)
    names = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
             "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
             "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden, hidden),
             "blk.0.attn_v.weight": (hidden, hidden), "blk.0.attn_output.weight": (hidden, hidden),
             "blk.0.ffn_gate.weight": (32, hidden), "blk.0.ffn_up.weight": (32, hidden),
             "blk.0.ffn_down.weight": (hidden, 32)}
    if arch.startswith("gemma"):
        names |= {"blk.0.post_attention_norm.weight": (hidden,), "blk.0.post_ffw_norm.weight": (hidden,)}
    for name, shape in names.items():
        w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ["hello world", "the and the", " the", "  hello   world  ", "hello\nworld", "caf\u00e9 \u00fc!",
            "<start_of_turn>hello", "a, b. c? d!", "", "x" * 20, "\u65e5\u672c", "abc", "xabcx abc"]


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "llama", "phi3"])
def test_sentencepiece_tokenizer_equals_transformers(tmp_path, arch):
    """Ids and text as transformers' GGUF tokenizer gives them (merges rebuilt from the vocabulary:
    by file order for Gemma, by score otherwise; Gemma's space tokens respelled; byte fallback)."""
    transformers = pytest.importorskip("transformers")
    from diffuse.model.tokenizer import Tokenizer

    texts = write_spm_gguf(tmp_path / "spm.gguf", arch)
    ours = Tokenizer.load(import_gguf(tmp_path / "spm.gguf", tmp_path / "spm"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in texts:
        ids = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special=True) == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
