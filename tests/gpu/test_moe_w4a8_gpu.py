"""bench/moe_w4a8.py's W4A8 probe (FP8 wgmma) on the GPU: fresh random experts and rows, on gate/up's
rows (one and two tokens, experts shared or not) and on down's (a row a pair), against the float64
product of the exactly decoded weights and the activations quantised as the probe quantises them
(`moe_w4a8.reference`). The products are exact and each group's 32 are summed by the tensor core
before the float32 rescale. Hopper's FP8 wgmma is reported to accumulate with 13-14 mantissa bits
(terms aligned to the largest and truncated; DeepSeek-V3 section 3.3.2): modelled on this kernel's
order of sums that is 0.7-2e-5 rel L2, so the bound is 1e-4, where a wrong fragment or descriptor
layout is of the order of 1e-1 and flushed subnormal inputs (e2m1 +-0.5 are e4m3 subnormals) about
1e-2. Every row written
(poisoned with NaN first), and the same launch twice bit-identical (the cluster adds its K shares in
a fixed order)."""

from __future__ import annotations

import pytest
import torch

from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

DEV = torch.device("cuda")


@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("pipe", [True, False])
@pytest.mark.parametrize("experts", [[3, 7, 8, 30], [5, 5, 9, 2, 2, 17, 30, 1]])
def test_probe_matches_its_arithmetic(experts, pipe, which):
    from pdserve.bench import moe_w4a8 as mw
    from pdserve.kernels.mxfp4 import random_experts

    if torch.cuda.get_device_capability(DEV) < (9, 0):
        pytest.skip("wgmma needs Hopper")
    gen = torch.Generator(device=DEV).manual_seed(len(experts) + 2 * pipe)
    w = random_experts(32, gen, DEV)
    wg = w.to_packed()
    top_k = mw.TOP_K if which == "gate_up" else 1  # down: a row a pair
    x = (torch.randn(len(experts) // top_k, mw.KG * 32, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    ids = torch.tensor(experts, dtype=torch.int64, device=DEV)
    kernel = mw._kernel(torch.cuda.current_device(), pipe)
    blocks, scales = getattr(wg, which + "_blocks"), getattr(wg, which + "_scales")
    outs = []
    for _ in range(2):
        out = torch.full((len(experts), blocks.shape[1]), float("nan"), device=DEV)
        mw.rows_w4a8(kernel, blocks, scales, ids, x, top_k, out)
        outs.append(out)
    assert not torch.isnan(outs[0]).any()
    assert rel_l2(outs[0], mw.reference(w, ids, x, top_k, which=which)) < 1e-4
    assert torch.equal(outs[0], outs[1])
