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
