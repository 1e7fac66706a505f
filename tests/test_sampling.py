"""The batched sampler against plain per-row references, on fresh random logits."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.sampling import (SamplingError, SamplingParams, apply_token_bitmask, prompt_logprobs,
                                     sample, uniform)


def _logits(b: int, v: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(random.getrandbits(32))) * scale


def _reference(logits: torch.Tensor, p: SamplingParams, output: list[int], stop_ids=()) -> torch.Tensor:
    """OpenAI's order, one row at a time with Python loops: what the batched sampler must match."""
    x = logits.float().clone()
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, bias in p.logit_bias.items():
        x[t] += bias
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids)):
            x[t] = float("-inf")
    return torch.log_softmax(x / (p.temperature or 1.0), dim=-1)


def test_logprobs_follow_penalties_bias_and_temperature():
    b, v = 6, 300
    logits = _logits(b, v)
    rng = random.Random(random.getrandbits(32))
    params, outputs = [], []
    for i in range(b):
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), seed=rng.getrandbits(64),
            presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
            logit_bias={rng.randrange(v): rng.uniform(-100, 100) for _ in range(rng.randrange(4))},
            min_tokens=rng.choice([0, 50]), stop_token_ids=[rng.randrange(v)],
            logprobs=rng.choice([None, 0, 3, 20]), max_new_tokens=100))
        outputs.append([rng.randrange(v) for _ in range(rng.randrange(0, 40))])
    out = sample(logits, params, outputs, stop_ids=(7,))
    for i, (p, o) in enumerate(zip(params, outputs)):
        ref = _reference(logits[i], p, o, (7,))
        if p.logprobs is None:
            assert out.logprobs[i] is None
            continue
        lp = out.logprobs[i]
        assert lp.token == out.tokens[i]
        assert lp.logprob == pytest.approx(float(ref[lp.token]), abs=1e-4)
        top = torch.topk(ref, p.logprobs)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [x for _, x in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if p.greedy:
            assert out.tokens[i] == int(ref.argmax())


def test_draws_follow_the_distribution_and_seeds():
    """Many rows of one distribution, each with its own seed: frequencies match the softmax."""
    v, rows = 6, 6000
    row = _logits(1, v, 1.0)
    params = [SamplingParams(temperature=0.8, seed=random.getrandbits(64)) for _ in range(rows)]
    tokens = sample(row.expand(rows, v), params, [[]] * rows).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=v).float() / rows
    probs = torch.softmax(row[0] / 0.8, dim=-1)
    assert torch.allclose(freq, probs, atol=0.03)
    # a row's draw depends on its seed and token index only, not on the batch around it
    again = sample(row.expand(3, v), [params[5], params[0], params[9]], [[]] * 3).tokens
    assert again == [tokens[5], tokens[0], tokens[9]]
    assert uniform(1, 2) == uniform(1, 2) and uniform(1, 2) != uniform(1, 3) and 0 <= uniform(5, 0) < 1


def test_top_k_and_top_p_cut_the_tail():
    v, rows = 500, 400
    row = _logits(1, v)
    order = torch.argsort(row[0], descending=True)
    probs = torch.softmax(row[0], dim=-1)[order]
    nucleus = int((torch.cumsum(probs, 0) - probs < 0.5).sum())
    ps = [SamplingParams(top_p=0.5, seed=random.getrandbits(64)) for _ in range(rows)]
    assert set(sample(row.expand(rows, v), ps, [[]] * rows).tokens) <= set(order[:nucleus].tolist())
    ks = [SamplingParams(top_k=3, top_p=0.99, seed=random.getrandbits(64)) for _ in range(rows)]
    got = set(sample(row.expand(rows, v), ks, [[]] * rows).tokens)
    assert got <= set(order[:3].tolist()) and len(got) > 1


def test_rows_with_different_cuts_share_one_batch():
    """top-k alone, top-p (with and without top-k) and no cut, interleaved in one batch."""
    v, per = 300, 60
    row = _logits(1, v)
    order = torch.argsort(row[0], descending=True).tolist()
    probs = torch.softmax(row[0], dim=-1)[order]
    nucleus = int((torch.cumsum(probs, 0) - probs < 0.6).sum())
    kinds = [(dict(top_k=4), set(order[:4])), (dict(top_p=0.6), set(order[:nucleus])),
             (dict(top_k=2, top_p=0.99), set(order[:2])), ({}, set(order))]
    params, allowed = [], []
    for i in range(per * len(kinds)):
        kw, ok = kinds[i % len(kinds)]
        params.append(SamplingParams(seed=random.getrandbits(64), **kw))
        allowed.append(ok)
    tokens = sample(row.expand(len(params), v), params, [[]] * len(params)).tokens
    assert all(t in ok for t, ok in zip(tokens, allowed))
    assert len({t for t, (kw, _) in zip(tokens, kinds * per) if not kw}) > 4  # the free rows roam


