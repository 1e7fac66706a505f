"""Chunked prefill: a prompt run `prefill_chunk_tokens` at a time (each chunk a suffix prefill over
the KV of the chunks before it) gives the one-shot logits within bf16 noise, for chunk boundaries
inside and past the tiny model's 16-token sliding window, with a prefix cache, when scoring the
prompt, and on two gloo ranks; no forward pass sees more than a chunk of tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from numerics import rel_l2
from pdserve.engine.prefix_cache import PrefixCache, chain_keys
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence

PAGE = 4  # the 16-token window spans 4-5 pages: windows start mid-prompt and mid-chunk


@pytest.fixture(scope="module")
def runner(tiny_mxfp4):
    from pdserve.engine.model_runner import ModelRunner

    return ModelRunner(str(tiny_mxfp4), precision="bf16", page_size=PAGE, num_kv_blocks=128)


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(201088) for _ in range(n)]


def _chunked(runner, chunk: int, fn):
    runner.prefill_chunk_tokens, before = chunk, runner.prefill_chunk_tokens
    try:
        return fn()
    finally:
        runner.prefill_chunk_tokens = before


def _assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The bound of docs/engine.md's suffix prefill (the chunk's rows run in another matmul shape)."""
    assert got.shape == want.shape
    assert rel_l2(got, want) <= 1e-2
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().amax(-1)
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


# chunk 5: boundaries mid-page and inside the window; 16: the window itself; 23: past it
@pytest.mark.parametrize("chunk,length", [(5, 27), (16, 50), (23, 40), (7, 8)])
def test_chunked_logits_equal_one_shot(runner, chunk, length):
    rng = random.Random(chunk * 1000 + length)
    prompt = _ids(length + rng.randrange(3), rng)
    one_shot = runner.prompt_logits(prompt)
    seen: list[int] = []
    forward = runner.model.forward

    def counting(ids, pos, step):
        seen.append(ids.shape[0])
        return forward(ids, pos, step)

    runner.model.forward = counting
    try:
        chunked = _chunked(runner, chunk, lambda: runner.prompt_logits(prompt))
    finally:
        del runner.model.forward
    assert seen == [min(chunk, len(prompt) - s) for s in range(0, len(prompt), chunk)]
    _assert_same_logits(chunked, one_shot)
    assert runner.cache.num_used_blocks == 0


def test_chunked_local_prefill_then_decode_follows_one_shot(runner):
    """finish_prefill after the last chunk leaves the sliding table a decode step can continue."""
    rng = random.Random(3)
    prompt = _ids(30, rng)

    def run():
        seq = Sequence("r", list(prompt), SamplingParams(max_new_tokens=4, temperature=0))
        seq.blocks = runner.cache.reserve(seq.max_tokens, local_prompt_tokens=len(prompt))
        try:
            out = [runner.prefill(seq)]
            for _ in range(2):
                seq.output_ids.append(int(out[-1].argmax()))
                out.append(runner.decode([seq])[0])
            return torch.stack(out)
        finally:
            runner.cache.release(seq.blocks)

    _assert_same_logits(_chunked(runner, 6, run), run())
    assert runner.cache.num_used_blocks == 0


