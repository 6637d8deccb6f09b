"""The one client service: every answer, from the swarm or from this process, under one policy.

`diffuse ask`, the API and whatever comes next are thin callers of `open_service`. The policy is
here once: which models are offered and which answer in their place (client/fallback.py), waiting
for the swarm to cover them, answering in this process when no swarm is reachable at all,
speculation's default (on through the swarm; off in this process, where a step is no round trip)
with each model's draft head, and the report of where an answer's tokens were computed. The
service is itself the `Backend` the API serves (client/backend.py).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import trio

from diffuse.client import fallback
from diffuse.client.backend import Backend, Unservable
from diffuse.client.generate import Completion, complete, session_length
from diffuse.client.local import LocalBackend
from diffuse.client.pipeline import Pipeline
from diffuse.client.sampling import SamplingParams
from diffuse.client.speculative import SpecConfig, SpecState
from diffuse.client.swarm_backend import SwarmConfig, open_swarm_backend
from diffuse.client.vault import Vault
from diffuse.control.dht import BootstrapError
from diffuse.control.routing import NoRoute
from diffuse.errors import first_leaf
from diffuse.metrics import FALLBACKS
from diffuse.model import store
from diffuse.model.tokenizer import Tokenizer

T = TypeVar("T")
Say = Callable[[str], None]


def notice(text: str) -> None:
    """The default way a service tells its user something: a line on stderr."""
    print(f"notice: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServiceConfig:
    home: Path  # the store
    models: tuple[str | None, ...] = (None,)  # store names offered (None: the default model); the first is the default
    swarm: SwarmConfig | None = None  # None: whole models in this process
    fallback: str | tuple[str, ...] = fallback.AUTO  # who answers when a model is not servable
    fallback_from_store: bool = False  # `auto` draws on the whole store (ask), not only the models offered (api)
    speculate: bool | None = None  # None: through the swarm yes, in this process no
    exact: bool = False  # batch-invariant kernels here and on every hop
    dtype: str = "bf16"  # of the blocks this process runs
    device: str = "cpu"
    warm_up: bool = False  # run a few steps of each model held here before the first request
    say: Say = field(default=notice, compare=False)
    vault: Vault | None = field(default=None, compare=False)  # where finished conversations are kept (None: nowhere)
    quant: str = "none"  # the variant of the blocks this process runs (model/variants.py)


@dataclass
class Answer:
    completion: Completion
    model: str  # the model that answered (a fallback names itself)
    mode: str  # "swarm" or "local"
    speculated: bool
    report: dict[str, Any]  # where its tokens were computed (route, failovers, checks; swarm answers)


class Service:
    """A backend (swarm or local) with the policy around it."""

    def __init__(self, config: ServiceConfig, backend: Backend, mode: str, orders: dict[str, tuple[str, ...]],
                 reason: str | None = None):
        self.config, self.backend, self.mode, self.reason = config, backend, mode, reason
        self.orders = orders  # per offered model: the models that answer in its place, best first
        self.default_model = next(iter(orders))

    def fallbacks(self, model_id: str) -> tuple[str, ...]:
        return self.orders.get(model_id, ())

    async def models(self) -> list[dict[str, Any]]:
        return await self.backend.models()

    def tokenizer(self, model_id: str) -> Tokenizer:
        return self.backend.tokenizer(model_id)

    def context_length(self, model_id: str) -> int:
        return self.backend.context_length(model_id)

    async def session(self, model_id: str, max_len: int) -> Pipeline:
        return await self.backend.session(model_id, max_len)

    async def speculation(self, model_id: str) -> SpecConfig | None:
        return await self.backend.speculation(model_id)

    def speculated(self, model_id: str, state: SpecState) -> None:
        self.backend.speculated(model_id, state)

    def describe(self, model_id: str, pipeline: Pipeline, tokens: int) -> dict[str, Any]:
        return self.backend.describe(model_id, pipeline, tokens)

    def answer_dict(self, answer: Answer) -> dict[str, Any]:
        """An answer as `ask --json` prints it: text, token ids, timings, steps, where it was computed."""
        c, swarm = answer.completion, self.config.swarm
        where = ({"reason": self.reason} if self.reason else {}) | (
            {"swarm_mode": swarm.access.mode, "trust": swarm.trust} if self.mode == "swarm" and swarm else {})
        return {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids), "timings": c.timings,
                "tokens_per_s": c.timings["tokens_per_s"], "speculate": answer.speculated, "exact": self.config.exact,
                "tokens_per_step": round(c.tokens_per_step, 3), "positions_per_step": round(c.positions_per_step, 3),
                "steps": c.steps, "positions": c.positions, "step_modes": c.modes, "modes": c.mode_counts(),
                "mode": self.mode, "model": answer.model} | where | answer.report

    async def answer(self, messages: list[dict[str, str]], params: SamplingParams,
                     on_text: Callable[[str], None] | None = None, model: str | None = None,
                     store: bool = True) -> Answer:
        """One chat answer from `model` (default: the first offered), or from the first of its
        fallbacks that is servable, said to the user; kept in the history vault if `store`."""
        asked = model or self.default_model
        opened: dict[str, Any] = {}

        async def attempt(model_id: str) -> Pipeline:
            prompt = self.tokenizer(model_id).encode_chat(messages)
            speculate = await self.speculation(model_id)
            t0 = trio.current_time()
            pipeline = await self.session(model_id, session_length(len(prompt), params.max_tokens, speculate))
            opened.update(prompt=prompt, speculate=speculate, route_s=round(trio.current_time() - t0, 4))
            return pipeline

        answering, pipeline = await first_servable(self, asked, attempt, self.config.say)
        answer = await self._complete(answering, pipeline, opened, params, on_text)
        if store:
            await self.keep(messages, [answer.completion.text], answering)
        return answer

    async def keep(self, messages: list[dict[str, Any]], answers: list[str], model: str) -> None:
        """Keep a finished conversation in the history vault, where the service has one (`ask` by
        default when one exists, `api --history`); on a thread, as the write waits for the disk."""
        if self.config.vault is not None:
            await trio.to_thread.run_sync(self.config.vault.keep, messages, answers, model)

    async def _complete(self, model_id: str, pipeline: Pipeline, opened: dict[str, Any], params: SamplingParams,
                        on_text: Callable[[str], None] | None) -> Answer:
        prompt, speculate = opened["prompt"], opened["speculate"]
        state = SpecState() if speculate is not None else None
        result = None
        try:
            result = await complete(pipeline, self.tokenizer(model_id), prompt, params, on_text,
                                    speculate=speculate, state=state)
        finally:
            await pipeline.close()
        if state is not None:
            self.speculated(model_id, state)
        report = {"route_s": opened["route_s"]} | self.describe(model_id, pipeline, len(prompt) + len(result.token_ids))
        if speculate is not None and speculate.draft is not None and state is not None:
            report["draft_head"] = {"first_guesses": state.draft_trials, "right": state.draft_hits}
        return Answer(result, model_id, self.mode, speculate is not None, report)


async def first_servable(backend: Backend, asked: str, attempt: Callable[[str], Awaitable[T]],
                         say: Say) -> tuple[str, T]:
    """`attempt` the asked model, then each of its fallbacks (`backend.fallbacks`), until one is
    servable; whoever answers in the asked model's place is said and counted. The asked model's
    own refusal is raised when none is."""
    refusal: Exception | None = None
    for model in (asked, *backend.fallbacks(asked)):
        try:
            result = await attempt(model)
        except (Unservable, NoRoute) as e:  # NoRoute: announced, but no replica opened a session
            refusal = refusal or e
            continue
        if model != asked:
            FALLBACKS.labels(asked, model).inc()
            say(fallback.notice(asked, model, getattr(refusal, "why", str(refusal))))
        return model, result
    assert refusal is not None
    raise refusal


@asynccontextmanager
async def open_service(config: ServiceConfig) -> AsyncIterator[Service]:
    """The service over the swarm, or over whole models here (`config.swarm` None). When no
    bootstrap peer answers at all (none refused us: another key or mode is an error), the models
    that fit in memory answer from this process instead, said to the user (`fallback` none
    refuses)."""
    home = config.home
    offered = {i.manifest.model_id: (n, i.size_bytes) for n in config.models
               if (i := store.info(store.resolve(home, n)))}
    sizes = {m: size for m, (_, size) in offered.items()}
    pool = fallback.held_models(home) | sizes if config.fallback_from_store else sizes
    orders = {m: tuple(fallback.fallback_order(config.fallback, m, pool)) for m in offered}
    names = {m: n for m, (n, _) in offered.items()} | {
        m: fallback.store_name(home, m) for order in orders.values() for m in order if m not in offered}
    if config.swarm is None:
        async with _local(config, [names[m] for m in offered], orders) as service:
            yield service
        return
    unreachable: list[BootstrapError] = []
    opened = False
    try:
        async with _swarm(config, config.swarm, names, orders) as service:
            opened = True
            yield service
    except* BootstrapError as eg:
        error = first_leaf(eg)
        if opened or error.refused or config.fallback == fallback.NONE:
            raise error from None
        unreachable.append(error)
    if unreachable:
        async with _local_instead(config, orders, names, pool, unreachable[0]) as service:
            yield service


@asynccontextmanager
async def _swarm(config: ServiceConfig, swarm: SwarmConfig, names: dict[str, str | None],
                 orders: dict[str, tuple[str, ...]]) -> AsyncIterator[Service]:
    spares = {m: n for m, n in names.items() if m not in orders}
    swarm = replace(swarm, options=replace(swarm.options, exact=config.exact))
    speculate = config.speculate is not False
    async with open_swarm_backend(config.home, [names[m] for m in orders], swarm, speculate, spares,
                                  config.say) as backend:
        yield Service(config, backend, "swarm", orders)


@asynccontextmanager
async def _local(config: ServiceConfig, names: Sequence[str | None], orders: dict[str, tuple[str, ...]],
                 reason: str | None = None) -> AsyncIterator[Service]:
    backend = LocalBackend.open(config.home, list(names), config.dtype, config.device, bool(config.speculate),
                                config.exact, config.quant)
    if config.warm_up:
        await backend.warm_up()
    yield Service(config, backend, "local", orders, reason)


def _local_instead(config: ServiceConfig, orders: dict[str, tuple[str, ...]], names: dict[str, str | None],
                   sizes: dict[str, int], error: BootstrapError):
    """No swarm answered: the offered models that fit in memory, else the first of their
    fallbacks that does, each in this process (falling back among those loaded only)."""
    from diffuse.client.rescue import MEMORY_SHARE
    from diffuse.control.placement import available_memory

    room = MEMORY_SHARE * available_memory()
    fits = [m for m in orders if sizes[m] <= room] or \
        [m for order in orders.values() for m in order if sizes[m] <= room][:1]
    if not fits:
        raise error
    config.say(f"no swarm answered ({str(error).splitlines()[0]}); answering in this process with {', '.join(fits)}")
    narrowed = {m: tuple(f for f in orders.get(m, ()) if f in fits) for m in fits}
    return _local(config, [names[m] for m in fits], narrowed, "no swarm reachable")
