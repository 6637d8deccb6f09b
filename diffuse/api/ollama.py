"""Ollama's API on the same server: /api/chat, /api/generate, /api/tags, /api/show, /api/version.

Every answer takes the OpenAI endpoints' path (the asked model or its first servable fallback,
the same sessions and queue); this module is only Ollama's wire format: newline-delimited JSON
when streaming (Ollama's default), the last line with `done`, `done_reason`, token counts and
durations in nanoseconds; errors as `{"error": message}`. Sampling defaults are Ollama's own.
Options that would change the answer in ways this server cannot reproduce are refused by name.
Tools are the OpenAI endpoint's (api/tools.py), offered as its `auto` (Ollama has no tool_choice):
calls come back in `message.tool_calls` with their arguments as objects, streamed in one line
once the answer is read; past calls and `tool` results in the history are rendered for the model.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from diffuse.api.answers import Answers
from diffuse.api.respond import (
    ApiError, Dialect, Encode, Host, Prepare, Respond, Single, constrained, guarded, named, read, refuse,
)
from diffuse.api.schema import BadRequest, Options, ToolRequest, parse_tools
from diffuse.api.tools import Call, CallStream, offered_form, read_calls, tool_options
from diffuse.client.backend import UnknownModel
from diffuse.client.constrain import OutputConstraint
from diffuse.client.generate import Completion
from diffuse.client.sampling import SamplingParams
from diffuse.client.vault import opted_out
from diffuse.model import store
from diffuse.model.engine import block_parameters
from diffuse.validate import Int64

VERSION = "0.12.0"  # the Ollama release whose API this follows; clients ask for it first
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, where a request gives none
MAX_STOP = 16
_NEUTRAL_OPTIONS = {"mirostat": (0,), "typical_p": (1.0,), "tfs_z": (1.0,), "min_p": (0.0,)}
_REFUSED = {"think": (None, False), "images": (None, []), "context": (None, []), "suffix": (None, ""),
            "template": (None, ""), "logprobs": (None, False)}
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}

Penalty = Annotated[float, Meta(ge=-2, le=2)]


class SamplingOptions(msgspec.Struct):
    """The `options` that shape an answer; load-time ones (num_ctx, num_thread, ...) are ignored."""

    temperature: Annotated[float, Meta(ge=0)] = DEFAULTS["temperature"]
    top_k: Annotated[int, Meta(ge=0)] = int(DEFAULTS["top_k"])
    top_p: Annotated[float, Meta(gt=0, le=1)] = DEFAULTS["top_p"]
    seed: Int64 | None = None
    num_predict: Annotated[int, Meta(ge=-2)] | None = None  # -1 and -2 (no limit): the server's --max-tokens
    stop: Annotated[list[str], Meta(max_length=MAX_STOP)] = []
    repeat_penalty: Annotated[float, Meta(gt=0)] = 1.0  # over the whole context
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0


class CalledFunction(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1)]
    arguments: dict[str, Any] = {}  # an object, as Ollama writes it (not OpenAI's JSON text)


class PastCall(msgspec.Struct):
    function: CalledFunction


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[PastCall] = []  # an assistant's calls
    tool_name: str | None = None  # the function a tool message answers


class Asking(msgspec.Struct):
    model: Annotated[str, Meta(min_length=1)]
    stream: bool = True
    options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    format: Literal["", "json"] | dict[str, Any] = ""  # any JSON object, or one matching this schema


class Chat(Asking):
    messages: list[Message] = []


class Generate(Asking):
    prompt: str = ""
    system: str | None = None
    raw: bool = False  # the prompt as it is, without the chat template


class Show(msgspec.Struct):
    model: str | None = None
    name: str | None = None  # older clients' name for it


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _name(model: str) -> str:
    """Ollama names carry a tag, `:latest` by default; this server's models have none."""
    return model.removesuffix(":latest")


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _error(error: ApiError) -> dict[str, Any]:
    return {"error": named(error)}


