"""Structured output: `response_format` enforced by constrained decoding, through the official
`openai` client against `diffuse api --local`, and the constraint in the generation loop itself
(speculation verifies only what the constraint allows, and answers as plain decoding does)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
import trio

from support.procs import local_api
from diffuse.client.constrain import ConstraintError, OutputConstraint
from diffuse.client.generate import stream_tokens
from diffuse.client.sampling import Sampler, SamplingParams
from diffuse.client.speculative import SpecConfig, SpecState, kv_headroom, speculative_tokens, verify
from diffuse.home import DEFAULT_MODEL
from diffuse.model.tokenizer import Tokenizer
from support.speculation import ROUND_TRIP_80MS, FixedCost

pytestmark = pytest.mark.slow
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Marseille"]},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "street": {"type": "string", "maxLength": 30}},
                    "required": ["zip", "street"], "additionalProperties": False},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "address", "pets", "student"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Invent a person who lives in France and describe them as JSON."}]


# JSON Schema counts 30.0 an integer; the grammar writes integers without a fraction, and so
# must every answer checked here.
STRICT = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=(
    jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda _, value: type(value) is int)))


def test_the_schema_refuses_what_the_answers_must_not_be():
    good = {"name": "Ana", "age": 30, "city": "Lyon", "address": {"zip": "69001", "street": "Rue A"},
            "pets": [], "student": False}
    jsonschema.validate(good, PERSON, cls=STRICT)
    for bad in ({"age": 130}, {"city": "Rome"}, {"address": {"zip": "6900", "street": "x"}}, {"pets": ["a"] * 3},
                {"student": 1}, {"extra": 1}, {"age": "30"}, {"age": 30.0}, {"age": True}):
        assert not STRICT(PERSON).is_valid(good | bad), bad
    assert not STRICT(PERSON).is_valid({k: v for k, v in good.items() if k != "name"})


@pytest.fixture(scope="module")
def client(home, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "api.log"
    with local_api(home, log, "--max-tokens", "128") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 1), (1.0, 2), (1.0, 3)])
def test_a_strict_json_schema_answer_meets_the_schema(client, temperature, seed):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, response_format=FORMAT,
                                       temperature=temperature, seed=seed, max_tokens=128)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # the grammar completed, not the length
    jsonschema.validate(json.loads(choice.message.content), PERSON, cls=STRICT)


def test_json_object_is_parseable_and_streams_as_it_answers_whole(client):
    args = {"model": DEFAULT_MODEL, "messages": ASK, "response_format": {"type": "json_object"},
            "temperature": 0, "max_tokens": 128}
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    text = client.chat.completions.create(**args | {"response_format": {"type": "text"}}).choices[0]
    assert text.message.content != whole.message.content  # unconstrained, this model answers in prose


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/nowhere"}}}, "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
])
def test_a_bad_response_format_is_a_400_naming_it(client, response_format, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, response_format=response_format)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


# ---- the constraint in the generation loop ---------------------------------------------------

def test_verification_rejects_a_guess_the_constraint_forbids(smollm2):
    """The model's favourite is drafted but forbidden: rejected, and the token chosen instead is
    the best one the grammar allows."""
    tok = Tokenizer.load(smollm2)
    yes, no, maybe = (tok.encode(w)[0] for w in ("yes", "no", "maybe"))
    sampler = Sampler(SamplingParams(constraint=OutputConstraint("lark", 'start: "yes" | "no"')), tok)
    logits = torch.zeros(2, tok.vocab_size)
    logits[:, maybe], logits[:, no], logits[:, yes] = 9.0, 5.0, 1.0
    path, target = verify([7, maybe], [-1, 0], logits, sampler, [7], max_depth=4)
    assert path == [] and target == no and sampler.stopped  # "no" completes the grammar
    with pytest.raises(ConstraintError):
        OutputConstraint("lark", "start: nowhere").check()


@pytest.mark.timeout(900)
def test_constrained_speculation_answers_as_constrained_plain_decoding(home):
    from diffuse.client.local import open_local

    model, tok = open_local(home, None, "fp32")
    prompt = tok.encode_chat(ASK)
    params = SamplingParams(max_tokens=100, constraint=OutputConstraint("json_schema", PERSON))

    async def tokens(source, pipe, *config) -> list[int]:
        return [t async for t in source(pipe, prompt, Sampler(params, tok), tok.eos_ids, *config)]

    plain = trio.run(tokens, stream_tokens, model.session(len(prompt) + 101))
    cfg, state = SpecConfig(), SpecState(cost=FixedCost(ROUND_TRIP_80MS))  # trees pay, so they are sent
    spec = trio.run(tokens, speculative_tokens, model.session(len(prompt) + 100 + kv_headroom(cfg)), cfg, state)
    assert spec == plain, (tok.decode(plain), tok.decode(spec))
    jsonschema.validate(json.loads(tok.decode(plain)), PERSON, cls=STRICT)
    assert max(state.stats.positions) > 1  # trees were sent


def test_constraints_compile_once_per_schema(smollm2):
    from diffuse.client.constrain import compiler

    tok = Tokenizer.load(smollm2)
    first = compiler(tok).compile(OutputConstraint("json_schema", PERSON))
    reordered = dict(reversed(list(PERSON.items())))
    assert compiler(tok) is compiler(tok) and compiler(tok).compile(OutputConstraint("json_schema", reordered)) is first
