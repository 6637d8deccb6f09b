"""The OpenAI wire format: request fields checked into our types, and the JSON we answer with.

Pure functions, no I/O. Checks name the offending field (`param`), as OpenAI's 400s do, so a
client library shows which argument to fix. Fields we cannot honour faithfully (log-probs,
tools, logit bias, echo) are refused rather than silently ignored.
"""

from __future__ import annotations

import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

from diffuse.client.generate import Completion
from diffuse.client.sampling import SamplingParams
from diffuse.errors import DiffuseError

MAX_STOP = 4  # as OpenAI
ROLES = {"system", "developer", "user", "assistant", "tool"}
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


def _num(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be a number between {lo} and {hi}, got {v!r}", name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise BadRequest(f"{name} must be an integer {bound}, got {v!r}", name)
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {v!r}", name)
    return v


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    return stop


def parse_options(body: dict[str, Any], default_max_tokens: int, max_n: int) -> Options:
    """The sampling and delivery options shared by chat and text completions."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", "model")
    for name, allowed in _REFUSED.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{name} is not supported by this server", name, "unsupported_parameter")
    # max_completion_tokens is the chat API's newer name for max_tokens.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, 1)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    try:
        params = SamplingParams(
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
            seed=_int(body, "seed", -(2**63), 2**63 - 1),
            max_tokens=max_tokens or default_max_tokens,
            stop=_stop(body),
        )
    except ValueError as e:  # what the ranges above let through, e.g. top_p=0
        raise BadRequest(str(e), str(e).split()[0]) from None
    return Options(
        model=model, params=params, max_tokens_given=max_tokens is not None,
        n=_int(body, "n", 1, max_n) or 1,
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        stream=_bool(body, "stream"),
        include_usage=_bool(stream_options, "include_usage"),
    )


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages as the chat template wants them: role and plain-text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content"), f"messages[{i}].content")})
    return out


def _content(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"{param} must be a string or a list of text parts (this model reads text only)", param)


def parse_prompts(body: dict[str, Any]) -> list[str]:
    """The legacy completions prompt: one string or a list of them (each gets n choices)."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompt must be a string or a non-empty list of strings", "prompt")
    return prompts


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
