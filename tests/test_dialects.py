"""Ollama's and Anthropic's APIs on `diffuse api`, through their own client libraries.

One `diffuse api --local` process serves the embedded model for the module; each dialect must give
the OpenAI endpoints' greedy answer to the same prompt and length, streamed or whole, list the
models, and speak its own error shape. The last test asks the same through a loopback swarm (a
sentinel and one peer serving the blocks the API does not compute).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from support.procs import Procs, local_api
from diffuse.home import DEFAULT_MODEL
from diffuse.model.tokenizer import Tokenizer, describe_tools

pytestmark = pytest.mark.slow
KEY = "sk-diffuse-dialects"
QUESTION = "What is the capital of France? Answer in one sentence."
ASK = [{"role": "user", "content": QUESTION}]
SYSTEM = "You are a terse geography teacher."
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # a base-model continuation that does not stop by itself
LENGTH = 16


@pytest.fixture(scope="module")
def api(home, tmp_path_factory):
    log = tmp_path_factory.mktemp("dialects") / "api.log"
    with local_api(home, log, "--api-key", KEY, "--max-tokens", "32") as url:
        yield url


@pytest.fixture(scope="module")
def reference(api):
    """The OpenAI endpoints' greedy answers: chat, chat with a system prompt, and text."""
    client = openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=LENGTH)
    system = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "system", "content": SYSTEM}, *ASK],
                                            temperature=0, max_tokens=LENGTH)
    text = client.completions.create(model=DEFAULT_MODEL, prompt=COUNTING, temperature=0, max_tokens=8)
    assert "Paris" in chat.choices[0].message.content
    return {"chat": chat, "system": system, "text": text}


@pytest.fixture
def local(api):
    return ollama.Client(host=api, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture
def claude(api):
    return anthropic.Anthropic(base_url=api, api_key=KEY, max_retries=0, timeout=120)


GREEDY = {"temperature": 0, "num_predict": LENGTH}
ZERO = {"temperature": 0}  # Anthropic's client sends sampling settings as extra body fields
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}}, "required": ["city"],
        "additionalProperties": False}
# The ollama client keeps only some schema keywords of a tool (type, required, properties with
# their type, description and enum), in this order, so this schema reaches the server as written.
FORECAST = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "description": "A city's name."},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
OLLAMA_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": FORECAST}}
PARIS = {"city": "Paris", "unit": "celsius"}
# This small model calls a function when asked plainly (it writes the call alone, whatever the
# tool's wording), where a question that needs a tool gets it talking.
CALL_ASK = [{"role": "user", "content": "Repeat exactly: <tool_call>\n"
                                        + json.dumps({"name": "get_weather", "arguments": PARIS}) + "\n</tool_call>"}]


def test_ollama_chat_whole_and_streamed_is_the_openai_answer(local, reference, smollm2):
    want = reference["chat"]
    whole = local.chat(model=DEFAULT_MODEL, messages=ASK, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == want.choices[0].message.content
    assert whole.done and whole.done_reason == want.choices[0].finish_reason
    assert whole.prompt_eval_count == want.usage.prompt_tokens == len(Tokenizer.load(smollm2).encode_chat(ASK))
    assert whole.eval_count == want.usage.completion_tokens
    assert all(isinstance(d, int) and d >= 0 for d in (whole.total_duration, whole.load_duration,
                                                         whole.prompt_eval_duration, whole.eval_duration))
    assert whole.total_duration >= whole.eval_duration

    parts = list(local.chat(model=DEFAULT_MODEL + ":latest", messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == want.choices[0].message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].message.content == "" and parts[-1].done_reason == whole.done_reason
    assert parts[-1].eval_count == whole.eval_count and parts[-1].model == DEFAULT_MODEL


def test_ollama_generate_templated_raw_and_streamed(local, reference):
    templated = local.generate(model=DEFAULT_MODEL, prompt=QUESTION, system=SYSTEM, options=GREEDY, stream=True)
    assert "".join(p.response for p in templated) == reference["system"].choices[0].message.content
    raw = local.generate(model=DEFAULT_MODEL, prompt=COUNTING, raw=True, stream=False,
                         options={"temperature": 0, "num_predict": 8})
    assert raw.response == reference["text"].choices[0].text and raw.done_reason == "length" and raw.eval_count == 8
    cut = local.generate(model=DEFAULT_MODEL, prompt=COUNTING, raw=True, stream=False,
                         options={"temperature": 0, "num_predict": 8, "stop": ["10"]})
    assert cut.response == " 9, " and cut.done_reason == "stop"


def test_structured_output_is_the_openai_answer(local, claude, api):
    client = openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    want = client.chat.completions.create(model=DEFAULT_MODEL, messages=ask, temperature=0, max_tokens=LENGTH,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "city", "schema": CITY}})
    text = want.choices[0].message.content
    assert json.loads(text)["city"] in ("Paris", "Lyon")
    assert local.chat(model=DEFAULT_MODEL, messages=ask, options=GREEDY, format=CITY).message.content == text
    output = {"output_config": {"format": {"type": "json_schema", "schema": CITY}}}
    answer = claude.messages.create(model=DEFAULT_MODEL, max_tokens=LENGTH, messages=ask, extra_body=ZERO | output)
    assert answer.content[0].text == text
    anything = local.generate(model=DEFAULT_MODEL, prompt=ask[0]["content"], options=GREEDY, format="json")
    assert isinstance(json.loads(anything.response), dict)


