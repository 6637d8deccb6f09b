"""Tokenizer: tokenizer.json + tokenizer_config.json, chat templates, streaming detokenisation.

Built on the `tokenizers` library directly rather than transformers, which is a test-only
dependency; chat templates are rendered the way transformers renders them, so prompts match,
tools included (`tools=` given to the template). A template that takes no tools gets them in the
Hermes form, written into the system prompt, with past calls and results written as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from diffuse.errors import ModelError

# llama.cpp pre-tokenizer names -> the split regex their merges were learned with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Gemma, Phi).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# How a model writes a tool call, and the text of its template that says it writes them so.
HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_CALL_MARKS = ((MISTRAL, "[TOOL_CALLS]"), (HERMES, "<tool_call>"), (LLAMA3, '"parameters"'))
_CALL_SHAPES = {HERMES: '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
                LLAMA3: '{"name": ..., "parameters": {...}}',
                MISTRAL: '[TOOL_CALLS][{"name": ..., "arguments": {...}}]'}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # llama.cpp: every digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in (None, "default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    # A wrong split regex silently changes token ids, so refuse rather than guess.
    raise ModelError(f"pre-tokenizer {pre!r} is not supported (known: smollm, gpt2, {', '.join(_SPLITS)})")


def build_tokenizer_json(
    vocab: list[str], merges: list[str], token_types: list[int], model: str = "gpt2", pre: str | None = None,
    scores: list[float] | None = None, flavor: str = "llama",
) -> str:
    """A tokenizer.json for the tokenizer a GGUF embeds: byte-level BPE (`gpt2`: vocab, merges, a
    pre-tokenizer name) or SentencePiece BPE (`llama`: vocab and scores, merges when the file has
    them). `flavor` is the SentencePiece layout, which the file does not state and its architecture
    implies: `gemma`, `phi3` or `llama` (Llama 2, Mistral). Built as transformers builds them from
    the same file, so that both encode text to the same ids."""
    if model == "gpt2":
        tok = _Backend(BPE(vocab={t: i for i, t in enumerate(vocab)},
                           merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
    elif model == "llama":
        tok = _sentencepiece(vocab, merges, scores, flavor)
    else:
        raise ModelError(f"tokenizer model {model!r} is not supported: byte-level BPE ('gpt2') and "
                         "SentencePiece BPE ('llama') are")
    typed = list(zip(vocab, token_types))  # as the file spells them
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    known = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed
                    if k == _USER_DEFINED and t in known])
    return tok.to_str()


def _gemma_spelling(vocab: list[str]) -> list[str]:
    """Gemma files store tokens of two or more spaces as spaces; its tokenizer spells them with ▁."""
    return ["\u2581" * len(t) if " " in t and not t.strip() else t for t in vocab]


def _sentencepiece(vocab: list[str], merges: list[str], scores: list[float] | None, flavor: str) -> _Backend:
    if flavor not in ("gemma", "phi3", "llama"):
        raise ModelError(f"SentencePiece layout {flavor!r} is not supported (known: gemma, phi3, llama)")
    if flavor == "gemma":
        vocab = _gemma_spelling(vocab)
        # Gemma's scores do not follow its merge order; the order of the tokens in the file does.
        order = {t: -i for i, t in enumerate(vocab)}
    else:
        if scores is None:
            raise ModelError("a SentencePiece vocabulary without scores")
        order = dict(zip(vocab, scores))
    ids = {t: i for i, t in enumerate(vocab)}
    pairs = [tuple(m.split(" ")) for m in merges] if merges else _merges_from_vocab(ids, order)
    if flavor == "gemma":
        tok = _Backend(BPE(vocab=ids, merges=pairs, fuse_unk=True, unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok
    tok = _Backend(BPE(vocab=ids, merges=pairs, fuse_unk=True, byte_fallback=True))
    if flavor == "phi3":  # the prefix space comes from a normalizer: "  hi" keeps all its spaces
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok


def _merges_from_vocab(ids: dict[str, int], order: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a token into two tokens is one, ranked by
    the token's score (ties: shorter left, then right part first), as transformers derives them."""
    merges = []
    for token, score in order.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in ids and token[i:] in ids]
        merges.extend(sorted(local, key=lambda x: (ids[x[0]], ids[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


class _Generation(Extension):
    """transformers' `{% generation %}` tag marks assistant spans for training masks; here it is a no-op."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise(message: str):
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """Same environment as transformers: templates are untrusted code from model repos."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@lru_cache(maxsize=8)
def _takes_tools(template: str) -> bool:
    """Whether a template reads `tools`, as those of Qwen 2.5/3, Llama 3.1+ and Mistral do."""
    try:
        return "tools" in meta.find_undeclared_variables(_environment().parse(template))
    except jinja2.TemplateError:
        return False  # rendering will say what is wrong with it


@dataclass(frozen=True)
class ToolForm:
    """How a model is told of tools and writes its calls: `call` is the shape of a call (HERMES,
    LLAMA3, MISTRAL); `in_template` says whether its chat template renders the tools, or they go
    into the system prompt in the Hermes form because the template takes none."""

    call: str
    in_template: bool

    def __str__(self) -> str:
        where = "rendered by the chat template" if self.in_template else "in the system prompt (Hermes form)"
        return f"{self.call}: {_CALL_SHAPES[self.call]}, {where}"


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The system prompt's tools block in the Hermes form (as Qwen 2.5's template writes it)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>"
            "\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """A conversation with tools for a template that takes none: the tools in the system prompt,
    each call as `<tool_call>` JSON in its assistant message, consecutive results as one user
    message of `<tool_response>` blocks."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
        elif m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
            out.append({"role": m["role"], "content": f"{m['content']}\n{text}" if m.get("content") else text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{hermes_tools_prompt(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": hermes_tools_prompt(tools)})
    return out


def _token_str(v) -> str | None:
    """tokenizer_config.json spells tokens as strings or as serialised AddedToken dicts."""
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, backend: _Backend, config: dict, chat_template: str | None, extra_eos: list[int]):
        self.backend = backend
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self._specials = {k: _token_str(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.add_bos = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template
        ends = [self.eos_token, *_END_OF_TURN]
        self.eos_ids: set[int] = {i for i in map(backend.token_to_id, filter(None, ends)) if i is not None}
        self.eos_ids.update(extra_eos)

    @classmethod
    def load(cls, model_dir: Path) -> "Tokenizer":
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"no tokenizer.json in {d}")
        def optional_json(name: str) -> dict:
            return json.loads((d / name).read_text()) if (d / name).is_file() else {}

        try:
            backend = _Backend.from_file(str(path))
            config, gen = optional_json("tokenizer_config.json"), optional_json("generation_config.json")
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad tokenizer.json
            raise ModelError(f"cannot read the tokenizer in {d}: {e}") from None
        template = config.get("chat_template")
        if (d / "chat_template.jinja").is_file():  # newer repos keep the template in its own file
            template = (d / "chat_template.jinja").read_text()
        elif isinstance(template, list):  # older multi-template form: [{"name":..., "template":...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos = gen.get("eos_token_id")
        return cls(backend, config, template, eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Special tokens written in `text` (e.g. `<|im_start|>`) become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.backend.token_to_id(self.bos_token) if self.bos_token else None
        return [bos, *ids] if add_special and self.add_bos and bos is not None else ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def tool_form(self) -> ToolForm | None:
        """How this model is given tools and calls them; None without a chat template. A template
        that takes tools but writes calls in none of the known shapes gets the Hermes form too."""
        if not self.chat_template:
            return None
        if _takes_tools(self.chat_template):
            for call, mark in _CALL_MARKS:
                if mark in self.chat_template:
                    return ToolForm(call, True)
        return ToolForm(HERMES, False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """`tools` as transformers takes them: OpenAI's {"type": "function", "function": {...}}."""
        if not self.chat_template:
            raise ModelError("this model has no chat template")
        try:
            return _compile(self.chat_template).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **self._specials
            )
        except jinja2.TemplateError as e:
            raise ModelError(f"the chat template rejected the conversation: {e}") from None
        except TypeError as e:  # e.g. a template adding a string to a message's missing content
            raise ModelError(f"the chat template cannot render this conversation: {e}") from None

    def encode_chat(self, messages: list[dict], system: str | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for `messages` (assistant `tool_calls` with arguments as objects, `tool`
        results), offering `tools`; `system` replaces any leading system message.

        No BOS is added: chat templates write their own, as in transformers. A model without a
        template gets the plain prompt (see _encode_plain).
        """
        msgs = list(messages)
        if system is not None:
            if msgs and msgs[0].get("role") == "system":
                msgs = msgs[1:]
            msgs = [{"role": "system", "content": system}, *msgs]
        form = self.tool_form
        if form is None:
            if tools:
                raise ModelError("this is a base model without a chat template: it cannot be offered tools")
            return self._encode_plain(msgs)
        if not form.in_template:
            msgs, tools = _hermes_messages(msgs, tools), None
        return self.encode(self.apply_chat_template(msgs, add_generation_prompt=True, tools=tools or None))

    def _encode_plain(self, messages: list[dict]) -> list[int]:
        """A base model (no chat template) continues text: one user message is sent as it is
        (after BOS, as the model was trained); a conversation it cannot express is refused."""
        if len(messages) != 1 or messages[0].get("role") != "user" or not isinstance(messages[0].get("content"), str):
            raise ModelError("this is a base model without a chat template: it continues a plain prompt (one user "
                             "message, no system prompt); use the completions endpoint for raw text")
        return self.encode(messages[0]["content"], add_special=True)


def describe_tools(model_dir: Path) -> str:
    """How the model in `model_dir` is given tools and calls them, in words (`diffuse model info`)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return "none (no tokenizer)"
    return str(Tokenizer.load(model_dir).tool_form or "none (no chat template)")


class StreamDecoder:
    """Incremental detokenisation: text is emitted only once its bytes form complete characters.

    One token can hold part of a UTF-8 character (emoji, CJK) and byte-level decoders may
    render context-dependently, so each push decodes a short window of recent ids and emits
    the diff against the already-emitted prefix of that window.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # end of the text already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=self.skip_special)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(done) :]
