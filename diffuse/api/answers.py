"""Running the choices of one request: each in its own backend session, all concurrently.

Sessions are opened before the HTTP answer starts (so an unservable model is a 503, not a broken
stream) and closed in a shielded `finally`, so a client that hangs up frees its swarm sessions
at once, even though the close itself has to wait on the network.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
import trio
from torch import Tensor

from diffuse.client.backend import Backend, Overloaded
from diffuse.client.generate import Completion, Generation, TokenSource, session_length, stream_tokens
from diffuse.client.pipeline import Pipeline
from diffuse.client.sampling import Logprob, Sampler, SamplingParams
from diffuse.client.speculative import PLAIN, SpecConfig, SpecState
from diffuse.client.swarm import route_report
from diffuse.metrics import (
    DECODE_STEP_POSITIONS, DECODE_STEP_TOKENS, DECODE_STEPS, FIRST_TOKEN_SECONDS, SESSIONS_OPEN, STEP_SECONDS,
    TOKENS_GENERATED,
)
from diffuse.model.tokenizer import Tokenizer

CLOSE_TIMEOUT_S = 10.0  # a peer that does not acknowledge a close in this long is left to time out

# emit(choice index, new text, the completion once the choice has finished)
Emit = Callable[[int, str, Completion | None], Awaitable[None]]


class Sessions:
    """Opens backend sessions under a process-wide cap. Past it a request waits its turn in a
    bounded queue (first come, first served); past the queue it gets a 429 at once, with a
    Retry-After from how long sessions have lasted, rather than every answer slowing down (and
    the KV caches exhausting memory)."""

    def __init__(self, backend: Backend, limit: int, queue: int = 0):
        self.backend, self.limit, self.queue_limit = backend, limit, queue
        self.open = 0  # sessions reserved
        self.waiting = 0  # sessions asked for by requests in the queue
        self.turns = trio.Semaphore(limit)  # FIFO: whoever waits longest goes first
        self.lasted = 10.0  # seconds a session lasts (moving average), for Retry-After

    def retry_after(self) -> int:
        """Seconds until a slot is likely free for a request that comes now."""
        return max(1, math.ceil(self.lasted * (1 + self.waiting) / max(1, self.limit)))

    async def acquire(self, model: str, max_len: int, count: int) -> list[Pipeline]:
        if count > self.limit or (self.open + count > self.limit and self.waiting + count > self.queue_limit):
            raise Overloaded(f"{self.open} of {self.limit} sessions are in use and {self.waiting} wait "
                             f"(at most {self.queue_limit}); retry shortly", self.retry_after())
        self.waiting += count
        taken = 0
        try:
            for _ in range(count):
                await self.turns.acquire()
                taken += 1
        except BaseException:
            for _ in range(taken):
                self.turns.release()
            raise
        finally:
            self.waiting -= count
        self.open += count
        SESSIONS_OPEN.labels("client").inc(count)
        opened: list[Pipeline] = []
        try:
            for _ in range(count):
                opened.append(await self.backend.session(model, max_len))
        except BaseException:
            await self.release(opened, count)
            raise
        return opened

    async def release(self, pipelines: list[Pipeline], count: int | None = None, since: float | None = None) -> None:
        """Close `pipelines` (shielded: this runs while a hung-up client's request is cancelled)
        and give back `count` reservations (default: one per pipeline), opened at `since`."""
        count = len(pipelines) if count is None else count
        if since is not None:
            self.lasted = 0.8 * self.lasted + 0.2 * (time.perf_counter() - since)
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            for pipeline in pipelines:
                await pipeline.close()
        self.open -= count
        for _ in range(count):
            self.turns.release()
        SESSIONS_OPEN.labels("client").dec(count)


class Penalized:
    """OpenAI's presence and frequency penalties, as a wrapper around a Sampler: logit[t] is
    lowered by frequency * (times t was generated) + presence * (t was generated at all), before
    the sampler's own temperature, top-p and repetition penalty. Only generated tokens count,
    not the prompt, as in OpenAI's definition. The rest (its generator, constraint, what was
    taken) is the sampler's own."""

    def __init__(self, sampler: Sampler, prompt_len: int, presence: float, frequency: float):
        self.sampler, self.p = sampler, sampler.p
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def penalized(self, logits: Tensor, context: Tensor | None) -> Tensor:
        if context is not None and len(context) > self.prompt_len:
            counts = torch.bincount(context[self.prompt_len:], minlength=logits.shape[-1]).to(logits.dtype)
            logits = logits - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)
        return logits

    def sample(self, logits: Tensor, context: Tensor | None = None) -> int:
        return self.sampler.sample(self.penalized(logits, context), context)

    def probs(self, logits: Tensor, context: Tensor | None = None) -> Tensor:
        return self.sampler.probs(self.penalized(logits, context), context)


