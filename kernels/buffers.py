"""Output and scratch buffers of the Triton kernels, optionally poisoned for tests.

With POISON set (tests), `empty` fills every buffer a kernel should overwrite with NaN (e4m3: its NaN
byte; integers: their largest value), so that an element a kernel leaves unwritten fails a test
instead of passing on whatever the allocator left there.
"""

from __future__ import annotations

import torch

POISON = False


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, NaN-filled (or out of range) under POISON."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        if dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        elif dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(dtype).max)
    return t
