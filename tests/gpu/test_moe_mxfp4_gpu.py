"""The MXFP4 decode MoE (kernels/triton_moe_mxfp4.py) on the GPU, gpt-oss-20b expert shape, bf16
activations, fresh random weights and routing, against `experts_forward_ref` in float32 on the
dequantised weights (exact). Tolerance: rel L2 4e-3, the bf16 rounding of the output (float32
sums in another order are ~1e-6 apart). Also: replayed from a CUDA graph on new inputs, and
bitwise deterministic."""

from __future__ import annotations

import pytest
import torch

from numerics import rel_l2

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

DEV = torch.device("cuda")


def _layer(e, g, h=2880, i=2880):
    from pdserve.kernels.triton_moe_mxfp4 import MxExperts

    def mx(rows, cols):
        return (torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=DEV),
                torch.randint(118, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8, device=DEV))

    gb, gs = mx(2 * i, h)
    db, ds = mx(h, i)
    return MxExperts(gb, gs, torch.randn(e, 2 * i, device=DEV, generator=g) * 0.1, db, ds,
                     torch.randn(e, h, device=DEV, generator=g) * 0.1)


def _ref(x, weights, ids, w, bias=True):
    from pdserve.kernels.moe import ExpertWeights, experts_forward_ref
    from pdserve.kernels.mxfp4 import dequantize_mxfp4

    rw = ExpertWeights(dequantize_mxfp4(w.gate_up_blocks, w.gate_up_scales, torch.float32), w.gate_up_bias,
                       dequantize_mxfp4(w.down_blocks, w.down_scales, torch.float32), w.down_bias)
    return experts_forward_ref(x.float(), weights.float(), ids, rw, add_down_bias=bias)


@pytest.mark.parametrize("t", [1, 5, 64])
def test_mxfp4_moe(t):
    from pdserve.kernels.triton_moe_mxfp4 import MxConfig, experts_forward_mxfp4

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g)
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    ref = _ref(x, weights, ids, w)
    for cfg in (MxConfig(), MxConfig((64, 2, 4, 4), (8, 8, 4, 3)), MxConfig((64, 32, 4, 3), (8, 32, 1, 3)),
                MxConfig((32, 4, 4, 3), (16, 4, 4, 3), decode="lut"), MxConfig(decode="v1"),
                MxConfig((64, 256, 4, 3), (32, 256, 4, 3), decode="dot"),
                MxConfig((16, 512, 4, 2), (16, 512, 4, 2), decode="dot")):
        out = experts_forward_mxfp4(x, weights, ids, w, config=cfg)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel_l2(out, ref) < 4e-3, rel_l2(out, ref)
        assert torch.equal(out, experts_forward_mxfp4(x, weights, ids, w, config=cfg))
    nobias = experts_forward_mxfp4(x, weights, ids, w, add_down_bias=False)
    assert rel_l2(nobias, _ref(x, weights, ids, w, bias=False)) < 4e-3


def test_mxfp4_moe_cuda_graph():
    from pdserve.kernels.triton_moe_mxfp4 import experts_forward_mxfp4

    g = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _layer(8, g)
    x = torch.randn(2, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], device=DEV)
    weights = torch.full((2, 4), 0.25, device=DEV, dtype=torch.bfloat16)
    experts_forward_mxfp4(x, weights, ids, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward_mxfp4(x, weights, ids, w)
    x.copy_(torch.randn(2, 2880, device=DEV, generator=g))
    ids.copy_(torch.tensor([[7, 3, 1, 0], [2, 6, 5, 4]], device=DEV))
    graph.replay()
    assert rel_l2(out, _ref(x, weights, ids, w)) < 4e-3


def test_dispatch_of_mxfp4_experts():
    """kernels.moe.experts_forward: the kernel (byte-table decode) for decode-sized batches, the
    bf16 reference on the routed experts above MXFP4_KERNEL_MAX_TOKENS."""
    from pdserve.kernels.moe import MXFP4_KERNEL_MAX_TOKENS, experts_forward, experts_forward_mxfp4_ref
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
