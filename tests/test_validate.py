"""Decoded values checked into typed structs (diffuse/validate.py): failures name the field and
the problem, for peer records, evidence and API requests alike."""

from __future__ import annotations

import msgspec
import pytest

from diffuse.api.schema import BadRequest, parse_messages, parse_options, parse_prompts
from diffuse.validate import Count, Hash, Malformed, Text, convert


class Thing(msgspec.Struct, forbid_unknown_fields=True):
    n: Count
    names: list[Text] = []
    data: dict[str, int] = {}
    digest: Hash = bytes(32)


@pytest.mark.parametrize("value, field, reason", [
    ({"n": -1}, "n", "expected `int` >= 0"),
    ({}, "n", "required but missing"),
    ({"n": 1, "x": 2}, "x", "not a known field"),
    ({"n": True}, "n", "expected `int`, got `bool`"),
    ({"n": 1, "names": ["a", 3]}, "names[1]", "expected `str`, got `int`"),
    ({"n": 1, "names": ["a" * 257]}, "names[0]", "expected `str` of length <= 256"),
    ({"n": 1, "data": {1: 2}}, "data", "a key: expected `str`, got `int`"),
    ({"n": 1, "digest": "00" * 32}, "digest", "expected `bytes`, got `str`"),  # never base64 from text
    ([1], None, "expected `object`, got `array`"),
])
def test_failures_name_the_field_and_the_problem(value, field, reason):
    with pytest.raises(Malformed) as e:
        convert(value, Thing)
    assert (e.value.field, e.value.reason) == (field, reason)
    assert str(e.value) == (f"{field}: {reason}" if field else reason)


def test_a_value_of_its_shape_converts_exactly():
    got = convert({"n": 3, "names": ["a"], "data": {"k": -1}, "digest": b"\x01" * 32}, Thing)
    assert got == Thing(3, ["a"], {"k": -1}, b"\x01" * 32)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("change, param", [
    ({"temperature": 5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 9}, "n"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"model": ""}, "model"),
    ({"model": None}, "model"),
    ({"echo": True}, "echo"),
])
def test_bad_options_are_400s_naming_the_field(change, param):
    with pytest.raises(BadRequest) as e:
        parse_options(CHAT | change, 16, 8)
    assert e.value.param == param and param.split(".")[0] in str(e.value)


def test_null_fields_are_absent_ones_and_defaults_apply():
    o = parse_options(CHAT | {"temperature": None, "stop": "x", "max_tokens": 5, "stream": None}, 16, 8)
    assert (o.params.temperature, o.params.top_p, o.params.stop, o.params.max_tokens) == (1.0, 1.0, ["x"], 5)
    assert o.max_tokens_given and (o.n, o.stream, o.include_usage) == (1, False, False)
    assert parse_options(CHAT, 16, 8).params.max_tokens == 16 and not parse_options(CHAT, 16, 8).max_tokens_given


def test_messages_and_prompts():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse_messages({"messages": [{"role": "developer", "content": parts}, {"role": "assistant"}]}) == [
        {"role": "system", "content": "ab"}, {"role": "assistant", "content": ""}]
    assert parse_prompts({"prompt": "a"}) == ["a"] and parse_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "wizard"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content[0].type")]:
        with pytest.raises(BadRequest) as e:
            parse_messages(body)
        assert e.value.param == param
    with pytest.raises(BadRequest) as e:
        parse_prompts({"prompt": [1]})
    assert e.value.param == "prompt[0]"
