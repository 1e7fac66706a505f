"""Error measures the tests share."""

from __future__ import annotations

import torch


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def assert_one_bf16_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """out = x @ w^T + b within one bf16 rounding of the float32 reference, elementwise (2^-8 of it),
    plus 1e-5 of the element's magnitude sum |x w| + |b| for float32 sums taken in another order."""
    xf, wf = x.float(), w.float()
    ref = xf @ wf.T
    mag = xf.abs() @ wf.abs().T
    if b is not None:
        ref, mag = ref + b.float(), mag + b.float().abs()
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    excess = (out.float() - ref).abs() - (2.0**-8 * ref.abs() + 1e-5 * mag)
    assert excess.max() <= 0, f"{(excess > 0).sum()} elements past one bf16 rounding, worst by {excess.max():.3e}"
