"""The OpenAI-compatible HTTP API over a Backend, plus /metrics and the live status page.

Starlette gives routing, request parsing and error handlers; the two answering paths (whole JSON
and server-sent events) are our own `Response` so that generation runs inside the response,
watched for the client hanging up: a disconnect cancels the generation and closes its sessions
there and then, rather than when an abandoned stream iterator is garbage-collected.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from diffuse.api import anthropic, ollama
from diffuse.api.answers import Answers, Emit, Sessions
from diffuse.api.respond import ApiError, Encode, Generating, Host, Respond, as_api_error, unless_disconnected
from diffuse.client.backend import UnknownModel
from diffuse.client.service import Service, first_servable
from diffuse.client.vault import opted_out
from diffuse.api.page import PAGE
from diffuse.api.schema import (
    BadRequest, ChatShape, Options, Shape, TextShape, error_body, parse_messages, parse_options, parse_prompts,
    parse_tools, usage,
)
from diffuse.api.tools import ToolShape, tool_options
from diffuse.client.generate import Completion
from diffuse.errors import DiffuseError
from diffuse.metrics import PROMPT_TOKENS, REGISTRY, REQUESTS, exposition
from diffuse.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
MAX_BODY = 4 << 20  # bytes; a prompt this long is far beyond any context anyway


@dataclass(frozen=True)
class Settings:
    api_keys: frozenset[str] = frozenset()  # empty: no key needed
    max_sessions: int = 16  # concurrent inference sessions; past them requests wait in a queue
    max_queue: int = 64  # sessions requests may wait for; past them a 429
    default_max_tokens: int = 256  # when a request gives none (every token reserves KV cache)
    max_n: int = 8  # choices per request


class Answering(Generating):
    """Generates the answer while responding: one JSON body, or server-sent events."""

    def __init__(self, answers: Answers, shape: Shape, options: Options, prompt_tokens: int,
                 headers: dict[str, str]):
        self.answers, self.shape, self.options, self.prompt_tokens = answers, shape, options, prompt_tokens
        self.stream = options.stream
        shape.scored = answers.logprobs_since  # each chunk carries its tokens' log-probabilities
        self.model_headers = headers  # which model answers (x-diffuse-model), and which was asked if another
        self.background = None

    def _usage(self, completions: list[Completion]) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(len(c.token_ids) for c in completions))

    async def _whole(self, scope, receive, send) -> None:
        async def ignore(i: int, text: str, done: Completion | None) -> None:
            pass

        async def work() -> Response:
            completions = await self.answers.run(ignore)
            body = self.shape.whole(completions, self._usage(completions))
            report = self.answers.report()
            if report is not None:  # where the answer was computed: peers, this process, failovers
                body["diffuse"] = report
            return JSONResponse(body, headers=self.model_headers)

        outcome = await unless_disconnected(receive, work)
        if outcome.finished:
            response = as_api_error(outcome.error).response() if outcome.error else outcome.value
            await response(scope, receive, send)

    async def _stream(self, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                                *((k.encode(), v.encode()) for k, v in self.model_headers.items())]})
        lock = trio.Lock()  # n choices write concurrently; events must not interleave

        async def event(data: dict | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            async with lock:
                await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(),
                            "more_body": True})

        async def emit(i: int, text: str, done: Completion | None) -> None:
            if done is not None or text:
                for chunk in self.shape.chunks(i, text, done.finish_reason if done else None):
                    await event(chunk)

        async def work() -> None:
            for i in range(len(self.answers.choices)):
                opening = self.shape.opening(i)
                if opening:
                    await event(opening)
            completions = await self.answers.run(emit)
            if self.options.include_usage:
                await event(self.shape.usage_chunk(self._usage(completions)))
            await event("[DONE]")

        outcome = await unless_disconnected(receive, work)
        if not outcome.finished:
            return  # nobody is listening any more
        if outcome.error:  # headers are out: the error travels as an event, as OpenAI's do
            await event(as_api_error(outcome.error).body)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Kept(Answers):
    """A request's answers whose conversation the service keeps (`api --history`) once all are done."""

    def __init__(self, *args: Any, service: Service, conversation: list[dict[str, Any]]):
        super().__init__(*args)
        self.service, self.conversation = service, conversation

    async def run(self, emit: Emit) -> list[Completion]:
        completions = await super().run(emit)
        await self.service.keep(self.conversation, [c.text for c in completions], self.model)
        return completions


