"""Sampling controls and logprobs through the whole system (router, prefill and decode worker
processes, NIXL over TCP) with the official `openai` client, checked against the engine's logits."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.launch.serve import ClusterSpec, LocalCluster
from pdserve.router.harmony import HarmonyCodec
from ports import server_ports
from test_serving_e2e import wait_kv_drained

pytestmark = pytest.mark.slow

MODEL = "gpt-oss"
RETURN = 200002  # <|return|>: a Harmony end-of-turn id


@pytest.fixture(scope="module")
def cluster(tiny_mxfp4, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(),
                       max_batch_size=16, kv_blocks=512)
    with LocalCluster(spec, tmp_path_factory.mktemp("logs")) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def codec():
    return HarmonyCodec()


def _text_ids(n: int) -> list[int]:
    return [random.randrange(1000, 100000) for _ in range(n)]


def _step_logits(runner, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] float32: the raw logits each output token was drawn from, computed on the
    engine's own path, as the workers compute them: a prefill of the prompt, then one decode step a
    token over the KV cache. (A single prefill of the whole sequence rounds differently, and on
    this random model's near-tied routing that now and then picks another expert for one token:
    0.04-0.2 off in about 1 % of requests.)"""
    seq = Sequence("reference", list(prompt), SamplingParams(max_new_tokens=len(output), temperature=0))
    seq.blocks = runner.cache.reserve(seq.max_tokens, len(prompt))
    try:
        rows = [runner.prefill(seq)]
        for t in output[:-1]:
            seq.append(t, (), runner.max_context)
            rows.append(runner.decode([seq])[0])
        return torch.stack(rows).float()
    finally:
        runner.cache.release(seq.blocks)


def _processed_logprobs(runner, ids: list[int], n_prompt: int, p: SamplingParams) -> torch.Tensor:
    """[len(output), V]: the distribution each output token was drawn from, recomputed from the
    engine's logits (`_step_logits`) with OpenAI's penalties, bias and temperature."""
    logits = _step_logits(runner, ids[:n_prompt], ids[n_prompt:])
    out = []
    for i, row in enumerate(logits):
        x = row.clone()
        generated = ids[n_prompt:n_prompt + i]
        for t in set(generated):
            x[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
        for t, b in p.logit_bias.items():
            x[t] += b
        out.append(torch.log_softmax(x / (p.temperature or 1.0), dim=-1))
    return torch.stack(out)


def test_completion_logprobs_with_echo_match_the_engine(client, cluster, tiny_runner, codec):
    """echo + logprobs (what lm-eval's loglikelihood tasks send), with penalties and a bias: the
    tokens equal a single-process run with the same seed, every logprob matches a recomputation
    from the engine's logits, prompt logprobs come from the prefill."""
    prompt = _text_ids(10)
    bias_token = random.randrange(1000, 100000)
    p = SamplingParams(temperature=0.8, seed=random.getrandbits(63), max_new_tokens=6, ignore_eos=True,
                       presence_penalty=1.5, frequency_penalty=0.7, logit_bias={bias_token: 3.0}, logprobs=4)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=p.seed, logprobs=4, echo=True,
        presence_penalty=1.5, frequency_penalty=0.7, logit_bias={str(bias_token): 3.0},
        extra_body={"ignore_eos": True})
    choice = r.choices[0]
    expected = LLMEngine(tiny_runner).generate([prompt], p)[0].output_ids
    lp = choice.logprobs
    assert lp.tokens == [codec.decode([t]) for t in prompt + expected]
    assert choice.text == codec.decode(prompt) + codec.decode(expected)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:2] == [0, len(codec.decode(prompt[:1]))]
    raw = torch.log_softmax(tiny_runner.prompt_logits(prompt), dim=-1)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(float(raw[i - 1, prompt[i]]), abs=2e-3)
        assert len(lp.top_logprobs[i]) in (4, 5)  # the prompt token joins its 4 alternatives
    ref = _processed_logprobs(tiny_runner, prompt + expected, len(prompt), p)
    for i, t in enumerate(expected):
        got = lp.token_logprobs[len(prompt) + i]
        assert got == pytest.approx(float(ref[i, t]), abs=1e-3)
        best = torch.topk(ref[i], 4)
        top = lp.top_logprobs[len(prompt) + i]
        assert max(top.values()) == pytest.approx(float(best.values[0]), abs=1e-3)
    assert r.usage.completion_tokens == 6
    wait_kv_drained(cluster)


def test_max_tokens_0_with_echo_scores_the_prompt_even_when_cached(client):
    """Scoring a prompt twice: the second prefill finds its pages in the prefix cache but must
    still compute every position for the prompt logprobs."""
    prompt = _text_ids(40)
    scores = []
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 40 and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
        scores.append(lp.token_logprobs)
    assert scores[0] == pytest.approx(scores[1], abs=1e-4)


