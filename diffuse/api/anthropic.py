"""Anthropic's Messages API on the same server: POST /v1/messages.

Every answer takes the OpenAI endpoints' path (the asked model or its first servable fallback,
the same sessions and queue); this module is only Anthropic's wire format: text content blocks
in, one text block out, `stop_reason` end_turn / max_tokens / stop_sequence, server-sent events
(message_start ... message_stop) when streaming, and errors as `{"type": "error", "error": ...}`.
A last assistant turn is a prefill the answer continues, as Anthropic's is.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from diffuse.api.answers import Answers
from diffuse.api.respond import (
    ApiError, Dialect, Encode, Host, Single, constrained, guarded, read, refuse, stop_sequence,
)
from diffuse.api.schema import Options
from diffuse.client.generate import Completion
from diffuse.client.sampling import SamplingParams

MAX_STOP = 16
_REFUSED = {"tools": (None, []), "thinking": (None, {"type": "disabled"}), "mcp_servers": (None, [])}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class TextBlock(msgspec.Struct):
    type: Literal["text"]  # this model reads text only
    text: str


Content = str | list[TextBlock]


class Turn(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: Content


class JsonOutputFormat(msgspec.Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct):
    format: JsonOutputFormat | None = None  # structured output: an answer matching the schema


class Messages(msgspec.Struct):
    """A Messages request; fields not named here (metadata, service_tier, ...) are ignored."""

    model: Annotated[str, Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[Turn], Meta(min_length=1)]
    system: Content = ""
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP)] = []
    temperature: Annotated[float, Meta(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    stream: bool = False
    output_config: OutputConfig | None = None


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _error(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": str(error)}}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class AnthropicAnswer(Dialect):
    """One Messages answer: a message with one text block."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, model: str, answers: Answers, prompt_tokens: int):
        self.model, self.answers, self.prompt_tokens = model, answers, prompt_tokens
        self.id = "msg_" + secrets.token_hex(12)

    def _stop(self, c: Completion) -> dict[str, Any]:
        """Why the answer ended, in Anthropic's words (a lost span keeps the server's own)."""
        if c.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if c.finish_reason != "stop":
            return {"stop_reason": c.finish_reason, "stop_sequence": None}
        matched = stop_sequence(c, self.answers.tokenizer, self.answers.choices[0][1].stop)
        return {"stop_reason": "stop_sequence" if matched else "end_turn", "stop_sequence": matched}

    def _message(self, content: list[dict[str, Any]], stop: dict[str, Any], output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                **stop, "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}}

    def opening(self) -> list[bytes]:
        start = self._message([], {"stop_reason": None, "stop_sequence": None}, 0)
        return [_event("message_start", {"type": "message_start", "message": start}),
                _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}}),
                _event("ping", {"type": "ping"})]

    def piece(self, text: str) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})

    def closing(self, completion: Completion) -> list[bytes]:
        return [_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event("message_delta", {"type": "message_delta", "delta": self._stop(completion),
                                         "usage": {"output_tokens": len(completion.token_ids)}}),
                _event("message_stop", {"type": "message_stop"})]

    def whole(self, completion: Completion) -> dict[str, Any]:
        return self._message([{"type": "text", "text": completion.text}], self._stop(completion),
                             len(completion.token_ids))

    def error(self, error: ApiError) -> dict[str, Any]:
        return _error(error)

    def stream_error(self, error: ApiError) -> bytes:
        return _event("error", _error(error))


def _prompt(turns: list[dict[str, str]], system: str) -> Encode:
    """The conversation through the chat template; a last assistant turn is continued, not answered."""
    prefill = turns[-1]["content"] if turns[-1]["role"] == "assistant" else None
    asked = turns[:-1] if prefill is not None else turns
    return lambda tok: [tok.encode_chat(asked, system or None) + (tok.encode(prefill) if prefill else [])]


class Anthropic:
    """The handler, bound to the API's answer path."""

    def __init__(self, host: Host):
        self.host = host

    async def messages(self, request: Request) -> Response:
        body = await self.host.body(request)
        refuse(body, _REFUSED)
        r = read(body, Messages)
        turns = [{"role": t.role, "content": _text(t.content)} for t in r.messages]
        wanted = r.output_config.format if r.output_config is not None else None
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                                stop=r.stop_sequences, constraint=None if wanted is None else constrained(
                                    "json_schema", wanted.schema, "output_config.format.schema"))
        options = Options(model=r.model, params=params, max_tokens_given=True, n=1, presence_penalty=0.0,
                          frequency_penalty=0.0, stream=r.stream, include_usage=False)
        return await self.host.answer(options, _prompt(turns, _text(r.system)), lambda model, answers, tokens, headers:
                                      Single(answers, AnthropicAnswer(model, answers, tokens), r.stream, headers))


def routes(host: Host) -> list[Route]:
    """Anthropic's endpoint, answering its errors as Anthropic does."""
    return [Route("/v1/messages", guarded(Anthropic(host).messages, _error), methods=["POST"])]
