"""The router's OpenAI API, driven by the official `openai` client, over fake gRPC workers."""

import json
import random

import httpx
import openai
import pytest

from router_harness import Cluster, codec, harmony_ids, wait_for

MODEL = "gpt-oss-test"

REASONING = "The user greets; answer briefly."
ANSWER = "Hello there! How can I help?"
CHAT_SCRIPT = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
               f"<|channel|>final<|message|>{ANSWER}<|return|>")
TOOL_ARGS = '{"city": "Paris", "unit": "celsius"}'
TOOL_SCRIPT = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               f"{TOOL_ARGS}<|call|>")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string",
                                                             "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
USER = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(script=harmony_ids(CHAT_SCRIPT), max_context=4096)
    yield c
    c.close()


@pytest.fixture
def fresh(cluster):
    cluster.reset(harmony_ids(CHAT_SCRIPT))
    return cluster


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=10)


def _one_of(workers, predicate):
    hits = [w for w in workers if predicate(w)]
    assert len(hits) == 1, f"expected exactly one worker, got {hits}"
    return hits[0]


def test_chat_non_streamed_separates_reasoning_and_drives_the_workers(fresh, client):
    seed = random.randrange(2 ** 63)
    r = client.chat.completions.create(model=MODEL, messages=USER, temperature=0.3, top_p=0.9,
                                       seed=seed, max_tokens=100)
    choice = r.choices[0]
    assert r.id.startswith("chatcmpl-")
    assert choice.message.content == ANSWER
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert REASONING not in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens == len(fresh.script.token_ids)

    # one request id on every worker; the prompt is the Harmony rendering of the messages
    prefill = _one_of(fresh.prefill, lambda w: w.requests)
    decode = _one_of(fresh.decode, lambda w: w.decode_requests)
    (pre,), (dec,), (res,) = prefill.requests, decode.decode_requests, decode.reserve_requests
    assert pre.request_id == dec.request_id == res.request_id == r.id
    rendered = codec().render_chat(USER)
    # the rendered system message carries today's date; compare everything else exactly
    assert len(pre.prompt_token_ids) == r.usage.prompt_tokens == len(rendered)
    assert list(pre.prompt_token_ids[-2:]) == rendered[-2:]  # ... <|start|>assistant
    assert dec.num_prompt_tokens == len(pre.prompt_token_ids) and not dec.generated_token_ids
    assert res.num_prompt_tokens == len(pre.prompt_token_ids) and res.max_new_tokens == 100
    assert pre.placements[0].decode_worker_id == decode.name
    assert dec.first_token_id == fresh.script.token_ids[0]
    for sampling in (pre.sampling, dec.sampling):
        assert sampling.temperature == pytest.approx(0.3) and sampling.top_p == pytest.approx(0.9)
        assert sampling.seed == seed and sampling.max_new_tokens == 100
        assert set(sampling.stop_token_ids) == set(codec().stop_token_ids())
    assert not prefill.cancelled and not decode.cancelled  # finished normally: nothing to cancel


def test_chat_streamed(fresh, client):
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                            stream_options={"include_usage": True})
    content, reasoning, finish, usage, ids = [], [], None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content.append(delta.content)
        if (delta.model_extra or {}).get("reasoning_content"):
            reasoning.append(delta.model_extra["reasoning_content"])
        if chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert "".join(content) == ANSWER
    assert "".join(reasoning) == REASONING
    assert len(content) > 1  # really streamed, in several events
    assert finish == "stop"
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert usage.completion_tokens == len(fresh.script.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_releases_text_that_is_no_header(fresh, client):
    """Noise without a Harmony header (a random-weights model) streams as it comes."""
    words = " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(20))
    fresh.reset(codec().encode(words) + harmony_ids("<|return|>"))
    pieces = []
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append((chunk.choices[0].delta.content, chunk.choices[0].finish_reason))
    assert "".join(p for p, _ in pieces) == words
    assert len(pieces) >= 5  # chunk by chunk, not all at the end


def test_tool_call(fresh, client):
    fresh.reset(harmony_ids(TOOL_SCRIPT))
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert call.id
    assert not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "Need the weather tool."


def test_tool_call_streamed(fresh, client):
    fresh.reset(harmony_ids(TOOL_SCRIPT))
    stream = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
        tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    fragments, finish, content = 0, None, []
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content.append(choice.delta.content)
        for tc in choice.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "the id comes once, first"
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
            fragments += 1
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert calls[0]["arguments"] == TOOL_ARGS
    assert fragments > 1
    assert "".join(content) == ""


def test_multi_turn_tool_result_renders(fresh, client):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                       reasoning_effort="low")
    assert r.choices[0].message.content == ANSWER
    prompt = codec().decode(list(_one_of(fresh.prefill, lambda w: w.requests).requests[0]
                                 .prompt_token_ids))
    assert "Reasoning: low" in prompt and "get_weather" in prompt and '{"temp": 21}' in prompt


