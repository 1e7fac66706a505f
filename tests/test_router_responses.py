"""The Responses API (`/v1/responses`), driven by the official `openai` client over fake workers."""

import json
import random

import httpx
import openai
import pytest

from pdserve.router.responses import ResponseStore, StoredResponse
from router_harness import Cluster, codec, harmony_ids, wait_for
from test_router_errors import assert_error

MODEL = "gpt-oss-test"
REASONING = "The user greets; answer briefly."
ANSWER = "Hello there! How can I help?"
CHAT_SCRIPT = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
               f"<|channel|>final<|message|>{ANSWER}<|return|>")
TOOL_ARGS = '{"city": "Paris"}'
TOOL_SCRIPT = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               f"{TOOL_ARGS}<|call|>")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, script=harmony_ids(CHAT_SCRIPT), max_context=4096)
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


def prompt_text(cluster, index: int = -1) -> str:
    return codec().decode(list(cluster.prefill[0].requests[index].prompt_token_ids))


def test_plain_response_returns_reasoning_and_message(fresh, client):
    word = random.choice(["tersely", "kindly", "in French"])
    r = client.responses.create(model=MODEL, input="Hi!", instructions=f"Answer {word}.",
                                reasoning={"effort": "low"}, temperature=0.5)
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING
    assert r.output_text == ANSWER
    assert r.usage.output_tokens == len(fresh.script.token_ids)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.usage.input_tokens == len(fresh.prefill[0].requests[0].prompt_token_ids)
    prompt = prompt_text(fresh)
    assert f"Answer {word}." in prompt and "Reasoning: low" in prompt and "Hi!" in prompt
    assert fresh.decode[0].decode_requests[0].sampling.temperature == pytest.approx(0.5)


def test_streamed_response_events(fresh, client):
    events = list(client.responses.create(model=MODEL, input="Hi!", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (text, reasoning) == (ANSWER, REASONING)
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    assert sum(t == "response.output_text.delta" for t in types) > 1  # really streamed
    final = events[-1].response
    assert final.output_text == ANSWER and final.usage.output_tokens == len(fresh.script.token_ids)
    done = [e for e in events if e.type == "response.output_text.done"]
    assert done[0].text == ANSWER and done[0].item_id == final.output[1].id


def test_the_sdk_stream_helper_accumulates_the_events(fresh, client):
    with client.responses.stream(model=MODEL, input="Hi!") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == ANSWER


def test_function_tool_call_and_its_result(fresh, client):
    fresh.reset(harmony_ids(TOOL_SCRIPT))
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == json.loads(TOOL_ARGS)
    assert calls[0].call_id.startswith("call_")
    assert "get_weather" in prompt_text(fresh)
    # the client runs the tool and sends back the conversation with its output
    temperature = random.randint(-10, 35)
    fresh.reset(harmony_ids(CHAT_SCRIPT))
    follow = client.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"}, *[i.model_dump() for i in r.output],
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": json.dumps({"temp_c": temperature})}])
    assert follow.output_text == ANSWER
    prompt = prompt_text(fresh)
    assert f'"temp_c": {temperature}' in prompt and "Need the weather tool." in prompt


def test_function_call_streamed(fresh, client):
    fresh.reset(harmony_ids(TOOL_SCRIPT))
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],
                                          tool_choice="required", stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == TOOL_ARGS and len(done) == 1
    assert (done[0].name, done[0].arguments) == ("get_weather", TOOL_ARGS)
    added = [e.item for e in events if e.type == "response.output_item.added"
             and e.item.type == "function_call"]
    assert added[0].id == done[0].item_id and added[0].name == "get_weather"
    assert "You must call at least one" in prompt_text(fresh)


def test_previous_response_id_continues_a_stored_response(fresh, client):
    secret = f"my number is {random.randrange(10 ** 6)}"
    first = client.responses.create(model=MODEL, input=secret, store=True,
                                    instructions="first instructions")
    assert client.responses.retrieve(first.id).output_text == ANSWER
    second = client.responses.create(model=MODEL, input="What did I say?",
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id
    prompt = prompt_text(fresh)
    assert secret in prompt and ANSWER in prompt and "What did I say?" in prompt
    assert "first instructions" not in prompt  # instructions do not carry over
    # a response not stored cannot be continued or fetched
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="again", previous_response_id=second.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_max_output_tokens_makes_an_incomplete_response(fresh, client):
    r = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4


def test_benchmark_extensions_ignore_eos_exact_length(fresh):
    """guidellm sends ignore_eos (and stop: null) for exact output lengths."""
    n = random.randint(3, len(fresh.script.token_ids) - 2)
    r = post(fresh, {"model": MODEL, "input": "Hi!", "max_output_tokens": n, "ignore_eos": True,
                     "stop": None, "min_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == n and r.json()["status"] == "incomplete"
    sampling = fresh.decode[0].decode_requests[0].sampling
    assert sampling.ignore_eos and sampling.min_tokens == 2 and not sampling.stop_token_ids


def post(cluster, body):
    return httpx.post(cluster.base_url + "/v1/responses", json=body, timeout=10)


@pytest.mark.parametrize("overrides,param", [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "1"}]},
     "input"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"stop": ["x"]}, "stop"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
])
def test_invalid_or_unsupported_requests_are_400(fresh, overrides, param):
    body = {"model": MODEL, "input": "Hi!", **overrides}
    error = assert_error(post(fresh, body), 400)
    assert error["param"] is not None and error["param"].startswith(param), error
    assert "valid string" not in error["message"].split(";")[0], error  # the telling alternative
    assert not fresh.prefill[0].requests


