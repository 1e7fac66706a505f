"""Float32 math the kernels share: exp and rsqrt that round as torch's CUDA kernels do (libdevice,
the functions nvcc's expf / rsqrtf are, with plain fallbacks for Triton's CPU interpreter, which
has no libdevice), and gpt-oss' clamped SwiGLU.

Kernels pass `ACCURATE=not INTERPRET`; the interpreter evaluates both in numpy float32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def exp_f32(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return tl.extra.cuda.libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def rsqrt_f32(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return tl.extra.cuda.libdevice.rsqrt(x)
    else:
        return 1.0 / tl.sqrt(x)


@triton.jit
def swiglu_f32(glu, lin, limit, alpha):
    """gpt-oss' clamped SwiGLU (kernels/swiglu.py) on float32 glu and linear values."""
    glu = tl.minimum(glu, limit)
    lin = tl.clamp(lin, -limit, limit)
    return glu * tl.sigmoid(alpha * glu) * (lin + 1.0)


@triton.jit
def packed_group(rows, g, K_GROUPS: tl.constexpr):
    """Where group g of row `rows` of one expert's packed MXFP4 blocks lies, in 16-byte groups: each 16-row
    tile stored tile-major (kernels/mxfp4.py TILE_ROWS), step g // 4 of the tile's rows one after the other, row
    r's 4 groups at 4 r; the partial last step (q = K_GROUPS % 4 groups a row) after the whole ones, row r's
    groups at 2 q (r % 8) + q (r // 8)."""
    WHOLE: tl.constexpr = K_GROUPS // 4 * 4
    Q: tl.constexpr = K_GROUPS - WHOLE
    r = rows % 16
    within = tl.where(g < WHOLE, (g // 4) * 64 + r * 4 + g % 4, WHOLE * 16 + 2 * Q * (r % 8) + Q * (r // 8) + g - WHOLE)
    return (rows // 16) * (16 * K_GROUPS) + within