def test_chat_logprobs_streamed_equal_non_streamed_with_usage_in_every_chunk(client, codec):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0.9,
              seed=random.getrandbits(63), logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 9
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6
    streamed, usages = [], []
    for chunk in client.chat.completions.create(stream=True, stream_options={"continuous_usage_stats": True},
                                                **kw):
        usages.append(chunk.usage.completion_tokens)
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert usages == sorted(usages) and usages[-1] == 9


def test_a_bias_of_100_is_always_sampled_and_ignore_eos_gives_max_tokens(client, codec):
    favourite = random.randrange(1000, 100000)
    r = client.completions.create(model=MODEL, prompt=_text_ids(5), max_tokens=6, temperature=1.0,
                                  logit_bias={str(favourite): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [codec.decode([favourite])] * 6
    # +100 on the end-of-turn id: without ignore_eos the first token ends the turn, with it the
    # request runs to exactly max_tokens
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                logit_bias={str(RETURN): 100})
    assert client.chat.completions.create(**chat).usage.completion_tokens == 1
    r = client.chat.completions.create(**chat, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_min_tokens_holds_back_the_end_of_turn(client):
    r = client.completions.create(model=MODEL, prompt=_text_ids(5), max_tokens=10, temperature=1.0,
                                  logit_bias={str(RETURN): 100}, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=_text_ids(5), max_tokens=10, temperature=1.0,
                                  logit_bias={str(RETURN): 100}, extra_body={"stop_token_ids": [RETURN],
                                                                             "ignore_eos": True})
    assert r.usage.completion_tokens == 1


def _prefills(cluster) -> float:
    """Prompts the prefill workers ran, as the router counts them."""
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("pdserve_prefill_compute_seconds_count"))


def test_n_choices_run_one_prefill_and_follow_their_seeds(client, cluster, tiny_runner, codec):
    """n=4: one prefill (router metric), 4 choices; choice i is the stream a single process samples
    with seed + i; the choices' shared KV blocks all come back."""
    prompt = _text_ids(21)
    seed = random.getrandbits(63)
    before = _prefills(cluster)
    r = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=5, temperature=0.9, seed=seed,
                                  logprobs=0, extra_body={"ignore_eos": True})
    assert _prefills(cluster) == before + 1
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    outputs = set()
    for c in r.choices:
        p = SamplingParams(temperature=0.9, seed=(seed + c.index) % 2**64, max_new_tokens=5, ignore_eos=True)
        expected = LLMEngine(tiny_runner).generate([prompt], p)[0].output_ids
        assert c.logprobs.tokens == [codec.decode([t]) for t in expected]
        assert c.finish_reason == "length"
        outputs.add(tuple(expected))
    assert len(outputs) > 1
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 21
    before = _prefills(cluster)
    finishes, usage = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                                max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 18
    assert _prefills(cluster) == before + 1
    wait_kv_drained(cluster)


def test_streamed_completion_logprobs_and_echo_equal_the_whole_response(client):
    prompt = _text_ids(12)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=7, temperature=0.7, seed=random.getrandbits(63), logprobs=2,
              echo=True, n=2, extra_body={"ignore_eos": True})
    whole = {c.index: c for c in client.completions.create(**kw).choices}
    tokens, logprobs, texts = {0: [], 1: []}, {0: [], 1: []}, {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs:
                tokens[c.index] += c.logprobs.tokens
                logprobs[c.index] += c.logprobs.token_logprobs
    for i in (0, 1):
        assert texts[i] == whole[i].text
        assert tokens[i] == whole[i].logprobs.tokens and len(tokens[i]) == 12 + 7
        assert logprobs[i][0] is None and whole[i].logprobs.token_logprobs[0] is None
        assert logprobs[i][1:] == pytest.approx(whole[i].logprobs.token_logprobs[1:], abs=1e-5)


def test_grpc_generate_streams_each_choice_with_its_logprobs(cluster):
    import grpc

    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(temperature=0.8, max_new_tokens=4, ignore_eos=True, n=3, logprobs=1,
                                 seed=random.getrandbits(63))
    got: dict[int, list] = {0: [], 1: [], 2: []}
    finished = set()
    with grpc.insecure_channel(f"127.0.0.1:{cluster.spec.grpc_port}") as ch:
        for msg in pb_grpc.GeneratorStub(ch).Generate(
                pb.GenerateRequest(prompt_token_ids=_text_ids(9), sampling=sampling), timeout=120):
            assert len(msg.logprobs) == len(msg.token_ids)
            got[msg.choice] += [(t, lp.token_id) for t, lp in zip(msg.token_ids, msg.logprobs)]
            if msg.finish_reason:
                finished.add(msg.choice)
    assert finished == {0, 1, 2}
    assert all(len(v) == 4 and all(t == lp for t, lp in v) for v in got.values())
