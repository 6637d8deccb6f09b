"""Tool calling: the calls read back out of an answer, streamed or whole, and the grammar that
makes a forced call valid.

A model is told of tools by its chat template or, where the template takes none, in the system
prompt in the Hermes form (model/tokenizer.py: `Tokenizer.tool_form`); it answers with calls in
its own shape, which is read here. A call that does not parse, or names no offered function,
leaves the answer as text, so a client never gets a call it cannot run. A forced or `required`
call is constrained, token by token, to the model's call shape around a JSON object whose name
is an offered function's and whose arguments match its parameters schema.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import replace
from typing import Any

from diffuse.api.schema import BadRequest, ChatShape, Options, ToolRequest
from diffuse.client.constrain import ConstraintError, OutputConstraint
from diffuse.client.generate import Completion
from diffuse.model.tokenizer import HERMES, LLAMA3, MISTRAL, Tokenizer, ToolForm

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)  # the last may be unclosed at EOS
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Call = dict[str, Any]  # {"name": ..., "arguments": {...}}


def offered_form(tokenizer: Tokenizer, request: ToolRequest) -> ToolForm:
    """The form `tokenizer`'s model is offered tools in; a 400 naming `tools` for a base model."""
    form = tokenizer.tool_form
    if form is None:
        raise BadRequest("this model has no chat template: it cannot be offered tools", "tools")
    return form


def _call(obj: Any, names: set[str]) -> Call | None:
    """A parsed call object, if it names an offered function and its arguments are an object."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


def _json_calls(text: str, names: set[str]) -> list[Call] | None:
    """Llama 3's shape: the whole answer is one or more call objects (`;` between them)."""
    decoder, rest, calls = json.JSONDecoder(), text.strip(), []
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        call = _call(obj, names)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip().removeprefix(";").strip()
    return calls or None