def token_source(model: str, presence: float, frequency: float, arrived: float,
                 speculate: SpecConfig | None = None,
                 judged: Callable[[SpecState], None] = lambda state: None) -> TokenSource:
    """The generation loop with the penalties applied, speculating with `speculate`, every step
    timed and counted by mode for /metrics (the first token's time from the request's arrival:
    its wait in the queue and its prefill), and a checkpoint after each token so that concurrent
    answers take turns. A speculating answer's state goes to `judged` when it ends (the draft
    head's record)."""

    async def tokens(pipeline: Pipeline, prompt: list[int], sampler: Sampler, eos_ids: set[int]
                     ) -> AsyncIterator[int]:
        if presence or frequency:
            sampler = Penalized(sampler, len(prompt), presence, frequency)
        state = SpecState() if speculate is not None else None
        counted, first, t0 = 0, True, arrived
        try:
            async for token in stream_tokens(pipeline, prompt, sampler, eos_ids, speculate, state):
                (FIRST_TOKEN_SECONDS if first else STEP_SECONDS.labels("client")).observe(time.perf_counter() - t0)
                TOKENS_GENERATED.labels(model).inc()
                if state is None and not first:
                    _count_step(model, PLAIN, 1, 1)
                elif state is not None:
                    s = state.stats
                    for mode, made, sent in zip(s.modes[counted:], s.tokens[counted:], s.positions[counted:]):
                        _count_step(model, mode, made, sent)
                    counted = s.steps
                first = False
                yield token
                # A local model never waits, so without this one answer would hold the event loop to
                # its end: no other request, no status page, no noticing that its client hung up.
                await trio.lowlevel.checkpoint()
                t0 = time.perf_counter()
        finally:
            if state is not None:
                judged(state)

    return tokens


def _count_step(model: str, mode: str, tokens: int, positions: int) -> None:
    DECODE_STEPS.labels(model, mode).inc()
    DECODE_STEP_TOKENS.labels(model, mode).inc(tokens)
    DECODE_STEP_POSITIONS.labels(model, mode).inc(positions)


class Answers:
    """The choices of one request (n per prompt), each with its session, run concurrently."""

    def __init__(self, sessions: Sessions, model: str, tokenizer: Tokenizer,
                 choices: list[tuple[list[int], SamplingParams]], presence: float, frequency: float):
        self.sessions, self.model, self.tokenizer, self.choices = sessions, model, tokenizer, choices
        self.arrived = time.perf_counter()
        self.penalties = presence, frequency
        self.speculate: SpecConfig | None = None
        self.pipelines: list[Pipeline] = []
        self.opened = 0.0
        self.reports: list[dict] = []  # where each finished choice's tokens were computed (swarm sessions)
        self.generations: list[Generation | None] = [None] * len(choices)
        self.scored = [0] * len(choices)  # per choice, the tokens whose log-probabilities went out

    async def open(self) -> None:
        backend = self.sessions.backend
        self.speculate = await backend.speculation(self.model)
        self.source = token_source(self.model, *self.penalties, self.arrived, self.speculate,
                                   lambda state: backend.speculated(self.model, state))
        max_len = max(session_length(len(prompt), params.max_tokens, self.speculate) for prompt, params in self.choices)
        self.pipelines = await self.sessions.acquire(self.model, max_len, len(self.choices))
        self.opened = time.perf_counter()

    async def run(self, emit: Emit) -> list[Completion]:
        """Generate every choice, calling `emit` with each piece of text; the sessions are
        closed when this returns, fails or is cancelled."""
        done: list[Completion | None] = [None] * len(self.choices)
        errors: list[Exception] = []

        async def one(i: int, nursery: trio.Nursery) -> None:
            prompt, params = self.choices[i]
            try:
                gen = self.generations[i] = Generation(self.pipelines[i], self.tokenizer, prompt, params, self.source)
                async for piece in gen:
                    await emit(i, piece, None)
                done[i] = gen.completion
                report = route_report(self.pipelines[i], gen.completion.prompt_tokens + len(gen.completion.token_ids))
                if report is not None:
                    self.reports.append(report)
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

    def logprobs_since(self, i: int) -> list[Logprob] | None:
        """Choice `i`'s log-probabilities not yet handed out (an emit sends those of its tokens);
        None when the request did not ask for them."""
        gen = self.generations[i]
        new = gen.logprobs[self.scored[i]:] if gen is not None and gen.logprobs is not None else None
        self.scored[i] += len(new or ())
        return new

    def report(self) -> dict | None:
        """The choices' route reports as one (route of the first, the rest added up): the
        response's `diffuse` field. None where no choice went through the swarm."""
        if not self.reports:
            return None
        first = self.reports[0]
        return {"route": first["route"], "in_process": [b for r in self.reports for b in r["in_process"]],
                "failovers": [f for r in self.reports for f in r["failovers"]],
                "tokens": {k: sum(r["tokens"][k] for r in self.reports) for k in ("peers", "here")}}

    async def close(self) -> None:
        pipelines, self.pipelines = self.pipelines, []
        if pipelines:
            await self.sessions.release(pipelines, since=self.opened)
