"""Every bad input and every back-pressure state leaves as an OpenAI error with the right status."""

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_harness import Cluster, RouterThread, harmony_ids, wait_for

MODEL = "gpt-oss-test"
SCRIPT = "<|channel|>final<|message|>ok<|return|>"
USER = [{"role": "user", "content": "Hi!"}]
MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(script=harmony_ids(SCRIPT), max_context=MAX_CONTEXT)
    yield c
    c.close()


@pytest.fixture
def fresh(cluster):
    cluster.reset()
    return cluster


def post(cluster, path, body=None, content=None):
    return httpx.post(cluster.base_url + path, json=body, content=content, timeout=10,
                      headers={"Content-Type": "application/json"})


def assert_error(response, status, *, param=None, code=None, retry_after=False):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if retry_after:
        assert int(response.headers["Retry-After"]) >= 1
    return error


def chat(**overrides):
    return {"model": MODEL, "messages": USER, **overrides}


BAD_CHAT = [
    ({"messages": USER}, "model"),
    ({"model": MODEL}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    (chat(messages=[{"role": "user"}]), "messages.0"),
    (chat(messages=[{"role": "tool", "content": "x"}]), "messages.0"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=-3), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(temperature=3.5), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(n=0), "n"),
    (chat(n=65), "n"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
     "tools.0.function.name"),
    (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}]),
     "tools.0.function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools.0.function.parameters"),
    (chat(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(frequency_penalty=2.5), "frequency_penalty"),
    (chat(presence_penalty=-2.01), "presence_penalty"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logit_bias={"12": 101}), "logit_bias"),
    (chat(logit_bias={"hello": 1}), "logit_bias"),
    (chat(logit_bias={"201088": 1}), "logit_bias"),
    (chat(stop_token_ids=[-1]), "stop_token_ids"),
    (chat(min_tokens=-1), "min_tokens"),
    (chat(min_tokens=9, max_tokens=8), "min_tokens"),
    (chat(reasoning_effort="extreme"), "reasoning_effort"),
    (chat(messages=[{"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "call_unknown", "content": "42"}]), "messages"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_invalid_chat_requests_are_400(fresh, body, param):
    assert_error(post(fresh, "/v1/chat/completions", body), 400, param=param)
    assert not any(p.requests for p in fresh.prefill)  # rejected before any worker saw it


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [1, -5]}, "prompt"),
    ({"model": MODEL, "prompt": [10 ** 7]}, "prompt"),
    ({"model": MODEL, "prompt": "a <|start|> b"}, "prompt"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_invalid_completion_requests_are_400(fresh, body, param):
    assert_error(post(fresh, "/v1/completions", body), 400, param=param)


def test_malformed_json_is_400(fresh):
    error = assert_error(post(fresh, "/v1/chat/completions", content=b'{"model": "x", '), 400)
    assert error["type"] == "invalid_request_error"
    assert_error(post(fresh, "/v1/completions", content=b"\xff\xfe"), 400)
    assert_error(post(fresh, "/v1/chat/completions", content=b"[1, 2]"), 400)


def test_unknown_model_is_404(fresh):
    assert_error(post(fresh, "/v1/chat/completions", chat(model="gpt-5")), 404, param="model",
                 code="model_not_found")
    assert_error(post(fresh, "/v1/completions", {"model": "llama", "prompt": "x"}), 404)
    client = openai.OpenAI(base_url=fresh.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)


def test_prompt_over_the_context_is_400(fresh):
    long_prompt = [{"role": "user", "content": "word " * (MAX_CONTEXT + 50)}]
    assert_error(post(fresh, "/v1/chat/completions", chat(messages=long_prompt)), 400,
                 param="messages", code="context_length_exceeded")
    # prompt fits, but prompt + explicit max_tokens does not
    assert_error(post(fresh, "/v1/completions", {"model": MODEL, "prompt": list(range(1, 400)),
                                                "max_tokens": 200}),
                 400, param="max_tokens", code="context_length_exceeded")
    # without max_tokens the budget is capped by what the context leaves
    r = post(fresh, "/v1/completions", {"model": MODEL, "prompt": list(range(1, 400))})
    assert r.status_code == 200
    reserve = next(d for d in fresh.decode if d.reserve_requests).reserve_requests[0]
    assert reserve.num_prompt_tokens + reserve.max_new_tokens == MAX_CONTEXT


def test_no_kv_blocks_is_429(fresh):
    for d in fresh.decode:
        d.exhausted = True
    # the router learns it from the next load reports; then refuses without calling Reserve
    assert wait_for(lambda: fresh.router.call(
        lambda: all(w.free_kv_blocks == 0 for w in fresh.router.router.registry.workers("decode"))))
    error = assert_error(post(fresh, "/v1/chat/completions", chat()), 429, retry_after=True)
    assert error["type"] == "rate_limit_error"
    client = openai.OpenAI(base_url=fresh.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=USER)
    for d in fresh.decode:
        d.exhausted = False
    assert wait_for(lambda: post(fresh, "/v1/chat/completions", chat()).status_code == 200)


def test_all_reservations_refused_is_429(fresh):
    """Load reports say there is room, but every Reserve refuses: back-pressure, not an error."""
    for d in fresh.decode:
        d.refuse_reserve = True
    assert_error(post(fresh, "/v1/chat/completions", chat()), 429, code="kv_cache_full",
                 retry_after=True)
    assert all(len(d.reserve_requests) == 1 for d in fresh.decode)  # each tried once
    assert not any(p.requests for p in fresh.prefill)


def test_full_prefill_queues_are_429(fresh):
    for p in fresh.prefill:
        p.mode = "exhausted"
    assert_error(post(fresh, "/v1/chat/completions", chat()), 429, code="queue_full",
                 retry_after=True)
    assert all(len(p.requests) == 1 for p in fresh.prefill)  # each tried once
    # the reservation made for it is given back
    decode = next(d for d in fresh.decode if d.reserve_requests)
    rid = decode.reserve_requests[0].request_id
    assert wait_for(lambda: rid in decode.cancelled)


def test_no_healthy_workers_is_503():
    router = RouterThread(prefill=["127.0.0.1:1"], decode=["127.0.0.1:2"])
    try:
        health = httpx.get(router.base_url + "/health")
        assert health.status_code == 503 and int(health.headers["Retry-After"]) >= 1
        r = httpx.post(router.base_url + "/v1/chat/completions", json=chat())
        error = assert_error(r, 503, code="no_healthy_workers", retry_after=True)
        assert "prefill" in error["message"]
        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="hi")
        assert info.value.status_code == 503
        channel = grpc.insecure_channel(router.grpc_address)
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=5).status
        channel.close()
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        router.close()


def test_unknown_route_is_openai_shaped_404(fresh):
    r = httpx.get(fresh.base_url + "/v1/nope")
    assert_error(r, 404)
