"""Log-probabilities through the official `openai` client against `diffuse api --local`: OpenAI's
shapes, streamed and whole, consistent with the tokens chosen, and equal to the engine's own
log-softmax computed in this process on the same model."""

from __future__ import annotations

import math

import openai
import pytest
import trio

from support.procs import local_api
from diffuse.client.generate import complete
from diffuse.client.sampling import SamplingParams
from diffuse.home import DEFAULT_MODEL

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"


@pytest.fixture(scope="module")
def client(home, tmp_path_factory):
    log = tmp_path_factory.mktemp("logprobs") / "api.log"
    with local_api(home, log, "--max-tokens", "32") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_greedy_chat_lists_the_chosen_token_first_with_the_engine_values(client, home):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=12,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert bytes(e.bytes).decode() == e.token and e.logprob <= 0
        assert len(e.top_logprobs) == 5 and (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)

    from diffuse.client.local import open_local

    model, tok = open_local(home, None, "bf16")  # what `api --local` loads
    prompt = tok.encode_chat(ASK)

    async def reference():
        pipe = model.session(len(prompt) + 13)
        try:
            return await complete(pipe, tok, prompt, SamplingParams(max_tokens=12, logprobs=5))
        finally:
            await pipe.close()

    ours = trio.run(reference)
    assert [e.bytes for e in ours.logprobs] == [bytes(e.bytes) for e in content]
    for mine, theirs in zip(ours.logprobs, content):
        assert math.isclose(mine.logprob, theirs.logprob, abs_tol=1e-5)
        assert [t.logprob for t in mine.top] == pytest.approx([t.logprob for t in theirs.top_logprobs], abs=1e-5)


def test_streamed_logprobs_are_the_whole_answers(client):
    args = {"model": DEFAULT_MODEL, "messages": ASK, "temperature": 0, "max_tokens": 12, "logprobs": True,
            "top_logprobs": 2}
    whole = client.chat.completions.create(**args).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole]
    plain = client.chat.completions.create(**args | {"logprobs": False, "top_logprobs": None}).choices[0]
    assert plain.logprobs is None


def test_sampled_tokens_carry_their_own_logprob(client):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=1.0, seed=5, max_tokens=12,
                                       logprobs=True, top_logprobs=0)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in content)


def test_completions_logprobs_in_the_legacy_shape(client):
    args = {"model": DEFAULT_MODEL, "prompt": COUNTING, "temperature": 0, "max_tokens": 6, "logprobs": 3}
    whole = client.completions.create(**args).choices[0]
    lp = whole.logprobs
    assert "".join(lp.tokens) == whole.text and len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == top[token] == logprob and 3 <= len(top) <= 4
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


@pytest.mark.parametrize("endpoint, kwargs, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(client, endpoint, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=2, **kwargs)
        else:
            client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, max_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
