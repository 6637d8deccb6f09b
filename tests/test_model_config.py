"""Configs: what each family's config.json means, and the refusal of everything the engine does not
implement (a wrong answer is worse than a refusal)."""

from __future__ import annotations

import json

import pytest
import torch

from diffuse.errors import ModelError
from diffuse.model import kernels
from diffuse.model.config import FULL, SLIDING, ModelConfig
from diffuse.model.engine import block_parameters
from diffuse.model.load import load_head, load_span
from tiny import COMMON, FAMILIES, make_tiny

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}


def refused(d: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_configs_round_trip_through_transformers(tmp_path, name):
    """to_hf (what a GGUF import writes) is read by transformers as the same model."""
    import transformers

    cfg = ModelConfig.load(make_tiny(tmp_path / name, name))
    d = cfg.to_hf()
    assert ModelConfig.from_hf(d) == cfg
    hf = transformers.AutoConfig.for_model(**d)
    assert ModelConfig.from_hf(hf.to_dict()) == cfg


def test_family_settings_are_read():
    qwen3 = ModelConfig.from_hf(BASE | {"model_type": "qwen3", "head_dim": 32, "use_sliding_window": True,
                                        "sliding_window": 8, "max_window_layers": 2})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    assert [qwen3.window(i) for i in range(4)] == [None, None, 8, 8]
    qwen2 = ModelConfig.from_hf(BASE | {"model_type": "qwen2", "sliding_window": 8})  # use_sliding_window off
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.layer_types == ()
    mistral = ModelConfig.from_hf(BASE | {"model_type": "mistral"})  # transformers' default window
    assert mistral.window(3) == 4096
    assert ModelConfig.from_hf(BASE | {"model_type": "mistral", "sliding_window": None}).window(3) is None
    gemma2 = ModelConfig.from_hf(BASE | {"model_type": "gemma2"})  # its class defaults apply
    assert (gemma2.final_logit_softcapping, gemma2.attn_logit_softcapping) == (30.0, 50.0)
    assert (gemma2.query_pre_attn_scalar, gemma2.head_dim, gemma2.hidden_act) == (256, 256, "gelu_pytorch_tanh")
    assert [gemma2.layer_type(i) for i in range(4)] == [SLIDING, FULL, SLIDING, FULL]
    gemma3 = ModelConfig.from_hf(BASE | {"model_type": "gemma3_text", "num_hidden_layers": 12,
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.layer_types == ((SLIDING,) * 5 + (FULL,)) * 2 and gemma3.final_logit_softcapping is None
    assert gemma3.rope(0) == (10000.0, gemma3.rope(0)[1]) and gemma3.rope(0)[1].type == "default"
    assert gemma3.rope(5)[0] == 1e6 and gemma3.rope(5)[1].factor == 8.0
    llama = ModelConfig.from_hf(BASE | {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192},
                                        "rope_theta": 500000.0})
    assert llama.rope_description == "theta 500000, llama3 (factor 32, original 8192)"


@pytest.mark.parametrize("d, match", [
    (BASE | {"model_type": "gpt_neox"}, "unsupported architecture 'gpt_neox': Diffuse runs llama, mistral"),
    (BASE | {"model_type": "gemma3", "text_config": {}}, "gemma3 with a vision tower"),
    (BASE | {"rope_scaling": {"rope_type": "mrope", "factor": 2}}, "RoPE type 'mrope' is not supported"),
    (BASE | {"rope_scaling": {"rope_type": "llama3", "factor": 8, "alpha": 1}}, "setting\\(s\\) alpha"),
    (BASE | {"rope_scaling": {"rope_type": "linear"}}, "needs a factor"),
    (BASE | {"mlp_bias": True}, "mlp_bias=True"),
    (BASE | {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    (BASE | {"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    (BASE | {"model_type": "mistral", "layer_types": [FULL] * 4}, "alternating attention"),
    (BASE | {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is supported for phi3 only"),
    (BASE | {"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
    (BASE | {"model_type": "qwen3", "layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    (BASE | {"model_type": "qwen3", "layer_types": [FULL] * 3}, "lists 3 layers"),
    (BASE | {"model_type": "gemma3_text", "rope_parameters": {
        FULL: {"rope_type": "default", "rope_theta": 1e6},
        SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}, "sliding-window layers"),
])
def test_unimplemented_settings_are_refused(d, match):
    refused(d, match)


def dynamic_model(tmp_path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**(COMMON | {"max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0}}))
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dyn")
    return tmp_path / "dyn", transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dyn").eval()


def test_dynamic_rope_runs_to_its_switch_point_and_no_further(tmp_path):
    """Dynamic NTK equals the static table up to max_position_embeddings; past it the reference
    recomputes its frequencies from the sequence length, which a shared KV cache cannot follow."""
    path, ref = dynamic_model(tmp_path)
    head, span = load_head(path, verify=False), load_span(path, 0, 4, verify=False)
    ids = torch.randint(0, 300, (1, 32))
    cache = span.new_cache(40)
    got = head.logits(span(head.embed_tokens(ids), torch.arange(32), cache))
    with torch.no_grad():
        assert (got - ref(ids).logits).abs().max() < 1e-4
    with pytest.raises(ModelError, match="position 32 is past the 32 tokens this model's dynamic RoPE"):
        span(head.embed_tokens(ids[:, :1]), torch.tensor([32]), cache)


def test_longrope_runs_to_its_original_length(tmp_path):
    path = make_tiny(tmp_path / "phi3", "phi3")
    assert ModelConfig.load(path).context_limit == 64
    span = load_span(path, 0, 4)
    cache = span.new_cache(70)
    span(torch.randn(1, 64, 64), torch.arange(64), cache)
    with pytest.raises(ModelError, match="position 64 is past the 64 tokens this model's longrope RoPE"):
        span(torch.randn(1, 1, 64), torch.tensor([64]), cache)


def test_block_parameters_count_every_expert(tmp_path):
    cfg = ModelConfig.load(make_tiny(tmp_path / "moe", "qwen3_moe"))
    attention = 64 * (4 * 32 + 2 * 2 * 32) + 4 * 32 * 64 + 2 * 32 + 2 * 64  # q/k/v, o, q/k norms, norms
    assert block_parameters(cfg, 0) == attention + 8 * 64 + 8 * 3 * 64 * 32  # router, 8 experts
    assert block_parameters(cfg, 1) == attention + 3 * 64 * 128  # mlp_only_layers: dense
    d = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert d["num_local_experts"] == 8  # transformers 5 writes this name; both are read


def test_model_list_and_info_show_architecture_rope_and_memory(tmp_path, capsys):
    from diffuse.cli import main
    from diffuse.home import models_dir

    make_tiny(models_dir(tmp_path) / "tiny-gemma3", "gemma3")
    assert main(["--home", str(tmp_path), "model", "list"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:3] == ["tiny-gemma3", "gemma3_text", "4"]
    assert main(["--home", str(tmp_path), "model", "info", "tiny-gemma3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    params = block_parameters(ModelConfig.load(models_dir(tmp_path) / "tiny-gemma3"), 0)
    fp32 = (8 if kernels.reorders() else 4) * params  # with the reordered copy products keep
    bf16 = (4 if kernels.reorders(torch.bfloat16) else 2) * params
    assert d["block_bytes"] == {"fp32": fp32, "bf16": bf16, "fp16": 2 * params}
    assert d["kv_bytes_per_token_per_block"]["bf16"] == 2 * 2 * 32 * 2  # k and v, 2 heads of 32, 2 bytes
    assert d["rope"] == "theta 50000, linear (factor 4); sliding layers theta 1000"
    assert d["attention"] == "sliding window 8 in 2 of 4 layers" and d["experts"] is None
    assert main(["--home", str(tmp_path), "model", "info", "tiny-gemma3"]) == 0
    assert "per block    fp32" in capsys.readouterr().out
