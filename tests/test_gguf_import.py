"""GGUF -> HF conversion: the real embedded SmolLM2 (once per module) and tiny synthetic GGUFs."""

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


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, copied: what the import must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch="llama", tokenizer_model="gpt2", pre="gpt2", seed=0, **extra_tensors) -> dict:
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
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]
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
    write_tiny_gguf(tmp_path / "sp.gguf", tokenizer_model="llama")
    assert "tokenizer model 'llama' is not supported" in _import_error(tmp_path / "sp.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "pre.gguf", pre="mystery")
    assert "pre-tokenizer 'mystery'" in _import_error(tmp_path / "pre.gguf", tmp_path)
    write_tiny_gguf(tmp_path / "rope.gguf", rope_freqs__weight=np.ones(2, dtype=np.float32))
    assert "RoPE scaling" in _import_error(tmp_path / "rope.gguf", tmp_path)
