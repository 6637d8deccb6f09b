"""Anthropic's Messages API on the same server: POST /v1/messages.

Every answer takes the OpenAI endpoints' path (the asked model or its first servable fallback,
the same sessions and queue); this module is only Anthropic's wire format: text, tool_use and
tool_result content blocks in; a text block and any tool_use blocks out; `stop_reason` end_turn /
max_tokens / stop_sequence / tool_use; server-sent events (message_start ... message_stop) when
streaming; errors as `{"type": "error", "error": ...}`. Tools are the OpenAI endpoint's
(api/tools.py): offered in the model's own form, calls read back from its answer, a forced call
constrained. A last assistant turn is a prefill the answer continues, as Anthropic's is.
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
    ApiError, Dialect, Encode, Host, Prepare, Single, constrained, guarded, named, read, refuse, stop_sequence,
)
from diffuse.api.schema import BadRequest, Options, ToolRequest
from diffuse.api.tools import Call, CallStream, call_id, offered_form, read_calls, tool_options
from diffuse.client.generate import Completion
from diffuse.client.sampling import SamplingParams
from diffuse.client.vault import opted_out

MAX_STOP = 16
_REFUSED = {"thinking": (None, {"type": "disabled"}), "mcp_servers": (None, [])}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}  # as ToolRequest.choice


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: Annotated[str, Meta(min_length=1)]
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] = ""


class Turn(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock]  # this model reads text only


class Tool(msgspec.Struct):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    input_schema: dict[str, Any]  # a JSON schema of type object
    description: str | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


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
    system: str | list[TextBlock] = ""
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP)] = []
    temperature: Annotated[float, Meta(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    stream: bool = False
    output_config: OutputConfig | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content if isinstance(b, TextBlock))


def _error(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": named(error)}}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _block_events(index: int, start: dict[str, Any], delta: dict[str, Any] | None) -> list[bytes]:
    return [_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
            *([_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})]
              if delta else []),
            _event("content_block_stop", {"type": "content_block_stop", "index": index})]


class AnthropicAnswer(Dialect):
    """One Messages answer: a text block, then a tool_use block per call where tools were offered."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, model: str, answers: Answers, prompt_tokens: int, tools: ToolRequest | None):
        self.model, self.answers, self.prompt_tokens = model, answers, prompt_tokens
        self.id = "msg_" + secrets.token_hex(12)
        offered = tools if tools is not None and tools.offered else None
        self.call_shape = offered_form(answers.tokenizer, offered).call if offered else None
        self.names = {t["function"]["name"] for t in offered.tools} if offered else set()
        self.parallel = offered.parallel if offered else False
        self.calls = CallStream(self.call_shape, self.names) if self.call_shape else None

    def _stop(self, c: Completion, calls: list[Call]) -> dict[str, Any]:
        """Why the answer ended, in Anthropic's words (a lost span keeps the server's own)."""
        if calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if c.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if c.finish_reason != "stop":
            return {"stop_reason": c.finish_reason, "stop_sequence": None}
        matched = stop_sequence(c, self.answers.tokenizer, self.answers.choices[0][1].stop)
        return {"stop_reason": "stop_sequence" if matched else "end_turn", "stop_sequence": matched}

    def _use(self, call: Call) -> dict[str, Any]:
        assert self.call_shape is not None  # calls are read only where tools were offered
        return {"type": "tool_use", "id": call_id(self.call_shape), "name": call["name"], "input": call["arguments"]}

    def _message(self, content: list[dict[str, Any]], stop: dict[str, Any], output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                **stop, "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}}

    def opening(self) -> list[bytes]:
        start = self._message([], {"stop_reason": None, "stop_sequence": None}, 0)
        return [_event("message_start", {"type": "message_start", "message": start}),
                _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}}),
                _event("ping", {"type": "ping"})]

    def _delta(self, text: str) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})

    def piece(self, text: str) -> bytes:
        text = self.calls.push(text) if self.calls is not None else text  # a call is held until it is whole
        return self._delta(text) if text else b""

    def closing(self, completion: Completion) -> list[bytes]:
        rest, calls = self.calls.finish() if self.calls is not None else ("", [])
        calls = calls if self.parallel else calls[:1]
        frames = [self._delta(rest)] if rest else []
        frames.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        for k, use in enumerate(map(self._use, calls), 1):
            frames += _block_events(k, use | {"input": {}}, {"type": "input_json_delta",
                                                             "partial_json": json.dumps(use["input"])})
        return [*frames, _event("message_delta", {"type": "message_delta", "delta": self._stop(completion, calls),
                                                  "usage": {"output_tokens": len(completion.token_ids)}}),
                _event("message_stop", {"type": "message_stop"})]

    def whole(self, completion: Completion) -> dict[str, Any]:
        found = read_calls(completion.text, self.call_shape, self.names) if self.call_shape else None
        text, calls = (completion.text, []) if found is None else (found[0] or "", found[1])
        calls = calls if self.parallel else calls[:1]
        content = ([{"type": "text", "text": text}] if text or not calls else []) + [self._use(c) for c in calls]
        return self._message(content, self._stop(completion, calls), len(completion.token_ids))

    def error(self, error: ApiError) -> dict[str, Any]:
        return _error(error)

    def stream_error(self, error: ApiError) -> bytes:
        return _event("error", _error(error))


