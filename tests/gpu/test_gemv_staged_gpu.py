"""The GEMV that stages its weights in shared memory ahead of its PDL wait (kernels/cuda_gemv_staged.py)
on the GPU, at gpt-oss' O projection [2880, 4096] and its TP-2 share [2880, 2048], fresh random
inputs each run.

Reference: x @ w^T + bias in float32; tolerance: one bf16 rounding of the output plus 1e-5 of the
element's magnitude sum (tests/numerics.py), as for the Triton GEMV it stands in for. Results are
bit-identical from call to call and when replayed from a CUDA graph behind a kernel that writes x.
"""

from __future__ import annotations

import pytest
import torch

from numerics import assert_one_bf16_rounding

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

from pdserve.kernels import cuda_gemv_staged  # noqa: E402
from pdserve.kernels.cuda_gemv_staged import gemv_staged  # noqa: E402

SHAPES = {"o": (2880, 4096), "o tp2": (2880, 2048)}


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not cuda_gemv_staged.available(torch.device("cuda")):
        pytest.skip("the staged GEMV needs Hopper and NVRTC")


def _problem(n: int, k: int, m: int, seed: int, bias: bool = True, row_pad: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16) if bias else None
    x = torch.randn(m, k + row_pad, device="cuda", generator=g).to(torch.bfloat16)[:, :k]
    return x, w, b


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", range(1, 9))
def test_matches_reference(shape, m, seed):
    x, w, b = _problem(*SHAPES[shape], m, seed)
    assert_one_bf16_rounding(gemv_staged(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [1, 3])
def test_without_bias_and_with_strided_rows(m, seed):
    x, w, _ = _problem(*SHAPES["o"], m, seed, bias=False, row_pad=64)
    assert x.stride(0) != x.shape[1]
    assert_one_bf16_rounding(gemv_staged(x, w, None), x, w, None)


def test_graph_replay_behind_a_writer_is_bit_identical(seed):
    """Captured behind a kernel that writes x (the attention's place in the step): each replay reads
    that replay's x (the kernel waits for it), and equals the eager call bit for bit."""
    src, w, b = _problem(*SHAPES["o"], 2, seed)
    x = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.copy_(src)
        gemv_staged(x, w, b)  # compile and load outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            torch.mul(src, 1.0, out=x)
            out = gemv_staged(x, w, b)
    for scale in (1.0, -2.0):
        src.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv_staged(src, w, b))
