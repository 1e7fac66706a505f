"""Structured outputs through the whole system (router, prefill and decode worker processes) with
the official `openai` client on the tiny random model: whatever the random weights sample, every
answer parses and validates against its schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from test_sampling_e2e import client, cluster  # noqa: F401 (fixtures: a tiny cluster, its openai client)

pytestmark = pytest.mark.slow

MODEL = "gpt-oss"
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                      "scores": {"type": "array", "items": {"type": "number"}}},
     "required": ["tags", "scores"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "address": {"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"], "additionalProperties": False}},
        "required": ["id", "address"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "answer in JSON"}],
                                          seed=random.getrandbits(63), **kw)


def test_every_json_schema_answer_validates(client):
    for schema in SCHEMAS:
        budget = random.choice([40, 80, 160])
        r = _chat(client, n=1, max_tokens=budget, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert r.usage.completion_tokens <= budget


def test_a_streamed_answer_validates(client):
    schema = SCHEMAS[3]
    stream = _chat(client, max_tokens=100, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_forced_tool_calls(client):
    r = _chat(client, max_tokens=60, n=3, response_format={"type": "json_object"})
    assert len(r.choices) == 3  # each choice with its own matcher
    for choice in r.choices:
        assert isinstance(json.loads(choice.message.content), dict)
    for choice, tool in (({"type": "function", "function": {"name": "get_weather"}}, WEATHER), ("required", None)):
        r = _chat(client, max_tokens=80, tools=[WEATHER, TIME], tool_choice=choice)
        [call] = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
        assert tool is None or call.function.name == tool["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_responses_text_format(client):
    schema = SCHEMAS[1]
    r = client.responses.create(model=MODEL, input="answer in JSON", max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    tool = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(model=MODEL, input="weather?", max_output_tokens=80, tools=[tool],
                                tool_choice="required")
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])


def test_an_invalid_schema_is_a_400_naming_the_problem(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "minLength": "three"}}}}})
    assert "minLength" in str(e.value) and "response_format" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"response_format": {"type": "json_object"}})
    assert "response_format" in str(e.value)