def _tools(r: Messages) -> ToolRequest | None:
    """`tools` and `tool_choice` as the OpenAI endpoint's tool request; None where none are offered."""
    choice = r.tool_choice or ToolChoice("auto")
    if not r.tools:
        if choice.type not in ("auto", "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    tools: list[dict[str, Any]] = []
    for i, t in enumerate(r.tools):
        if any(t.name == u["function"]["name"] for u in tools):
            raise BadRequest(f"two tools are named {t.name!r}", f"tools[{i}].name")
        if t.input_schema.get("type", "object") != "object":
            raise BadRequest("input_schema must be a JSON schema of type object", f"tools[{i}].input_schema")
        described = {} if t.description is None else {"description": t.description}
        tools.append({"type": "function", "function": {"name": t.name, **described, "parameters": t.input_schema}})
    named = choice.name if choice.type == "tool" else None
    if choice.type == "tool" and all(named != t.name for t in r.tools):
        raise BadRequest(f"tool_choice names {named!r}, which is not among the tools", "tool_choice.name")
    return ToolRequest(tools, _CHOICES[choice.type], named, not choice.disable_parallel_tool_use)


def _conversation(turns: list[Turn]) -> list[dict[str, Any]]:
    """Turns as chat templates take them: an assistant's tool_use blocks become its tool_calls, a
    user's tool_result blocks tool messages (before the text of its turn)."""
    called: dict[str, str] = {}  # tool_use id -> function name, of the calls so far
    out: list[dict[str, Any]] = []
    for i, t in enumerate(turns):
        blocks = [TextBlock(t.content)] if isinstance(t.content, str) else t.content
        uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
        results = [(j, b) for j, b in enumerate(blocks) if isinstance(b, ToolResultBlock)]
        if (uses and t.role != "assistant") or (results and t.role != "user"):
            raise BadRequest("tool_use blocks belong to assistant turns, tool_result blocks to user turns",
                             f"messages[{i}].content")
        for j, b in results:
            if b.tool_use_id not in called:
                raise BadRequest("a tool_result must answer a tool_use of an earlier assistant turn by its id",
                                 f"messages[{i}].content[{j}].tool_use_id")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "name": called[b.tool_use_id],
                        "content": _text(b.content)})
        called |= {u.id: u.name for u in uses}
        text = _text(blocks)
        calls = [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}} for u in uses]
        if calls or text or not results:
            out.append({"role": t.role, "content": text} | ({"tool_calls": calls} if calls else {}))
    return out


def _prompt(messages: list[dict[str, Any]], system: str, tools: ToolRequest | None) -> Encode:
    """The conversation through the chat template; a last assistant turn of text is continued, not answered."""
    last = messages[-1]
    prefill = last["content"] if last["role"] == "assistant" and "tool_calls" not in last else None
    asked = messages[:-1] if prefill is not None else messages
    offered = tools.tools if tools is not None and tools.offered else None
    return lambda tok: [tok.encode_chat(asked, system or None, offered) + (tok.encode(prefill) if prefill else [])]


def _options(r: Messages, tools: ToolRequest | None) -> tuple[Options, Prepare]:
    """The sampling asked for, and how to fit it to the answering model: a forced call constrained."""
    wanted = r.output_config.format if r.output_config is not None else None
    if wanted is not None and tools is not None and tools.offered:
        raise BadRequest("output_config.format cannot be combined with tools", "output_config.format")
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                            stop=r.stop_sequences, constraint=None if wanted is None else constrained(
                                "json_schema", wanted.schema, "output_config.format.schema"))
    options = Options(model=r.model, params=params, max_tokens_given=True, n=1, presence_penalty=0.0,
                      frequency_penalty=0.0, stream=r.stream, include_usage=False)
    if tools is None or not tools.offered:
        return options, lambda tok, o: o
    return options, lambda tok, o: tool_options(tok, o, tools)


class Anthropic:
    """The handler, bound to the API's answer path."""

    def __init__(self, host: Host):
        self.host = host

    async def messages(self, request: Request) -> Response:
        body = await self.host.body(request)
        refuse(body, _REFUSED)
        r = read(body, Messages)
        tools = _tools(r)
        options, prepare = _options(r, tools)
        messages, system = _conversation(r.messages), _text(r.system)
        kept = [{"role": "system", "content": system}] * bool(system) + messages
        return await self.host.answer(
            options, _prompt(messages, system, tools),
            lambda model, answers, prompt_tokens, headers: Single(
                answers, AnthropicAnswer(model, answers, prompt_tokens, tools), r.stream, headers),
            prepare, keep=None if opted_out(request.headers) else kept)


def routes(host: Host) -> list[Route]:
    """Anthropic's endpoint, answering its errors as Anthropic does."""
    return [Route("/v1/messages", guarded(Anthropic(host).messages, _error), methods=["POST"])]
