"""Random MXFP4 expert layers of gpt-oss-20b's shape (GPU tests of the MXFP4 MoE kernels) and the
float32 reference every MXFP4 MoE kernel test compares against."""

from __future__ import annotations

import torch

from pdserve.kernels.mxfp4 import random_experts as random_layer  # noqa: F401  (the tests' name)


def scale_extremes_expert(g: torch.Generator, scales: list[int], groups: int = 6):
    """One expert (published layout) whose row r has every group at scales[r % len(scales)], rows a multiple of
    the packed layout's tile (TILE_ROWS); random codes, with every code in each row's first 16 bytes (the
    grouped kernels' decode tests)."""
    from pdserve.kernels.mxfp4 import TILE_ROWS, MxExperts

    n = -(-len(scales) // TILE_ROWS) * TILE_ROWS
    blocks = torch.randint(0, 256, (1, n, groups, 16), generator=g, dtype=torch.uint8)
    blocks[0, :, 0] = torch.arange(0, 256, 16, dtype=torch.uint8) | torch.arange(16, dtype=torch.uint8)
    s = torch.tensor(scales, dtype=torch.uint8).repeat(n // len(scales) + 1)[:n]
    s = s[None, :, None].expand(1, n, groups).contiguous()
    z = torch.zeros(1, 32 * groups)
    return MxExperts(blocks, s, z, blocks, s, z)


def every_code_expert(h: int, s_gate_up: int, s_down: int, g: torch.Generator):
    """One expert (published layout, on g's device), H = I = h: every code 4 times in each row, in a
    different order per row (identical rows would cancel to 0); every group of gate/up at scale byte
    s_gate_up, of down at s_down; no biases."""
    from pdserve.kernels.mxfp4 import MxExperts

    dev = g.device

    def blocks(rows):
        codes = torch.arange(16, device=dev).repeat(rows, h // 16)
        codes = torch.gather(codes, 1, torch.argsort(torch.rand(rows, h, device=dev, generator=g), dim=1))
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(1, rows, h // 32, 16)

    def scales(rows, s):
        return torch.full((1, rows, h // 32), s, dtype=torch.uint8, device=dev)

    return MxExperts(blocks(2 * h), scales(2 * h, s_gate_up), torch.zeros(1, 2 * h, device=dev),
                     blocks(h), scales(h, s_down), torch.zeros(1, h, device=dev))


# scale bytes for the decode tests: the ends of the range the packed layout allows (0..PACKED_MAX_SCALE = 192)
# and around 2^(s - 1) leaving bf16 (s = 129)
DECODE_SCALES = [0, 1, 2, 3, 66, 110, 127, 128, 129, 130, 190, 191, 192, 192]


def reference(x, weights, ids, w, bias=True):
    """`experts_forward_ref` in float32 on the exactly dequantised weights of published `w`."""
    from pdserve.kernels.experts import ExpertWeights, experts_forward_ref
    from pdserve.kernels.mxfp4 import dequantize_mxfp4

    rw = ExpertWeights(dequantize_mxfp4(w.gate_up_blocks, w.gate_up_scales, torch.float32), w.gate_up_bias,
                       dequantize_mxfp4(w.down_blocks, w.down_scales, torch.float32), w.down_bias)
    return experts_forward_ref(x.float(), weights.float(), ids, rw, add_down_bias=bias)


def f16_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of the experts folded in f16, row by row, as torch computes them: e the biased exponent of
    the row's largest |x| (at least 15), the row times 2^(141 - e) rounded to f16 (to nearest even), and
    2^(e - 141) (float32)."""
    e = torch.clamp(x.float().abs().amax(1).view(torch.int32) >> 23, min=15)
    up = ((268 - e) << 23).view(torch.float32)
    return (x.float() * up[:, None]).to(torch.float16), ((e - 14) << 23).view(torch.float32)
