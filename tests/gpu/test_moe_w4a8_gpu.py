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


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("early_x", [False, True])
def test_engine_gate_up_matches_the_mma_path_on_quantised_rows(t, early_x, monkeypatch):
    """kernels/cuda_moe_w4a8.py in the per-pair MoE (`ENABLED`): the whole layer (its gate/up, the mma
    kernels' down) against the mma path given the rows as the W4A8 kernel quantises them (so both see
    the same activations; what is left is the FP8 wgmma's accumulation, ~1e-4 of a layer, and f16 SwiGLU
    outputs), against the unquantised reference within the FP8 activations' rounding, deterministic,
    eager and replayed from a CUDA graph alike."""
    from mxfp4_layers import random_layer, reference
    from pdserve.bench import moe_w4a8 as mw
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels import cuda_moe_w4a8 as w4

    if torch.cuda.get_device_capability(DEV) != (9, 0):
        pytest.skip("wgmma for sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(100 + t + 10 * early_x)
    w = random_layer(32, gen, DEV)
    wp = w.to_packed()
    assert w4.applies(wp, 2880)
    x = torch.randn(t, 2880, device=DEV, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(32, device=DEV, generator=gen)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=gen), -1).to(torch.bfloat16)
    xq = mw.quantize_groups(x).to(torch.bfloat16)  # e4m3 values times powers of two: exact in bf16
    mma = cm.experts_forward_mxfp4_mma(xq, weights, ids, wp)
    monkeypatch.setattr(w4, "ENABLED", True)
    out = cm.experts_forward_mxfp4_mma(x, weights, ids, wp, x_before_routing=early_x)
    assert torch.isfinite(out).all()
    assert rel_l2(out, mma) < 1e-3, rel_l2(out, mma)
    assert rel_l2(out, reference(x, weights, ids, w)) < 5e-2
    assert torch.equal(out, cm.experts_forward_mxfp4_mma(x, weights, ids, wp, x_before_routing=early_x))
    graph = torch.cuda.CUDAGraph()
    static = x.clone()
    with torch.cuda.graph(graph):
        replayed = cm.experts_forward_mxfp4_mma(static, weights, ids, wp, x_before_routing=early_x)
    graph.replay()
    assert torch.equal(replayed, out)
    x2 = torch.randn(t, 2880, device=DEV, generator=gen).to(torch.bfloat16)
    static.copy_(x2)
    graph.replay()
    assert torch.equal(replayed, cm.experts_forward_mxfp4_mma(x2, weights, ids, wp, x_before_routing=early_x))


def test_engine_gate_up_pairs_without_a_local_expert_leave_their_rows(monkeypatch):
    """A pair whose expert id is negative (expert parallelism: another rank's) writes nothing: its
    activation row keeps what was there, as mx_gate_up's."""
    from mxfp4_layers import random_layer
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels import cuda_moe_w4a8 as w4

    if torch.cuda.get_device_capability(DEV) != (9, 0):
        pytest.skip("wgmma for sm_90a")
    gen = torch.Generator(device=DEV).manual_seed(7)
    wp = random_layer(8, gen, DEV).to_packed()
    x = torch.randn(1, 2880, device=DEV, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[3, -1, 5, -1]], device=DEV)
    act = torch.full((4, 2880), 7.0, dtype=torch.float16, device=DEV)
    w4.gate_up(wp, x, ids.view(-1), 4, act, 7.0, 1.702, cm.act_shift(7.0), False, False)
    assert (act[[1, 3]] == 7.0).all() and not (act[[0, 2]] == 7.0).all() and torch.isfinite(act).all()
