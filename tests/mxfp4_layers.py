"""Random MXFP4 expert layers of gpt-oss-20b's shape (GPU tests of the MXFP4 MoE kernels) and the
float32 reference every MXFP4 MoE kernel test compares against."""

from __future__ import annotations

import torch


def random_layer(e: int, g: torch.Generator, device: torch.device | str = "cpu", h: int = 2880, i: int = 2880,
                 scales: tuple[int, int] = (118, 124), bias_std: float = 0.1):
    """`e` experts [h, i] in the published MXFP4 layout: random codes, scale exponents in
    [scales[0], scales[1]) (biased by 127), biases ~ N(0, bias_std)."""
    from pdserve.kernels.mxfp4 import MxExperts

    def mx(rows, cols):
        return (torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=device),
                torch.randint(*scales, (e, rows, cols // 32), generator=g, dtype=torch.uint8, device=device))

    gb, gs = mx(2 * i, h)
    db, ds = mx(h, i)
    return MxExperts(gb, gs, torch.randn(e, 2 * i, device=device, generator=g) * bias_std, db, ds,
                     torch.randn(e, h, device=device, generator=g) * bias_std)


def reference(x, weights, ids, w, bias=True):
    """`experts_forward_ref` in float32 on the exactly dequantised weights of published `w`."""
    from pdserve.kernels.moe import ExpertWeights, experts_forward_ref
    from pdserve.kernels.mxfp4 import dequantize_mxfp4

    rw = ExpertWeights(dequantize_mxfp4(w.gate_up_blocks, w.gate_up_scales, torch.float32), w.gate_up_bias,
                       dequantize_mxfp4(w.down_blocks, w.down_scales, torch.float32), w.down_bias)
    return experts_forward_ref(x.float(), weights.float(), ids, rw, add_down_bias=bias)
