"""The client service (client/service.py): who answers when the asked model cannot, and one
answer in this process with its report. Through a swarm, ask and the API exercise it end to end
(test_models_swarm.py: fallbacks, no swarm reachable; test_swarm.py: routes)."""

from __future__ import annotations

import pytest
import trio

from diffuse.client.backend import Unservable
from diffuse.client.local import open_local
from diffuse.client.sampling import SamplingParams
from diffuse.client.service import ServiceConfig, first_servable, open_service
from diffuse.control.routing import NoRoute
from diffuse.home import DEFAULT_MODEL, data_home
from diffuse.metrics import REGISTRY


class Orders:
    def __init__(self, orders: dict[str, tuple[str, ...]]):
        self.orders = orders

    def fallbacks(self, model_id: str) -> tuple[str, ...]:
        return self.orders.get(model_id, ())


def test_the_first_servable_fallback_answers_and_says_so():
    said: list[str] = []
    refusals = {"big": Unservable("big", [3, 4, 5]), "mid": NoRoute("no replica opened a session")}

    async def attempt(model: str) -> str:
        if model in refusals:
            raise refusals[model]
        return f"session of {model}"

    before = REGISTRY.get_sample_value("diffuse_fallbacks_total", {"asked": "big", "answered": "small"}) or 0
    got = trio.run(first_servable, Orders({"big": ("mid", "small", "tiny")}), "big", attempt, said.append)
    assert got == ("small", "session of small")
    assert len(said) == 1 and "big is not servable now (no peer serves blocks 3-5)" in said[0] and "small" in said[0]
    assert REGISTRY.get_sample_value("diffuse_fallbacks_total", {"asked": "big", "answered": "small"}) == before + 1

    with pytest.raises(Unservable, match="blocks 3-5"):  # none servable: the asked model's own refusal
        trio.run(first_servable, Orders({"big": ("mid",)}), "big", attempt, said.append)
    assert len(said) == 1


def test_an_answer_in_process_is_the_models_own_greedy_answer():
    home = data_home()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=8)

    async def run():
        async with open_service(ServiceConfig(home, dtype="fp32")) as service:
            return await service.answer(messages, params), service.mode

    answer, mode = trio.run(run)
    assert (mode, answer.model, answer.mode, answer.speculated) == ("local", DEFAULT_MODEL, "local", False)
    assert answer.report == {"route_s": answer.report["route_s"]}  # nothing went through a swarm

    model, tokenizer = open_local(home, None, "fp32")

    async def reference():
        from diffuse.client.generate import complete, session_length

        prompt = tokenizer.encode_chat(messages)
        pipeline = model.session(session_length(len(prompt), params.max_tokens))
        try:
            return await complete(pipeline, tokenizer, prompt, params)
        finally:
            await pipeline.close()

    assert answer.completion.token_ids == trio.run(reference).token_ids
    assert "Paris" in answer.completion.text
