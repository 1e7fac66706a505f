"""Decode replayed from CUDA graphs equals the eager decode on the GPU (FlashInfer attention,
Triton FP8 MoE), step by step, while the batch changes size, requests cross pages and the
128-token window, and requests finish and free their blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("flashinfer")


def _start(runner: ModelRunner, prompts: list[list[int]], steps: list[int]) -> list[Sequence]:
    seqs = []
    for i, (p, n) in enumerate(zip(prompts, steps)):
        s = Sequence(f"r{i}", list(p), SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
        s.blocks = runner.cache.reserve(s.max_tokens, len(p))
        s.append(int(runner.prefill(s).argmax()), (), runner.max_context)
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("attention_precision,unembedding_precision", [("bf16", "bf16"), ("fp8", "bf16"),
                                                                    ("fp8", "fp8")])
def test_graph_decode_matches_eager(narrow_ckpt, attention_precision, unembedding_precision, monkeypatch):
    """FP8 attention projections too: up to cuda_gemv_fp8.MAX_TOKENS tokens their QKV GEMV launches at
    the start of the norm before it (kernels/pdl.py's exception), in the replay as in the eager step;
    and an FP8 vocabulary projection, through the streaming FP8 GEMV up to STREAM_MAX_TOKENS tokens."""
    from pdserve.kernels import cuda_gemv_fp8

    precisions = {"attention_precision": attention_precision, "unembedding_precision": unembedding_precision}
    eager = ModelRunner(str(narrow_ckpt), device="cuda", num_kv_blocks=512, **precisions)
    graphs = ModelRunner(str(narrow_ckpt), device="cuda", num_kv_blocks=512, cuda_graph_max_batch=16, **precisions)
    one = torch.zeros(1, graphs.cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    assert graphs.model._qkv_launches_early(0, one) == (attention_precision == "fp8")
    streamed = []
    real = cuda_gemv_fp8.gemv_fp8_stream
    monkeypatch.setattr(cuda_gemv_fp8, "gemv_fp8_stream",
                        lambda x, *a, **k: streamed.append(x.shape[0]) or real(x, *a, **k))
    eager.model.logits(one.expand(cuda_gemv_fp8.STREAM_MAX_TOKENS + 1, -1).contiguous())
    eager.model.logits(one.expand(cuda_gemv_fp8.STREAM_MAX_TOKENS, -1).contiguous())
    assert streamed == ([cuda_gemv_fp8.STREAM_MAX_TOKENS] if unembedding_precision == "fp8" else [])
    assert graphs.decode_graphs is not None and eager.decode_graphs is None
    assert graphs.decode_graphs.sizes == [1, 2, 4, 8, 16]
    free_before = graphs.cache.num_free_blocks
    gen = torch.Generator().manual_seed(0)
    lens = [5, 130, 300, 17, 1000, 64, 15]
    steps = [40, 12, 30, 3, 20, 8, 25]
    prompts = [torch.randint(0, 201088, (n,), generator=gen).tolist() for n in lens]
    se, sg = _start(eager, prompts, steps), _start(graphs, prompts, steps)
    errs, checked = [], 0
    dg = graphs.decode_graphs
    while se:
        le, lg = eager.decode(se), graphs.decode(sg)
        assert torch.isfinite(lg).all()
        # the replay computes exactly what the same padded step computes eagerly
        step = dg._steps[dg.size_for(len(sg))]
        assert torch.equal(lg, dg._forward(step)[: len(sg)])
        errs.append(rel_l2(lg, le))
        checked += len(se)
        toks = le.argmax(-1).tolist()  # teacher forcing: both follow the eager tokens
        keep_e, keep_g = [], []
        for a, b, t in zip(se, sg, toks):
            done = a.append(t, (), eager.max_context)
            b.append(t, (), graphs.max_context)
            if done:
                eager.cache.release(a.blocks)
                graphs.cache.release(b.blocks)
            else:
                keep_e.append(a)
                keep_g.append(b)
        se, sg = keep_e, keep_g
    errs.sort()
    median, worst = errs[len(errs) // 2], errs[-1]
    print(f"graph vs eager decode: median step rel L2 {median:.2e}, worst {worst:.2e} over {checked} rows")
    # Against the plain eager runner the kernels are the same but their splits are not: a padded
    # batch (7 runs as 8) and the graph's fixed page-table width change XQA's split of the keys
    # over CTAs, i.e. the float32 summation order; on this random model (routing near-ties) that
    # measured up to 8.5e-2 per step, the size of the TP2-vs-TP1 differences at 2 layers (4e-2).
    assert median < 5e-2 and worst < 0.2
    assert graphs.cache.num_free_blocks == free_before


def test_graph_decode_over_the_largest_size_runs_eagerly(narrow_ckpt):
    r = ModelRunner(str(narrow_ckpt), device="cuda", num_kv_blocks=256, cuda_graph_max_batch=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    seqs = _start(r, prompts, [4, 4, 4])
    out = r.decode(seqs)  # 3 > 2: the eager path
    assert out.shape == (3, r.cfg.vocab_size) and torch.isfinite(out).all()
    out2 = r.decode(seqs[:2])  # graph of size 2
    assert out2.shape == (2, r.cfg.vocab_size) and torch.isfinite(out2).all()


@pytest.mark.parametrize("zero_copy,stage_max", [("1", None), ("1", 0), ("0", None)])
def test_pipelined_decode_matches_step_by_step(narrow_ckpt, zero_copy, stage_max, monkeypatch):
    """LLMEngine's pipelined decode (the next step launched on the device-side tokens before the
    host reads them; one event wait per step) against the step-by-step engine on the same runner:
    the batches are composed the same way (length ends are known ahead; requests join at the same
    step), so the replays and therefore the greedy tokens are identical. Every way of moving the
    step's inputs and ids: kernels on mapped pinned memory (kernels/step_io.py), the copy engine for
    the staged bytes and a kernel for the fed ids (a staging buffer over STAGE_MAX_BYTES), copies
    only. Rows that end leave gaps, so the next step gathers its fed ids from the in-flight ones."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kernels import step_io

    monkeypatch.setenv("PDSERVE_ZERO_COPY", zero_copy)
    if stage_max is not None:
        monkeypatch.setattr(step_io, "STAGE_MAX_BYTES", stage_max)

    r = ModelRunner(str(narrow_ckpt), device="cuda", num_kv_blocks=512, cuda_graph_max_batch=8)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    prompts = [torch.randint(0, 201088, (int(n),), generator=gen).tolist() for n in (7, 140, 33, 300, 9)]
    lens = [30, 12, 25, 40, 3]
    outs = {}
    for pipeline in (False, True):
        eng = LLMEngine(r, max_batch_size=8, pipeline=pipeline)
        seqs = [eng.add_request(p, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
                for p, n in zip(prompts[:3], lens[:3])]
        step = 0
        while eng.busy:
            if step == 4:  # two join while a step is in flight
                seqs += [eng.add_request(p, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
                         for p, n in zip(prompts[3:], lens[3:])]
            eng.step()
            step += 1
        outs[pipeline] = [s.output_ids for s in seqs]
        assert [len(o) for o in outs[pipeline]] == lens
    assert outs[True] == outs[False]