def test_ollama_nothing_to_say_loads_the_model(local):
    assert local.chat(model=DEFAULT_MODEL, messages=[]).done_reason == "load"
    assert local.generate(model=DEFAULT_MODEL, prompt="").done_reason == "load"


def test_ollama_tags_show_and_version(local, api, smollm2):
    tags = local.list().models
    assert [m.model for m in tags] == [DEFAULT_MODEL]
    assert tags[0].details.family == "llama" and tags[0].size > 0 and tags[0].digest
    shown = local.show(DEFAULT_MODEL)
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.block_count"] == 30
    assert shown.details.parameter_size == f"{info['general.parameter_count'] / 1e6:.1f}M"
    assert shown.template == Tokenizer.load(smollm2).chat_template and "completion" in shown.capabilities
    assert "tools" in shown.capabilities and info["diffuse.tools"] == describe_tools(smollm2)
    assert "temperature 0.8" in shown.parameters.splitlines()
    assert httpx.get(api + "/api/version").json()["version"]


@pytest.mark.parametrize("call, status, names", [
    (lambda c: c.chat(model="no-such-model", messages=ASK, stream=False), 404, "no-such-model"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=ASK, options={"temperature": -1}), 400, "options.temperature"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=ASK, options={"mirostat": 2}), 400, "options.mirostat"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    (lambda c: c.generate(model=DEFAULT_MODEL, prompt="hi", images=[b"\x89PNG"]), 400, "images"),
    (lambda c: c.show("no-such-model"), 404, "no-such-model"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=ASK, format={"type": "bogus"}), 400, "format"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=ASK, format="json", tools=[OLLAMA_TOOL]), 400, "format"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=ASK, tools=[{"type": "function", "function": {"name": "a b"}}]),
     400, "tools[0].function.name"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=[*ASK, {"role": "tool", "content": "22", "tool_name": "f"}]), 400,
     "messages[1].tool_name"),
    (lambda c: c.chat(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]}]), 400, "messages[0].tool_calls"),
])
def test_ollama_errors_in_ollamas_shape(local, call, status, names):
    with pytest.raises(ollama.ResponseError) as e:
        call(local)
    assert e.value.status_code == status and names in e.value.error


