"""Running the choices of one request: each in its own backend session, all concurrently.

Sessions are opened before the HTTP answer starts (so an unservable model is a 503, not a broken
stream) and closed in a shielded `finally`, so a client that hangs up frees its swarm sessions
at once, even though the close itself has to wait on the network.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import torch
import trio
from torch import Tensor

from diffuse.api.backend import Backend, Overloaded
from diffuse.client.generate import Completion, Generation, TokenSource, stream_tokens
from diffuse.client.pipeline import Pipeline
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.metrics import FIRST_TOKEN_SECONDS, SESSIONS_OPEN, STEP_SECONDS, TOKENS_GENERATED
from diffuse.model.tokenizer import Tokenizer

CLOSE_TIMEOUT_S = 10.0  # a peer that does not acknowledge a close in this long is left to time out

# emit(choice index, new text, the completion once the choice has finished)
Emit = Callable[[int, str, Completion | None], Awaitable[None]]


class Sessions:
    """Opens backend sessions under a process-wide cap: past it a request gets a 429 at once,
    rather than every answer slowing down (and the KV caches exhausting memory)."""

    def __init__(self, backend: Backend, limit: int):
        self.backend, self.limit, self.open = backend, limit, 0

    async def acquire(self, model: str, max_len: int, count: int) -> list[Pipeline]:
        if self.open + count > self.limit:
            raise Overloaded(f"{self.open} of {self.limit} sessions are in use; retry shortly")
        self.open += count  # reserved before the first await, so concurrent requests see it
        SESSIONS_OPEN.labels("client").inc(count)
        opened: list[Pipeline] = []
        try:
            for _ in range(count):
                opened.append(await self.backend.session(model, max_len))
        except BaseException:
            await self.release(opened, count)
            raise
        return opened

    async def release(self, pipelines: list[Pipeline], count: int | None = None) -> None:
        """Close `pipelines` (shielded: this runs while a hung-up client's request is cancelled)
        and give back `count` reservations (default: one per pipeline)."""
        count = len(pipelines) if count is None else count
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            for pipeline in pipelines:
                await pipeline.close()
        self.open -= count
        SESSIONS_OPEN.labels("client").dec(count)


class Penalized:
    """OpenAI's presence and frequency penalties, as a wrapper around a Sampler: logit[t] is
    lowered by frequency * (times t was generated) + presence * (t was generated at all), before
    the sampler's own temperature, top-p and repetition penalty. Only generated tokens count,
    not the prompt, as in OpenAI's definition."""

    def __init__(self, sampler: Sampler, prompt_len: int, presence: float, frequency: float):
        self.sampler, self.p = sampler, sampler.p
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def sample(self, logits: Tensor, context: Tensor | None = None) -> int:
        if context is not None and len(context) > self.prompt_len:
            counts = torch.bincount(context[self.prompt_len:], minlength=logits.shape[-1]).to(logits.dtype)
            logits = logits - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)
        return self.sampler.sample(logits, context)


def token_source(model: str, presence: float, frequency: float) -> TokenSource:
    """The generation loop with the penalties applied, every step timed for /metrics, and a
    checkpoint after each token so that concurrent answers take turns."""

    async def tokens(pipeline: Pipeline, prompt: list[int], sampler: Sampler, eos_ids: set[int]
                     ) -> AsyncIterator[int]:
        if presence or frequency:
            sampler = Penalized(sampler, len(prompt), presence, frequency)
        first, t0 = True, time.perf_counter()
        async for token in stream_tokens(pipeline, prompt, sampler, eos_ids):
            (FIRST_TOKEN_SECONDS if first else STEP_SECONDS.labels("client")).observe(time.perf_counter() - t0)
            TOKENS_GENERATED.labels(model).inc()
            first = False
            yield token
            # A local model never waits, so without this one answer would hold the event loop to
            # its end: no other request, no status page, no noticing that its client hung up.
            await trio.lowlevel.checkpoint()
            t0 = time.perf_counter()

    return tokens


class Answers:
    """The choices of one request (n per prompt), each with its session, run concurrently."""

    def __init__(self, sessions: Sessions, model: str, tokenizer: Tokenizer,
                 choices: list[tuple[list[int], SamplingParams]], presence: float, frequency: float):
        self.sessions, self.model, self.tokenizer, self.choices = sessions, model, tokenizer, choices
        self.source = token_source(model, presence, frequency)
        self.pipelines: list[Pipeline] = []

    async def open(self) -> None:
        max_len = max(len(prompt) + params.max_tokens for prompt, params in self.choices)
        self.pipelines = await self.sessions.acquire(self.model, max_len, len(self.choices))

    async def run(self, emit: Emit) -> list[Completion]:
        """Generate every choice, calling `emit` with each piece of text; the sessions are
        closed when this returns, fails or is cancelled."""
        done: list[Completion | None] = [None] * len(self.choices)
        errors: list[Exception] = []

        async def one(i: int, nursery: trio.Nursery) -> None:
            prompt, params = self.choices[i]
            gen = Generation(self.pipelines[i], self.tokenizer, prompt, params, self.source)
            try:
                async for piece in gen:
                    await emit(i, piece, None)
                done[i] = gen.completion
                await emit(i, "", gen.completion)
            except Exception as e:  # noqa: BLE001 - one failed choice fails the request: stop the others
                errors.append(e)
                nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(self.choices)):
                    nursery.start_soon(one, i, nursery)
        finally:
            await self.close()
        if errors:
            raise errors[0]  # as itself, not wrapped in an ExceptionGroup, so callers can map it
        return [c for c in done if c is not None]

    async def close(self) -> None:
        pipelines, self.pipelines = self.pipelines, []
        if pipelines:
            await self.sessions.release(pipelines)
