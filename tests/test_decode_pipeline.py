"""The pipelined decode of LLMEngine (each step launched before the host reads the previous
step's tokens, which feed it on the device) produces exactly what the step-by-step engine does:
same tokens, finish reasons and streamed callbacks, requests joining while a step is in flight,
stop tokens seen one step late, length ends never overrun, every KV block given back.

Runs on the CPU through engine.cuda_graphs' padded static steps (capture=False) with a scripted
bigram checkpoint (tests/scripted_model.py), whose greedy next token has a large margin, so the
padding and batch composition, which differ between the two modes by design, cannot flip a token.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from scripted_model import scripted_graph_runner

SCRIPT = list(range(1000, 1024))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return scripted_graph_runner(tmp_path_factory.mktemp("ckpt") / "pipeline", SCRIPT)


def _run(runner: ModelRunner, pipeline: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    eng = LLMEngine(runner, max_batch_size=4, pipeline=pipeline)
    launched = []
    decode = runner.decode

    def spy(seqs, *a, device_ids=None, **kw):
        launched.append(device_ids is not None)
        return decode(seqs, *a, device_ids=device_ids, **kw)

    runner.decode = spy
    events = []

    def on_token(seq, toks):
        events.append((seq.request_id, tuple(toks)))

    def request(i: int, start: int, **kw):
        prompt = torch.randint(0, 999, (int(torch.randint(3, 40, (), generator=g)),), generator=g).tolist()
        eng.add_request(prompt + [SCRIPT[start]], SamplingParams(temperature=0, **kw), request_id=f"r{i}")

    try:
        request(0, 0, max_new_tokens=12)
        request(1, 3, max_new_tokens=20, stop_token_ids=[SCRIPT[9]])  # stops on its 6th token
        request(2, 10, max_new_tokens=1)
        seqs = []
        for step in range(200):
            if step == 3:  # join while a step is in flight
                request(3, 5, max_new_tokens=7)
                request(4, 1, max_new_tokens=10)
                request(5, 2, max_new_tokens=4, stop_token_ids=[SCRIPT[6]])  # stops on its last token
            eng.step(on_token)
            if not eng.busy:
                break
        seqs = {s.request_id: s for s in list(eng.running)}
        assert not seqs and not eng.busy
    finally:
        runner.decode = decode
    return events, launched


def test_pipelined_decode_equals_step_by_step(runner):
    pads = runner.cache.num_used_blocks
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    plain_events, plain_launched = _run(runner, False, seed)
    assert not any(plain_launched)
    assert runner.cache.num_used_blocks == pads
    piped_events, piped_launched = _run(runner, True, seed)
    assert sum(piped_launched) > 5  # most steps took their input tokens from the device
    assert runner.cache.num_used_blocks == pads  # every block back
    # each request's stream (tokens, then its end) is the same; only the interleaving may differ
    per = lambda ev: {rid: [t for r, t in ev if r == rid] for rid, _ in ev}  # noqa: E731
    assert per(piped_events) == per(plain_events)
    out = per(plain_events)
    assert [t[0] for t in out["r0"][:3]] == SCRIPT[1:4] and len(out["r0"]) == 12 + 1
    assert out["r1"][-2] == (SCRIPT[9],) and out["r1"][-1] == ()
    assert len(out["r2"]) == 2 and len(out["r5"]) == 5


def test_pipeline_falls_back_for_host_sampled_requests(runner):
    eng = LLMEngine(runner, max_batch_size=4)
    eng.add_request([5, 6, SCRIPT[0]], SamplingParams(temperature=0, max_new_tokens=6))
    eng.add_request([7, SCRIPT[2]], SamplingParams(temperature=0, max_new_tokens=6, logprobs=1))
    res = {s.request_id: s for s in [*eng.waiting]}
    while eng.busy:
        eng.step()
    outs = [s.output_ids for s in res.values()]
    assert outs == [SCRIPT[1:7], SCRIPT[3:9]]
    assert all(len(s.output_logprobs) == 6 for s in res.values() if s.params.logprobs is not None)
