"""Decode through engine.cuda_graphs' padded static steps (run eagerly on CPU, capture=False):
the padding to the captured sizes and the pad blocks must not change any real row; the GPU test
(tests/gpu/test_engine_graphs_gpu.py) checks capture and replay."""

from __future__ import annotations

import torch

import pytest

from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, pad_batch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.kernels.paged_batch import PagedBatch
from numerics import rel_l2


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_pad_batch_appends_one_token_requests_on_the_pad_page():
    b = PagedBatch.from_tables([1, 1], [17, 3], [[5, 6], [9]], page_size=16)
    p = pad_batch(b, 4, pad_page=2)
    assert p.batch_size == 4 and p.is_decode
    assert p.kv_lens.tolist() == [17, 3, 1, 1]
    assert p.kv_indices.tolist() == [5, 6, 9, 2, 2]
    with pytest.raises(ValueError, match="exceeds"):
        pad_batch(b, 1, pad_page=2)


@pytest.fixture(scope="module")
def runner(tiny_mxfp4):
    return ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=256)


def test_padded_static_step_matches_the_eager_decode(runner):
    graphs = DecodeGraphs(runner.model, runner.cache, 8, max_context=runner.max_context, capture=False)
    assert all(not runner.cache.allocator.is_free(graphs.pad_block[g]) for g in runner.cache.pools)
    assert len(set(graphs.pad_block.values())) == len(runner.cache.pools)  # one block per group
    g = torch.Generator().manual_seed(3)
    engine = LLMEngine(runner, max_batch_size=8)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    for n in (5, 21, 40):  # contexts inside one page, across pages, past the 16-token window
        engine.add_request(torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist(), params)
    while engine.waiting:
        engine.step()
    seqs = engine.running
    assert len(seqs) == 3  # padded to 4
    for _ in range(3):
        plan = runner.decode_plan(seqs)
        eager = runner.execute(plan)
        static = graphs.run(plan.input_ids, plan.positions, plan.slots, plan.batches)
        assert static.shape == eager.shape == (3, runner.cfg.vocab_size)
        assert rel_l2(static, eager) < 1e-3
        assert torch.equal(static.argmax(-1), eager.argmax(-1))
        for s, tok in zip(seqs, eager.argmax(-1).tolist()):
            s.num_cached += 1
            s.output_ids.append(tok)
    with pytest.raises(ValueError, match="exceeds the largest"):
        graphs.run([0] * 9, [0] * 9, {}, {})
    for s in seqs:
        runner.cache.release(s.blocks)


def test_generation_through_static_steps_equals_eager(tiny_mxfp4):
    """Whole greedy generations, with requests joining and finishing (the padded size changes)."""
    prompts = [torch.randint(0, 201088, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 30, 12)]
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in (6, 3, 9)]
    outs = []
    for static in (False, True):
        r = ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=128)
        if static:
            r.decode_graphs = DecodeGraphs(r.model, r.cache, 4, max_context=r.max_context, capture=False)
        free = r.cache.num_free_blocks
        outs.append([res.output_ids for res in LLMEngine(r, max_batch_size=4).generate(prompts, params)])
        assert r.cache.num_free_blocks == free  # nothing leaked
    assert outs[0] == outs[1]


def test_cuda_graphs_need_cuda(runner):
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(runner.model, runner.cache, 4, max_context=runner.max_context, capture=True)


def test_attention_falls_back_to_torch_without_flashinfer(monkeypatch):
    """A CUDA host without FlashInfer runs the torch attention (the NCCL device run had none);
    asking for FlashInfer or for CUDA-graph attention there is a clear error."""
    import sys

    from pdserve.kernels.attention import TorchSinkAttention, make_sink_attention

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    kw = dict(window_left=-1, sm_scale=0.125, num_qo_heads=64, num_kv_heads=8, head_dim=64, page_size=16)
    assert isinstance(make_sink_attention("cuda", **kw), TorchSinkAttention)
    with pytest.raises(RuntimeError, match="unavailable"):
        make_sink_attention("cuda", backend="flashinfer", **kw)
    with pytest.raises(RuntimeError, match="CUDA-graph"):
        make_sink_attention("cuda", cuda_graph_batch_size=4, max_pages_per_request=8, pad_page=0, **kw)
    with pytest.raises(RuntimeError, match="CUDA-graph"):
        make_sink_attention("cpu", cuda_graph_batch_size=4, max_pages_per_request=8, pad_page=0, **kw)


def _capture_rank(rank: int, init: str, out) -> None:
    """One gloo rank of a 2-rank worker running DecodeGraphs.capture_all on a stub model, in
    three cases: the ranks agree, their sizes differ, rank 1's capture of batch 4 fails."""
    import types

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        for case in ("agree", "sizes", "fails"):
            g = object.__new__(DecodeGraphs)
            g.model = types.SimpleNamespace(device=torch.device("cpu"))
            g.world_size, g.capture, g._steps = 2, True, {}
            g.sizes = [1, 2, 4, 8] if case != "sizes" or rank == 0 else [1, 2, 4]
            order = []

            def capture(size, case=case, g=g, order=order):
                if case == "fails" and rank == 1 and size == 4:
                    raise MemoryError("out of memory capturing batch 4")
                order.append(size)
                g._steps[size] = size

            g._capture = capture
            try:
                g.capture_all()
                result = ("ok", order)
            except Exception as e:  # noqa: BLE001 - reported to the test
                result = ("raised", f"{type(e).__name__}: {e}")
            try:
                g._steps.clear()
                g.run([1], [0], {}, {})
            except RuntimeError as e:
                result += (str(e),)
            out.put((case, rank, result))
    finally:
        dist.destroy_process_group()


def test_multi_rank_capture_is_agreed_or_fails_on_every_rank(tmp_path):
    """Two ranks capture the same sizes in the same order; different sizes, or a capture failing
    on one rank, raise on both (none is left waiting in a collective); no lazy capture later."""
    import torch.multiprocessing as tmp_mp

    ctx = tmp_mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_capture_rank, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(6):
        case, rank, result = out.get(timeout=120)
        results[case, rank] = result
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all("captures every size up front" in r[-1] for r in results.values())
    assert results["agree", 0][:2] == results["agree", 1][:2] == ("ok", [8, 4, 2, 1])
    assert all(results["sizes", r][0] == "raised" and "disagree on the capture sizes" in results["sizes", r][1]
               for r in (0, 1))
    assert results["fails", 1][0] == "raised" and "MemoryError" in results["fails", 1][1]
    assert results["fails", 0][0] == "raised" and "capture of batch size 4" in results["fails", 0][1]