class Api:
    """The request handlers, bound to one backend and its session cap."""

    def __init__(self, backend: Service, settings: Settings):
        self.backend, self.settings = backend, settings
        self.sessions = Sessions(backend, settings.max_sessions, settings.max_queue)

    def _authorize(self, request: Request) -> None:
        """A key as OpenAI's and Ollama's clients send it (Bearer), or as Anthropic's (x-api-key)."""
        if not self.settings.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not given or not any(hmac.compare_digest(given.encode(), k.encode()) for k in self.settings.api_keys):
            raise ApiError(401, "Incorrect API key provided: give a valid key as 'Authorization: Bearer KEY' "
                           "or 'x-api-key: KEY'", "invalid_request_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB", "invalid_request_error")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        options = parse_options(body, self.settings.default_max_tokens, self.settings.max_n)
        messages, tools = parse_messages(body), parse_tools(body)
        keep = _kept(request, body, messages)
        if tools is None or not tools.offered:
            return await self._answer(options, lambda tok: [tok.encode_chat(messages)], ChatShape, keep)
        return await self.answer(  # the answer may call the tools: each model offered them in its own form
            options, lambda tok: [tok.encode_chat(messages, tools=tools.tools)],
            lambda model, answers, prompt_tokens, headers: Answering(
                answers, ToolShape(model, self.backend.tokenizer(model), tools), options, prompt_tokens, headers),
            lambda tok, opts: tool_options(tok, opts, tools), keep)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        options = parse_options(body, self.settings.default_max_tokens, self.settings.max_n, chat=False)
        texts = parse_prompts(body)
        return await self._answer(options, lambda tok: [tok.encode(p, add_special=True) for p in texts], TextShape,
                                  _kept(request, body, [{"role": "prompt", "content": p} for p in texts]))

    async def _answer(self, options: Options, encode: Encode, shape: Callable[[str], Shape],
                      keep: list[dict[str, Any]] | None) -> Response:
        return await self.answer(options, encode, lambda model, answers, prompt_tokens, headers: Answering(
            answers, shape(model), options, prompt_tokens, headers), keep=keep)

    async def answer(self, options: Options, encode: Encode, respond: Respond,
                     prepare: Callable[[Tokenizer, Options], Options] = lambda tok, options: options,
                     keep: list[dict[str, Any]] | None = None) -> Response:
        """The answer of the asked model or, when it is not servable, of the first of its
        fallbacks that is (each encodes the prompts with its own tokenizer), said in the
        response's `model`, its headers and /metrics; every dialect answers through here.
        `keep`: the conversation the service keeps once answered (None: the request opted out)."""
        asked = options.model

        async def attempt(model: str) -> Response:
            tokenizer = self.backend.tokenizer(model)  # `prepare` fits the options to the model
            answers, prompt_tokens = await self._open(prepare(tokenizer, replace(options, model=model)),
                                                      encode(tokenizer), keep)
            named = {"x-diffuse-model": model} | ({"x-diffuse-asked-model": asked} if model != asked else {})
            return respond(model, answers, prompt_tokens, named)

        return (await first_servable(self.backend, asked, attempt, log.warning))[1]

    async def _open(self, options: Options, prompts: list[list[int]],
                    keep: list[dict[str, Any]] | None) -> tuple[Answers, int]:
        context = self.backend.context_length(options.model)
        longest = max(len(p) for p in prompts)
        max_tokens = options.params.max_tokens
        if longest + max_tokens > context:
            if options.max_tokens_given or longest >= context:
                raise BadRequest(f"this model's context is {context} tokens; the prompt has {longest} and "
                                 f"max_tokens asks for {max_tokens} more", "max_tokens", "context_length_exceeded")
            max_tokens = context - longest
        choices = [(p, options.choice_params(j, max_tokens)) for p in prompts for j in range(options.n)]
        args = (self.sessions, options.model, self.backend.tokenizer(options.model), choices,
                options.presence_penalty, options.frequency_penalty)
        answers = Answers(*args) if keep is None else Kept(*args, service=self.backend, conversation=keep)
        await answers.open()
        prompt_tokens = sum(len(p) for p in prompts)
        PROMPT_TOKENS.labels(options.model).inc(prompt_tokens * options.n)
        return answers, prompt_tokens

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [_model_object(c) for c in await self.backend.models()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        model_id = request.path_params["model"]
        known = await self.backend.models()
        for c in known:
            if c["model"] == model_id:
                return JSONResponse(_model_object(c))
        raise UnknownModel(model_id, [c["model"] for c in known])

    async def status(self, request: Request) -> Response:
        models = await self.backend.models()
        tokens = {c["model"]: REGISTRY.get_sample_value("diffuse_tokens_generated_total", {"model": c["model"]}) or 0
                  for c in models}
        return JSONResponse({"time": time.time(), "models": models,
                             "api": {"sessions_open": self.sessions.open, "max_sessions": self.sessions.limit,
                                     "tokens_generated": tokens}})

    async def metrics(self, request: Request) -> Response:
        body, ctype = exposition()
        return Response(body, headers={"content-type": ctype})

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE)


def _kept(request: Request, body: dict[str, Any], conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation to keep, unless the request says `store: false` (OpenAI's field) or
    `x-diffuse-store: false`."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise BadRequest("store must be true or false", "store")
    return None if store is False or opted_out(request.headers) else conversation


def _model_object(coverage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's model object, with whether the swarm can serve it now (a request for one that
    it cannot is answered by a fallback, or refused naming the blocks); `created` is when its
    longest-serving peer started."""
    oldest = max((p.get("age_s", 0.0) for p in coverage["peers"]), default=0.0)
    return {"id": coverage["model"], "object": "model", "created": int(time.time() - oldest),
            "owned_by": "diffuse", "servable": coverage["servable"], "coverage": coverage}


async def _on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                       "invalid_request_error", None, kind), exc.status_code, exc.headers)
    error = as_api_error(exc)
    if error.status == 500:  # a bug: the client learns nothing of it, the operator must
        log.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
    return error.response()


class _CountRequests:
    """Counts responses by endpoint and status for /metrics (plain ASGI: Starlette's
    BaseHTTPMiddleware would buffer the event streams)."""

    def __init__(self, app, endpoints: set[str]):
        self.app, self.endpoints = app, endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                REQUESTS.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def create_app(backend: Service, settings: Settings = Settings()):
    """The ASGI app: the OpenAI endpoints under /v1, Ollama's under /api, Anthropic's Messages
    at /v1/messages, /metrics, /status.json and the page at /."""
    api = Api(backend, settings)
    host = Host(backend, api._authorize, api._body, api.answer, settings.default_max_tokens)
    routes = [
        Route("/", api.page),
        Route("/status.json", api.status),
        Route("/metrics", api.metrics),
        Route("/v1/models", api.models),
        Route("/v1/models/{model:path}", api.model),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        *ollama.routes(host),
        *anthropic.routes(host),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _on_error, DiffuseError: _on_error,
                                                       Exception: _on_error})
    return _CountRequests(app, {r.path for r in routes if "{" not in r.path})
