"""Hostile or malformed input is a 4xx with an OpenAI error body, counted, never a 500.

Repros of issue 13: lone surrogates, JSON nested 100k deep, megabytes of one character, loosely
typed fields, and fields that would change the output but are not honoured.
"""

import json
import random

import httpx
import pytest

from pdserve.router.harmony import HarmonyError, _tokenizer_errors
from pdserve.router.request_limits import MAX_JSON_DEPTH, MAX_RUN_CHARS
from router_harness import Cluster, harmony_ids
from test_router_errors import assert_error

MODEL = "gpt-oss-test"
SCRIPT = "<|channel|>final<|message|>ok<|return|>"
USER = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, script=harmony_ids(SCRIPT), max_context=4096)
    yield c
    c.close()


@pytest.fixture
def fresh(cluster):
    cluster.reset()
    return cluster


def post(cluster, path, *, body=None, content=None):
    if body is not None:
        content = json.dumps(body)
    return httpx.post(cluster.base_url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json"})


def chat(**overrides):
    return {"model": MODEL, "messages": USER, **overrides}


def count(cluster, endpoint, status) -> float:
    text = httpx.get(cluster.base_url + "/metrics").text
    line = f'pdserve_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    return next((float(s.removeprefix(line)) for s in text.splitlines() if s.startswith(line)), 0.0)


def test_lone_surrogate_is_400_and_a_pair_is_fine(fresh):
    lone = random.choice(["\\ud800", "\\udbff", "\\udc00", "\\udfff"])
    raw = '{"model": "%s", "messages": [{"role": "user", "content": "a%sb"}]}' % (MODEL, lone)
    before = count(fresh, "chat_completions", 400)
    assert_error(post(fresh, "/v1/chat/completions", content=raw), 400, param="messages",
                 code="invalid_unicode")
    assert count(fresh, "chat_completions", 400) == before + 1
    raw = '{"model": "%s", "prompt": "x%sy"}' % (MODEL, lone)
    assert_error(post(fresh, "/v1/completions", content=raw), 400, param="prompt")
    pair = '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud83d\\ude00b"}]}' % MODEL
    assert post(fresh, "/v1/chat/completions", content=pair).status_code == 200
    assert not fresh.prefill[0].requests[1:]  # only the valid one reached a worker


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_is_400(fresh, depth):
    raw = '{"model": "%s", "messages": %s}' % (MODEL, "[" * depth + "]" * depth)
    assert_error(post(fresh, "/v1/chat/completions", content=raw), 400, code="invalid_json")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/tokenize", "/detokenize"])
def test_an_integer_literal_past_pythons_digit_limit_is_400(fresh, path):
    """json.loads raises a plain ValueError (not JSONDecodeError) for an int of more than 4300
    digits."""
    raw = '{"model": "%s", "max_tokens": 1%s}' % (MODEL, "0" * 5000)
    assert_error(post(fresh, path, content=raw), 400, code="invalid_json")


def test_a_nested_tool_schema_within_the_bound_is_fine(fresh):
    schema = {"type": "object", "properties": {}}
    inner = schema
    for _ in range(8):
        child = {"type": "object", "properties": {}}
        inner["properties"]["x"] = child
        inner = child
    r = post(fresh, "/v1/chat/completions", body=chat(tools=[
        {"type": "function", "function": {"name": "f", "parameters": schema}}]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("size", [100_000, 1_000_000])
def test_a_long_run_of_one_character_is_400_without_tokenizing(fresh, size):
    char = random.choice("aZé ._=-")
    text = char * size
    assert_error(post(fresh, "/v1/chat/completions",
                      body=chat(messages=[{"role": "user", "content": text}])), 400,
                 param="messages")
    assert_error(post(fresh, "/v1/completions", body={"model": MODEL, "prompt": "hi " + text}),
                 400, param="prompt")
    assert not fresh.prefill[0].requests


def test_a_run_at_the_bound_is_tokenized(fresh):
    r = post(fresh, "/v1/completions", body={"model": MODEL, "prompt": "a" * MAX_RUN_CHARS,
                                            "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < MAX_RUN_CHARS


def test_too_much_text_is_400(fresh):
    words = " ".join(random.choice(["alpha", "beta", "gamma"]) for _ in range(200_000))
    assert len(words) > 1 << 20
    assert_error(post(fresh, "/v1/completions", body={"model": MODEL, "prompt": words}), 400,
                 param="prompt", code="context_length_exceeded")


def test_a_body_over_the_size_limit_is_413_and_counted(fresh):
    before = count(fresh, "completions", 413)
    text = random.choice("ab") * (10 << 20)
    error = assert_error(post(fresh, "/v1/completions", body={"model": MODEL, "prompt": text}),
                         413, code="request_too_large")
    assert error["type"] == "invalid_request_error"
    assert count(fresh, "completions", 413) == before + 1


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", 2.0), ("max_tokens", "5"), ("stream", "yes"),
    ("stream", 1), ("temperature", True), ("temperature", "0.5"), ("seed", False),
    ("n", "1"), ("top_k", True), ("logprobs", "false"), ("max_completion_tokens", True),
])
def test_loosely_typed_fields_are_400(fresh, field, value):
    assert_error(post(fresh, "/v1/chat/completions", body=chat(**{field: value})), 400,
                 param=field)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat(top_k=2 ** 31)),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": 10 ** 30}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "top_k": 2 ** 40}),
])
def test_a_top_k_past_what_the_workers_take_is_400(fresh, path, body):
    """top_k travels to the workers as an int32: a larger one is the client's error, not a 500."""
    assert_error(post(fresh, path, body=body), 400, param="top_k")
    assert not fresh.prefill[0].requests


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat(stream_options={"include_usage": True})),
    ("/v1/chat/completions", chat(stream=False, stream_options={"include_usage": True})),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {}}),
])
def test_stream_options_without_stream_is_400(fresh, path, body):
    """As OpenAI: stream_options is only allowed when stream is enabled."""
    error = assert_error(post(fresh, path, body=body), 400, param="stream_options")
    assert "stream" in error["message"]
    assert not fresh.prefill[0].requests


