"""The FP8 attention projections (kernels/triton_fp8_linear.py) on the GPU against the plain-torch
path (the dequantised weights in float32 on the CPU: `kernels.fp8.fp8_weight_linear_ref`, or
`fp8_linear_ref` for the 1x128-quantised-activation mode), at gpt-oss' QKV [5120, 2880] and O
[2880, 4096] shapes with bias, fresh random inputs each run.

Tolerance: rel L2 4e-3 = the bf16 rounding of the output (~1.1e-3 RMS) with margin; the float32
sums differ from the reference only in order (the FP8 tensor-core mode also in Hopper's reduced
precision inside each 128-deep step, measured 1e-4 on the MoE GEMMs). Split-K results are
bit-identical from call to call and in CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("triton")

from pdserve.kernels.fp8 import fp8_linear_ref, fp8_weight_linear_ref, quantize_weight_fp8  # noqa: E402
from pdserve.kernels.triton_fp8_linear import GEMV_MAX_M, LinearConfig, fp8_linear, launch_shape  # noqa: E402

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
TOL = 4e-3
CONFIGS = {
    "default": None,
    "n64-split4": LinearConfig(block_n=64, split_k=4),
    "n32-nosplit": LinearConfig(block_n=32, split_k=1, num_stages=6),
    "n128-auto": LinearConfig(block_n=128, num_stages=3),
    "fp8x-n64": LinearConfig(block_n=64, x_fp8=True),
    "fp8x-n128-split3": LinearConfig(block_n=128, split_k=3, x_fp8=True),
    "tma-n64": LinearConfig(block_n=64, tma=True),
    "tma-n64-nosplit": LinearConfig(block_n=64, split_k=1, tma=True),
    "tma-fp8x-n64": LinearConfig(block_n=64, x_fp8=True, tma=True),
    # x quantised inside the kernel, and every config of bench/fp8_linear.py's CANDIDATES
    "fp8xq-n64": LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True),
    "fp8xq-n64-tma": LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, tma=True),
    "fp8xq-n128": LinearConfig(block_n=128, x_fp8=True, quant_in_kernel=True, num_stages=4),
    "fp8xq-n64-split2": LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, split_k=2),
    "fp8xq-n64-split3": LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, split_k=3),
    "fp8xq-n64-split3-tma": LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, split_k=3, tma=True),
    "fp8xq-n128-w8-tma": LinearConfig(block_n=128, x_fp8=True, quant_in_kernel=True, num_warps=8, num_stages=3,
                                      tma=True),
    "fp8xq-n128-w8-tma-split4": LinearConfig(block_n=128, x_fp8=True, quant_in_kernel=True, num_warps=8,
                                             num_stages=3, split_k=4, tma=True),
    "fp8x-n64-split2": LinearConfig(block_n=64, x_fp8=True, split_k=2),
    # the GEMV kernel (at most GEMV_MAX_M tokens: 64 is refused)
    "gemv-n4-k512-w2-pf2": LinearConfig(block_n=4, block_k=512, num_warps=2, prefetch=2),
    "gemv-n8-k512-w2-pf2": LinearConfig(block_n=8, block_k=512, num_warps=2, prefetch=2),
    "gemv-n4-k1024-w4-pf2": LinearConfig(block_n=4, block_k=1024, num_warps=4, prefetch=2),
    "gemv-n2-k512-w1-pf2": LinearConfig(block_n=2, block_k=512, num_warps=1, prefetch=2),
    "gemvw-n16-k512-w4-pf2": LinearConfig(block_n=16, block_k=512, num_warps=4, prefetch=2, words=True),
    "gemvw-n8-k512-w2-pf2": LinearConfig(block_n=8, block_k=512, num_warps=2, prefetch=2, words=True),
    "gemvw-n8-k512-w4-pf2": LinearConfig(block_n=8, block_k=512, num_warps=4, prefetch=2, words=True),
    "gemvw-n4-k512-w2-pf2": LinearConfig(block_n=4, block_k=512, num_warps=2, prefetch=2, words=True),
    "gemvw-n8-k1024-w4-pf2": LinearConfig(block_n=8, block_k=1024, num_warps=4, prefetch=2, words=True),
    "gemvw-n8-k512-split3": LinearConfig(block_n=8, block_k=512, num_warps=2, split_k=3, words=True),
    "gemv-n8-k512-w2-split3": LinearConfig(block_n=8, block_k=512, num_warps=2, split_k=3, prefetch=2),
}


def _problem(n: int, k: int, m: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    wq, ws = quantize_weight_fp8(w)
    b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    return x, wq, ws, b


def _reference(x, wq, ws, b, x_fp8: bool) -> torch.Tensor:
    ref = fp8_linear_ref if x_fp8 else fp8_weight_linear_ref
    return ref(x.cpu(), wq.cpu(), ws.cpu(), None if b is None else b.cpu())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_matches_reference(shape, m, name, seed):
    n, k = SHAPES[shape]
    cfg = CONFIGS[name]
    x, wq, ws, b = _problem(n, k, m, seed)
    if cfg is not None and cfg.block_k and m > GEMV_MAX_M:
        with pytest.raises(ValueError, match="GEMV kernel takes at most"):
            fp8_linear(x, wq, ws, b, config=cfg)
        return
    out = fp8_linear(x, wq, ws, b, config=cfg)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    x_fp8 = cfg is not None and cfg.x_fp8
    err = rel_l2(out.float().cpu(), _reference(x, wq, ws, b, x_fp8))
    assert err < TOL, (shape, m, name, err)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", [name for name, cfg in CONFIGS.items() if cfg is not None and cfg.block_k])
def test_gemv_most_tokens(shape, name, seed):
    """The GEMV kernel at GEMV_MAX_M tokens (each token's dot reduced every K step)."""
    n, k = SHAPES[shape]
    x, wq, ws, b = _problem(n, k, GEMV_MAX_M, seed)
    out = fp8_linear(x, wq, ws, b, config=CONFIGS[name])
    assert rel_l2(out.float().cpu(), _reference(x, wq, ws, b, False)) < TOL


PREFILL_CONFIGS = {
    "default": None,
    "n64m128": LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4),
    "n64m128-fp8x": LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4, x_fp8=True),
    "n128m128-tma": LinearConfig(block_n=128, block_m=128, split_k=1, num_warps=8, num_stages=3, tma=True),
    "n64m128-fp8x-tma": LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4, x_fp8=True,
                                     tma=True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(PREFILL_CONFIGS))
