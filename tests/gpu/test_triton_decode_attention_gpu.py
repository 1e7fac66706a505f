"""The Triton split-KV decode attention (kernels/triton_decode_attention.py) on gpt-oss shapes
(64 q / 8 kv heads, d 64, 16-token pages, bf16), against the float32 reference
`sink_attention_ref` (through `TorchSinkAttention`) and against FlashInfer's XQA decode.

Tolerance: relative L2 < 1e-2 per batch, as the FlashInfer paths (tests/gpu/test_attention_gpu.py;
bf16 inputs, probabilities and output: ~3e-3 expected). Outputs are poisoned with NaN first.
Determinism: the same launch twice is bit-identical (the splits are combined in a fixed order,
whichever program arrives last). Graph mode: a replay equals the same object's eager run bitwise.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is
pytest.importorskip("triton")

from paged_attention_cases import (D, DEV, HKV, HQ, PAGE, SM_SCALE, random_batch, reference,  # noqa: E402
                                   rel_l2, sinks_for)
from pdserve.kernels.flashinfer_attention import FlashInferSinkAttention  # noqa: E402
from pdserve.kernels.triton_decode_attention import (  # noqa: E402
    FULL_LAYERS, WINDOWED_LAYERS, DecodeConfig, DecodeScratch, num_splits, paged_decode_attention,
)


def decode_batch(kv_lens, gen, spare_pages=3):
    """One-token requests on shuffled pages of one pool (page 0 left free for graph padding)."""
    batch, kv, q = random_batch([1] * len(kv_lens), kv_lens, gen, spare_pages)
    return batch, kv, q, sinks_for(gen)


def lens_for(b, ctx, gen):
    """The first request at `ctx` keys, the others anywhere in 1..ctx."""
    return [ctx] + torch.randint(1, ctx + 1, (b - 1,), generator=gen).tolist()


def triton_decode(batch, q, kv, sinks, window_left, cfg=DecodeConfig()):
    table = FlashInferSinkAttention._page_table(batch, max(int((batch.kv_indptr[1:] - batch.kv_indptr[:-1]).max()), 1))
    lens = batch.kv_lens.to(torch.int32)
    keys = int(lens.max()) if window_left < 0 else window_left + 1
    scratch = DecodeScratch(q.shape[0], HKV, HQ // HKV, D, num_splits(q.shape[0], HKV, keys, DEV, cfg), DEV)
    out = torch.full_like(q, float("nan"))
    return paged_decode_attention(q, kv, table.to(DEV), lens.to(DEV), sinks, SM_SCALE, window_left, scratch, out=out,
                                  cfg=cfg)


# the default tiling, and the one the engine runs for the layer type
TILINGS = {"default": lambda window_left: DecodeConfig(),
           "engine": lambda window_left: WINDOWED_LAYERS if window_left >= 0 else FULL_LAYERS}


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("ctx", [1, 1000, 8192])
@pytest.mark.parametrize("b", [1, 4, 16])
def test_matches_reference(b, ctx, window_left, tiling):
    gen = torch.Generator().manual_seed(1000 * b + ctx + window_left)
    batch, kv, q, sinks = decode_batch(lens_for(b, ctx, gen), gen)
    cfg = TILINGS[tiling](window_left)
    out = triton_decode(batch, q, kv, sinks, window_left, cfg)
    assert rel_l2(out, reference(batch, q, kv, sinks, window_left)) < 1e-2
    assert torch.equal(out, triton_decode(batch, q, kv, sinks, window_left, cfg))  # deterministic


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("b", [1, 16])
def test_matches_xqa(b, window_left):
    pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(7 + b)
    batch, kv, q, sinks = decode_batch(lens_for(b, 3000, gen), gen)
    outs = {}
    for backend in ("triton", "xqa"):
        attn = FlashInferSinkAttention(DEV, window_left=window_left, sm_scale=SM_SCALE, num_qo_heads=HQ,
                                       num_kv_heads=HKV, head_dim=D, page_size=PAGE, decode_backend=backend)
        attn.plan(batch)
        outs[backend] = attn.run(q, kv, sinks, out=torch.full_like(q, float("nan")))
    assert rel_l2(outs["triton"], outs["xqa"]) < 1e-2
    assert rel_l2(outs["triton"], reference(batch, q, kv, sinks, window_left)) < 1e-2


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("b_graph", [1, 8])
def test_cuda_graph_replay(b_graph, window_left):
    """plan() outside, run() captured once; each replay (new, shorter or padded batches) equals
    the same object's eager run bitwise and the reference within tolerance."""
    gen = torch.Generator().manual_seed(11 + b_graph)
    max_pages = 600
    attn = FlashInferSinkAttention(DEV, window_left=window_left, sm_scale=SM_SCALE, num_qo_heads=HQ,
                                   num_kv_heads=HKV, head_dim=D, page_size=PAGE, decode_backend="triton",
                                   cuda_graph_batch_size=b_graph, max_pages_per_request=max_pages)
    kv = torch.randn(max_pages * b_graph + 1, 2, PAGE, HKV, D, generator=gen).to(DEV, torch.bfloat16)
    sinks = (torch.randn(HQ, generator=gen) * 2).to(DEV)
    q_static = torch.zeros(b_graph, HQ, D, device=DEV, dtype=torch.bfloat16)
    out_static = torch.zeros_like(q_static)
    warm, *_ = decode_batch([5] * b_graph, gen)
    attn.plan(warm)
    attn.run(q_static, kv, sinks, out=out_static)  # warm-up outside the capture: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_static, kv, sinks, out=out_static)
    for step, lens in enumerate(([max_pages * PAGE] + [1] * (b_graph - 1), lens_for(b_graph, 9000, gen),
                                 lens_for(max(b_graph // 2, 1), 130, gen))):
        batch, kv_new, q, _ = decode_batch(lens, gen, spare_pages=0)
        kv[: kv_new.shape[0]].copy_(kv_new)
        n = len(lens)
        q_static.zero_()
        q_static[:n].copy_(q)
        out_static.fill_(float("nan"))
        attn.plan(batch)
        graph.replay()
        eager = attn.run(q_static, kv, sinks, out=torch.full_like(q_static, float("nan")))
        torch.cuda.synchronize()
        assert not out_static.isnan().any(), f"step {step}: a padded row was not written"
        assert torch.equal(out_static, eager), f"step {step}"
        assert rel_l2(out_static[:n], reference(batch, q, kv, sinks, window_left)) < 1e-2, f"step {step}"


@pytest.mark.parametrize("window_left", [-1, 127])
@pytest.mark.parametrize("b,b_graph", [(1, 1), (3, 4), (5, 8), (20, 32)])
def test_eager_step_equals_the_graph_that_runs_it(b, b_graph, window_left):
    """An eager decode step of b requests and the CUDA graph of the size the engine pads b to
    (engine.cuda_graphs) give the same outputs bit for bit, whatever the lengths (the longest here
    needs a split count that is not a power of two): the splits depend on the rows and the layer
    type only."""
    gen = torch.Generator().manual_seed(31 + b)
    max_pages = 400
    kw = dict(window_left=window_left, sm_scale=SM_SCALE, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
              page_size=PAGE, decode_backend="triton")
    batch, kv, q, sinks = decode_batch([1300] + torch.randint(1, 1301, (b - 1,), generator=gen).tolist(), gen)
    eager = FlashInferSinkAttention(DEV, **kw)
    eager.plan(batch)
    want = eager.run(q, kv, sinks, out=torch.full_like(q, float("nan")))
    graph_obj = FlashInferSinkAttention(DEV, cuda_graph_batch_size=b_graph, max_pages_per_request=max_pages, **kw)
    graph_obj.plan(batch)
    q_static = torch.zeros(b_graph, HQ, D, device=DEV, dtype=torch.bfloat16)
    q_static[:b].copy_(q)
    out_static = torch.full_like(q_static, float("nan"))
    graph_obj.run(q_static, kv, sinks, out=out_static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_obj.run(q_static, kv, sinks, out=out_static)
    out_static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_static[:b], want)


def test_graph_object_rejects_oversized_batches():
    attn = FlashInferSinkAttention(DEV, window_left=-1, sm_scale=SM_SCALE, num_qo_heads=HQ, num_kv_heads=HKV,
                                   head_dim=D, page_size=PAGE, decode_backend="triton",
                                   cuda_graph_batch_size=2, max_pages_per_request=4)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="exceeds"):
        attn.plan(decode_batch([5, 5, 5], gen)[0])
    with pytest.raises(ValueError, match="max_pages_per_request"):
        attn.plan(decode_batch([5 * PAGE], gen)[0])


def test_auto_rule_takes_triton_up_to_its_batch(monkeypatch):
    """"auto" picks the Triton kernel for batches up to `_TRITON_MAX_BATCH` of the layer type."""
    pytest.importorskip("flashinfer")
    from pdserve.kernels import flashinfer_attention

    assert flashinfer_attention._TRITON_MAX_BATCH == {"full": 16, "window": 64}  # as measured (docs/performance.md)
    monkeypatch.setitem(flashinfer_attention._TRITON_MAX_BATCH, "full", 4)
    monkeypatch.setitem(flashinfer_attention._TRITON_MAX_BATCH, "window", 2)
    kw = dict(sm_scale=SM_SCALE, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE)

    def graph(b, window_left):
        return FlashInferSinkAttention(DEV, window_left=window_left, cuda_graph_batch_size=b,
                                       max_pages_per_request=4, **kw).decode_backend

    assert (graph(4, -1), graph(8, -1), graph(2, 127), graph(4, 127)) == ("triton", "xqa", "triton", "xqa")
    eager = FlashInferSinkAttention(DEV, window_left=-1, **kw)
    gen = torch.Generator().manual_seed(3)
    assert eager._pick_decode(decode_batch([9, 40, 3], gen)[0]) == "triton"
    assert eager._pick_decode(decode_batch([9] * 5, gen)[0]) == "xqa"
    # eager steps follow the graphs' rule (by batch size), whatever the KV tokens they read
    assert [eager._pick_decode(decode_batch([9] * b, gen)[0]) for b in (16, 17)] == ["xqa", "fa2"]
    assert eager._pick_decode(decode_batch([14000] * 5, gen)[0]) == graph(5, -1) == "xqa"  # 70k keys
