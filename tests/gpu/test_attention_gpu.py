"""FlashInfer sink attention (FA2/FA3 prefill, XQA/FA2 decode, CUDA-graph decode) vs the fp32
torch reference `sink_attention_ref` (through `TorchSinkAttention`), gpt-oss shapes, H200.

Tolerance: relative L2 < 1e-2 per batch (bf16 inputs and output, fp32 softmax in the reference;
measured 2e-3..4e-3, README of the device folder). Outputs are poisoned with NaN before each run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is
pytest.importorskip("flashinfer")

from paged_attention_cases import (D, DEV, HKV, HQ, PAGE, SM_SCALE, random_batch, reference,  # noqa: E402
                                   rel_l2, sinks_for)
from pdserve.kernels.flashinfer_attention import FlashInferSinkAttention  # noqa: E402


def attention(window_left, **kw):
    return FlashInferSinkAttention(
        torch.device(DEV), window_left=window_left, sm_scale=SM_SCALE, num_qo_heads=HQ,
        num_kv_heads=HKV, head_dim=D, page_size=PAGE, **kw,
    )


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_prefill_ragged_causal(window_left, backend):
    gen = torch.Generator().manual_seed(1)
    # fresh prompts, a chunked-prefill continuation (kv > qo) and a 1-token tail
    qo_lens, kv_lens = [1, 37, 300, 1000, 129], [1, 37, 700, 1000, 4099]
    batch, kv, q = random_batch(qo_lens, kv_lens, gen)
    sinks = sinks_for(gen)
    attn = attention(window_left, prefill_backend=backend)
    attn.plan(batch)
    out = torch.full_like(q, float("nan"))
    res = attn.run(q, kv, sinks, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert rel_l2(out, reference(batch, q, kv, sinks, window_left)) < 1e-2


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("backend", ["xqa", "fa2"])
@pytest.mark.parametrize("b", [1, 7, 64])
def test_decode_batched(window_left, backend, b):
    gen = torch.Generator().manual_seed(100 + b)
    kv_lens = torch.randint(1, 3000, (b,), generator=gen).tolist()
    kv_lens[0] = 1  # a request on its first generated token
    batch, kv, q = random_batch([1] * b, kv_lens, gen)
    sinks = sinks_for(gen)
    attn = attention(window_left, decode_backend=backend)
    attn.plan(batch)
    out = torch.full_like(q, float("nan"))
    attn.run(q, kv, sinks, out=out)
    assert rel_l2(out, reference(batch, q, kv, sinks, window_left)) < 1e-2


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("backend", ["xqa", "fa2"])
def test_decode_cuda_graph(window_left, backend):
    """plan() outside, run() captured once; replays follow new plans (fewer, longer requests)."""
    b_graph, max_pages = 8, 256
    gen = torch.Generator().manual_seed(7)
    attn = attention(window_left, decode_backend=backend, cuda_graph_batch_size=b_graph,
                     max_pages_per_request=max_pages)
    sinks = sinks_for(gen)
    batch, kv, q = random_batch([1] * 5, [3, 900, 17, 2500, 128], gen, spare_pages=400)
    q_static = torch.zeros(b_graph, HQ, D, device=DEV, dtype=torch.bfloat16)
    out_static = torch.full_like(q_static, float("nan"))
    attn.plan(batch)
    attn.run(q_static, kv, sinks, out=out_static)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_static, kv, sinks, out=out_static)
    for step, lens in enumerate(([3, 900, 17, 2500, 128], [4000, 1, 64, 333, 2048, 16, 5, 777])):
        b = len(lens)
        perm_batch, _, q_new = random_batch([1] * b, lens, gen, spare_pages=0)
        # keep the pool: draw page ids inside kv's range
        assert int(perm_batch.kv_indices.max()) < kv.shape[0]
        out_static.fill_(float("nan"))
        q_static.zero_()
        q_static[:b].copy_(q_new)
        attn.plan(perm_batch)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(perm_batch, q_new, kv, sinks, window_left)
        assert rel_l2(out_static[:b], ref) < 1e-2, f"step {step}"
        assert not out_static.isnan().any()


def test_plan_rejects_bad_batches():
    attn = attention(-1, cuda_graph_batch_size=2, max_pages_per_request=4)
    gen = torch.Generator().manual_seed(0)
    too_many, _, _ = random_batch([1, 1, 1], [5, 5, 5], gen)
    with pytest.raises(ValueError):
        attn.plan(too_many)
    too_long, _, _ = random_batch([1], [5 * PAGE], gen)
    with pytest.raises(ValueError):
        attn.plan(too_long)
    prefill, _, _ = random_batch([3], [3], gen)
    with pytest.raises(ValueError):
        attn.plan(prefill)
    eager = attention(-1)
    with pytest.raises(RuntimeError):
        eager.run(torch.zeros(1, HQ, D, device=DEV, dtype=torch.bfloat16),
                  torch.zeros(1, 2, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16),
                  torch.zeros(HQ, device=DEV))


def test_make_sink_attention_picks_flashinfer():
    from pdserve.kernels.attention import make_sink_attention

    attn = make_sink_attention(DEV, window_left=127, sm_scale=SM_SCALE, num_qo_heads=HQ,
                               num_kv_heads=HKV, head_dim=D, page_size=PAGE)
    assert isinstance(attn, FlashInferSinkAttention)
