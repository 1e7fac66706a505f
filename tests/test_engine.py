"""Paged KV cache, batched decode and sampling against full recomputation."""

from __future__ import annotations

import pytest
import torch

from numerics import rel_l2
from pdserve.engine.kv_cache import BlockAllocator, KVCacheFull, PagedKVCache, sliding_first_page
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling import SamplingError, SamplingParams, sample
from pdserve.engine.sequence import FinishReason


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 201088, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_cached_decode_equals_full_recomputation(tiny_runner):
    """Each decode step's logits equal a fresh prefill of the whole sequence so far; the run
    crosses page boundaries and the 16-token window (pages recycled)."""
    prompt = _ids(13, 1)
    steps = []
    engine = LLMEngine(tiny_runner)
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
    orig_decode = tiny_runner.decode

    def spy(seqs):
        out = orig_decode(seqs)
        steps.append((list(seqs[0].prompt_ids + seqs[0].output_ids), out[0].clone()))
        return out

    tiny_runner.decode = spy
    try:
        while engine.waiting or engine.running:
            engine.step()
    finally:
        tiny_runner.decode = orig_decode
    assert len(seq.output_ids) == 30 and len(steps) == 29
    for tokens, logits in steps[::4] + steps[-1:]:
        full = tiny_runner.prompt_logits(tokens)[-1]
        assert rel_l2(logits, full) <= 1e-2
        assert int(logits.argmax()) == int(full.argmax())
    assert tiny_runner.cache.num_used_blocks == 0


def test_batch_of_mixed_lengths_equals_one_by_one(tiny_runner):
    prompts = [_ids(n, 10 + n) for n in (3, 17, 16, 40, 1, 29)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    batched = LLMEngine(tiny_runner).generate(prompts, params)
    single = [LLMEngine(tiny_runner).generate([p], params)[0] for p in prompts]
    for b, s in zip(batched, single):
        assert b.output_ids == s.output_ids
        assert b.finish_reason == FinishReason.LENGTH
    assert tiny_runner.cache.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_runner):
    prompt = _ids(9, 3)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_new_tokens=10, ignore_eos=True)
    alone = LLMEngine(tiny_runner).generate([prompt], p)[0].output_ids
    other = SamplingParams(temperature=1.0, seed=8, max_new_tokens=10, ignore_eos=True)
    together = LLMEngine(tiny_runner).generate([_ids(20, 4), prompt], [other, p])[1].output_ids
    assert alone == together
    different = LLMEngine(tiny_runner).generate([prompt], SamplingParams(temperature=0.8, seed=9, max_new_tokens=10, ignore_eos=True))
    assert different[0].output_ids != alone


def test_stop_tokens_and_max_new_tokens(tiny_runner):
    prompt = _ids(5, 5)
    greedy = LLMEngine(tiny_runner).generate([prompt], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))[0]
    stop_at = greedy.output_ids[2]
    res = LLMEngine(tiny_runner).generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop_at]))[0]
    assert res.output_ids == greedy.output_ids[: greedy.output_ids.index(stop_at) + 1]
    assert res.finish_reason == FinishReason.STOP


def test_sampler_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1000, generator=g)
    top = logits.argmax(-1).tolist()
    none = [[], [], []]
    assert sample(logits, [SamplingParams(temperature=0)] * 3, none).tokens == top
    assert sample(logits, [SamplingParams(top_k=1, seed=1)] * 3, none).tokens == top
    assert sample(logits, [SamplingParams(top_p=1e-6, seed=1)] * 3, none).tokens == top
    # top-k confines samples to the k best
    best5 = set(torch.topk(logits[0], 5).indices.tolist())
    draws = {sample(logits[:1], [SamplingParams(top_k=5, temperature=5.0, seed=s)], [[]]).tokens[0] for s in range(50)}
    assert draws <= best5 and len(draws) > 1
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(max_new_tokens=0)):
        with pytest.raises(SamplingError):
            SamplingParams(**bad)


def test_block_allocator_accounting():
    a = BlockAllocator(8)
    x = a.allocate(5)
    assert (a.num_free, a.num_used) == (3, 5)
    with pytest.raises(KVCacheFull):
        a.allocate(4)
    assert (a.num_free, a.num_used) == (3, 5)  # a refused allocation takes nothing
    a.free(x[:2])
    with pytest.raises(RuntimeError):
        a.free(x[:1])
    assert (a.num_free, a.num_used) == (5, 3)


def test_sliding_layers_hold_only_their_window(tiny_cfg):
    cache = PagedKVCache(tiny_cfg, num_blocks=64, page_size=4)
    assert cache.sliding_quota(1000) == 16 // 4 + 1
    seq = cache.reserve(200, local_prompt_tokens=50)
    assert len(seq.full) == 50 and len(seq.owned_sliding()) == 13  # whole prompt while prefilling
    cache.prepare(seq, 0, 50)
    cache.finish_prefill(seq, 50)
    assert seq.sliding_first_page == sliding_first_page(50, 16, 4) == 8
    assert len(seq.owned_sliding()) == 5 and cache.num_used_blocks == 50 + 5
    for pos in range(50, 150):  # decode: the window slides, the quota is never exceeded
        slots = cache.prepare(seq, pos, 1)
        assert len(seq.sliding) <= 5
        table, kv_len = cache.tables(seq, pos + 1)["sliding"]
        assert kv_len >= 16 and kv_len <= 16 + 4 - 1 + 1
        assert int(slots["sliding"]) // 4 == table[pos // 4 - seq.sliding_first_page]
    cache.release(seq)
    assert cache.num_used_blocks == 0


def test_admission_refuses_what_cannot_fit(tiny_runner):
    from pdserve.engine.model_runner import InvalidRequest

    engine = LLMEngine(tiny_runner)
    with pytest.raises(InvalidRequest):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.add_request([201088], SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.add_request([1] * tiny_runner.max_context, SamplingParams())
    assert not engine.waiting