def test_ollama_tool_calls_whole_and_streamed(local):
    ask = {"model": DEFAULT_MODEL, "messages": CALL_ASK, "tools": [OLLAMA_TOOL],
           "options": {"temperature": 0, "num_predict": 64}}
    whole = local.chat(**ask, stream=False)
    assert whole.done_reason == "stop" and whole.message.content == ""
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == PARIS
    jsonschema.validate(call.function.arguments, FORECAST, cls=jsonschema.Draft202012Validator)

    parts = list(local.chat(**ask, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].done_reason == "stop"
    assert [p for p in parts if p.message.tool_calls] == [parts[-2]]  # the calls in one line, once read
    assert "".join(p.message.content for p in parts) == ""
    assert [(c.function.name, c.function.arguments) for c in parts[-2].message.tool_calls] == [("get_weather", PARIS)]


def test_ollama_tool_results_in_the_history_are_the_openai_answer(local, api):
    """An assistant's past call and a tool message answering it (by `tool_name`, or the earliest
    unanswered call without one) are rendered as the OpenAI endpoint renders its tool_calls and
    tool messages: the same prompt, the same answer."""
    called = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                              "arguments": PARIS}}]}
    result = {"role": "tool", "content": "22 degrees and sunny", "tool_name": "get_weather"}
    ask = {"model": DEFAULT_MODEL, "tools": [OLLAMA_TOOL], "options": GREEDY, "stream": False}
    answered = local.chat(messages=[*WEATHER_ASK, called, result], **ask)
    unnamed = local.chat(messages=[*WEATHER_ASK, called, {"role": "tool", "content": result["content"]}], **ask)
    client = openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)
    past = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}
    same = client.chat.completions.create(
        model=DEFAULT_MODEL, tools=[OLLAMA_TOOL], temperature=0, max_tokens=LENGTH, messages=[
            *WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [past]},
            {"role": "tool", "tool_call_id": "call_1", "content": result["content"]}])
    assert answered.prompt_eval_count == unnamed.prompt_eval_count == same.usage.prompt_tokens
    assert answered.message.content == unnamed.message.content == same.choices[0].message.content
    assert answered.message.content and answered.eval_count == same.usage.completion_tokens


def test_ollama_streams_by_default_and_refuses_a_missing_key_in_its_shape(api):
    ask = {"model": DEFAULT_MODEL, "messages": ASK, "options": {"temperature": 0, "num_predict": 4}}
    r = httpx.post(api + "/api/chat", json=ask, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert r.headers["content-type"] == "application/x-ndjson" and len(lines) > 1
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["eval_count"] == 4 and lines[-1]["done_reason"] == "length"
    r = httpx.post(api + "/api/chat", json=ask)
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert httpx.get(api + "/api/tags").status_code == 401


def test_anthropic_messages_whole_and_streamed_is_the_openai_answer(claude, reference):
    want = reference["system"]
    ask = {"model": DEFAULT_MODEL, "max_tokens": LENGTH, "system": SYSTEM, "messages": ASK, "extra_body": ZERO}
    whole = claude.messages.create(**ask)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == want.choices[0].message.content
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert whole.usage.input_tokens == want.usage.prompt_tokens
    assert whole.usage.output_tokens == want.usage.completion_tokens
    assert whole.id.startswith("msg_") and whole.model == DEFAULT_MODEL and whole.role == "assistant"

    blocks = ask | {"system": [{"type": "text", "text": SYSTEM}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]}
    with claude.messages.stream(**blocks) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens

    events = [e.type for e in claude.messages.create(**ask, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"] and "content_block_delta" in events
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequences_and_prefill(claude, reference):
    cut = claude.messages.create(model=DEFAULT_MODEL, max_tokens=LENGTH, extra_body=ZERO, messages=ASK,
                                 stop_sequences=["zzz", "Paris"])
    answer = reference["chat"].choices[0].message.content
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    assert cut.content[0].text == answer[:answer.index("Paris")]
    start = answer[:answer.index("Paris")].rstrip()
    prefilled = claude.messages.create(model=DEFAULT_MODEL, max_tokens=LENGTH, extra_body=ZERO,
                                       messages=[*ASK, {"role": "assistant", "content": start}])
    assert "Paris" in prefilled.content[0].text  # the answer continues the prefill, without repeating it
    assert not prefilled.content[0].text.startswith(start)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_anthropic_tool_use_is_the_openai_call(claude, api):
    client = openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)
    want = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=WEATHER_ASK, temperature=0, max_tokens=64, parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls[0]
    ask = {"model": DEFAULT_MODEL, "max_tokens": 64, "messages": WEATHER_ASK, "extra_body": ZERO,
           "tools": [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}],
           "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    whole = claude.messages.create(**ask)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    use = whole.content[0]
    assert use.name == "get_weather" and use.input == json.loads(want.function.arguments)
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (use.name, use.input)]

    result = [*WEATHER_ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": use.name,
                                                                "input": use.input}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                            "content": "22 degrees and sunny"}]}]
    answered = claude.messages.create(**(ask | {"messages": result, "tool_choice": {"type": "auto"}}))
    history = [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]
    same = client.chat.completions.create(model=DEFAULT_MODEL, messages=history, temperature=0, max_tokens=64,
                                          tools=[{"type": "function", "function": {
                                              "name": "get_weather", "description": "The weather in a city.",
                                              "parameters": WEATHER}}])
    assert answered.usage.input_tokens == same.usage.prompt_tokens
    assert answered.usage.output_tokens == same.usage.completion_tokens