def test_the_plain_text_format_is_accepted(fresh):
    r = post(fresh, {"model": MODEL, "input": "Hi!", "text": {"format": {"type": "text"}}})
    assert r.status_code == 200, r.text


def test_store_is_bounded_in_count_size_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=3, ttl=60.0, max_chars=1000, clock=lambda: now[0])
    ids = [f"resp_{i}" for i in range(5)]
    for rid in ids:
        assert store.put(rid, StoredResponse({"id": rid}, [], chars=100))
        now[0] += 1
    assert len(store) == 3 and store.get(ids[0]) is None and store.get(ids[4]) is not None
    now[0] += 57.5  # ids[2] was stored at t=2: 60.5 s ago, ids[3] 59.5 s ago
    assert store.get(ids[2]) is None and store.get(ids[3]) is not None
    now[0] += 2
    assert len(store) == 0
    sizes = [random.randint(100, 600) for _ in range(6)]
    for i, chars in enumerate(sizes):
        store.put(f"big_{i}", StoredResponse({}, [], chars=chars))
        kept = [j for j in range(i + 1) if store.get(f"big_{j}") is not None]
        assert sum(sizes[j] for j in kept) <= 1000 and kept == list(range(kept[0], i + 1))
    assert not store.put("huge", StoredResponse({}, [], chars=1001)) and store.get("huge") is None


def test_a_worker_dying_mid_stream_fails_the_response():
    cluster = Cluster(num_prefill=1, num_decode=1, script=harmony_ids(CHAT_SCRIPT))
    try:
        cluster.decode[0].die_after_chunks = 1
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(model=MODEL, input="Hi!", stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.failed"
        assert events[-1].response.status == "failed"
        assert events[-1].response.error.code == "decode_failed"
        gauge = cluster.router.router.metrics.in_flight.labels("responses")
        assert wait_for(lambda: cluster.router.call(lambda: gauge._value.get()) == 0)
    finally:
        cluster.close()


def test_random_item_sequences_render_every_turn_in_order(rng):
    """Input items -> chat messages -> Harmony prompt: user text, calls, their outputs and answers
    all land in the prompt, in order (reasoning before the last answer is dropped, by design)."""
    from pdserve.router.responses import _ITEMS, to_chat_messages

    for _ in range(30):
        items, expected, calls = [], [], 0
        for turn in range(rng.randint(1, 4)):
            question = f"question {turn} {rng.randrange(10 ** 6)}"
            items.append({"role": "user", "content": question})
            expected.append(question)
            if rng.random() < 0.5:
                items.append({"type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": "thinking"}]})
            for _ in range(rng.randint(0, 2)):
                calls += 1
                args, result = f'{{"n": {calls}}}', f"result {calls} {rng.randrange(10 ** 6)}"
                items.append({"type": "function_call", "call_id": f"call_{calls}",
                              "name": "get_weather", "arguments": args})
                items.append({"type": "function_call_output", "call_id": f"call_{calls}",
                              "output": result})
                expected += [args, result]
            answer = f"answer {turn} {rng.randrange(10 ** 6)}"
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": answer}]})
            expected.append(answer)
        messages = to_chat_messages("be brief", _ITEMS.validate_python(items))
        prompt = codec().decode(codec().render_chat(messages, tools=[
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}]))
        position = prompt.index("be brief")
        for text in expected:
            position = prompt.index(text, position) + len(text)
