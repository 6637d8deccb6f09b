"""Tool calling: templates with tools rendered as transformers renders them, the Hermes form for
templates without tools, calls read back in each shape (whole and streamed), the grammar of a
forced call, and the API through the official `openai` client on the embedded SmolLM2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from support.procs import local_api
from diffuse.api.schema import ToolRequest
from diffuse.api.tools import CallStream, call_grammar, read_calls
from diffuse.home import DEFAULT_MODEL
from diffuse.model.tokenizer import HERMES, LLAMA3, MISTRAL, Tokenizer, ToolForm, describe_tools

pytestmark = pytest.mark.slow
TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": TIME}}]
NAMES = {"get_weather", "get_time"}
CALLED = [{"role": "user", "content": "What is the weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "a1B2c3D4e", "type": "function", "function": {
              "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
          {"role": "tool", "tool_call_id": "a1B2c3D4e", "name": "get_weather", "content": "22 degrees, sunny"}]


# JSON Schema counts 3.0 an integer; a call's arguments checked here must write integers as such.
STRICT = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=(
    jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda _, value: type(value) is int)))


@pytest.fixture(scope="module")
def tok(smollm2) -> Tokenizer:
    return Tokenizer.load(smollm2)


@pytest.fixture(scope="module")
def hf(smollm2):
    return pytest.importorskip("transformers").AutoTokenizer.from_pretrained(smollm2)


def templated(tok: Tokenizer, name: str) -> Tokenizer:
    return Tokenizer(tok.backend, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                     (TEMPLATES / name).read_text(), [])


@pytest.mark.parametrize("name, form", [("qwen2.5.jinja", ToolForm(HERMES, True)),
                                        ("llama3.2.jinja", ToolForm(LLAMA3, True)),
                                        ("mistral-nemo.jinja", ToolForm(MISTRAL, True))])
def test_templates_with_tools_render_as_transformers(tok, hf, name, form):
    mine = templated(tok, name)
    assert mine.tool_form == form
    template = (TEMPLATES / name).read_text()
    for chat in (CALLED[:1], CALLED):
        want = hf.apply_chat_template(chat, tools=TOOLS, chat_template=template, tokenize=False,
                                      add_generation_prompt=True)
        assert mine.apply_chat_template(chat, tools=TOOLS) == want
        assert mine.encode_chat(chat, tools=TOOLS) == mine.encode(want)
        assert '"get_time"' in want and "22 degrees" in want[-200:] if len(chat) > 1 else True


def test_template_without_tools_gets_the_hermes_form(tok, smollm2):
    assert tok.tool_form == ToolForm(HERMES, False)
    assert describe_tools(smollm2).startswith("hermes: <tool_call>") and "system prompt" in describe_tools(smollm2)
    text = tok.decode(tok.encode_chat(CALLED, tools=TOOLS), skip_special=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and "</tools>" in system
    assert [json.loads(line) for line in system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")] == TOOLS
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n22 degrees, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with_system = tok.decode(tok.encode_chat([{"role": "system", "content": "Be brief."}, *CALLED], tools=TOOLS))
    assert with_system.startswith("system\nBe brief.\n\n# Tools")
    assert Tokenizer(tok.backend, {}, None, []).tool_form is None


@pytest.mark.parametrize("shape, text, want", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     ("Let me look.", [{"name": "get_time", "arguments": {"zone": "UTC"}}])),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
     (None, [{"name": "get_time", "arguments": {"zone": "UTC"}},
             {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}])),
    (HERMES, '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', None),  # not offered
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', None),
    (HERMES, "The time is noon.", None),
    (LLAMA3, '{"name": "get_time", "parameters": {"zone": "UTC"}}',
     (None, [{"name": "get_time", "arguments": {"zone": "UTC"}}])),
    (LLAMA3, '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
     (None, [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "CET"}}])),
    (LLAMA3, '{"answer": 42}', None),
    (LLAMA3, "It is noon.", None),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     (None, [{"name": "get_time", "arguments": {"zone": "UTC"}}])),
    (MISTRAL, '[{"name": "get_time", "arguments": {"zone": "UTC"}}]',  # the marker decoded away
     (None, [{"name": "get_time", "arguments": {"zone": "UTC"}}])),
    (MISTRAL, "[1, 2] are numbers", None),
])
def test_calls_read_back_whole_and_streamed(shape, text, want):
    assert read_calls(text, shape, NAMES) == want
    for cut in (1, 3, 7):
        stream = CallStream(shape, NAMES)
        sent = "".join(stream.push(text[i:i + cut]) for i in range(0, len(text), cut))
        rest, calls = stream.finish()
        if want is None:
            assert (sent + rest, calls) == (text, [])
        else:
            assert ((sent + rest) or None, calls) == want
            assert "<tool_call>" not in sent and "{" not in sent


def walk(tok: Tokenizer, grammar: str, seed: int) -> str:
    """A random path through the grammar, as a sampler under the constraint would take."""
    llguidance = pytest.importorskip("llguidance")
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=sorted(tok.eos_ids))
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    rng, ids = random.Random(seed), []
    while len(ids) < 400:
        allowed = [i for i, b in enumerate(matcher.compute_logit_bias()) if b and i not in tok.eos_ids]
        if matcher.is_accepting() and (not allowed or rng.random() < 0.5):
            break
        ids.append(rng.choice(allowed))
        assert matcher.consume_token(ids[-1]), matcher.get_error()
    assert matcher.is_accepting()
    return tok.decode(ids)


@pytest.mark.parametrize("form", [ToolForm(HERMES, False), ToolForm(LLAMA3, True), ToolForm(MISTRAL, True)])
@pytest.mark.parametrize("named", ["get_weather", None])
def test_forced_call_grammar_gives_valid_calls(tok, form, named):
    request = ToolRequest(TOOLS, "function" if named else "required", named, parallel=False)
    grammar = call_grammar(tok, form, request)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    seen = set()
    for seed in range(6):
        text = walk(tok, grammar, seed)
        found = read_calls(text, form.call, NAMES)
        assert found is not None, text
        content, calls = found
        assert content is None and len(calls) == 1
        assert named in (None, calls[0]["name"])
        jsonschema.validate(calls[0]["arguments"], schemas[calls[0]["name"]], cls=STRICT)
        seen.add(calls[0]["name"])
    assert named is not None or seen == NAMES


def test_required_parallel_grammar_allows_several_calls(tok):
    grammar = call_grammar(tok, ToolForm(HERMES, False), ToolRequest(TOOLS, "required", None, parallel=True))
    counts = {len(read_calls(walk(tok, grammar, seed), HERMES, NAMES)[1]) for seed in range(12)}
    assert 1 in counts and max(counts) > 1


@pytest.fixture(scope="module")
def client(home, tmp_path_factory):
    log = tmp_path_factory.mktemp("api") / "api.log"
    with local_api(home, log, "--max-tokens", "48") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def streamed(stream) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) of a streamed answer, its deltas put together as a client does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or ():
            call = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
            call["name"] += c.function.name or ""
            call["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls and len({c["id"] for c in calls}) == len(calls)
    for c in calls:
        assert c["id"].startswith("call_") and c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]], cls=STRICT)


ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.mark.parametrize("choice, names", [({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
                                           ("required", NAMES)])
def test_forced_and_required_calls_are_valid_whole_and_streamed(client, choice, names):
    kwargs = dict(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                  parallel_tool_calls=False, max_tokens=64)  # this small model, free to, calls on and on
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in whole.message.tool_calls]
    assert_valid_calls(calls, names)
    assert len(calls) == 1
    content, streamed_calls, finish = streamed(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert_valid_calls(streamed_calls, names)
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]


def test_tool_choice_none_answers_in_text(client):
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=16).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_a_history_of_calls_and_results_is_rendered_and_answered(client, tok):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=history, tools=TOOLS, temperature=0,
                                           max_tokens=24)
    rendered = tok.encode_chat([*ASK, {**CALLED[1], "tool_calls": [{**CALLED[1]["tool_calls"][0], "id": "call_1"}]},
                                {**CALLED[2], "tool_call_id": "call_1", "content": "22 degrees and sunny"}],
                               tools=TOOLS)
    assert whole.usage.prompt_tokens == len(rendered)
    answer = whole.choices[0]
    assert answer.message.content or answer.message.tool_calls
    content, calls, finish = streamed(client.chat.completions.create(
        model=DEFAULT_MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=24, stream=True))
    assert (content or None, finish) == (answer.message.content, answer.finish_reason)


BAD_TOOL = {"type": "function", "function": {"name": "get weather!", "parameters": WEATHER}}


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[BAD_TOOL]), "tools[0].function.name"),
    (dict(tools=[{"type": "retrieval", "function": TOOLS[0]["function"]}]), "tools[0].type"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}], tool_choice="required"),
     "tools"),
    (dict(messages=[*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "?"}]), "messages[1].tool_call_id"),
    (dict(messages=[*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]), "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tools_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": DEFAULT_MODEL, "messages": ASK, "max_tokens": 4} | kwargs)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_tools_on_the_completions_endpoint_are_refused(client):
    r = httpx.post(str(client.base_url) + "completions", json={"model": DEFAULT_MODEL, "prompt": "Hi",
                                                                "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
