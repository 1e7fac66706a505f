"""MXFP4 (OCP microscaling FP4) decoding, as stored in the published gpt-oss checkpoints.

`*_blocks` is uint8 [..., rows, cols/32, 16]: 32 e2m1 values per group, two per byte, low nibble
first. `*_scales` is uint8 [..., rows, cols/32]: the group's power-of-two exponent, biased by 127.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# e2m1 code -> value; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


def unpack_fp4_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G, 16] -> int64 codes [..., G, 32], low nibble first."""
    lo = (blocks & 0x0F).long()
    hi = (blocks >> 4).long()
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Decode to `dtype` [..., rows, cols]. Exact for bf16/fp32 (every value is k * 2^e)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("MXFP4 blocks and scales must be uint8")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = lut[unpack_fp4_codes(blocks)]  # [..., G, 32]
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exp.unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `w` [..., rows, cols] to MXFP4 (nearest e2m1 per group, shared power-of-two scale).

    Used to write random checkpoints in the published layout; the scale is chosen so the group's
    largest magnitude lands at or below 6.0.
    """
    *lead, rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"cols ({cols}) must be a multiple of {GROUP}")
    g = w.float().reshape(*lead, rows, cols // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    mag = scaled.abs().unsqueeze(-1)
    code = (mag - lut).abs().argmin(-1)  # nearest magnitude
    code = code + 8 * (scaled < 0).long() * (code > 0).long()
    pairs = code.reshape(*lead, rows, cols // GROUP, GROUP // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales


@dataclass
class MxExperts:
    """One layer's experts kept in MXFP4 (the layout above) with float32 biases.
    gate_up_blocks [E, 2I, H/32, 16], gate_up_scales [E, 2I, H/32], down_blocks [E, H, I/32, 16],
    down_scales [E, H, I/32] (uint8); gate_up_bias [E, 2I], down_bias [E, H]."""

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    gate_up_bias: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    down_bias: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.gate_up_blocks.shape[0]