class OllamaAnswer(Dialect):
    """One answer of /api/chat (a `message`, with `tool_calls` where tools were offered) or
    /api/generate (a `response`)."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, answers: Answers, chat: bool, tools: ToolRequest | None = None):
        self.model, self.answers, self.chat = model, answers, chat
        self.call_shape = offered_form(answers.tokenizer, tools).call if tools is not None else None
        self.names = {t["function"]["name"] for t in tools.tools} if tools is not None else set()
        self.calls = CallStream(self.call_shape, self.names) if self.call_shape else None

    def _text(self, text: str, calls: list[Call] | None = None) -> dict[str, Any]:
        called = {"tool_calls": [{"function": {"index": k, "name": c["name"], "arguments": c["arguments"]}}
                                 for k, c in enumerate(calls)]} if calls else {}
        content = {"message": {"role": "assistant", "content": text} | called} if self.chat else {"response": text}
        return {"model": self.model, "created_at": _now()} | content

    def _done(self, c: Completion, called: bool) -> dict[str, Any]:
        """The last line's facts; an answer that calls tools is done with "stop", as Ollama's is."""
        arrived, opened = self.answers.arrived, self.answers.opened
        return {"done": True, "done_reason": "stop" if called else c.finish_reason,
                "total_duration": _ns(time.perf_counter() - arrived),
                "load_duration": _ns(opened - arrived), "prompt_eval_count": c.prompt_tokens,
                "prompt_eval_duration": _ns(c.timings["first_token_s"]), "eval_count": len(c.token_ids),
                "eval_duration": _ns(c.timings["decode_s"])}

    def piece(self, text: str) -> bytes:
        text = self.calls.push(text) if self.calls is not None else text  # a call is held until it is whole
        return _line(self._text(text) | {"done": False}) if text else b""

    def closing(self, completion: Completion) -> list[bytes]:
        rest, calls = self.calls.finish() if self.calls is not None else ("", [])
        lines = [_line(self._text(rest) | {"done": False})] if rest else []
        lines += [_line(self._text("", calls) | {"done": False})] if calls else []
        return [*lines, _line(self._text("") | self._done(completion, bool(calls)))]

    def whole(self, completion: Completion) -> dict[str, Any]:
        found = read_calls(completion.text, self.call_shape, self.names) if self.call_shape else None
        text, calls = (completion.text, []) if found is None else (found[0] or "", found[1])
        return self._text(text, calls) | self._done(completion, bool(calls))

    def error(self, error: ApiError) -> dict[str, Any]:
        return _error(error)

    def stream_error(self, error: ApiError) -> bytes:
        return _line(_error(error))


def options(asking: Asking, given_options: dict[str, Any], default_max_tokens: int) -> Options:
    """Ollama's `options` as the answer path's: n is 1, usage is always in the last line."""
    refuse(given_options, _NEUTRAL_OPTIONS, "options.")
    o = asking.options
    if o.num_predict == 0:
        raise BadRequest("options.num_predict: 0 asks for no tokens; give a count, or -1 for the server's default",
                         "options.num_predict")
    count = o.num_predict or -1
    given = count > 0
    params = SamplingParams(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, seed=o.seed,
                            repetition_penalty=o.repeat_penalty, stop=o.stop,
                            max_tokens=count if given else default_max_tokens, constraint=_constraint(asking.format))
    return Options(model=_name(asking.model), params=params, max_tokens_given=given, n=1,
                   presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty, stream=asking.stream,
                   include_usage=False)


def _constraint(format_: str | dict[str, Any]) -> OutputConstraint | None:
    """`format` as structured output: "json" any JSON object, a dict the schema to match."""
    if isinstance(format_, dict):
        return constrained("json_schema", format_, "format")
    return constrained("json_object", None, "format") if format_ == "json" else None


def _turns(r: Generate) -> list[dict[str, str]]:
    """/api/generate's prompt as a conversation: a user's turn after `system`, or the `raw` prompt."""
    if r.raw:
        return [{"role": "prompt", "content": r.prompt}]
    return [{"role": "system", "content": r.system}] * bool(r.system) + [{"role": "user", "content": r.prompt}]


def _prompt(r: Generate) -> Encode:
    """/api/generate's prompt: through the chat template, or `raw`."""
    if r.raw:
        return lambda tok: [tok.encode(r.prompt, add_special=True)]
    messages = _turns(r)
    return lambda tok: [tok.encode_chat(messages)]


