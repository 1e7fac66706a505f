"""The decode GEMV (kernels/triton_bf16_gemv.py) in Triton's CPU interpreter against a float64
reference of x @ w^T + bias, on fresh random inputs.

The kernel runs in a child process with TRITON_INTERPRET=1 (read when triton is imported); this
process draws the inputs and compares. Shapes are ragged (K not a multiple of the K step, N not of
the row tile), every token count 1..8, with and without bias, split K (the last program to arrive
reducing the partials) and not. Outputs are NaN-filled before the launch (kernels.buffers.POISON),
so an unwritten element fails. float32 cases: rel L2 2e-6 (float32 sums in another order, ~2e-7
measured). bf16 cases: each element within one bf16 step of the reference (the interpreter casts
float32 to bf16 by truncation, the GPU rounds to nearest: < 2^-7 relative either way) plus 1e-5 of
its magnitude (sum |x w| + |b|); a wrong row, column or token is off by far more.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from numerics import rel_l2

pytest.importorskip("triton")

# name: (M, N, K, config kwargs or None for the default, bias, dtype)
CASES = {
    "f32-1tok-split2": (1, 37, 300, dict(block_n=8, block_k=64, num_warps=2, num_stages=3, split_k=2), True,
                        torch.float32),
    "f32-2tok-split3-nobias": (2, 40, 520, dict(block_n=16, block_k=128, num_warps=4, num_stages=2, split_k=3),
                               False, torch.float32),
    "f32-3tok-nosplit-plain-loads": (3, 24, 200, dict(block_n=8, block_k=32, num_warps=1, num_stages=1, split_k=1),
                                     True, torch.float32),
    "f32-5tok-auto-split-odd-k": (5, 20, 333, dict(block_n=4, block_k=64, num_warps=1), True, torch.float32),
    "f32-6tok-2rows-split4": (6, 33, 400, dict(block_n=2, block_k=128, num_warps=1, num_stages=2, split_k=4), True,
                              torch.float32),
    "f32-8tok-split2-nobias": (8, 30, 260, dict(block_n=8, block_k=64, num_warps=2, num_stages=3, split_k=2), False,
                               torch.float32),
    "bf16-1tok": (1, 40, 300, dict(block_n=8, block_k=128, num_warps=2, split_k=1), True, torch.bfloat16),
    "bf16-4tok-split3-nobias": (4, 37, 520, dict(block_n=8, block_k=64, num_warps=2, split_k=3), False,
                                torch.bfloat16),
    "bf16-7tok": (7, 24, 136, dict(block_n=4, block_k=32, num_warps=1, num_stages=2), True, torch.bfloat16),
    "bf16-8tok-default": (8, 16, 1000, None, True, torch.bfloat16),
    "bf16-3tok-default": (3, 72, 1000, None, True, torch.bfloat16),
}


def _case(name: str, seed: int) -> dict:
    m, n, k, cfg, bias, dtype = CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return dict(name=name, x=x, w=w, b=b, cfg=cfg)


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels import buffers, triton_bf16_gemv
    from pdserve.kernels.triton_bf16_gemv import GemvConfig, bf16_gemv

    buffers.POISON = True
    results = {}
    for c in torch.load(in_path):
        cfg = GemvConfig(**c["cfg"]) if c["cfg"] is not None else None
        out = bf16_gemv(c["x"], c["w"], c["b"], config=cfg)
        again = bf16_gemv(c["x"], c["w"], c["b"], config=cfg)  # the arrival counters were reset
        triton_bf16_gemv.EARLY_WEIGHTS = False  # the first K step read in the loop, not before it
        late = bf16_gemv(c["x"], c["w"], c["b"], config=cfg)
        triton_bf16_gemv.EARLY_WEIGHTS = True
        results[c["name"]] = dict(out=out, again=again, late=late)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    seed = module_seed
    cases = [_case(name, seed + i) for i, name in enumerate(CASES)]
    results = run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("bf16_gemv_interp"), seed)
    return {c["name"]: c for c in cases}, results


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(run, name):
    cases, results = run
    c, r = cases[name], results[name]
    x, w, b = c["x"].double(), c["w"].double(), c["b"]
    ref = x @ w.T + (b.double() if b is not None else 0.0)
    mag = x.abs() @ w.abs().T + (b.double().abs() if b is not None else 0.0)
    out = r["out"]
    assert out.shape == ref.shape and out.dtype == c["x"].dtype
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        assert rel_l2(out, ref) < 2e-6
    else:
        err = (out.double() - ref).abs()
        bound = 2.0**-7 * ref.abs() + 1e-5 * mag
        assert (err <= bound).all(), f"max excess {(err - bound).max():.3e}"
    assert torch.equal(r["again"], out)
    assert torch.equal(r["late"], out)  # EARLY_WEIGHTS moves a read, not an operation


def test_launch_shapes_leave_no_split_empty():
    from pdserve.kernels.triton_bf16_gemv import CONFIGS, DEFAULTS, GemvConfig, launch_shape, select_config

    for n, k in ((5120, 2880), (2880, 4096), (640, 2880), (2880, 512), (37, 300)):
        for cfg in [*DEFAULTS.values(), *CONFIGS.values(),
                    *(GemvConfig(block_n=8, block_k=512, split_k=s) for s in (1, 2, 3, 7, 64))]:
            split, k_per = launch_shape(cfg, n, k)
            num_k = -(-k // cfg.block_k)
            assert 1 <= split <= num_k and (split - 1) * k_per < num_k <= split * k_per
        for m in range(1, 9):
            bucket = 1 << (m - 1).bit_length()
            assert select_config(m, n, k) == CONFIGS.get((n, k, bucket), DEFAULTS[bucket])


def test_bad_inputs_are_refused():
    from pdserve.kernels.triton_bf16_gemv import GemvConfig, bf16_gemv

    w = torch.randn(64, 256)
    with pytest.raises(ValueError, match="not \\[M, K\\]"):
        bf16_gemv(torch.randn(2, 128), w)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        bf16_gemv(torch.randn(9, 256), w)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        bf16_gemv(torch.randn(0, 256), w)
    with pytest.raises(ValueError, match="bf16, float16 or float32"):
        bf16_gemv(torch.randn(2, 256), w.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="contiguous \\[64\\] vector"):
        bf16_gemv(torch.randn(2, 256), w, torch.zeros(63))
    with pytest.raises(ValueError, match="w rows must be contiguous"):
        bf16_gemv(torch.randn(2, 64), torch.randn(64, 64).T)
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=12)
    with pytest.raises(ValueError, match="block_k"):
        GemvConfig(block_k=4)
    with pytest.raises(ValueError, match="bad launch shape"):
        GemvConfig(num_warps=3)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
