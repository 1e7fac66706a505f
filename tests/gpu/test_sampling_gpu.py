"""The batched sampler on the GPU: every rule in one call synchronises with the host once (the copy
of its results), and draws what the CPU draws for the same seeds."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from pdserve.engine.sampling import SamplingParams, sample

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is


V = 201088


def _batch(b: int):
    rng = random.Random(random.getrandbits(32))
    params, outputs = [], []
    for i in range(b):
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 40]),
            seed=rng.getrandbits(64), presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
            logit_bias={rng.randrange(V): rng.uniform(-5, 5)}, min_tokens=rng.choice([0, 100]),
            stop_token_ids=[rng.randrange(V)], logprobs=rng.choice([None, 5]), max_new_tokens=200))
        outputs.append([rng.randrange(V) for _ in range(rng.randrange(0, 150))])
    return params, outputs


def test_one_host_sync_per_call_and_the_cpu_draws():
    b = 48
    params, outputs = _batch(b)
    logits = torch.randn(b, V, generator=torch.Generator().manual_seed(random.getrandbits(32))) * 3
    cpu = sample(logits, params, outputs, stop_ids=(200002,))
    gpu_logits = logits.cuda()
    sample(gpu_logits, params, outputs, stop_ids=(200002,))  # warm-up: allocator, kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gpu = sample(gpu_logits, params, outputs, stop_ids=(200002,))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the mode's own "prototype feature" notice is no synchronisation)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
    # float sums differ by rounding between devices: a draw on a token boundary may differ
    same = sum(a == b for a, b in zip(cpu.tokens, gpu.tokens))
    assert same >= b - 2, (cpu.tokens, gpu.tokens)
    for c, g in zip(cpu.logprobs, gpu.logprobs):
        assert (c is None) == (g is None)
        if c is not None and c.token == g.token:
            assert g.logprob == pytest.approx(c.logprob, abs=1e-3)
