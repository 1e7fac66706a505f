"""Random MXFP4 expert layers of gpt-oss-20b's shape (GPU tests of the MXFP4 MoE kernels) and the
float32 reference every MXFP4 MoE kernel test compares against."""

from __future__ import annotations

import torch


def random_layer(e: int, g: torch.Generator, device: torch.device, h: int = 2880, i: int = 2880):
    """`e` experts in the published MXFP4 layout, scales 2^-9..2^-4, biases ~0.1."""
    from pdserve.kernels.mxfp4 import MxExperts

    def mx(rows, cols):
        return (torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=device),
                torch.randint(118, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8, device=device))

    gb, gs = mx(2 * i, h)
    db, ds = mx(h, i)
    return MxExperts(gb, gs, torch.randn(e, 2 * i, device=device, generator=g) * 0.1, db, ds,
                     torch.randn(e, h, device=device, generator=g) * 0.1)


def reference(x, weights, ids, w, bias=True):
    """`experts_forward_ref` in float32 on the exactly dequantised weights of published `w`."""
    from pdserve.kernels.moe import ExpertWeights, experts_forward_ref
    from pdserve.kernels.mxfp4 import dequantize_mxfp4

    rw = ExpertWeights(dequantize_mxfp4(w.gate_up_blocks, w.gate_up_scales, torch.float32), w.gate_up_bias,
                       dequantize_mxfp4(w.down_blocks, w.down_scales, torch.float32), w.down_bias)
    return experts_forward_ref(x.float(), weights.float(), ids, rw, add_down_bias=bias)
