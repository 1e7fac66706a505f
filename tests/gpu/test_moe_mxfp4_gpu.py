"""The MXFP4 decode MoE (kernels/triton_moe_mxfp4.py) on the GPU, gpt-oss-20b expert shape, bf16
activations, fresh random weights and routing, against `experts_forward_ref` in float32 on the
dequantised weights (exact). Tolerance: rel L2 4e-3, the bf16 rounding of the output (float32
sums in another order are ~1e-6 apart); the "packed" decode sums each word's 4 products per lane
in bf16 (bf16x2 FMAs) and keeps the SwiGLU activations in bf16, about 2x that rounding: 8e-3.
Also: replayed from a CUDA graph on new inputs, and bitwise deterministic."""

from __future__ import annotations

import pytest
import torch

from mxfp4_layers import every_code_expert, random_layer, reference
from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("triton")

DEV = torch.device("cuda")


def _packed():
    from pdserve.kernels.triton_moe_mxfp4 import MxConfig

    return MxConfig((64, 8, 4, 3), (16, 8, 2, 3), decode="packed")


PACKED = _packed()


def _layer(e, g):
    return random_layer(e, g, DEV)


_ref = reference


@pytest.mark.parametrize("t", [1, 5, 64])
def test_mxfp4_moe(t):
    from pdserve.kernels.triton_moe_mxfp4 import PACKED_CONFIG, MxConfig, experts_forward_mxfp4

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g)
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    ref = _ref(x, weights, ids, w)
    for cfg in (MxConfig(), MxConfig((64, 2, 4, 4), (8, 8, 4, 3)), MxConfig((64, 32, 4, 3), (8, 32, 1, 3)),
                MxConfig((32, 4, 4, 3), (16, 4, 4, 3), decode="lut"), MxConfig(decode="v1"),
                MxConfig((64, 256, 4, 3), (32, 256, 4, 3), decode="dot"),
                MxConfig((16, 512, 4, 2), (16, 512, 4, 2), decode="dot"), PACKED,
                MxConfig((64, 16, 4, 3), (16, 16, 2, 3), decode="packed"),
                MxConfig((32, 4, 2, 4), (8, 8, 1, 2), decode="packed"), PACKED_CONFIG):
        wc = w.to_packed() if cfg.decode == "packed" else w
        out = experts_forward_mxfp4(x, weights, ids, wc, config=cfg)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel_l2(out, ref) < (8e-3 if cfg.decode == "packed" else 4e-3), (cfg, rel_l2(out, ref))
        assert torch.equal(out, experts_forward_mxfp4(x, weights, ids, wc, config=cfg))
    nobias = experts_forward_mxfp4(x, weights, ids, w, add_down_bias=False)
    assert rel_l2(nobias, _ref(x, weights, ids, w, bias=False)) < 4e-3


@pytest.mark.parametrize("decode", ["bits", "packed"])
def test_mxfp4_moe_cuda_graph(decode):
    from pdserve.kernels.triton_moe_mxfp4 import MxConfig, experts_forward_mxfp4

    cfg = PACKED if decode == "packed" else MxConfig()
    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g)
    wc = w.to_packed() if decode == "packed" else w
    x = torch.randn(2, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], device=DEV)
    weights = torch.full((2, 4), 0.25, device=DEV, dtype=torch.bfloat16)
    experts_forward_mxfp4(x, weights, ids, wc, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward_mxfp4(x, weights, ids, wc, config=cfg)
    x.copy_(torch.randn(2, 2880, device=DEV, generator=g))
    ids.copy_(torch.tensor([[7, 3, 1, 0], [2, 6, 5, 4]], device=DEV))
    graph.replay()
    eager = experts_forward_mxfp4(x, weights, ids, wc, config=cfg)
    assert torch.equal(out, eager)
    assert rel_l2(out, _ref(x, weights, ids, w)) < (8e-3 if decode == "packed" else 4e-3)


def test_packed_decode_every_code_and_scale(seed):
    """Each e2m1 code at every position of a word, scales 2^-60..2^60 and activations 2^-61..2^20:
    the packed decode (subnormal bf16 lanes for +-0.5, the 2^64 activation prescale, the 2^(s-65)
    rescale) against the exact float32 product, one expert, one token, no bias. (Activations below
    2^-65 would underflow the bf16 products: the kernel's stated range.) Tolerance 1.5e-2: with
    K = 64 (two groups) the bf16 rounding of each word's 4-product partial sums is not averaged
    down by a long sum, and +-codes cancel in the output; a wrong code or scale is off by > 1e-1.
    Each case's scale times its activations keeps the gate/up sums within a few units (|sum| of
    order 2^(s - 127) x scale x 24), where the clamped SwiGLU is smooth: with sums of order 2^80 (the
    case scale 2^60 x activations 2^20 this test had) the clamp turns into a step at 0 on the
    rounding's scale, and a row whose exact sum fell within the rounding of 0 (some runs) flipped
    its activation between 0 and 56, a rel L2 of 0.13."""
    from pdserve.kernels.triton_moe_mxfp4 import experts_forward_mxfp4

    g = torch.Generator(device=DEV).manual_seed(seed)
    h = 64
    for s, xs in ((97, 2.0**-20), (127, 2.0**-3), (187, 2.0**-61), (67, 2.0**20), (140, 2.0**-20)):
        w = every_code_expert(h, s, s, g)
        x = (torch.randn(1, h, device=DEV, generator=g) * xs).to(torch.bfloat16)
        ids = torch.zeros(1, 1, dtype=torch.long, device=DEV)
        ones = torch.ones(1, 1, dtype=torch.bfloat16, device=DEV)
        got = experts_forward_mxfp4(x, ones, ids, w.to_packed(), add_down_bias=False, config=PACKED)
        want = _ref(x, ones, ids, w, bias=False)
        assert torch.isfinite(got).all()
        err = float((got.double() - want.double()).norm() / want.double().norm())  # float64: tiny magnitudes
        assert err < 1.5e-2, (s, xs, err)


def test_dispatch_of_mxfp4_experts():
    """kernels.moe.experts_forward: the kernel (byte-table decode) for decode-sized batches, the
    bf16 reference on the routed experts above MXFP4_KERNEL_MAX_TOKENS."""
    from pdserve.kernels.experts import experts_forward_mxfp4_ref
    from pdserve.kernels.moe import MXFP4_KERNEL_MAX_TOKENS, experts_forward
    from pdserve.kernels.triton_moe_mxfp4 import MxConfig, experts_forward_mxfp4

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g)
    for t in (3, MXFP4_KERNEL_MAX_TOKENS + 1):
        x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
        out = experts_forward(x, weights, ids, w)
        want = (experts_forward_mxfp4(x, weights, ids, w, config=MxConfig()) if t <= MXFP4_KERNEL_MAX_TOKENS
                else experts_forward_mxfp4_ref(x, weights, ids, w))
        assert torch.equal(out, want)
        assert rel_l2(out, _ref(x, weights, ids, w)) < 2e-2  # the bf16 reference rounds each stage
