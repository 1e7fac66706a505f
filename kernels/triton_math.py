"""Float32 exp and rsqrt that round as torch's CUDA kernels do (libdevice, the functions nvcc's
expf / rsqrtf are), and plain fallbacks for Triton's CPU interpreter, which has no libdevice.

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