@pytest.mark.parametrize("key", ["²", "１", "٣", "⑦"])
def test_logit_bias_keys_of_non_ascii_digits_are_400(fresh, key):
    """str.isdigit() holds for superscripts, full-width and Arabic-Indic digits, which int()
    refuses or reads as another id: token ids are ASCII digits."""
    for path, body in (("/v1/chat/completions", chat(logit_bias={key: 5})),
                       ("/v1/responses", {"model": MODEL, "input": "hi", "logit_bias": {key: 5}})):
        assert_error(post(fresh, path, body=body), 400, param="logit_bias")
    assert not fresh.prefill[0].requests


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat(**dict.fromkeys([
        "temperature", "top_p", "n", "stream", "logprobs", "top_logprobs", "presence_penalty",
        "frequency_penalty", "seed", "stop", "max_tokens", "max_completion_tokens", "top_k",
        "min_tokens", "ignore_eos", "stream_options", "tool_choice", "response_format"]))),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", **dict.fromkeys([
        "temperature", "top_p", "n", "stream", "echo", "logprobs", "presence_penalty",
        "frequency_penalty", "seed", "stop", "max_tokens", "suffix", "best_of"])}),
    ("/v1/responses", {"model": MODEL, "input": "hi", **dict.fromkeys([
        "temperature", "top_p", "stream", "store", "max_output_tokens", "instructions",
        "previous_response_id", "tool_choice", "text", "reasoning"])}),
])
def test_null_is_the_default_of_a_nullable_field(fresh, path, body):
    """OpenAI's API declares these fields nullable, null meaning the default, and clients send
    them so (openai-python passes `temperature=None` on as null)."""
    r = post(fresh, path, body=body)
    assert r.status_code == 200, r.text
    sampling = fresh.prefill[0].requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.n) == (1.0, 1.0, 1)