@pytest.mark.parametrize("prefix_len", [12, 30])
def test_chunked_suffix_over_a_cached_prefix(runner, prefix_len):
    """A prefix-cache lease, then a suffix several chunks long: the logits of the from-scratch
    prompt, and every complete page (full and sliding block) joins the cache."""
    rng = random.Random(prefix_len)
    cache = PrefixCache(runner.cache)
    system = _ids(prefix_len, rng)

    def prefill(tokens):
        lease = cache.acquire(tokens)
        seq = Sequence("r", list(tokens), SamplingParams(temperature=0), blocks=lease.blocks,
                       num_cached=lease.num_cached)
        ok = False
        try:
            logits = _chunked(runner, 7, lambda: runner.prefill(seq, all_logits=True, finish=False))
            ok = True
        finally:
            cache.release(lease, computed=ok)
        return lease.num_cached, logits

    prefill(system + _ids(3, rng))
    prompt = system + _ids(20, rng)
    cached, logits = prefill(prompt)
    assert cached == prefix_len // PAGE * PAGE
    _assert_same_logits(logits, runner.prompt_logits(prompt)[cached:])
    entries = [cache._entries.get(k) for k in chain_keys(prompt, PAGE, len(prompt) // PAGE)]
    assert all(e is not None and e.sliding_block is not None for e in entries)  # chunks kept every page
    cache.clear()
    assert runner.cache.num_used_blocks == 0


def test_chunked_scoring_equals_one_shot(runner):
    """Prompt logprobs across chunk boundaries: the last row of a chunk scores the next chunk's
    first token."""
    rng = random.Random(11)
    prompt = _ids(33, rng)

    def score():
        seq = Sequence("s", list(prompt), SamplingParams(max_new_tokens=1))
        seq.blocks = runner.cache.reserve(len(prompt), local_prompt_tokens=len(prompt))
        try:
            return runner.prefill_scored(seq, 2)
        finally:
            runner.cache.release(seq.blocks)

    last_a, a = score()
    last_b, b = _chunked(runner, 6, score)
    assert [s.token for s in b] == prompt[1:]
    assert np.allclose([s.logprob for s in b], [s.logprob for s in a], atol=5e-2)
    _assert_same_logits(last_b[None], last_a[None])


def test_chunk_size_must_be_positive(tiny_mxfp4):
    from pdserve.engine.model_runner import ModelRunner

    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=4, prefill_chunk_tokens=0)


@pytest.mark.slow
def test_tp2_chunked_prefill_matches_one_rank(tiny_mxfp4, runner):
    """Two gloo ranks prefill in chunks of 6 (`pdserve logits --tp 2 --prefill-chunk-tokens 6`):
    the one-rank one-shot function, within the TP rounding of tests/test_parallel_logits.py."""
    from pdserve.launch.parallel_logits import parallel_prompt_logits

    prompt = _ids(40, random.Random(5))
    got = parallel_prompt_logits(str(tiny_mxfp4), prompt, tp=2, precision="bf16", prefill_chunk_tokens=6)
    ref = runner.prompt_logits(prompt).numpy()
    per_pos = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.median(per_pos) <= 2e-2 and (per_pos > 5e-2).mean() <= 0.15
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.85


class _NoScores:
    """Attention that materialises nothing: what is left is every other activation."""

    def plan(self, batch) -> None:
        pass

    def run(self, q, kv_cache, sinks, early_launch=False):
        return torch.zeros_like(q)


def _peak_bytes(runner, n: int) -> int:
    """Peak live bytes the CPU allocator handed out during a local prefill of n tokens (torch
    profiler memory events; weights and KV pools exist before it starts)."""
    from torch.profiler import ProfilerActivity, profile

    seq = Sequence("p", _ids(n, random.Random(n)), SamplingParams(max_new_tokens=1))
    seq.blocks = runner.cache.reserve(n, local_prompt_tokens=n)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            runner.prefill(seq)
    finally:
        runner.cache.release(seq.blocks)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_peak_activation_memory_follows_the_chunk_not_the_prompt(runner, monkeypatch):
    """Attention stubbed out (the torch reference backend materialises chunk x prompt scores;
    FlashInfer's prefill kernel keeps none), the embedding, norms, QKV/O GEMMs and the MoE of a
    4x longer prompt add no peak bytes when chunked, and their share of each token when not
    (the last position's vocabulary-wide logits are a fixed part of both)."""
    for group in runner.attention:
        monkeypatch.setitem(runner.attention, group, _NoScores())
    one_shot = [_peak_bytes(runner, n) for n in (48, 192)]
    runner.prefill_chunk_tokens, before = 48, runner.prefill_chunk_tokens
    try:
        chunked = _peak_bytes(runner, 192)
    finally:
        runner.prefill_chunk_tokens = before
    growth = one_shot[1] - one_shot[0]
    assert growth > 144 * runner.cfg.hidden_size * 2 * 4  # the measure sees the pass grow
    assert chunked - one_shot[0] < 0.1 * growth


@pytest.mark.slow
def test_prefill_worker_chunks_and_the_stream_equals_one_process(tiny_mxfp4, tiny_runner, tmp_path):
    """A prefill worker started with --prefill-chunk-tokens 8 (1P + 1D over NIXL): greedy tokens
    of a 45-token prompt equal one process prefilling in the same chunks."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.launch.serve import ClusterSpec, LocalCluster
    from ports import server_ports
    from test_serving_e2e import grpc_generate

    prompt = _ids(45, random.Random(45))
    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(), kv_blocks=256,
                       extra_prefill_args=["--prefill-chunk-tokens", "8"])
    with LocalCluster(spec, tmp_path / "logs") as cluster:
        ids, _ = grpc_generate(cluster, prompt, max_new_tokens=8, ignore_eos=True, temperature=0.0)
    local = _chunked(tiny_runner, 8, lambda: LLMEngine(tiny_runner).generate(
        [prompt], SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0))[0])
    assert ids == local.output_ids and len(ids) == 8


@pytest.mark.parametrize("why", ["cancelled", "deadline"])
def test_a_cancelled_long_prompt_stops_at_the_next_chunk(runner, why):
    """The prefill worker checks cancel and deadline between chunks: one chunk runs, nothing is
    pushed, every block goes back (the prefix cache adopts nothing from a stopped prompt)."""
    import time

    from pdserve.prefill_worker.executor import PrefillExecutor, PrefillJob

    executor = PrefillExecutor(runner, agent=None)
    job = PrefillJob("long", _ids(40, random.Random(40)), SamplingParams(temperature=0), placements=[])
    calls = []
    forward = runner.model.forward

    def first_chunk_then_stop(ids, pos, step):
        calls.append(ids.shape[0])
        if why == "cancelled":
            job.cancelled = True
        else:
            job.deadline = time.monotonic() - 1
        return forward(ids, pos, step)

    runner.model.forward = first_chunk_then_stop
    try:
        with pytest.raises(InterruptedError if why == "cancelled" else TimeoutError):
            _chunked(runner, 8, lambda: executor._run(job))
    finally:
        del runner.model.forward
    assert calls == [8]
    assert executor.prefix_cache.num_cached_pages == 0
    assert runner.cache.num_used_blocks == 0


@pytest.mark.slow
def test_tp2_prefill_worker_chunks_like_one_process(tiny_mxfp4, tiny_runner, tmp_path):
    """A TP2 prefill worker (two gloo ranks, the leader broadcasting each chunk's plan) with
    --prefill-chunk-tokens 8: the greedy stream is the single-process model's up to the TP
    rounding of tests/test_parallel_serving.py."""
    from pdserve.launch.serve import ClusterSpec, LocalCluster
    from test_parallel_serving import MAX_NEW, check_greedy
    from ports import server_ports
    from test_serving_e2e import grpc_generate

    prompt = _ids(45, random.Random(46))
    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(), kv_blocks=256,
                       prefill_tp=2, extra_prefill_args=["--prefill-chunk-tokens", "8"])
    with LocalCluster(spec, tmp_path / "logs") as cluster:
        ids, _ = grpc_generate(cluster, prompt, max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
    check_greedy(tiny_runner, [(prompt, ids)])
