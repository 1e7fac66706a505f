"""The residual add + RMSNorm after a decode step's MoE, deferred into the kernels on either side.

Why: at decode the norm before each attention block is one CTA whose kernel stands between the MoE's
down projection and the QKV projection, and in the step it adds about 3 us to a layer at one token,
most of it a kernel boundary and an L2 round trip behind the QKV weights' stream (docs/performance.md,
twenty-seventh round). RMSNorm is a per-token scalar times an elementwise product:

    rms_norm(res) * w = r * (res * w),   r = rsqrt(mean(res^2) + eps),

so the projection after it can take the weighted rows res * w and multiply its sums by r. The MoE's
down projection already adds each token's expert outputs row by row (kernels/cuda_moe_mxfp4.py, the
cluster sums of per-pair launches); with MX_DEFER_NORM it writes the new residual res = x + y, the
weighted rows and, per CTA, a partial sum of res^2 instead of y. The FP8 QKV GEMV + RoPE launch
(kernels/cuda_gemv_fp8.py `qkv_rope_fp8`) adds the partials of each token in a fixed order and scales
its sums by r before the bias. No kernel stands between the two.

Numerics: the residual is bit-identical to the norm kernel's (kernels/triton_norm.py: x + bf16(y)
rounded to bf16); the sum of squares is float32 in another order; where the norm kernel rounds
res * r * w to bf16 before the projection, here res * w is rounded and r multiplies the float32 sums.
So the projection's outputs differ from norm-then-project by about one bf16 rounding of its input
(the GPU tests bound it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DeferredNorm:
    """One deferred norm of a step: its inputs (the residual stream x [T, H] bf16 before the MoE's
    output is added, the norm weight float32 [H], eps) and what the MoE writes (`allocate`): the new
    residual [T, H] bf16, the weighted rows bf16(residual * weight) [T, H] and the partial sums of
    residual^2 [T, parts] float32."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    weighted: torch.Tensor | None = None
    sumsq: torch.Tensor | None = None

    def __post_init__(self):
        if self.x.dim() != 2 or self.x.dtype != torch.bfloat16 or not self.x.is_contiguous():
            raise ValueError(f"a deferred norm takes a contiguous bf16 [T, H] residual, got {self.x.dtype} "
                             f"{tuple(self.x.shape)}")
        if self.weight.dtype != torch.float32 or self.weight.shape != (self.x.shape[1],) or not self.weight.is_contiguous():
            raise ValueError(f"the norm weight must be a contiguous float32 [{self.x.shape[1]}]")

    @property
    def inv_h(self) -> float:
        """float32(1 / H): the mean as the norm kernel (and torch's mean) takes it."""
        return float(np.float32(1) / np.float32(self.x.shape[1]))

    def allocate(self, parts: int) -> None:
        """The outputs, for a producer that writes `parts` partial sums a token."""
        self.residual = torch.empty_like(self.x)
        self.weighted = torch.empty_like(self.x)
        self.sumsq = torch.empty(self.x.shape[0], parts, dtype=torch.float32, device=self.x.device)

    def scale(self) -> torch.Tensor:
        """r [T] float32: rsqrt(mean(residual^2) + eps) from the partials (the consumer's value up to
        the order of its sums)."""
        return torch.rsqrt(self.sumsq.sum(dim=1) * self.inv_h + self.eps)

    def normed(self) -> torch.Tensor:
        """The normed rows this stands for, r * weighted, in float32 (tests and references)."""
        return self.weighted.float() * self.scale()[:, None]
