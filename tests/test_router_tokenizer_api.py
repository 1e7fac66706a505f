"""/tokenize, /detokenize, /tokenizer_info (as vLLM serves them) and the access log."""

import logging
import random
import string

import httpx
import pytest

from router_harness import Cluster, codec, harmony_ids, wait_for
from test_router_errors import assert_error

MODEL = "gpt-oss-test"
MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, script=harmony_ids("<|channel|>final<|message|>ok<|return|>"),
                max_context=MAX_CONTEXT)
    yield c
    c.close()


def post(cluster, path, body, **kwargs):
    return httpx.post(cluster.base_url + path, json=body, timeout=10, **kwargs)


def random_text() -> str:
    return " ".join("".join(random.choices(string.ascii_letters + "äé東京", k=random.randint(1, 9)))
                    for _ in range(random.randint(1, 40)))


def test_tokenize_text_matches_the_completions_encoding(cluster):
    text = random_text()
    r = post(cluster, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == codec().encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_CONTEXT
    assert len(body["token_strs"]) == body["count"]
    assert post(cluster, "/tokenize", {"prompt": text}).json()["token_strs"] is None  # model optional


def test_tokenize_messages_matches_the_chat_rendering(cluster):
    messages = [{"role": "system", "content": random_text()}, {"role": "user", "content": random_text()}]
    r = post(cluster, "/tokenize", {"model": MODEL, "messages": messages, "reasoning_effort": "high"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == codec().render_chat(messages, reasoning_effort="high")
    bare = post(cluster, "/tokenize", {"messages": messages, "reasoning_effort": "high",
                                      "add_generation_prompt": False}).json()["tokens"]
    assert bare + codec().assistant_prompt_ids == r.json()["tokens"]


def test_special_token_text_is_that_token(cluster):
    """lm-eval's remote tokenizer finds the eos id by tokenizing the eos token's text."""
    info = httpx.get(cluster.base_url + "/tokenizer_info").json()
    ids = post(cluster, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert ids.json()["tokens"] == [codec().return_id]


def test_detokenize_round_trip(cluster):
    text = random_text()
    ids = post(cluster, "/tokenize", {"prompt": text}).json()["tokens"]
    assert post(cluster, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 10 ** 7]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens.1"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
])
def test_bad_tokenizer_requests(cluster, path, body, status, param):
    assert_error(post(cluster, path, body), status, param=param)


def test_tokenizer_info(cluster):
    info = httpx.get(cluster.base_url + "/tokenizer_info").json()
    assert info["vocab_size"] == 201088 and info["model_max_length"] == MAX_CONTEXT
    assert info["eos_token"] == "<|return|>" and set(info["eos_token_ids"]) == set(
        codec().stop_token_ids())


def test_access_log_line_per_request_with_the_request_id(cluster, caplog):
    caplog.set_level(logging.DEBUG, logger="pdserve.access")
    mine = f"req-{random.randrange(10 ** 9)}"
    r = post(cluster, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}]}, headers={"X-Request-Id": mine})
    assert r.status_code == 200 and r.headers["x-request-id"] == mine
    missing = httpx.get(cluster.base_url + "/v1/nowhere")
    generated = missing.headers["x-request-id"]
    assert len(generated) == 32 and generated != mine
    bad_id = httpx.get(cluster.base_url + "/health", headers={"X-Request-Id": "a b\tc"})
    assert bad_id.headers["x-request-id"] != "a b\tc"
    def lines(level=logging.DEBUG):  # the line is written just after the response is sent
        return [r.getMessage() for r in caplog.records
                if r.name == "pdserve.access" and r.levelno == level]

    assert wait_for(lambda: any('"GET /health ' in line for line in lines(logging.DEBUG)))
    assert wait_for(lambda: any('"GET /v1/nowhere HTTP/1.1" 404 ' in line and generated in line
                                for line in lines(logging.INFO)))
    assert wait_for(lambda: [line for line in lines(logging.INFO) if f"id={mine}" in line
                             and '"POST /v1/chat/completions HTTP/1.1" 200 ' in line])
