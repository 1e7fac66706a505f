"""gpt-oss' clamped SwiGLU on interleaved gate/up channels."""

from __future__ import annotations

import torch


def swiglu(x: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """x [..., 2I] with glu at even and linear at odd channels -> [..., I], same dtype.

    glu is clamped above at `limit`, linear to [-limit, limit];
    out = glu * sigmoid(alpha * glu) * (linear + 1).
    """
    glu, lin = x[..., ::2], x[..., 1::2]
    glu = glu.clamp(max=limit)
    lin = lin.clamp(min=-limit, max=limit)
    return glu * torch.sigmoid(alpha * glu) * (lin + 1)