def test_stop_string_cuts_content_and_cancels(fresh, client):
    r = client.chat.completions.create(model=MODEL, messages=USER, stop=["How"])
    assert r.choices[0].message.content == "Hello there! "
    assert r.choices[0].finish_reason == "stop"
    rid = r.id
    prefill = _one_of(fresh.prefill, lambda w: w.requests)
    decode = _one_of(fresh.decode, lambda w: w.decode_requests)
    assert wait_for(lambda: rid in decode.cancelled and rid in prefill.cancelled)

    stream = client.chat.completions.create(model=MODEL, messages=USER, stop="there",
                                            stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_length_finish(fresh, client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.content == ""  # still thinking when cut off


def test_completions_text_and_ids(fresh, client):
    text = " Paris is the capital of France. Its river is the Seine."
    ids = codec().encode(text)
    fresh.reset(ids + codec().stop_token_ids()[:1])
    r = client.completions.create(model=MODEL, prompt="The capital of France?", max_tokens=200)
    assert r.id.startswith("cmpl-")
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(codec().encode("The capital of France?"))
    assert r.usage.completion_tokens == len(ids) + 1

    prompt_ids = [random.randrange(1000, 100000) for _ in range(7)]
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4)
    assert r.choices[0].text == codec().decode(ids[:4])
    assert r.choices[0].finish_reason == "length"
    assert any(list(req.prompt_token_ids) == prompt_ids for p in fresh.prefill for req in p.requests)

    r = client.completions.create(model=MODEL, prompt=[prompt_ids, [5, 6, 7]], max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text == codec().decode(ids[:3]) for c in r.choices)
    assert r.usage.prompt_tokens == 10 and r.usage.completion_tokens == 6


def test_completions_streamed_with_multibyte_text(fresh, client):
    text = " Grüße aus Köln — 日本語も大丈夫です 🙂."
    ids = codec().encode(text)
    fresh.reset(ids + codec().stop_token_ids()[:1])
    for chunk_size in (1, 3):
        for d in fresh.decode:
            d.chunk_size = chunk_size
        stream = client.completions.create(model=MODEL, prompt="Say hi", stream=True,
                                           stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
        assert "".join(pieces) == text
        assert "\ufffd" not in "".join(pieces)
        assert finish == "stop" and usage.completion_tokens == len(ids) + 1


def test_streamed_text_with_unicode_line_separators_keeps_one_data_line_per_event(fresh, cluster):
    """U+2028, U+2029 and U+0085 are legal raw in JSON, but line readers that split like
    str.splitlines (httpx's and requests' iter_lines) break a line there: the events escape them,
    so such a reader gets whole JSON data lines and the text back intact."""
    text = " one\u2028two\x85three\u2029four"
    ids = codec().encode(text)
    fresh.reset(ids + codec().stop_token_ids()[:1])
    for d in fresh.decode:
        d.chunk_size = 2
    pieces = []
    body = {"model": MODEL, "prompt": "Say hi", "stream": True}
    with httpx.stream("POST", cluster.base_url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == text


def test_completions_streamed_batch(fresh, client):
    text = " alpha beta gamma delta"
    ids = codec().encode(text)
    fresh.reset(ids + codec().stop_token_ids()[:1])
    stream = client.completions.create(model=MODEL, prompt=[[11, 12], [13, 14, 15], [16]],
                                       stream=True)
    texts, finishes = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: text, 1: text, 2: text}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    request_ids = sorted(r.request_id for p in fresh.prefill for r in p.requests)
    assert len(set(request_ids)) == 3 and all(r.startswith("cmpl-") for r in request_ids)


def test_completions_stop_string(fresh, client):
    text = " one, two, three, four"
    fresh.reset(codec().encode(text) + codec().stop_token_ids()[:1])
    r = client.completions.create(model=MODEL, prompt="Count", stop=[", three", "zzz"])
    assert r.choices[0].text == " one, two"
    assert r.choices[0].finish_reason == "stop"


def test_models_and_health(fresh, cluster):
    models = httpx.get(cluster.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 4096
    health = httpx.get(cluster.base_url + "/health")
    assert health.status_code == 200
    assert health.json()["workers"] == {"prefill": {"routable": 2, "known": 2},
                                        "decode": {"routable": 2, "known": 2}}


def test_metrics_exposed(fresh, client, cluster):
    client.chat.completions.create(model=MODEL, messages=USER)
    text = httpx.get(cluster.base_url + "/metrics").text
    for name in ("pdserve_requests_total", "pdserve_time_to_first_token_seconds_bucket",
                 "pdserve_inter_token_latency_seconds_bucket",
                 "pdserve_e2e_request_latency_seconds_bucket", "pdserve_requests_in_flight",
                 "pdserve_worker_queued_requests", "pdserve_worker_running_requests",
                 "pdserve_worker_kv_blocks_used", "pdserve_worker_kv_blocks_total",
                 "pdserve_kv_transfer_bytes_bucket", "pdserve_kv_transfer_seconds_bucket",
                 "pdserve_worker_healthy", "pdserve_prompt_tokens_total",
                 "pdserve_generation_tokens_total"):
        assert name in text, name
    assert 'pdserve_requests_total{endpoint="chat_completions",status="200"}' in text
    assert 'pdserve_worker_healthy{role="decode",worker="%s"} 1.0' % cluster.decode[0].address in text
    ttft_count = [line for line in text.splitlines()
                  if line.startswith("pdserve_time_to_first_token_seconds_count")]
    assert ttft_count and float(ttft_count[0].split()[-1]) >= 1