def test_strict_types_still_take_ints_for_floats(fresh):
    r = post(fresh, "/v1/chat/completions", body=chat(temperature=1, top_p=1, max_tokens=5))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field,value", [
    ("min_p", 0.1),
    ("repetition_penalty", 1.2),
    ("functions", [{"name": "f"}]),
    ("guided_json", {"type": "object"}),
    ("verbosity", "low"),
])
def test_fields_that_would_change_the_output_and_are_not_honoured_are_400(fresh, field, value):
    for path, body in (("/v1/chat/completions", chat(**{field: value})),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi", field: value})):
        error = assert_error(post(fresh, path, body=body), 400, param=field,
                             code="unsupported_parameter")
        assert field in error["message"]
    assert not fresh.prefill[0].requests


def test_completions_take_no_response_format(fresh):
    error = assert_error(post(fresh, "/v1/completions", body={"model": MODEL, "prompt": "hi",
                                                              "response_format": {"type": "json_object"}}),
                         400, param="response_format", code="unsupported_parameter")
    assert "response_format" in error["message"]


@pytest.mark.parametrize("value,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}, "unclosed group"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}, "does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "schema"),
    ({"type": "xml"}, "'xml'"),
])
def test_invalid_response_formats_are_400_naming_the_problem(fresh, value, needle):
    error = assert_error(post(fresh, "/v1/chat/completions", body=chat(response_format=value)), 400)
    assert error["param"].startswith("response_format") and needle in error["message"], error
    assert not fresh.prefill[0].requests


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
])
def test_a_json_schema_format_without_its_schema_is_400(fresh, path, body, param):
    """OpenAI requires the schema of a json_schema format; without one any JSON would pass."""
    error = assert_error(post(fresh, path, body=body), 400, param=param,
                         code="missing_required_parameter")
    assert param in error["message"]
    assert not fresh.prefill[0].requests


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 3}])
def test_structured_outputs_refuse_rules_that_fight_the_end_of_the_turn(fresh, extra):
    error = assert_error(post(fresh, "/v1/chat/completions", body=chat(
        response_format={"type": "json_object"}, **extra)), 400, param=next(iter(extra)))
    assert "structured output" in error["message"]


def test_neutral_values_of_unhonoured_fields_are_accepted(fresh):
    r = post(fresh, "/v1/chat/completions", body=chat(
        response_format={"type": "text"}, logit_bias={}, top_logprobs=0, ignore_eos=False,
        user="someone", metadata={"k": "v"}))
    assert r.status_code == 200, r.text


class PanicException(BaseException):
    """Stands in for pyo3's PanicException (openai-harmony's Rust panics)."""


def test_tokenizer_panics_and_value_errors_become_400_errors():
    for failure in (PanicException("index out of bounds"), ValueError("invalid message JSON")):
        with pytest.raises(HarmonyError) as info:
            with _tokenizer_errors("cannot tokenize", "prompt"):
                raise failure
        assert info.value.param == "prompt"
    with pytest.raises(KeyboardInterrupt):
        with _tokenizer_errors("cannot tokenize", "prompt"):
            raise KeyboardInterrupt


def test_longest_run_matches_a_plain_scan():
    """The vectorised run finder against a character-by-character scan, on fresh random text."""
    from pdserve.router.request_limits import _DIGIT, _class_of, longest_run

    alphabet = "ab c.,é東\n\t🙂𠀀1\u0301_=Z9 "
    for _ in range(200):
        text = "".join(random.choice(alphabet) * random.randint(1, 6)
                       for _ in range(random.randint(1, 60)))
        best = run = 0
        for i, char in enumerate(text):
            run = run + 1 if i and _class_of(char) == _class_of(text[i - 1]) else 1
            if _class_of(char) != _DIGIT:  # digits never form a long piece
                best = max(best, run)
        assert longest_run(text) == best, text


def _junk(rng: random.Random, depth: int = 0):
    kinds = ["null", "bool", "int", "float", "str", "list", "dict"] if depth < 3 else ["int", "str"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {rng.choice(["type", "role", "content", "text", "name", "x"]): _junk(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return {"null": None, "bool": rng.random() < 0.5,
            "int": rng.choice([0, -1, 1, 2 ** 70, rng.randrange(-10 ** 6, 10 ** 6)]),
            "float": rng.choice([0.5, -3.0, 1e308, float(rng.randrange(100))]),
            "str": rng.choice(["", "x", "<|start|>", "é" * rng.randint(1, 50), "true", "1"])}[kind]


@pytest.mark.parametrize("path,valid", [
    ("/v1/chat/completions", chat(max_tokens=3, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}])),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "hi"}],
                       "max_output_tokens": 3, "tools": [{"type": "function", "name": "f",
                                                          "parameters": {"type": "object"}}]}),
    ("/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2]}),
])
def test_random_junk_in_any_field_is_never_a_5xx(fresh, path, valid, rng):
    """Fresh random values (wrong types, nesting, specials) in one field at a time, on every
    endpoint: a 200 or an OpenAI error body with a 4xx, never a server error."""
    for _ in range(25):
        body = json.loads(json.dumps(valid))
        target = body
        field = rng.choice(list(target))
        while isinstance(target[field], (dict, list)) and target[field] and rng.random() < 0.6:
            target = target[field]
            field = rng.randrange(len(target)) if isinstance(target, list) else rng.choice(list(target))
        target[field] = _junk(rng)
        r = post(fresh, path, body=body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
