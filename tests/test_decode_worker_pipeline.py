"""The decode worker's scheduler runs the pipelined decode (engine.decode_pipeline) and streams
exactly what its step-by-step loop streams: same tokens and finish reasons per request, requests
joining while a step is in flight, stop tokens seen one step late, length ends never overrun, a
cancel while a step is in flight, every KV block given back.

CPU, through engine.cuda_graphs' padded static steps (capture=False) and the scripted bigram
checkpoint (tests/scripted_model.py), whose greedy next token has a large margin."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_worker.scheduler import DecodeScheduler
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.kvtransfer.notify import OK, PUSH, kv_notification, push_notification
from scripted_model import scripted_graph_runner

SCRIPT = list(range(1000, 1024))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return scripted_graph_runner(tmp_path_factory.mktemp("ckpt") / "pipeline", SCRIPT)


def _serve(runner: ModelRunner, pipeline: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = DecodeScheduler(runner, max_batch_size=4, pipeline=pipeline)
    inbox = []
    s.notification_source = lambda: [inbox.pop(0) for _ in range(len(inbox))]
    launched = []
    decode = runner.decode

    def spy(seqs, *a, device_ids=None, **kw):
        launched.append(device_ids is not None)
        return decode(seqs, *a, device_ids=device_ids, **kw)

    runner.decode = spy
    reqs = {}

    def request(rid: str, start: int, **kw):
        prompt = torch.randint(0, 999, (int(torch.randint(3, 40, (), generator=g)),), generator=g).tolist()
        prompt.append(SCRIPT[start])
        params = SamplingParams(temperature=0, **kw)
        s.reserve(rid, len(prompt), params.max_new_tokens, ttl_s=60)
        for note in (push_notification(rid, PUSH, "w"), kv_notification(rid, (0, runner.cfg.num_key_value_heads)),
                     push_notification(rid, OK, "w")):
            inbox.append((0, note))
        reqs[rid] = s.start(rid, SCRIPT[start + 1], len(prompt), params)

    try:
        request("r0", 0, max_new_tokens=12)
        request("r1", 3, max_new_tokens=20, stop_token_ids=[SCRIPT[9]])
        request("r2", 10, max_new_tokens=2)
        request("rc", 12, max_new_tokens=30)
        for step in range(200):
            if step == 3:
                request("r3", 5, max_new_tokens=7)
                request("r4", 2, max_new_tokens=4, stop_token_ids=[SCRIPT[6]])  # stops on its last token
            if step == 5:
                s.cancel("rc")
            s.run_once()
            if not s._requests and s._inflight is None:
                break
    finally:
        runner.decode = decode
    streams = {}
    for rid, r in reqs.items():
        ev = []
        while not r.events.empty():
            e = r.events.get_nowait()
            ev.append((tuple(e.tokens), e.finish_reason))
        streams[rid] = ev
    return streams, launched


def test_decode_worker_pipelined_equals_step_by_step(runner):
    free = runner.cache.num_free_blocks
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    plain, plain_launched = _serve(runner, False, seed)
    assert not any(plain_launched) and runner.cache.num_free_blocks == free
    piped, piped_launched = _serve(runner, True, seed)
    assert sum(piped_launched) > 5, seed  # most steps took their input ids from the device
    assert runner.cache.num_free_blocks == free, seed  # every block back, the cancelled one's too
    cancelled = piped.pop("rc"), plain.pop("rc")
    assert piped == plain, seed
    toks = lambda ev: [t for ts, _ in ev for t in ts]  # noqa: E731
    # the first token came with the hand-over: the stream holds the other max_new_tokens - 1
    assert toks(plain["r0"]) == SCRIPT[2:13] and plain["r0"][-1][1] is not None
    assert toks(plain["r1"])[-1] == SCRIPT[9] and toks(plain["r2"]) == SCRIPT[12:13]
    for ev in cancelled:  # a prefix of its script, then the cancel
        assert toks(ev) == SCRIPT[14:14 + len(toks(ev))] and ev[-1][1] is not None


def test_rows_that_need_the_host_sampler_are_not_pipelined():
    from pdserve.engine.decode_pipeline import sampled_on_device

    assert sampled_on_device(SamplingParams(temperature=0))
    for kw in (dict(temperature=1.0), dict(temperature=0, logprobs=1), dict(temperature=0, min_tokens=2),
               dict(temperature=0, logit_bias={3: 1.0}), dict(temperature=0, grammar="start: \"x\"")):
        assert not sampled_on_device(SamplingParams(**kw)), kw
