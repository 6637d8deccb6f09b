"""Tokenizer: ids, decoding, streaming and chat templates against transformers on the real SmolLM2."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from diffuse.errors import ModelError
from diffuse.model.gguf_import import embedded_gguf_path, import_gguf
from diffuse.model.tokenizer import StreamDecoder, Tokenizer, build_tokenizer_json

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "12345 3.14 and 1,000,000.50",
    "def f(x):\n    return x**2  # square\n\tif x != 0: pass",
    "你好，世界！日本語のテキストと한국어",
    "emoji: 👍🏽 🇫🇷 👨‍👩‍👧 🤖!",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "spaces   and\n\n\n  newlines\t\t tabs    ",
    "   leading and trailing   ",
    "don't I'll we've THEY'RE",
    "Ünïcödé naïve café — “quotes” 𝔘",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?\n"},
    ],
]
# Exercise trim_blocks/lstrip_blocks, loop controls, namespace, tojson and globals like transformers.
TEMPLATES = [
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U: {{ m.content }}\n  {% endif %}\n{% endfor %}\n",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m | tojson }}{% endfor %}{{ ns.n }}{{ bos_token }}{{ eos_token }}",
    "{%- for m in messages -%}\n{{- m.role | upper }}:{{ m.content | trim }}\n{%- endfor -%}\n"
    "{%- if add_generation_prompt %}A:{% endif %}",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return import_gguf(embedded_gguf_path(), tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.load(model_dir)


@pytest.fixture(scope="module")
def hf_dir(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' own GGUF tokenizer: built independently of ours, from the same file."""
    transformers = pytest.importorskip("transformers")
    path = embedded_gguf_path()
    try:
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ImportError, OSError, ValueError) as e:
        pytest.skip(f"transformers cannot load the GGUF tokenizer here: {e}")


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok, hf_dir, hf_gguf, text):
    want = hf_gguf(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == want
    assert hf_dir(text, add_special_tokens=False)["input_ids"] == want
    assert tok.encode(text, add_special=True) == hf_dir(text)["input_ids"]  # add_bos_token is false


@settings(max_examples=150, deadline=None, derandomize=True)
@given(text=st.text(max_size=40))
def test_random_text_ids_match_transformers_gguf(tok, hf_gguf, text):
    assert tok.encode(text) == hf_gguf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_special_tokens(tok):
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.decode([1, 4093, 2]) == "user"
    assert tok.eos_ids == {0, 2}  # <|endoftext|>, <|im_end|>; never <|im_start|>
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_equals_decode(tok, text):
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    if "🤖" in text:  # emoji span several byte tokens: the partial ones are held back
        assert "" in pieces


@settings(max_examples=100, deadline=None, derandomize=True)
@given(text=st.text(max_size=30), cut=st.integers(min_value=0, max_value=40))
def test_stream_decoder_random(tok, text, cut):
    ids = tok.encode(text)[:cut]  # a cut may split a character: flush must return its U+FFFD
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_dir, chat, gen):
    want = hf_dir.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(chat, add_generation_prompt=gen) == want
    assert want.startswith("<|im_start|>system\n")


@pytest.mark.parametrize("chat", CHATS)
def test_encode_chat_matches_transformers(tok, hf_dir, chat):
    want = hf_dir.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert tok.encode_chat(chat) == want["input_ids"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_semantics_match_transformers(tok, hf_dir, template):
    mine = Tokenizer(tok.backend, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, template, [])
    for chat in CHATS:
        want = hf_dir.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
        assert mine.apply_chat_template(chat) == want


def test_encode_chat_system_replaces_default(tok):
    text = tok.decode(tok.encode_chat(CHATS[1], system="Answer in French."), skip_special=False)
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi 👋")
    assert "Be brief" not in text and text.endswith("<|im_start|>assistant\n")


def test_template_errors(tok):
    def render(template: str) -> str:
        return Tokenizer(tok.backend, {}, template, []).apply_chat_template(CHATS[0])

    with pytest.raises(ModelError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ModelError, match="template"):
        render("{{ ''.__class__.__mro__ }}")  # sandboxed: no access to Python internals
    with pytest.raises(ModelError, match="no chat template"):
        Tokenizer(tok.backend, {}, None, []).apply_chat_template(CHATS[0])
    assert render("{% generation %}ok{% endgeneration %}") == "ok"


def test_base_model_gets_the_plain_prompt(tok):
    """Without a chat template (a base model such as Gemma 3 270M) one user message is the prompt
    itself, after BOS; what a plain prompt cannot express is refused, not guessed."""
    base = Tokenizer(tok.backend, {"bos_token": "<|im_start|>", "add_bos_token": True}, None, [])
    text = "The capital of France is"
    assert base.encode_chat([{"role": "user", "content": text}]) == base.encode(text, add_special=True)
    assert base.encode(text, add_special=True)[0] == tok.backend.token_to_id("<|im_start|>")
    with pytest.raises(ModelError, match="base model without a chat template"):
        base.encode_chat([{"role": "user", "content": text}], system="Be brief.")
    with pytest.raises(ModelError, match="base model without a chat template"):
        base.encode_chat(CHATS[2])


def test_load_prefers_chat_template_file_and_generation_eos(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }} messages")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    t = Tokenizer.load(tmp_path)
    assert t.apply_chat_template(CHATS[2]) == "3 messages"
    assert t.eos_ids == {0, 2, 7}


def test_load_errors(tmp_path):
    with pytest.raises(ModelError, match="no tokenizer.json"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read the tokenizer"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("smollm", ["1", "2", "3", "4", "5", "Ġabc"]),
        ("gpt2", ["12345", "Ġabc"]),
        ("llama-bpe", ["123", "45", "Ġabc"]),
        ("qwen2", ["1", "2", "3", "4", "5", "Ġabc"]),
    ],
)
def test_build_pre_tokenizers(pre, pieces):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend.from_str(build_tokenizer_json(alphabet, [], [1] * len(alphabet), pre=pre))
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("12345 abc")] == pieces


def test_build_rejects_unknown_tokenizers():
    with pytest.raises(ModelError, match="'bert'"):
        build_tokenizer_json(["a"], [], [1], model="bert")
    with pytest.raises(ModelError, match="without scores"):
        build_tokenizer_json(["a"], [], [1], model="llama")
    with pytest.raises(ModelError, match="layout 't5'"):
        build_tokenizer_json(["a"], [], [1], model="llama", scores=[0.0], flavor="t5")
    with pytest.raises(ModelError, match="'mystery'"):
        build_tokenizer_json(["a"], [], [1], pre="mystery")
