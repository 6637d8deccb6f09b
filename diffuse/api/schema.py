"""The OpenAI wire format: request fields checked into our types, and the JSON we answer with.

Pure functions, no I/O. Requests are checked against msgspec Structs (diffuse/validate.py);
a failure names the offending field (`param`), as OpenAI's 400s do, so a client library shows
which argument to fix. Fields we cannot honour faithfully (logit bias, echo, best_of, suffix)
are refused rather than silently ignored. `response_format` becomes an OutputConstraint that
decoding enforces (client/constrain.py); log-probabilities are the model's raw log-softmax.
Tools are OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked here into a
ToolRequest; diffuse/api/tools.py reads the calls back.
"""

from __future__ import annotations

import json
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from diffuse.client.constrain import ConstraintError, OutputConstraint
from diffuse.client.generate import Completion
from diffuse.client.sampling import MAX_LOGPROBS, Logprob, SamplingParams
from diffuse.errors import DiffuseError
from diffuse.validate import Int64, Malformed, convert

T = TypeVar("T")

MAX_STOP = 4  # as OpenAI
_REFUSED = {"functions": (None, []),
            "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}


class BadRequest(DiffuseError):
    """HTTP 400 in OpenAI's error format."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Options:
    """What one request asks for, apart from its prompt."""

    model: str
    params: SamplingParams  # max_tokens is the server default when the request gives none
    max_tokens_given: bool
    n: int
    presence_penalty: float
    frequency_penalty: float
    stream: bool
    include_usage: bool

    def choice_params(self, index: int, max_tokens: int) -> SamplingParams:
        """Choice `index`'s sampling: a seed moves with the index so that n choices differ yet a
        seeded request still reproduces every one of them."""
        seed = None if self.params.seed is None else (self.params.seed + index) % 2**64
        return replace(self.params, seed=seed, max_tokens=max_tokens)


Penalty = Annotated[float, Meta(ge=-2, le=2)]
Positive = Annotated[int, Meta(ge=1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class Request(msgspec.Struct):
    """The options shared by chat and text completions; a null field is an absent one, and fields
    not named here are ignored (clients send many)."""

    model: Annotated[str, Meta(min_length=1)]
    temperature: Annotated[float, Meta(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    seed: Int64 | None = None
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None  # the chat API's newer name for max_tokens
    n: Positive = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP)] = []
    stream: bool = False
    stream_options: StreamOptions | None = None


class TextPart(msgspec.Struct):
    type: Literal["text"]  # this model reads text only
    text: str


class CalledFunction(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1)]
    arguments: str  # a JSON object's text, as OpenAI writes it


class ToolCall(msgspec.Struct):
    id: Annotated[str, Meta(min_length=1)]
    function: CalledFunction
    type: Literal["function"] = "function"


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    name: str | None = None


class FunctionSpec(msgspec.Struct):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None


class ToolSpec(msgspec.Struct):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(msgspec.Struct):
    name: str


class NamedChoice(msgspec.Struct):
    type: Literal["function"]
    function: ChosenFunction


class Tools(msgspec.Struct):
    tools: list[ToolSpec] = []
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and how it lets the model use them."""

    tools: list[dict[str, Any]]  # as chat templates take them: {"type": "function", "function": {...}}
    choice: str  # "auto", "none", "required", or "function": call `named`
    named: str | None
    parallel: bool

    @property
    def offered(self) -> bool:
        """Whether the model is told of the tools (not with tool_choice "none")."""
        return self.choice != "none"


class Chat(msgspec.Struct):
    messages: Annotated[list[Message], Meta(min_length=1)]


class JsonSchemaSpec(msgspec.Struct):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    schema: dict[str, Any] = {}  # OpenAI's default: any JSON
    strict: bool | None = None  # the schema is always enforced, strict or not
    description: str | None = None


class TextFormat(msgspec.Struct, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaSpec


class Formats(msgspec.Struct):
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None


class ChatLogprobs(msgspec.Struct):
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None


class TextLogprobs(msgspec.Struct):
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None  # the legacy API's bound


class Prompts(msgspec.Struct):
    prompt: str | Annotated[list[str], Meta(min_length=1)]  # the legacy completions prompt: each gets n choices


def _read(body: dict[str, Any], type_: type[T]) -> T:
    """`body` checked into `type_`; a BadRequest naming the offending field where it does not fit."""
    try:
        return convert({k: v for k, v in body.items() if v is not None}, type_)
    except Malformed as e:
        raise BadRequest(str(e), e.field) from None


def parse_options(body: dict[str, Any], default_max_tokens: int, max_n: int, chat: bool = True) -> Options:
    """The sampling and delivery options shared by chat and text completions (`chat`: which)."""
    r = _read(body, Request)
    for name, allowed in _REFUSED.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name} is not supported by this server", name, "unsupported_parameter")
    if r.n > max_n:
        raise BadRequest(f"n: at most {max_n} choices per request", "n")
    max_tokens = r.max_completion_tokens or r.max_tokens
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                            max_tokens=max_tokens or default_max_tokens,
                            stop=[r.stop] if isinstance(r.stop, str) else r.stop,
                            constraint=parse_format(body), logprobs=parse_logprobs(body, chat))
    return Options(model=r.model, params=params, max_tokens_given=max_tokens is not None, n=r.n,
                   presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, stream=r.stream,
                   include_usage=bool(r.stream_options and r.stream_options.include_usage))