def _conversation(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates take them. Ollama's calls have no ids, so each past call gets
    one (9 letters and digits, which Mistral's templates insist on) and a tool message answers
    the earliest unanswered call of its `tool_name` (of any name without one)."""
    pending: list[tuple[str, str]] = []  # (id, function name) of the calls not yet answered
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            if m.role != "assistant":
                raise BadRequest("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            ids = [f"c{len(out):06d}{j:02d}" for j in range(len(m.tool_calls))]
            message["tool_calls"] = [{"id": k, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for k, c in zip(ids, m.tool_calls)]
            pending += [(k, c.function.name) for k, c in zip(ids, m.tool_calls)]
        if m.role == "tool":
            answered = next((p for p in pending if m.tool_name in (None, p[1])), None)
            if answered is None:
                raise BadRequest("a tool message must answer an unanswered call of an earlier assistant message"
                                 + (f" to {m.tool_name!r}" if m.tool_name else ""), f"messages[{i}].tool_name")
            pending.remove(answered)
            message |= {"tool_call_id": answered[0], "name": answered[1]}
        out.append(message)
    return out


def _tools(body: dict[str, Any], asking: Chat) -> tuple[ToolRequest | None, Prepare]:
    """`tools` as the OpenAI endpoint's, offered `auto`, and how to fit them to the answering model."""
    tools = parse_tools({"tools": body.get("tools") or []})
    if tools is None:
        return None, lambda tok, o: o
    if asking.format:
        raise BadRequest("format cannot be combined with tools", "format")
    return tools, lambda tok, o: tool_options(tok, o, tools)


def _respond(chat: bool, stream: bool, tools: ToolRequest | None = None) -> Respond:
    return lambda model, answers, prompt_tokens, headers: Single(answers, OllamaAnswer(model, answers, chat, tools),
                                                                 stream, headers)


class Ollama:
    """The handlers, bound to the API's answer path."""

    def __init__(self, host: Host):
        self.host = host

    def _loaded(self, model: str, chat: bool) -> Response:
        """Ollama's answer to nothing to say (how its clients load a model): done at once."""
        self.host.backend.tokenizer(model)  # an unknown model is a 404 all the same
        content = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        body = {"model": model, "created_at": _now()} | content | {"done": True, "done_reason": "load"}
        return JSONResponse(body)

    async def chat(self, request: Request) -> Response:
        body = await self.host.body(request)
        refuse(body, _REFUSED)
        r = read(body, Chat)
        for i, m in enumerate(body.get("messages") or []):
            refuse(m, {"images": (None, [])}, f"messages[{i}].")
        if not r.messages:
            return self._loaded(_name(r.model), chat=True)
        tools, prepare = _tools(body, r)
        messages, offered = _conversation(r.messages), tools.tools if tools is not None else None
        return await self.host.answer(options(r, body.get("options") or {}, self.host.default_max_tokens),
                                      lambda tok: [tok.encode_chat(messages, tools=offered)],
                                      _respond(True, r.stream, tools), prepare,
                                      keep=None if opted_out(request.headers) else messages)

    async def generate(self, request: Request) -> Response:
        body = await self.host.body(request)
        refuse(body, _REFUSED)
        if body.get("tools"):
            raise BadRequest("tools are offered through /api/chat", "tools", "unsupported_parameter")
        r = read(body, Generate)
        if not r.prompt:
            return self._loaded(_name(r.model), chat=False)
        return await self.host.answer(options(r, body.get("options") or {}, self.host.default_max_tokens), _prompt(r),
                                      _respond(False, r.stream), keep=None if opted_out(request.headers) else _turns(r))

    async def tags(self, request: Request) -> Response:
        self.host.authorize(request)
        held, offered = self._held(), await self.host.backend.models()
        return JSONResponse({"models": [_tag(c["model"], held.get(c["model"])) for c in offered]})

    async def show(self, request: Request) -> Response:
        r = read(await self.host.body(request), Show)
        model = _name(r.model or r.name or "")
        offered = [c["model"] for c in await self.host.backend.models()]
        info = self._held().get(model)
        if model not in offered or info is None:
            raise UnknownModel(model, offered)
        tokenizer = self.host.backend.tokenizer(model)
        form = tokenizer.tool_form  # None: a base model, which cannot be offered tools
        parameters = {**DEFAULTS, "num_predict": self.host.default_max_tokens}
        return JSONResponse({
            "license": info.licence or "", "template": tokenizer.chat_template or "",
            "parameters": "\n".join(f"{k} {v}" for k, v in parameters.items()),
            "details": _details(info), "modified_at": _modified(info),
            "capabilities": ["completion", "tools"] if form else ["completion"],
            "model_info": _model_info(info) | ({"diffuse.tools": str(form)} if form else {})})

    def _held(self) -> dict[str, store.ModelInfo]:
        """The store's models by id (a model offered from a directory outside it has no entry)."""
        return {i.manifest.model_id: i for i in store.list_models(self.host.backend.config.home)}

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})


