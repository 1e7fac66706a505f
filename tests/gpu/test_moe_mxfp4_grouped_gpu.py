"""The expert-grouped MXFP4 kernels (kernels/triton_moe_mxfp4_grouped.py) on the GPU, gpt-oss-20b
expert shape, bf16 activations, fresh random weights and routing, against `experts_forward_ref` in
float32 on the dequantised weights (exact). The weights decode exactly into bf16 and the dots sum
in float32, so the error is the bf16 rounding of the activations between the GEMMs and of the
output: rel L2 6e-3. Also: the inline-PTX decode alone exact for every code at the scale bytes
0..PACKED_MAX_SCALE, a layer at both ends of that range, bitwise deterministic, CUDA-graph replay
equal to the eager call, and the dispatch of kernels.moe.experts_forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mxfp4_layers import DECODE_SCALES, random_layer, reference, scale_extremes_expert
from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("triton")

DEV = torch.device("cuda")


def _layer(e, g):
    return random_layer(e, g, DEV)


_ref = reference


def _problem(t, e, g):
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    return x, ids, weights


@pytest.mark.parametrize("t", [3, 16, 64])
def test_grouped_mxfp4_moe(t):
    from pdserve.kernels.triton_moe_mxfp4_grouped import GroupedConfig, experts_forward_mxfp4_grouped

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g)
    p = w.to_packed()
    x, ids, weights = _problem(t, 8, g)
    ref = _ref(x, weights, ids, w)
    for cfg in (GroupedConfig(), GroupedConfig(32, (128, 128, 4, 3), (64, 256, 4, 3)),
                GroupedConfig(64, (128, 128, 4, 3), (128, 128, 8, 3))):
        out = experts_forward_mxfp4_grouped(x, weights, ids, p, config=cfg)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel_l2(out, ref) < 6e-3, (cfg, rel_l2(out, ref))
        assert torch.equal(out, experts_forward_mxfp4_grouped(x, weights, ids, p, config=cfg))
    nobias = experts_forward_mxfp4_grouped(x, weights, ids, p, add_down_bias=False)
    assert rel_l2(nobias, _ref(x, weights, ids, w, bias=False)) < 6e-3


def test_grouped_mxfp4_decode_exact_at_every_scale():
    from pdserve.kernels.mxfp4 import dequantize_mxfp4
    from pdserve.kernels.triton_moe_mxfp4_grouped import decode_packed_expert

    w = scale_extremes_expert(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item())),
                              DECODE_SCALES)
    p = w.to_packed()
    want = dequantize_mxfp4(w.gate_up_blocks[0], w.gate_up_scales[0], torch.float32)  # on the CPU: subnormals kept
    for tile in ((16, 64), (16, 128), (64, 128)):
        got = decode_packed_expert(p.gate_up_blocks[0].to(DEV), p.gate_up_scales[0].to(DEV), *tile).cpu()
        assert torch.equal(got, want), tile


def test_grouped_mxfp4_moe_scale_extremes():
    """gate/up at the top scale bytes (2^61..2^65: glu and linear clamp), down at the bottom ones
    (products about 2^-120, normal in float32) without its bias, so both decide the output."""
    from pdserve.kernels.triton_moe_mxfp4_grouped import GroupedConfig, experts_forward_mxfp4_grouped

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    hi, lo = random_layer(8, g, DEV, scales=(188, 193)), random_layer(8, g, DEV, scales=(2, 7))
    w = replace(hi, down_blocks=lo.down_blocks, down_scales=lo.down_scales)
    x, ids, weights = _problem(16, 8, g)
    ref = _ref(x, weights, ids, w, bias=False)
    for cfg in (GroupedConfig(), GroupedConfig(64, (128, 128, 4, 3), (128, 128, 4, 3))):
        out = experts_forward_mxfp4_grouped(x, weights, ids, w.to_packed(), add_down_bias=False, config=cfg)
        assert out.abs().max() > 0 and rel_l2(out, ref) < 6e-3, (cfg, rel_l2(out, ref))


def test_grouped_mxfp4_cuda_graph_and_dispatch(monkeypatch):
    """The Triton dispatch (the CUDA mma kernels off: tests/gpu/test_moe_mxfp4_mma_gpu.py has theirs)."""
    from pdserve.kernels import moe

    from pdserve.kernels.triton_moe_mxfp4_grouped import experts_forward_mxfp4_grouped

    monkeypatch.setattr(moe, "MXFP4_MMA_MAX_TOKENS", None)

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g).to_packed()
    x, ids, weights = _problem(16, 8, g)
    experts_forward_mxfp4_grouped(x, weights, ids, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward_mxfp4_grouped(x, weights, ids, w)
    x2, ids2, weights2 = _problem(16, 8, g)
    x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
    graph.replay()
    assert torch.equal(out, experts_forward_mxfp4_grouped(x, weights, ids, w))
    monkeypatch.setattr(moe, "MXFP4_GROUPED_MIN_TOKENS", 8)
    assert torch.equal(moe.experts_forward(x, weights, ids, w), out)
    small = moe.experts_forward(x[:4], weights[:4], ids[:4], w)  # below the bound: the packed GEMV
    from pdserve.kernels.triton_moe_mxfp4 import experts_forward_mxfp4

    assert torch.equal(small, experts_forward_mxfp4(x[:4], weights[:4], ids[:4], w))
    xb, idsb, weightsb = _problem(300, 8, g)  # past the packed GEMV's bound (a prefill): grouped, not the reference
    assert moe.MXFP4_KERNEL_MAX_TOKENS < 300
    assert torch.equal(moe.experts_forward(xb, weightsb, idsb, w), experts_forward_mxfp4_grouped(xb, weightsb, idsb, w))