def parse_format(body: dict[str, Any]) -> OutputConstraint | None:
    """`response_format` as the constraint decoding enforces; one that does not compile is a
    400 naming it."""
    f = _read(body, Formats).response_format
    if isinstance(f, JsonSchemaFormat):
        constraint = OutputConstraint("json_schema", f.json_schema.schema)
    elif isinstance(f, JsonObjectFormat):
        constraint = OutputConstraint("json_object")
    else:
        return None
    try:
        constraint.check()
    except ConstraintError as e:
        raise BadRequest(f"response_format: the schema does not compile: {e}", "response_format") from None
    return constraint


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives to report with each token's log-probability (None: no log-probs):
    chat's `logprobs: true` with `top_logprobs`, or the legacy completions' `logprobs: N`."""
    if not chat:
        return _read(body, TextLogprobs).logprobs
    r = _read(body, ChatLogprobs)
    if r.top_logprobs is not None and not r.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (r.top_logprobs or 0) if r.logprobs else None


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages as chat templates want them: role and plain-text content; an assistant's
    `tool_calls` with their arguments as objects; a tool result's `tool_call_id` and the name of
    the function it answers."""
    called: dict[str, str] = {}  # call id -> function name, of the calls so far
    out = []
    for i, m in enumerate(_read(body, Chat).messages):
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.tool_calls:
            if m.role != "assistant":
                raise BadRequest("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            message["tool_calls"] = [_past_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
            called |= {c.id: c.function.name for c in m.tool_calls}
        if m.role == "tool":
            if m.tool_call_id not in called:
                raise BadRequest("a tool message must answer a call of an earlier assistant message by its id",
                                 f"messages[{i}].tool_call_id")
            message |= {"tool_call_id": m.tool_call_id, "name": called[m.tool_call_id]}
        out.append(message)
    return out


def _past_call(call: ToolCall, where: str) -> dict[str, Any]:
    """A call of the history as templates take it, its arguments parsed."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise BadRequest("arguments must be a JSON object's text", f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools and tool_choice; None where it offers none."""
    r = _read(body, Tools)
    if not r.tools:
        if r.tool_choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    tools: list[dict[str, Any]] = []
    for i, t in enumerate(r.tools):
        f = t.function
        if any(f.name == u["function"]["name"] for u in tools):
            raise BadRequest(f"two tools are named {f.name!r}", f"tools[{i}].function.name")
        parameters = {"type": "object", "properties": {}} if f.parameters is None else f.parameters
        if parameters.get("type", "object") != "object":
            raise BadRequest("parameters must be a JSON schema of type object", f"tools[{i}].function.parameters")
        described = {} if f.description is None else {"description": f.description}
        tools.append({"type": "function", "function": {"name": f.name, **described, "parameters": parameters}})
    named = r.tool_choice.function.name if isinstance(r.tool_choice, NamedChoice) else None
    if named is not None and all(named != t["function"]["name"] for t in tools):
        raise BadRequest(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    choice = "function" if named else r.tool_choice or "auto"
    return ToolRequest(tools, choice, named, r.parallel_tool_calls)


def parse_prompts(body: dict[str, Any]) -> list[str]:
    """The legacy completions prompt: one string or a list of them (each gets n choices)."""
    if body.get("tools"):
        raise BadRequest("tools are offered through /v1/chat/completions", "tools", "unsupported_parameter")
    prompt = _read(body, Prompts).prompt
    return [prompt] if isinstance(prompt, str) else prompt


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


LEAST_LOGPROB = -9999.0  # what OpenAI writes for a token with no chance (JSON has no -inf)


def _spelt(entry: Logprob) -> tuple[str, float]:
    return entry.bytes.decode("utf-8", errors="replace"), max(entry.logprob, LEAST_LOGPROB)


def chat_logprobs(entries: list[Logprob] | None) -> dict[str, Any] | None:
    """OpenAI chat's `logprobs` of a choice or a chunk: per token, its text, bytes and
    log-probability, and the likeliest tokens there."""
    if not entries:
        return None

    def one(e: Logprob) -> dict[str, Any]:
        token, logprob = _spelt(e)
        return {"token": token, "logprob": logprob, "bytes": list(e.bytes)}

    return {"content": [one(e) | {"top_logprobs": [one(t) for t in e.top]} for e in entries], "refusal": None}


def text_logprobs(entries: list[Logprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions' `logprobs`: tokens, their log-probabilities, the likeliest tokens
    there (with the chosen one) and where each token starts in the text (from `offset`)."""
    if not entries:
        return None
    tokens = [_spelt(e) for e in entries]
    starts = [offset + sum(len(t) for t, _ in tokens[:k]) for k in range(len(tokens))]
    tops = [dict(map(_spelt, e.top)) | dict([t]) for e, t in zip(entries, tokens)]
    return {"tokens": [t for t, _ in tokens], "token_logprobs": [lp for _, lp in tokens],
            "top_logprobs": tops, "text_offset": starts}


class Shape(ABC):
    """How one kind of completion is written: whole, or as stream chunks. A stream's chunks carry
    the log-probabilities of the tokens since the last one, from `scored` (choice index -> them,
    None when not asked for), which the response sets."""

    object: str
    chunk_object: str
    prefix: str

    def __init__(self, model: str):
        self.model, self.id, self.created = model, self.prefix + secrets.token_hex(12), int(time.time())
        self.scored: Callable[[int], list[Logprob] | None] = lambda index: None

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def opening(self, index: int) -> dict[str, Any] | None:
        """The chunk that opens choice `index`'s stream, if the format has one."""
        return None

    @abstractmethod
    def chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]: ...

    def chunks(self, index: int, text: str, finish: str | None) -> list[dict[str, Any]]:
        """What to send for a piece of choice `index`'s text, or for its end (a shape may hold
        text back, as one that reads tool calls does)."""
        return [self.chunk(index, text, finish)]

    @abstractmethod
    def whole(self, completions: list[Completion], usage_: dict[str, int]) -> dict[str, Any]: ...

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        """The last chunk when the client asked for stream_options.include_usage."""
        return self._envelope(self.chunk_object, []) | {"usage": usage_}


class ChatShape(Shape):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def opening(self, index: int) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])

    def chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._envelope(self.chunk_object, [{"index": index, "delta": delta,
                                                   "logprobs": chat_logprobs(self.scored(index)),
                                                   "finish_reason": finish}])

    def whole(self, completions: list[Completion], usage_: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": chat_logprobs(c.logprobs), "finish_reason": c.finish_reason}
                   for i, c in enumerate(completions)]
        return self._envelope(self.object, choices) | {"usage": usage_}


class TextShape(Shape):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, model: str):
        super().__init__(model)
        self.offsets: dict[int, int] = {}  # per choice, the length of the text its logprobs covered

    def chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        logprobs = text_logprobs(self.scored(index), self.offsets.get(index, 0))
        if logprobs:
            self.offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return self._envelope(self.chunk_object, [{"index": index, "text": text, "logprobs": logprobs,
                                                   "finish_reason": finish}])

    def whole(self, completions: list[Completion], usage_: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": i, "text": c.text, "logprobs": text_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason} for i, c in enumerate(completions)]
        return self._envelope(self.object, choices) | {"usage": usage_}
