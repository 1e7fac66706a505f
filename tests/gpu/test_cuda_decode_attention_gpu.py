"""The cluster decode attention (kernels/cuda_decode_attention.py) on gpt-oss shapes (64 q / 8 kv
heads, d 64, 16-token pages, bf16), against the float32 reference `sink_attention_ref` (through
`TorchSinkAttention`) and against the Triton split-KV kernel it stands in for.

Tolerance: relative L2 < 1e-2 per batch, as the other decode kernels (bf16 inputs, probabilities and
output: ~3e-3 expected). Outputs are poisoned with NaN first. Determinism: the same launch twice is
bit-identical (the arrival counter of multi-cluster requests is reset for the next launch, or the
second launch's output stays NaN). The shapes beside the engine's (other cluster sizes, clusters of
16 at every batch, up to 8 clusters a request, more blocks a CTA than it holds at once, a single CTA
walking every block) run the ring and fold paths the engine's shapes reach only at long contexts,
and page-table entries requested further ahead than the engine's one block. The engine's shape is
clusters of 16 at one and two requests, of 8 from three.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

from paged_attention_cases import D, DEV, HKV, HQ, PAGE, SM_SCALE, random_batch, reference, rel_l2, sinks_for  # noqa: E402
from pdserve.kernels import cuda_decode_attention as cda  # noqa: E402
from pdserve.kernels.flashinfer_attention import FlashInferSinkAttention  # noqa: E402
from pdserve.kernels.triton_decode_attention import DecodeScratch  # noqa: E402

if torch.cuda.is_available() and torch.cuda.get_device_capability(DEV) < (9, 0):  # on Hopper a failed build fails
    pytest.skip("the cluster decode attention needs Hopper (thread-block clusters)", allow_module_level=True)

SHAPES = {
    "engine": None,
    "cluster 4, 1 stage, up to 8 clusters": cda.ClusterConfig(cluster=4, stages=1, max_rows=64, max_groups=8),
    "cluster 8, 3 stages, one cluster": cda.ClusterConfig(cluster=8, stages=3, max_rows=64),
    "cluster 16, up to 2 clusters": cda.ClusterConfig(cluster=16, stages=2, max_rows=64, max_groups=2),
    "one CTA, 2 stages": cda.ClusterConfig(cluster=1, stages=2, max_rows=64),
    "page entries 3 blocks ahead": cda.ClusterConfig(cluster=8, stages=2, max_rows=64, lookahead=3),
}


def run_cuda(batch, q, kv, sinks, window_left, cfg=None, scratch=None):
    table = FlashInferSinkAttention._page_table(batch, max(int((batch.kv_indptr[1:] - batch.kv_indptr[:-1]).max()), 1))
    out = torch.full_like(q, float("nan"))
    scratch = scratch or DecodeScratch(q.shape[0], HKV, HQ // HKV, D, 32, DEV)
    assert cda.applies(q[:1], kv, window_left)  # device, dtypes and shapes (the batch bound is the engine's)
    return cda.decode_attention(q, kv, table.to(DEV), batch.kv_lens.to(DEV, torch.int32), sinks, SM_SCALE, window_left,
                                scratch, out=out, cfg=cfg)


def lens_for(b, ctx, gen):
    """The first request at `ctx` keys, the others anywhere in 1..ctx."""
    return [ctx] + torch.randint(1, ctx + 1, (b - 1,), generator=gen).tolist()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("ctx", [1, 129, 1000, 8192])
@pytest.mark.parametrize("b", [1, 2, 4, 16])
def test_matches_reference(b, ctx, window_left, shape):
    """Every shape at one to sixteen requests: one or several clusters a request (up to 8 clusters:
    the grid holds 8 at one request, 4 at two, 2 at four, 1 at sixteen), each CTA with one block or
    many."""
    gen = torch.Generator().manual_seed(1000 * b + ctx + window_left + 7 * len(shape))
    batch, kv, q = random_batch([1] * b, lens_for(b, ctx, gen), gen, 3)
    sinks = sinks_for(gen)
    scratch = DecodeScratch(b, HKV, HQ // HKV, D, 32, DEV)
    out = run_cuda(batch, q, kv, sinks, window_left, SHAPES[shape], scratch)
    assert rel_l2(out, reference(batch, q, kv, sinks, window_left)) < 1e-2
    # deterministic, and the scratch's arrival counters are ready for the next launch
    assert torch.equal(out, run_cuda(batch, q, kv, sinks, window_left, SHAPES[shape], scratch))


@pytest.mark.parametrize("window_left", [-1, 127])
def test_peaked_scores_and_dominant_sinks(window_left):
    """Large q (scores in the hundreds: one key takes nearly all the weight, most probabilities
    underflow to zero) and sinks that outweigh every key for some heads: still within tolerance."""
    gen = torch.Generator().manual_seed(5)
    batch, kv, q = random_batch([1] * 4, [3000, 700, 129, 1], gen, 3)
    q = q * 40
    sinks = sinks_for(gen)
    sinks[::3] = 60.0
    out = run_cuda(batch, q, kv, sinks, window_left)
    assert rel_l2(out, reference(batch, q, kv, sinks, window_left)) < 1e-2


@pytest.mark.parametrize("window_left", [-1, 127])
def test_close_to_the_triton_kernel(window_left):
    """The attention object's "triton" decode mode with these kernels on and off: the two kernels
    split and add differently, so they agree to rounding, not bit for bit."""
    gen = torch.Generator().manual_seed(17)
    batch, kv, q = random_batch([1] * 4, lens_for(4, 5000, gen), gen, 3)
    sinks = sinks_for(gen)
    outs = {}
    for enabled in (True, False):
        cda.ENABLED = enabled
        try:
            attn = FlashInferSinkAttention(DEV, window_left=window_left, sm_scale=SM_SCALE, num_qo_heads=HQ,
                                           num_kv_heads=HKV, head_dim=D, page_size=PAGE, decode_backend="triton")
            attn.plan(batch)
            outs[enabled] = attn.run(q, kv, sinks, out=torch.full_like(q, float("nan")))
        finally:
            cda.ENABLED = True
    assert rel_l2(outs[True], outs[False]) < 5e-3
    assert not torch.equal(outs[True], outs[False])  # the object did take the other kernel
