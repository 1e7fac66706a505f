"""The FP8-weight linear kernel (kernels/triton_fp8_linear.py) in Triton's CPU interpreter against
the dequantised float32 reference (`kernels.fp8.fp8_weight_linear_ref`; `fp8_linear_ref` for the
1x128-quantised-activation mode, given the same quantised x).

The kernel runs in a child process with TRITON_INTERPRET=1 (read when triton is imported); this
process draws fresh inputs and compares. float32 activations: the interpreter's bf16 dot is wrong
(the GPU tests cover bf16). Shapes are ragged (K and N not multiples of 128, M not of the tile) and
cover split-K (several programs per tile, the last one reducing), several token tiles, no bias.
Outputs are NaN-filled before the launch (kernels.buffers.POISON), so an unwritten element fails.
Tolerance: rel L2 2e-6 (float32 sums in another order; measured ~2e-7); 8e-3 for bf16 activations (the
interpreter truncates the float32 result to bf16: < 2^-7 relative an element; a wrong scale, row
or decoded byte is off by > 1e-2).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from numerics import rel_l2

pytest.importorskip("triton")

TOL = 2e-6
# name: (M, N, K, config kwargs, bias)
CASES = {
    "ragged": (3, 200, 300, dict(block_n=32), True),
    "ragged-split3": (3, 200, 300, dict(block_n=16, split_k=3), True),
    "two-token-tiles-split2": (20, 96, 520, dict(block_n=64, block_m=16, split_k=2), True),
    "auto-split": (1, 256, 1024, dict(block_n=64), True),
    "no-bias-split4": (5, 130, 1000, dict(block_n=32, split_k=4), False),
    "fp8x-split2": (4, 200, 300, dict(block_n=32, split_k=2, x_fp8=True), True),
    "fp8x": (17, 64, 256, dict(block_n=64, split_k=1, x_fp8=True), False),
    # TMA tensor descriptors (rows 16-byte aligned), and the pointer fallback where they are not
    "tma-split3": (3, 200, 320, dict(block_n=64, split_k=3, tma=True), True),
    "tma-two-token-tiles": (20, 96, 528, dict(block_n=32, block_m=16, split_k=2, tma=True), False),
    "tma-fp8x": (4, 200, 320, dict(block_n=32, split_k=2, x_fp8=True, tma=True), True),
    "tma-fallback": (3, 200, 300, dict(block_n=32, tma=True), True),
    # x quantised inside the kernel (no quantisation launch): rows past M, ragged K, split K
    "fp8xq-split2": (5, 200, 300, dict(block_n=32, split_k=2, x_fp8=True, quant_in_kernel=True), True),
    "tma-fp8xq-two-token-tiles": (20, 96, 528, dict(block_n=32, block_m=16, split_k=1, x_fp8=True,
                                                     quant_in_kernel=True, tma=True), False),
    # the GEMV kernel (block_k > 0): one token (per-thread partial sums), several (per-step dots),
    # ragged K inside a step, N not a multiple of the row tile, split K, two steps prefetched
    "gemv-one-token": (1, 200, 300, dict(block_n=8, block_k=256, split_k=1), True),
    "gemv-one-token-split2-pf2": (1, 136, 1000, dict(block_n=16, block_k=128, split_k=2, prefetch=2), True),
    "gemv-three-tokens-pf2": (3, 72, 700, dict(block_n=8, block_k=256, split_k=1, prefetch=2), False),
    "gemv-16-tokens-split3": (16, 40, 900, dict(block_n=4, block_k=128, split_k=3, num_warps=2), True),
    "gemv-auto-split": (2, 64, 1024, dict(block_n=8, block_k=256, prefetch=2), True),
    "gemv-wide-steps-ragged": (1, 66, 1000, dict(block_n=2, block_k=512, num_warps=1, split_k=1, prefetch=2), True),
    "gemv-wide-steps-split2": (4, 36, 2100, dict(block_n=4, block_k=1024, split_k=2), False),
    # 32-bit-word GEMV (bf16 x): one token, several, split K, ragged K inside a scale group; and
    # float32 x, which runs the byte kernel instead
    "gemvw-one-token-bf16": (1, 72, 1000, dict(block_n=8, block_k=512, num_warps=2, prefetch=2, words=True), True),
    "gemvw-three-tokens-split2-bf16": (3, 40, 900, dict(block_n=4, block_k=256, split_k=2, words=True), False),
    "gemvw-two-tokens-bf16": (2, 24, 520, dict(block_n=8, block_k=128, prefetch=2, words=True), True),
    "gemvw-five-tokens-bf16": (5, 24, 520, dict(block_n=8, block_k=256, words=True), True),
    "gemvw-f32-falls-back": (2, 40, 300, dict(block_n=4, block_k=128, words=True), True),
}


def _case(name: str, seed: int) -> dict:
    from pdserve.kernels.fp8 import quantize_act_fp8, quantize_weight_fp8

    m, n, k, cfg, bias = CASES[name]
    g = torch.Generator().manual_seed(seed)
    wq, ws = quantize_weight_fp8(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g)
    if name.endswith("-bf16"):
        x = x.to(torch.bfloat16)
    xq, xs = quantize_act_fp8(x)
    b = torch.randn(n, generator=g) if bias else None
    return dict(name=name, x=x, xq=xq, xs=xs, w=wq, ws=ws, b=b, cfg=cfg)


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels import buffers
    from pdserve.kernels.triton_fp8_linear import LinearConfig, fp8_linear

    buffers.POISON = True
    results = {}
    for c in torch.load(in_path):
        cfg = LinearConfig(**c["cfg"])
        x_fp8 = (c["xq"], c["xs"]) if cfg.x_fp8 and not cfg.quant_in_kernel else None
        out = fp8_linear(c["x"], c["w"], c["ws"], c["b"], config=cfg, x_fp8=x_fp8)
        again = fp8_linear(c["x"], c["w"], c["ws"], c["b"], config=cfg, x_fp8=x_fp8)  # counters were reset
        results[c["name"]] = dict(out=out, again=again)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    seed = module_seed
    cases = [_case(name, seed + i) for i, name in enumerate(CASES)]
    results = run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("fp8_linear_interp"), seed)
    return {c["name"]: c for c in cases}, results


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(run, name):
    from pdserve.kernels.fp8 import fp8_linear_ref, fp8_weight_linear_ref

    cases, results = run
    c, r = cases[name], results[name]
    if c["cfg"].get("x_fp8"):
        ref = fp8_linear_ref(c["x"], c["w"], c["ws"], c["b"])
    else:
        ref = fp8_weight_linear_ref(c["x"], c["w"], c["ws"], c["b"])
    assert r["out"].shape == ref.shape and r["out"].dtype == c["x"].dtype
    assert not r["out"].isnan().any()
    # bf16 output: the interpreter casts float32 to bf16 by truncation (< 2^-7 relative each)
    assert rel_l2(r["out"].float(), ref) < (TOL if c["x"].dtype == torch.float32 else 8e-3)
    assert torch.equal(r["again"], r["out"])


def test_launch_shapes_leave_no_split_empty():
    from pdserve.kernels.triton_fp8_linear import LinearConfig, launch_shape, select_config

    for n, k in ((5120, 2880), (2880, 4096), (640, 2880), (2880, 512), (200, 300)):
        for m in (1, 3, 16, 17, 64, 300, 8192):
            for split in (0, 1, 2, 3, 7, 64):
                cfg = LinearConfig(block_n=64, split_k=split)
                block_m, s, k_per = launch_shape(cfg, m, n, k)
                num_k = -(-k // 128)
                assert 1 <= s <= num_k and (s - 1) * k_per < num_k <= s * k_per
                assert block_m >= 16 and (block_m >= m or block_m == 64)
                gemv = LinearConfig(block_n=8, block_k=512, split_k=split)
                block_m, s, k_per = launch_shape(gemv, m, n, k)
                num_k = -(-k // 512)
                assert 1 <= s <= num_k and (s - 1) * k_per < num_k <= s * k_per
                assert block_m >= m and block_m < 2 * m
            assert select_config(m, n, k).block_m or m <= 64  # prefill tiles are explicit


def test_bad_inputs_are_refused():
    from pdserve.kernels.fp8 import quantize_weight_fp8
    from pdserve.kernels.triton_fp8_linear import LinearConfig, fp8_linear

    wq, ws = quantize_weight_fp8(torch.randn(64, 256))
    with pytest.raises(ValueError, match="not \\[M, K\\]"):
        fp8_linear(torch.randn(2, 128), wq, ws)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_linear(torch.randn(2, 256), wq.float(), ws)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(torch.randn(2, 256), wq, ws, torch.zeros(63))
    with pytest.raises(ValueError, match="block_n"):
        LinearConfig(block_n=48)
    with pytest.raises(ValueError, match="quant_in_kernel"):
        LinearConfig(quant_in_kernel=True)
    with pytest.raises(ValueError, match="words is a GEMV option"):
        LinearConfig(words=True)
    with pytest.raises(ValueError, match="GEMV block_k"):
        LinearConfig(block_n=8, block_k=192)
    with pytest.raises(ValueError, match="GEMV block_n"):
        LinearConfig(block_n=256, block_k=256)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        fp8_linear(torch.randn(17, 256), wq, ws, config=LinearConfig(block_n=8, block_k=128))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
