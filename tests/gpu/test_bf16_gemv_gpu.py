"""The decode GEMV for bf16 projections (kernels/triton_bf16_gemv.py) on the GPU, at gpt-oss' QKV
[5120, 2880] and O [2880, 4096] shapes with bias, fresh random inputs each run.

Reference: x @ w^T + bias in float32 (IEEE: tests/gpu/conftest.py keeps TF32 off). Tolerance: one
bf16 rounding of the output, elementwise (2^-8 of the reference), plus 1e-5 of the element's
magnitude sum |x w| + |b| for the float32 sums taken in another order. Split-K results are
bit-identical from call to call and in CUDA-graph replay; the engine's projections take the GEMV up
to the token count where it measured faster (FASTER_THAN_CUBLAS_UP_TO) and cuBLAS above.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from numerics import assert_one_bf16_rounding

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("triton")

from pdserve.bench.bf16_gemv import SWEEP  # noqa: E402
from pdserve.kernels.triton_bf16_gemv import GemvConfig, bf16_gemv, launch_shape  # noqa: E402

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
# every candidate the benchmark sweeps, at the largest M of its bucket
CANDIDATES = [(m, cfg) for m, cfgs in SWEEP.items() for cfg in cfgs]


def _problem(n: int, k: int, m: int, seed: int, bias: bool = True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16) if bias else None
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    return x, w, b


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", range(1, 9))
def test_default_matches_reference(shape, m, seed):
    n, k = SHAPES[shape]
    x, w, b = _problem(n, k, m, seed)
    assert_one_bf16_rounding(bf16_gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m,cfg", CANDIDATES, ids=[f"m{m}-{c.label.replace(' ', '-')}" for m, c in CANDIDATES])
def test_candidates_match_reference(shape, m, cfg, seed):
    n, k = SHAPES[shape]
    x, w, b = _problem(n, k, m, seed)
    assert_one_bf16_rounding(bf16_gemv(x, w, b, config=cfg), x, w, b)


def test_no_bias_and_tp_shard_shapes(seed):
    """TP8 shards of 20b: QKV [640, 2880] (8 q + 2 x 1 kv heads), O [2880, 512]; no bias."""
    for n, k in ((640, 2880), (2880, 512)):
        for m in (1, 3):
            x, w, _ = _problem(n, k, m, seed)
            assert_one_bf16_rounding(bf16_gemv(x, w, None), x, w, None)


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("cfg", [None, GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=3, split_k=3)],
                         ids=["default", "split3"])
def test_deterministic_and_graph_replay(m, cfg, seed):
    """Split K sums in split order whatever the arrival order: repeated calls are bit-identical,
    the arrival counters are reset for the next launch, and a CUDA graph replays the same."""
    n, k = SHAPES["o"]
    x, w, b = _problem(n, k, m, seed)
    split, _ = launch_shape(cfg or GemvConfig(), n, k)
    assert cfg is None or split == 3
    first = bf16_gemv(x, w, b, config=cfg)
    for _ in range(5):
        assert torch.equal(bf16_gemv(x, w, b, config=cfg), first)
    static_x = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = bf16_gemv(static_x, w, b, config=cfg)
    for trial in range(3):
        fresh = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + trial))
        static_x.copy_(fresh.to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, bf16_gemv(static_x, w, b, config=cfg))


def test_engine_projection_routing(seed):
    """engine.model._project: the GEMV where it measured faster (bit-identical to calling it),
    cuBLAS elsewhere and without `gemv` (bit-identical to F.linear)."""
    from pdserve.engine.model import _project
    from pdserve.kernels.triton_bf16_gemv import FASTER_THAN_CUBLAS_UP_TO

    for n, k in (SHAPES["qkv"], SHAPES["o"]):
        top = FASTER_THAN_CUBLAS_UP_TO[(n, k)]
        for m in (1, top, top + 1):
            x, w, b = _problem(n, k, m, seed + m)
            out = _project(x, w, b, None, gemv=True)
            expect = bf16_gemv(x, w, b) if m <= top else F.linear(x, w, b)
            assert torch.equal(out, expect), (n, m)
            assert torch.equal(_project(x, w, b, None, gemv=False), F.linear(x, w, b))
