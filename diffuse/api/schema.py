"""The OpenAI wire format: request fields checked into our types, and the JSON we answer with.

Pure functions, no I/O. Requests are checked against msgspec Structs (diffuse/validate.py);
a failure names the offending field (`param`), as OpenAI's 400s do, so a client library shows
which argument to fix. Fields we cannot honour faithfully (log-probs, tools, logit bias, echo)
are refused rather than silently ignored.
"""

from __future__ import annotations

import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from diffuse.client.generate import Completion
from diffuse.client.sampling import SamplingParams
from diffuse.errors import DiffuseError
from diffuse.validate import Int64, Malformed, convert

T = TypeVar("T")

MAX_STOP = 4  # as OpenAI
_REFUSED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
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


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class Chat(msgspec.Struct):
    messages: Annotated[list[Message], Meta(min_length=1)]


class Prompts(msgspec.Struct):
    prompt: str | Annotated[list[str], Meta(min_length=1)]  # the legacy completions prompt: each gets n choices


def _read(body: dict[str, Any], type_: type[T]) -> T:
    """`body` checked into `type_`; a BadRequest naming the offending field where it does not fit."""
    try:
        return convert({k: v for k, v in body.items() if v is not None}, type_)
    except Malformed as e:
        raise BadRequest(str(e), e.field) from None


def parse_options(body: dict[str, Any], default_max_tokens: int, max_n: int) -> Options:
    """The sampling and delivery options shared by chat and text completions."""
    r = _read(body, Request)
    for name, allowed in _REFUSED.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name} is not supported by this server", name, "unsupported_parameter")
    if r.n > max_n:
        raise BadRequest(f"n: at most {max_n} choices per request", "n")
    max_tokens = r.max_completion_tokens or r.max_tokens
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                            max_tokens=max_tokens or default_max_tokens,
                            stop=[r.stop] if isinstance(r.stop, str) else r.stop)
    return Options(model=r.model, params=params, max_tokens_given=max_tokens is not None, n=r.n,
                   presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty, stream=r.stream,
                   include_usage=bool(r.stream_options and r.stream_options.include_usage))


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages as the chat template wants them: role and plain-text content."""
    return [{"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())}
            for m in _read(body, Chat).messages]


def parse_prompts(body: dict[str, Any]) -> list[str]:
    """The legacy completions prompt: one string or a list of them (each gets n choices)."""
    prompt = _read(body, Prompts).prompt
    return [prompt] if isinstance(prompt, str) else prompt


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


class Shape(ABC):
    """How one kind of completion is written: whole, or as stream chunks."""

    object: str
    chunk_object: str
    prefix: str

    def __init__(self, model: str):
        self.model, self.id, self.created = model, self.prefix + secrets.token_hex(12), int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def opening(self, index: int) -> dict[str, Any] | None:
        """The chunk that opens choice `index`'s stream, if the format has one."""
        return None

    @abstractmethod
    def chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]: ...

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
        return self._envelope(self.chunk_object, [{"index": index, "delta": delta, "logprobs": None,
                                                   "finish_reason": finish}])

    def whole(self, completions: list[Completion], usage_: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": None, "finish_reason": c.finish_reason} for i, c in enumerate(completions)]
        return self._envelope(self.object, choices) | {"usage": usage_}


class TextShape(Shape):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl-"

    def chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [{"index": index, "text": text, "logprobs": None,
                                                   "finish_reason": finish}])

    def whole(self, completions: list[Completion], usage_: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                   for i, c in enumerate(completions)]
        return self._envelope(self.object, choices) | {"usage": usage_}