def test_prefill_matches_reference(shape, name, seed):
    n, k = SHAPES[shape]
    cfg = PREFILL_CONFIGS[name]
    x, wq, ws, b = _problem(n, k, 300, seed)  # 300: ragged against the 128-token tile
    out = fp8_linear(x, wq, ws, b, config=cfg)
    x_fp8 = cfg is not None and cfg.x_fp8
    assert rel_l2(out.float().cpu(), _reference(x, wq, ws, b, x_fp8)) < TOL


def test_no_bias_and_tp_shard_shapes(seed):
    """TP8 shards of 20b: QKV [640, 2880] (8 q + 2 x 1 kv heads), O [2880, 512]; no bias."""
    for n, k in ((640, 2880), (2880, 512)):
        x, wq, ws, _ = _problem(n, k, 5, seed)
        out = fp8_linear(x, wq, ws, None)
        assert rel_l2(out.float().cpu(), _reference(x, wq, ws, None, False)) < TOL


@pytest.mark.parametrize("name", ["default", "fp8x-n128-split3", "tma-n64", "fp8xq-n64", "gemv-n8-k512-w2-split3",
                                  "gemvw-n8-k512-split3"])
def test_split_k_deterministic_and_graph_replay(name, seed):
    """Split-K sums in split order whatever the arrival order: repeated calls are bit-identical,
    the arrival counters are reset for the next launch, and a CUDA graph replays the same."""
    n, k = SHAPES["qkv"]
    cfg = CONFIGS[name]
    x, wq, ws, b = _problem(n, k, 2, seed)
    _, split, _ = launch_shape(cfg or LinearConfig(), 2, n, k)
    assert split > 1
    first = fp8_linear(x, wq, ws, b, config=cfg)
    for _ in range(5):
        assert torch.equal(fp8_linear(x, wq, ws, b, config=cfg), first)
    static_x = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_linear(static_x, wq, ws, b, config=cfg)
    for trial in range(3):
        fresh = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + trial))
        static_x.copy_(fresh.to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, fp8_linear(static_x, wq, ws, b, config=cfg))


def test_engine_fp8_attention(tmp_path):
    """The engine with FP8 projections: logits close to bf16 projections (weight rounding, the
    bound 8e-2 of the CPU test), and a decode step replayed from a CUDA graph bit-identical to the
    same padded step run eagerly."""
    pytest.importorskip("flashinfer")
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    cfg = dataclasses.replace(preset("20b"), hidden_size=640, intermediate_size=768, num_hidden_layers=2,
                              num_local_experts=8, layer_types=())
    ckpt = make_random_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (50,)).tolist()
    bf16 = ModelRunner(str(ckpt), device="cuda", num_kv_blocks=256).prompt_logits(ids)
    runner = ModelRunner(str(ckpt), device="cuda", num_kv_blocks=256, attention_precision="fp8",
                         cuda_graph_max_batch=4)
    assert runner.model.w.layers[0][0].qkv_weight.dtype == torch.float8_e4m3fn
    fp8 = runner.prompt_logits(ids)
    assert rel_l2(fp8, bf16) < 8e-2
    seqs = []
    for i, p in enumerate([ids[:7], ids[:20], ids[:33]]):
        s = Sequence(f"r{i}", list(p), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        s.blocks = runner.cache.reserve(s.max_tokens, len(p))
        s.append(int(runner.prefill(s).argmax()), (), runner.max_context)
        seqs.append(s)
    dg = runner.decode_graphs
    assert dg is not None
    logits = runner.decode(seqs)
    step = dg._steps[dg.size_for(len(seqs))]
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, dg._forward(step)[: len(seqs)])