def test_a_bias_of_100_always_wins_and_min_tokens_masks_stops():
    v, rows = 1000, 64
    logits = _logits(rows, v)
    favourite = random.randrange(v)
    ps = [SamplingParams(temperature=1.5, seed=random.getrandbits(64), logit_bias={favourite: 100.0})
          for _ in range(rows)]
    assert set(sample(logits, ps, [[]] * rows).tokens) == {favourite}
    # the same favourite as a stop id: banned until min_tokens tokens exist, then it wins again
    ps = [SamplingParams(seed=random.getrandbits(64), logit_bias={favourite: 100.0}, min_tokens=3,
                         max_new_tokens=10) for _ in range(rows)]
    early = sample(logits, ps, [[1, 2]] * rows, stop_ids=(favourite,)).tokens
    assert favourite not in early
    assert set(sample(logits, ps, [[1, 2, 3]] * rows, stop_ids=(favourite,)).tokens) == {favourite}
    ignoring = [SamplingParams(seed=p.seed, logit_bias={favourite: 100.0}, min_tokens=3, ignore_eos=True,
                               max_new_tokens=10) for p in ps]
    assert set(sample(logits, ignoring, [[]] * rows, stop_ids=(favourite,)).tokens) == {favourite}


def test_token_bitmask_confines_each_row():
    b, v = 5, 100
    logits = _logits(b, v)
    allowed = [set(random.sample(range(v), random.randint(1, 5))) for _ in range(b)]
    bits = torch.zeros(b, (v + 31) // 32 * 32, dtype=torch.bool)
    for i, a in enumerate(allowed):
        bits[i, list(a)] = True
    words = (bits.view(b, -1, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(torch.isfinite(masked), bits[:, :v])
    ps = [SamplingParams(temperature=2.0, seed=random.getrandbits(64)) for _ in range(b)]
    for i, t in enumerate(sample(logits, ps, [[]] * b, token_bitmask=bitmask).tokens):
        assert t in allowed[i]


def test_prompt_logprobs_are_the_next_token_log_softmax():
    n, v = 9, 50
    logits = _logits(n, v)
    ids = [random.randrange(v) for _ in range(n)]
    got = prompt_logprobs(logits, ids, 2, chunk=4)
    ref = torch.log_softmax(logits, dim=-1)
    assert [g.token for g in got] == ids[1:]
    for i, g in enumerate(got):
        assert g.logprob == pytest.approx(float(ref[i, ids[i + 1]]), abs=1e-5)
        assert [t for t, _ in g.top] == torch.topk(ref[i], 2).indices.tolist()
    assert prompt_logprobs(logits[:1], ids[:1], 2) == []


def test_parameters_out_of_range_are_refused():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(logit_bias={1: 101}),
                dict(logit_bias={-1: 1}), dict(min_tokens=5, max_new_tokens=4), dict(logprobs=21),
                dict(prompt_logprobs=-1), dict(n=0)):
        with pytest.raises(SamplingError):
            SamplingParams(**bad)
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        SamplingParams(logit_bias={500: 1.0}).check_vocab(500)
    with pytest.raises(SamplingError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[9]).check_vocab(9)
    choice = SamplingParams(seed=2**64 - 1, n=3).for_choice(2)
    assert (choice.seed, choice.n) == (1, 1)


def test_a_scored_prefill_equals_the_log_softmax_of_every_position(tiny_runner):
    """ModelRunner.prefill_scored makes the logits a few rows at a time; the result is the
    next-token log-softmax of a plain all-positions prefill, and its last logits equal prefill's."""
    from pdserve.engine.sequence import Sequence

    ids = [random.randrange(1000, 100000) for _ in range(random.randint(20, 40))]
    ref = torch.log_softmax(tiny_runner.prompt_logits(ids), dim=-1)
    seq = Sequence("scored", ids, SamplingParams(max_new_tokens=1))
    seq.blocks = tiny_runner.cache.reserve(len(ids), local_prompt_tokens=len(ids))
    tiny_runner.score_chunk = 7
    try:
        last, scored = tiny_runner.prefill_scored(seq, 3)
    finally:
        tiny_runner.score_chunk = type(tiny_runner).score_chunk
        tiny_runner.cache.release(seq.blocks)
    assert [s.token for s in scored] == ids[1:]
    for i, s in enumerate(scored):
        assert s.logprob == pytest.approx(float(ref[i, ids[i + 1]]), abs=1e-3)
        assert [t for t, _ in s.top] == torch.topk(ref[i], 3).indices.tolist()
    assert torch.allclose(torch.log_softmax(last, dim=-1), ref[-1], atol=1e-3)
