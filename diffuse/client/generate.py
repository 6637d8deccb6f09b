"""The generation loop: prefill, then one token per step (or several, speculating), streamed as
text as it comes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from diffuse.client.pipeline import Pipeline, showable
from diffuse.client.sampling import Logprob, Sampler, SamplingParams
from diffuse.control.routing import NoRoute
from diffuse.client.speculative import SpecConfig, SpecState, kv_headroom, speculative_tokens
from diffuse.errors import Rewind


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end of turn, stop string, constraint complete), "length", or "uncovered blocks A-B"
    prompt_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)  # tokens each decode round trip produced
    positions: list[int] = field(default_factory=list)  # positions each decode round trip sent
    modes: list[str] = field(default_factory=list)  # each round trip's mode: tree, plain or held (speculative.py)
    logprobs: list[Logprob] | None = None  # one per token id, when SamplingParams.logprobs asked for them

    @property
    def tokens_per_step(self) -> float:
        return sum(self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def positions_per_step(self) -> float:
        return sum(self.positions) / len(self.positions) if self.positions else 0.0

    def mode_counts(self) -> dict[str, dict[str, int]]:
        """Per mode: the round trips, tokens and positions it took."""
        out: dict[str, dict[str, int]] = {}
        for mode, tokens, positions in zip(self.modes, self.steps, self.positions):
            c = out.setdefault(mode, {"steps": 0, "tokens": 0, "positions": 0})
            c["steps"] += 1
            c["tokens"] += tokens
            c["positions"] += positions
        return out


def session_length(prompt_tokens: int, max_tokens: int, speculate: SpecConfig | None = None) -> int:
    """KV-cache slots a session needs: speculation writes its widest candidate tree past the end."""
    return prompt_tokens + max_tokens + (kv_headroom(speculate) if speculate else 0)


TokenSource = Callable[[Pipeline, list[int], Sampler, set[int]], AsyncIterator[int]]


async def stream_tokens(pipeline: Pipeline, prompt: list[int], sampler: Sampler,
                        eos_ids: set[int], speculate: SpecConfig | None = None,
                        state: SpecState | None = None) -> AsyncIterator[int]:
    """Yield sampled token ids until an end-of-turn token (not yielded), max_tokens or the
    sampler's constraint is complete; with `speculate`, several per forward
    (client/speculative.py), the same ids under greedy. Each chosen token is `take`n."""
    if speculate is not None:
        async for token in speculative_tokens(pipeline, prompt, sampler, eos_ids, speculate, state):
            yield token
        return
    pipeline.defer_checks()
    tokens = list(prompt)  # then each sampled token; the last one is not in the cache yet
    fed, shown, done = 0, len(prompt), sampler.p.max_tokens <= 0
    while True:
        try:
            if not done:
                logits = (await pipeline.forward(torch.tensor([tokens[fed:]]), rows=slice(-1, None)))[0, -1]
                fed = len(tokens)
                token = sampler.sample(logits, torch.tensor(tokens))
                sampler.take(logits, token)
                done = token in eos_ids
                if not done:
                    tokens.append(token)
                    done = len(tokens) - len(prompt) == sampler.p.max_tokens or sampler.stopped
            if done:
                await pipeline.settle()
        except Rewind as r:  # a peer was caught: what followed its bad step is recomputed
            del tokens[max(r.length + 1, len(prompt)):]
            sampler.rewind(len(tokens) - len(prompt))
            fed, done = r.length, False
            continue
        for token in tokens[shown:showable(pipeline, len(tokens), done)]:
            yield token
            shown += 1
        if done:
            return


class StopText:
    """Cuts the text at the first stop string, holding back what could still become one."""

    def __init__(self, stop: list[str]):
        self.stop, self.buf, self.hit = [s for s in stop if s], "", False

    def push(self, text: str) -> str:
        self.buf += text
        for s in self.stop:
            i = self.buf.find(s)
            if i >= 0:
                out, self.buf, self.hit = self.buf[:i], "", True
                return out
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Generation:
    """One answer as an async stream of text pieces; `completion` holds the totals at the end.

    Iterating is what runs the model, so a consumer that stops early (a client that hung up)
    stops the generation; the caller closes the pipeline. With `speculate` each round trip
    carries a candidate tree (same greedy output, same sampling distribution); the session must
    hold `session_length(..., speculate)` slots; `state` (default: a fresh one) is what it
    learns and counts. An explicit `tokens` source wins over it.
    """

    def __init__(self, pipeline: Pipeline, tokenizer, prompt: list[int], params: SamplingParams,
                 tokens: TokenSource | None = None, speculate: SpecConfig | None = None,
                 state: SpecState | None = None):
        self.pipeline, self.tokenizer, self.prompt, self.params = pipeline, tokenizer, prompt, params
        self.speculate = speculate if tokens is None else None
        self.state = (state or SpecState()) if self.speculate else None
        self.tokens = tokens or (lambda *a: stream_tokens(*a, speculate=self.speculate, state=self.state))
        self.sampler = Sampler(params, tokenizer)  # compiles the constraint now, before any token
        self.ids: list[int] = []
        self.completion: Completion | None = None

    @property
    def logprobs(self) -> list[Logprob] | None:
        """The log-probabilities of the tokens so far, when the parameters ask for them."""
        return None if self.params.logprobs is None else self.sampler.logprobs[:len(self.ids)]

    async def __aiter__(self) -> AsyncIterator[str]:
        from diffuse.model.tokenizer import StreamDecoder

        params, sampler, ids = self.params, self.sampler, self.ids
        decoder, stopper = StreamDecoder(self.tokenizer), StopText(params.stop)
        pieces: list[str] = []
        t0 = time.perf_counter()
        t_first = None
        finish = "length"
        stats = self.state.stats if self.state else None
        seen = stats.steps if stats else 0  # a state reused across answers keeps adding steps
        try:
            async for token in self.tokens(self.pipeline, self.prompt, sampler, self.tokenizer.eos_ids):
                t_first = t_first or time.perf_counter()
                ids.append(token)
                piece = stopper.push(decoder.push(token))
                if piece:
                    pieces.append(piece)
                    yield piece
                if stopper.hit:
                    finish = "stop"
                    break
            else:
                if len(ids) < params.max_tokens or sampler.stopped:
                    finish = "stop"
        except NoRoute as e:
            if not ids:  # nothing to keep: the caller says what failed
                raise
            finish = f"uncovered blocks {e.blocks}"  # the swarm lost them mid-answer: keep what we have
        if not stopper.hit:
            piece = stopper.push(decoder.flush()) + stopper.flush()
            if piece:
                pieces.append(piece)
                yield piece
        t_end = time.perf_counter()
        t_first = t_first or t_end
        decode_s = t_end - t_first
        plain = [1] * max(0, len(ids) - 1)
        steps, positions = (stats.tokens[seen:], stats.positions[seen:]) if stats else (plain, plain)
        modes = stats.modes[seen:] if stats else ["plain"] * len(plain)
        self.completion = Completion(
            text="".join(pieces), token_ids=ids, finish_reason=finish, prompt_tokens=len(self.prompt),
            timings={"first_token_s": t_first - t0, "decode_s": decode_s, "total_s": t_end - t0,
                     "tokens_per_s": (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else 0.0},
            steps=list(steps), positions=list(positions), modes=list(modes), logprobs=self.logprobs,
        )


async def complete(pipeline: Pipeline, tokenizer, prompt: list[int], params: SamplingParams,
                   on_text: Callable[[str], None] | None = None,
                   tokens: TokenSource | None = None, speculate: SpecConfig | None = None,
                   state: SpecState | None = None) -> Completion:
    """Run one answer to the end, calling on_text with each new piece of text."""
    gen = Generation(pipeline, tokenizer, prompt, params, tokens, speculate, state)
    async for piece in gen:
        if on_text:
            on_text(piece)
    return gen.completion
