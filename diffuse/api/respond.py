"""Answering while the client listens, in whichever dialect it speaks (OpenAI, Ollama, Anthropic).

What every dialect shares is here, apart from the handlers that bind it (app.py): the status code
an exception deserves (`as_api_error`), generation that stops when the client hangs up
(`unless_disconnected`), and the response that writes one answer whole or as a stream of a
dialect's frames (`Single`), so each dialect is only its wire format.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from diffuse.api.answers import Answers
from diffuse.api.schema import BadRequest, Options, error_body
from diffuse.client.backend import Overloaded, UnknownModel, Unservable
from diffuse.client.constrain import ConstraintError, OutputConstraint
from diffuse.client.generate import Completion
from diffuse.client.service import Service
from diffuse.errors import DiffuseError, ModelError
from diffuse.model.tokenizer import Tokenizer
from diffuse.validate import Malformed, convert

T = TypeVar("T")
log = logging.getLogger(__name__)

Encode = Callable[[Tokenizer], list[list[int]]]  # a request's prompts in the answering model's tokens
# (answering model, its answers with sessions open, prompt tokens, headers naming the model) -> the response
Respond = Callable[[str, Answers, int, dict[str, str]], Response]
Handler = Callable[[Request], Awaitable[Response]]
Prepare = Callable[[Tokenizer, Options], Options]  # a request's options fitted to the answering model


class Answer(Protocol):
    """The answer path (app.py's `Api.answer`): the asked model or its first servable fallback;
    `keep`: the conversation the history vault keeps once answered (None: nothing kept)."""

    def __call__(self, options: Options, encode: Encode, respond: Respond,
                 prepare: Prepare = ..., keep: list[dict[str, Any]] | None = None) -> Awaitable[Response]: ...


class ApiError(DiffuseError):
    """An error as OpenAI writes it: HTTP status, type, param, code."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = error_body(message, type_, param, code, **extra)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, self.status, self.headers)


def named(error: ApiError) -> str:
    """`error`'s message naming the offending field, for dialects whose errors have no `param`."""
    param, message = error.body["error"]["param"], str(error)
    return message if not param or message.startswith(param) else f"{param}: {message}"


def as_api_error(e: Exception) -> ApiError:
    """The status code and OpenAI error type that tell a client what to do about `e`."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BadRequest):
        return ApiError(400, str(e), "invalid_request_error", e.param, e.code)
    if isinstance(e, ModelError):  # e.g. the chat template rejected the conversation
        return ApiError(400, str(e), "invalid_request_error", "messages")
    if isinstance(e, UnknownModel):
        return ApiError(404, str(e), "invalid_request_error", "model", "model_not_found")
    if isinstance(e, Unservable):
        return ApiError(503, str(e), "service_unavailable", "model", "model_not_servable",
                        {"Retry-After": "10"}, missing_blocks=e.missing)
    if isinstance(e, Overloaded):
        return ApiError(429, str(e), "rate_limit_error", None, "overloaded", {"Retry-After": str(e.retry_after)})
    if isinstance(e, DiffuseError):  # the swarm failed under this answer (peers lost, no route)
        return ApiError(503, str(e), "service_unavailable", None, "swarm_error")
    return ApiError(500, "internal server error", "server_error")


@dataclass
class Outcome:
    finished: bool = False  # False: the client hung up first
    value: Any = None
    error: DiffuseError | None = None


async def unless_disconnected(receive, work: Callable[[], Awaitable[Any]]) -> Outcome:
    """Run `work` unless and until the client hangs up (a disconnect cancels it)."""
    outcome = Outcome()
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            outcome.value = await work()
        except DiffuseError as e:
            outcome.error = e
        outcome.finished = True
        nursery.cancel_scope.cancel()
    return outcome


def read(body: dict[str, Any], type_: type[T]) -> T:
    """`body` checked into `type_` (a null field is an absent one); a BadRequest naming the
    offending field where it does not fit."""
    try:
        return convert({k: v for k, v in body.items() if v is not None}, type_)
    except Malformed as e:
        raise BadRequest(str(e), e.field) from None


def refuse(body: dict[str, Any], neutral: dict[str, tuple[Any, ...]], prefix: str = "") -> None:
    """A BadRequest naming the first field of `body` that asks for what this server cannot honour
    faithfully (any value but its neutral ones), rather than ignoring it."""
    for name, allowed in neutral.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"{prefix}{name} is not supported by this server", prefix + name, "unsupported_parameter")


def constrained(kind: str, spec: dict[str, Any] | None, field: str) -> OutputConstraint:
    """A structured-output request as the constraint decoding enforces; one that does not
    compile is a 400 naming `field`."""
    try:
        constraint = OutputConstraint(kind, spec)
        constraint.check()
    except ConstraintError as e:
        raise BadRequest(f"{field}: the schema does not compile: {e}", field) from None
    return constraint


@dataclass(frozen=True)
class Host:
    """What a dialect's handlers need from the API: the backend, a request's body once its key is
    checked, the answer path (the asked model or the first servable fallback) and the default
    answer length."""

    backend: Service
    authorize: Callable[[Request], None]
    body: Callable[[Request], Awaitable[dict[str, Any]]]
    answer: Answer
    default_max_tokens: int


def guarded(handler: Handler, shape: Callable[[ApiError], dict[str, Any]]) -> Handler:
    """`handler` with its errors written in its dialect's shape (`shape`) instead of OpenAI's."""

    async def guarded_handler(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:  # noqa: BLE001 - every error is answered, in the dialect's shape
            error = as_api_error(e)
            if error.status == 500:  # a bug: the client learns nothing of it, the operator must
                log.error("internal error answering %s %s", request.method, request.url.path, exc_info=e)
            return JSONResponse(shape(error), error.status, error.headers)

    return guarded_handler


class Dialect(ABC):
    """How one API writes a single answer: whole, or as a stream of frames."""

    media_type: str  # of the stream

    def opening(self) -> list[bytes]:
        """The frames that open a stream, before any text."""
        return []

    @abstractmethod
    def piece(self, text: str) -> bytes:
        """The frame carrying a new piece of text (nothing while the dialect holds it back)."""

    @abstractmethod
    def closing(self, completion: Completion) -> list[bytes]:
        """The frames that end a stream, with why the answer ended and its counts."""

    @abstractmethod
    def whole(self, completion: Completion) -> dict[str, Any]:
        """The answer as one JSON body."""

    @abstractmethod
    def error(self, error: ApiError) -> dict[str, Any]:
        """An error's body in this dialect."""

    @abstractmethod
    def stream_error(self, error: ApiError) -> bytes:
        """The frame an error travels in once the stream has begun."""


class Generating(Response):
    """A response that generates its answers while it is sent, whole (`_whole`) or streamed
    (`_stream`, both written by each subclass); the answers' sessions are closed either way, even
    if the run never started (it closes them itself)."""

    answers: Answers
    stream: bool

    async def __call__(self, scope, receive, send) -> None:
        try:
            if self.stream:
                await self._stream(receive, send)
            else:
                await self._whole(scope, receive, send)
        finally:
            await self.answers.close()


class Single(Generating):
    """Generates one answer while responding, written in a dialect."""

    def __init__(self, answers: Answers, dialect: Dialect, stream: bool, headers: dict[str, str]):
        self.answers, self.dialect, self.stream, self.model_headers = answers, dialect, stream, headers
        self.background = None

    async def _whole(self, scope, receive, send) -> None:
        async def ignore(i: int, text: str, done: Completion | None) -> None:
            pass

        async def work() -> Completion:
            return (await self.answers.run(ignore))[0]

        outcome = await unless_disconnected(receive, work)
        if not outcome.finished:
            return
        if outcome.error:
            error = as_api_error(outcome.error)
            response = JSONResponse(self.dialect.error(error), error.status, error.headers)
        else:
            response = JSONResponse(self.dialect.whole(outcome.value), headers=self.model_headers)
        await response(scope, receive, send)

    async def _stream(self, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", self.dialect.media_type.encode()), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no"),
                                *((k.encode(), v.encode()) for k, v in self.model_headers.items())]})

        async def write(frames: list[bytes]) -> None:
            body = b"".join(frames)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})

        async def emit(i: int, text: str, done: Completion | None) -> None:
            if text:
                await write([self.dialect.piece(text)])

        async def work() -> None:
            await write(self.dialect.opening())
            completion = (await self.answers.run(emit))[0]
            await write(self.dialect.closing(completion))

        outcome = await unless_disconnected(receive, work)
        if not outcome.finished:
            return  # nobody is listening any more
        if outcome.error:  # headers are out: the error travels as a frame
            await write([self.dialect.stream_error(as_api_error(outcome.error))])
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def stop_sequence(completion: Completion, tokenizer: Tokenizer, stop: list[str]) -> str | None:
    """The stop string that ended `completion`, if one did: the text is cut just before it, so it
    opens what the tokens decode to past the text (an end-of-turn token is never among them)."""
    if completion.finish_reason != "stop" or not stop:
        return None
    rest = tokenizer.decode(completion.token_ids)[len(completion.text):]
    return next((s for s in stop if s and rest.startswith(s)), None)
