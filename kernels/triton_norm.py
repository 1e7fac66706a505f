"""Residual add + RMSNorm in one Triton launch (the norm before each attention and MoE block).

The plain path (`engine.model.rms_norm` after `x + delta`) is eight elementwise / reduction
kernels per norm (float cast, square, mean, add eps, rsqrt, two multiplies, cast back) plus the
residual add; at decode each is a few microseconds of launch-bound work, 49 norms per step.

Same arithmetic as the plain path, one row per program: the residual sum is rounded to x.dtype
(as `x + delta` is), then float32 sum of squares, mean as sum x float32(1/H) (torch's mean),
rsqrt(mean + eps) (libdevice's, as torch.rsqrt), times the row, times the float32 weight,
rounded to x.dtype. Only the order of the float32 sum of squares differs (a
tree here, torch's reduction tree there), so the normed output may differ from the plain path's by
one rounding step of x.dtype in rare elements; the residual output is bit-identical.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .pdl import enter, launch_options, launch_then_wait
from .triton_math import INTERPRET, rsqrt_f32


# With a delta (the residual add), read ahead of the PDL wait (kernels/pdl.py): the norm's weights and
# the residual row x (the engine's residual stream, written by the norm one block back, at least three
# kernels before this one), so that after the wait only the block's output is read. The weights were
# last read a step ago and come from DRAM: otherwise theirs is the longest of the reads after the wait.
EARLY_READS = True


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, H, inv_h, eps,
    stride_x, stride_d, stride_r, stride_o,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, ACCURATE: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    if EARLY:  # EARLY_READS; x through L2 only: x was written by a kernel of the step (kernels/pdl.py)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0, cache_modifier=".cg")
    if EARLY_LAUNCH:
        launch_then_wait(PDL)
    else:
        enter(PDL)
    if not EARLY:
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=m)
    t = x.to(tl.float32)
    mean = tl.sum(t * t, axis=0) * inv_h
    r = rsqrt_f32(mean + eps, ACCURATE)
    if not EARLY:
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, ((t * r) * w).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, early_launch: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, H] -> (x + delta, rms_norm(x + delta) * weight), both in x.dtype.
    With delta None: (x, rms_norm(x) * weight). With a delta, x and the weights are read ahead of
    the PDL wait (EARLY_READS): x must have been written before the kernel ahead of this one ran, as
    the residual stream is. `early_launch`: the next kernel may launch at this one's start, before its
    PDL wait (kernels/pdl.py's exception: the caller vouches that it reads nothing but weights ahead of
    its own wait)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with unit column stride, got {tuple(x.shape)}")
    t, h = x.shape
    if weight.shape != (h,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{h}] vector, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    if delta is not None:
        if delta.shape != x.shape or delta.stride(1) != 1:
            raise ValueError(f"delta {tuple(delta.shape)} must match x {tuple(x.shape)}")
        res = torch.empty_like(x)
        d, sd = delta, delta.stride(0)
    else:
        res, d, sd = x, x, 0
    if t:
        block = triton.next_power_of_2(h)
        _add_rms_norm_kernel[(t,)](
            x, d, weight, res, out, h, float(np.float32(1) / np.float32(h)), eps,
            x.stride(0), sd, res.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=block, ACCURATE=not INTERPRET, EARLY_LAUNCH=early_launch,
            EARLY=EARLY_READS and delta is not None,
            num_warps=max(1, min(16, block // 256)),
            **launch_options(x.device),
        )
    return res, out