def read_calls(text: str, call_shape: str, names: set[str]) -> tuple[str | None, list[Call]] | None:
    """(content, calls) of an answer written in `call_shape`, or None where it calls nothing."""
    if call_shape == HERMES:
        found = [_call(_loads(body), names) for body in _HERMES_CALL.findall(text)]
        if not found or None in found:
            return None
        return _HERMES_CALL.sub("", text).strip() or None, found  # type: ignore[return-value]
    if call_shape == LLAMA3:
        calls = _json_calls(text, names)
        return (None, calls) if calls else None
    rest = text.strip().removeprefix("[TOOL_CALLS]").strip()  # Mistral; the marker is a special token
    try:
        listed, end = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    calls = [_call(obj, names) for obj in listed] if isinstance(listed, list) else []
    if not calls or None in calls:
        return None
    return rest[end:].strip() or None, calls  # type: ignore[return-value]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_id(call_shape: str) -> str:
    """A fresh call id; Mistral's templates take only 9 letters and digits."""
    if call_shape == MISTRAL:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def wire_calls(calls: list[Call], call_shape: str) -> list[dict[str, Any]]:
    """Calls as OpenAI writes them: arguments as a JSON string."""
    return [{"id": call_id(call_shape), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


class CallStream:
    """One streamed answer: content is sent as it comes, a call is held until the answer ends,
    when it is read whole. Hermes calls start at `<tool_call>` (text that may begin one is held
    back); Llama 3 and Mistral calls are the whole answer, so one starting with `{` or `[` is held."""

    def __init__(self, call_shape: str, names: set[str]):
        self.call_shape, self.names = call_shape, names
        self.text, self.sent = "", 0

    def _safe(self) -> int:
        """How much of the text is content for sure."""
        if self.call_shape == HERMES:
            at = self.text.find("<tool_call>")
            if at < 0:  # hold back a tail that may be the start of the tag
                at = len(self.text) - max((k for k in range(1, 11) if self.text.endswith("<tool_call>"[:k])),
                                          default=0)
            return len(self.text[:at].rstrip())
        head = self.text.lstrip()
        return 0 if not head or head[0] in "{[" else len(self.text)

    def push(self, piece: str) -> str:
        """The content `piece` lets out."""
        self.text += piece
        safe = self._safe()
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """The content not yet sent, and the calls."""
        found = read_calls(self.text, self.call_shape, self.names)
        if found is None:
            return self.text[self.sent:], []
        content, calls = found
        sent = self.text[:self.sent].strip()
        return (content[len(sent):] if content and content.startswith(sent) else ""), calls


class ToolShape(ChatShape):
    """A chat completion whose answers may be tool calls: `message.tool_calls` (or streamed
    `delta.tool_calls`), with finish_reason "tool_calls"."""

    def __init__(self, model: str, tokenizer: Tokenizer, request: ToolRequest):
        super().__init__(model)
        self.call_shape, self.parallel = offered_form(tokenizer, request).call, request.parallel
        self.names = {t["function"]["name"] for t in request.tools}
        self.streams: dict[int, CallStream] = {}

    def _calls(self, calls: list[Call]) -> list[dict[str, Any]]:
        return wire_calls(calls if self.parallel else calls[:1], self.call_shape)

    def chunks(self, index: int, text: str, finish: str | None) -> list[dict[str, Any]]:
        stream = self.streams.setdefault(index, CallStream(self.call_shape, self.names))
        if finish is None:
            content = stream.push(text)
            return [self.chunk(index, content, None)] if content else []
        rest, calls = stream.finish()
        out = [self.chunk(index, rest, None)] if rest else []
        if calls:
            delta = {"tool_calls": [c | {"index": k} for k, c in enumerate(self._calls(calls))]}
            out.append(self._envelope(self.chunk_object, [{"index": index, "delta": delta, "logprobs": None,
                                                           "finish_reason": None}]))
            finish = "tool_calls"
        return [*out, self.chunk(index, "", finish)]

    def whole(self, completions: list[Completion], usage_: dict[str, int]) -> dict[str, Any]:
        body = super().whole(completions, usage_)
        for choice, completion in zip(body["choices"], completions):
            found = read_calls(completion.text, self.call_shape, self.names)
            if found is not None:
                choice["message"] |= {"content": found[0], "tool_calls": self._calls(found[1])}
                choice["finish_reason"] = "tool_calls"
        return body


def _call_schema(tool: dict[str, Any], key: str) -> dict[str, Any]:
    function = tool["function"]
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(tokenizer: Tokenizer, form: ToolForm, request: ToolRequest) -> str:
    """The Lark grammar of a forced call (the named function) or a `required` one (any offered
    function; several when parallel calls are allowed), in the model's call shape."""
    tools = [t for t in request.tools if request.named in (None, t["function"]["name"])]
    key = "parameters" if form.call == LLAMA3 else "arguments"
    schemas = [_call_schema(t, key) for t in tools]
    schema = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}) | {"x-guidance": _COMPACT}
    many = request.parallel and request.named is None
    rules = [f"call: %json {json.dumps(schema)}"]
    if form.call == HERMES:
        rules[:0] = ['start: tagged ("\\n" tagged)*' if many else "start: tagged",
                     'tagged: "<tool_call>\\n" call "\\n</tool_call>"']
    elif form.call == LLAMA3:
        rules.insert(0, "start: call")
    else:
        marker = tokenizer.backend.token_to_id("[TOOL_CALLS]")
        prefix = '"[TOOL_CALLS]"' if marker is None else f"<[{marker}]>"
        rules.insert(0, f'start: {prefix} "[" call (", " call)* "]"' if many else f'start: {prefix} "[" call "]"')
    return "\n".join(rules)


def call_constraint(tokenizer: Tokenizer, form: ToolForm, request: ToolRequest) -> OutputConstraint | None:
    """The constraint on an answer that must call a function; None where the model may choose.
    A parameters schema that does not compile is a 400 naming `tools`."""
    if request.named is None and request.choice != "required":
        return None
    constraint = OutputConstraint("lark", call_grammar(tokenizer, form, request))
    try:
        constraint.check()
    except ConstraintError as e:
        raise BadRequest(f"the tools' parameters do not compile to a grammar: {e}", "tools") from None
    return constraint


def tool_options(tokenizer: Tokenizer, options: Options, request: ToolRequest) -> Options:
    """`options` for `tokenizer`'s model answering a request that offers tools: a forced or
    required call constrained to its grammar. A response_format is refused beside them, since an
    answer held to it could call nothing."""
    form = offered_form(tokenizer, request)
    if options.params.constraint is not None:
        raise BadRequest("response_format cannot be combined with tools", "response_format")
    constraint = call_constraint(tokenizer, form, request)
    if constraint is None:
        return options
    return replace(options, params=replace(options.params, constraint=constraint))
