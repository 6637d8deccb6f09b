"""`diffuse api` through the official `openai` client, against real server processes.

One `diffuse api --local` process serves the embedded model for the whole module; a second
process serves a fake swarm (api_helpers.FakeSwarm) for what one process cannot show by itself:
uncovered blocks (503) and busy peers (429).
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
import torch
import trio
import trio.testing

from api_helpers import FULL, PARTIAL, fake_server_cmd
from support.procs import local_api, start_server, stop_server
from diffuse.api.answers import Penalized, Sessions
from diffuse.client.backend import Overloaded
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.home import DEFAULT_MODEL
from diffuse.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
KEY = "sk-diffuse-test-key"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # a base-model continuation that does not stop by itself


@pytest.fixture(scope="module")
def api(home, tmp_path_factory):
    log = tmp_path_factory.mktemp("api") / "api.log"
    with local_api(home, log, "--api-key", KEY, "--max-tokens", "32") as url:
        yield url


@pytest.fixture(scope="module")
def fake(smollm2, tmp_path_factory):
    proc, url = start_server(fake_server_cmd(smollm2), tmp_path_factory.mktemp("fake") / "fake.log")
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture
def client(api):
    return openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)


def status(url: str) -> dict:
    return httpx.get(url + "/status.json", timeout=30).json()


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [DEFAULT_MODEL]
    cov = models[0].model_extra["coverage"]
    assert cov["servable"] and cov["missing"] == [] and cov["num_blocks"] == 30
    assert all(b["peers"] == ["local"] for b in cov["blocks"])


def test_chat_streamed_equals_whole_under_greedy(client, smollm2):
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=16)
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    assert text == answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    prompt_tokens = len(Tokenizer.load(smollm2).encode_chat(ASK))
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == prompt_tokens
    assert 0 < whole.usage.completion_tokens == chunks[-1].usage.completion_tokens <= 16
    assert whole.usage.total_tokens == prompt_tokens + whole.usage.completion_tokens


def test_completions_whole_streamed_stop_seed_and_n(client):
    whole = client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=8)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.choices[0].text.startswith(" 9, 10")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=8, stream=True))
    assert streamed == whole.choices[0].text

    cut = client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=8, stop=["10"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == " 9, "

    def sampled():
        return client.completions.create(model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=5, n=2,
                                         temperature=1.0, top_p=0.9, seed=7, presence_penalty=0.5,
                                         frequency_penalty=0.5)

    first, again = sampled(), sampled()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # a seed reproduces every choice
    assert 0 < first.usage.completion_tokens <= 2 * 5


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 100}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"max_tokens": 10**6}, "max_tokens"),
])
def test_bad_requests_are_400_naming_the_field(client, kwargs, param):
    args = {"model": DEFAULT_MODEL, "messages": ASK, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_malformed_json_400(client, api):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=ASK)
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(api + "/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "error" in r.json()


def test_wrong_or_missing_api_key_is_401(api):
    bad = openai.OpenAI(base_url=api + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.post(api + "/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "x"}).status_code == 401


def test_unservable_model_is_503_naming_the_blocks(smollm2, fake):
    client = openai.OpenAI(base_url=fake + "/v1", api_key="unused", max_retries=0)
    listed = {m.id: m.model_extra["servable"] for m in client.models.list().data}
    assert listed == {FULL: True, PARTIAL: False}  # every model, and whether it is servable now
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=PARTIAL, messages=ASK)
    assert e.value.status_code == 503
    assert e.value.body["missing_blocks"] == list(range(20, 30)) and "20-29" in e.value.body["message"]
    with pytest.raises(openai.RateLimitError) as e:  # the backend says every peer is busy
        client.completions.create(model=FULL, prompt="hi", stream=True)
    assert e.value.status_code == 429


def test_session_cap_is_429_before_any_session_opens():
    class Counting:
        opened = 0

        async def session(self, model_id, max_len):
            Counting.opened += 1
            return None

    async def main():
        sessions = Sessions(Counting(), limit=3)
        held = await sessions.acquire("m", 8, 2)
        with pytest.raises(Overloaded):
            await sessions.acquire("m", 8, 2)
        return held

    assert trio.run(main) == [None, None] and Counting.opened == 2


def test_past_the_cap_requests_wait_in_a_bounded_queue_first_come_first_served():
    class Opened:
        async def session(self, model_id, max_len):
            return _Closing()

        async def close(self):
            pass

    order: list[str] = []

    async def main():
        sessions = Sessions(Opened(), limit=2, queue=2)
        held = await sessions.acquire("m", 8, 2)  # every slot in use
        done = trio.Event()

        async def wait(name: str) -> None:
            got = await sessions.acquire("m", 8, 1)
            order.append(name)
            await done.wait()
            await sessions.release(got)

        async with trio.open_nursery() as nursery:
            for name in ("first", "second"):
                nursery.start_soon(wait, name)
                await trio.testing.wait_all_tasks_blocked()
            assert sessions.waiting == 2
            with pytest.raises(Overloaded) as full:  # the queue is full too
                await sessions.acquire("m", 8, 1)
            assert full.value.retry_after >= 1 and "2 wait" in str(full.value)
            await sessions.release([_Closing()], 1)  # a slot frees: the longest waiting goes
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["first"]
            await sessions.release([_Closing()], 1)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["first", "second"] and sessions.open == 2 and sessions.waiting == 0
            done.set()
        assert sessions.open == 0 and held

    trio.run(main)


class _Closing:
    async def close(self):
        pass


def test_concurrent_streams_have_own_sessions_and_hanging_up_closes_them(api):
    """Two streams are served at once (two sessions open); closing them frees both sessions
    long before their answers could have ended."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": DEFAULT_MODEL, "prompt": COUNTING, "max_tokens": 2000, "temperature": 0, "stream": True}
    before = _generated(api)
    with httpx.Client(timeout=120) as one, httpx.Client(timeout=120) as two:
        with one.stream("POST", api + "/v1/completions", json=body, headers=headers) as r1, \
                two.stream("POST", api + "/v1/completions", json=body, headers=headers) as r2:
            streams = [r.iter_lines() for r in (r1, r2)]  # held: dropping one hangs up at once
            for r, lines in zip((r1, r2), streams):
                assert r.status_code == 200
                assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"]
            assert status(api)["api"]["sessions_open"] == 2
    deadline = time.monotonic() + 60  # bounded: the outcome, not the timing, is asserted
    while status(api)["api"]["sessions_open"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status(api)["api"]["sessions_open"] == 0, "sessions stayed open after the clients hung up"
    assert _generated(api) - before < 2 * 2000


def _generated(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf'^diffuse_tokens_generated_total{{model="{DEFAULT_MODEL}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_and_status(api, client):
    client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=3)
    text = httpx.get(api + "/metrics").text
    assert _generated(api) >= 3
    for name in ("diffuse_step_seconds_bucket", "diffuse_first_token_seconds_count", "diffuse_sessions_open",
                 'diffuse_api_requests_total{code="200",endpoint="/v1/completions"}'):
        assert name in text
    # In one process a step is no round trip: no speculation, every decode step counted as plain.
    steps = re.search(rf'^diffuse_decode_steps_total{{mode="plain",model="{DEFAULT_MODEL}"}} (\S+)$', text, re.M)
    assert steps and float(steps.group(1)) >= 2 and "mode=\"tree\"" not in text
    s = status(api)
    assert s["models"][0]["model"] == DEFAULT_MODEL and s["models"][0]["peers"][0]["throughput"] > 0
    page = httpx.get(api + "/")
    assert page.status_code == 200 and "status.json" in page.text


def test_penalties_count_generated_tokens_only():
    logits = torch.zeros(8)
    logits[3] = 1.0
    greedy = Sampler(SamplingParams(temperature=0))
    # 3 was generated twice: 1 - 2 * 0.4 - 0.5 < 0, so another token wins.
    assert Penalized(greedy, 1, 0.5, 0.4).sample(logits, torch.tensor([5, 3, 3])) == 0
    assert Penalized(greedy, 3, 0.5, 0.4).sample(logits, torch.tensor([3, 3, 3])) == 3  # all prompt
    assert Penalized(greedy, 1, -0.5, 0.0).sample(torch.zeros(8), torch.tensor([5, 6])) == 6  # negative: favour