def _model_info(info: store.ModelInfo) -> dict[str, Any]:
    """The model's facts in GGUF's key names, and diffuse's own under `diffuse.`."""
    cfg = info.config
    return {"general.architecture": cfg.arch, "general.parameter_count": _parameters(info),
            f"{cfg.arch}.context_length": cfg.max_position_embeddings, f"{cfg.arch}.embedding_length": cfg.hidden_size,
            f"{cfg.arch}.block_count": cfg.num_layers, f"{cfg.arch}.feed_forward_length": cfg.intermediate_size,
            f"{cfg.arch}.attention.head_count": cfg.num_heads, f"{cfg.arch}.attention.head_count_kv": cfg.num_kv_heads,
            f"{cfg.arch}.rope.freq_base": cfg.rope_theta, f"{cfg.arch}.vocab_size": cfg.vocab_size,
            "diffuse.attention": info.attention, "diffuse.model_hash": info.manifest.model_hash}


def _parameters(info: store.ModelInfo) -> int:
    cfg = info.config
    head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    return head + sum(block_parameters(cfg, i) for i in range(cfg.num_layers))


def _modified(info: store.ModelInfo) -> str:
    mtime = (info.path / "config.json").stat().st_mtime
    return datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _details(info: store.ModelInfo) -> dict[str, Any]:
    n = _parameters(info)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return {"parent_model": "", "format": "safetensors", "family": info.config.arch, "families": [info.config.arch],
            "parameter_size": size, "quantization_level": _DTYPES.get(info.manifest.dtype, info.manifest.dtype)}


def _tag(model: str, info: store.ModelInfo | None) -> dict[str, Any]:
    """A model as /api/tags lists it; the store's facts where the store holds it."""
    facts = {} if info is None else {"modified_at": _modified(info), "size": info.size_bytes,
                                     "digest": info.manifest.model_hash, "details": _details(info)}
    return {"name": model, "model": model} | facts


def routes(host: Host) -> list[Route]:
    """Ollama's endpoints, each answering its errors as Ollama does."""
    o = Ollama(host)
    return [Route(path, guarded(handler, _error), methods=[method]) for path, handler, method in (
        ("/api/chat", o.chat, "POST"), ("/api/generate", o.generate, "POST"), ("/api/tags", o.tags, "GET"),
        ("/api/show", o.show, "POST"), ("/api/version", o.version, "GET"))]