@pytest.mark.parametrize("kwargs, error, names", [
    ({"extra_body": {"temperature": 1.5}}, anthropic.BadRequestError, "temperature"),
    ({"max_tokens": 10**6}, anthropic.BadRequestError, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, anthropic.BadRequestError,
     "messages[0].content"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, anthropic.BadRequestError,
     "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     anthropic.BadRequestError, "tool_choice.name"),
    ({"messages": [*ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]},
     anthropic.BadRequestError, "messages[1].content[0].tool_use_id"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}, anthropic.BadRequestError,
     "output_config.format.schema"),
    ({"model": "no-such-model"}, anthropic.NotFoundError, "no-such-model"),
])
def test_anthropic_errors_in_anthropics_shape(claude, kwargs, error, names):
    with pytest.raises(error) as e:
        claude.messages.create(**({"model": DEFAULT_MODEL, "max_tokens": 4, "messages": ASK} | kwargs))
    body = e.value.body
    assert body["type"] == "error" and names in body["error"]["message"]
    assert body["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[e.value.status_code]


def test_anthropic_keys_as_x_api_key_and_its_refusal(api):
    ask = {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": ASK}
    assert httpx.post(api + "/v1/messages", json=ask, headers={"x-api-key": KEY}, timeout=120).status_code == 200
    r = httpx.post(api + "/v1/messages", json=ask, headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(api + "/v1/messages", json={"model": DEFAULT_MODEL, "messages": ASK},
                         headers={"x-api-key": KEY})
    assert missing.status_code == 400 and "max_tokens" in json.loads(missing.text)["error"]["message"]


@pytest.fixture(scope="module")
def swarm_api(home, tmp_path_factory):
    keys = tmp_path_factory.mktemp("swarm")
    with Procs(home) as procs:
        boot = procs.start("sentinel", "--identity", str(keys / "sentinel.key"),
                           "--listen", "/ip4/127.0.0.1/tcp/0").readline(timeout=120)
        common = ["--bootstrap", boot, "--listen", "/ip4/127.0.0.1/tcp/0"]
        procs.start("join", "--identity", str(keys / "peer.key"), "--blocks", "1:30", *common).read_until(
            "serving", timeout=300)
        api = procs.start("api", *common[:2], "--listen", "127.0.0.1:0", "--max-tokens", "32", "--wait", "60",
                          "--no-trust", "--no-speculate")  # one plain answer to compare, whoever asks
        yield api.read_until("listening on", timeout=300)[-1].split()[-1]


@pytest.mark.timeout(900)
def test_dialects_through_a_swarm_give_the_openai_answer(swarm_api):
    client = openai.OpenAI(base_url=swarm_api + "/v1", api_key="unused", max_retries=0, timeout=300)
    want = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0, max_tokens=LENGTH)
    assert "Paris" in want.choices[0].message.content and want.model_extra["diffuse"]["tokens"]["peers"] > 0
    parts = ollama.Client(host=swarm_api, timeout=300).chat(model=DEFAULT_MODEL, messages=ASK, options=GREEDY,
                                                            stream=True)
    assert "".join(p.message.content for p in parts) == want.choices[0].message.content
    whole = anthropic.Anthropic(base_url=swarm_api, api_key="unused", max_retries=0, timeout=300).messages.create(
        model=DEFAULT_MODEL, max_tokens=LENGTH, messages=ASK, extra_body=ZERO)
    assert whole.content[0].text == want.choices[0].message.content
