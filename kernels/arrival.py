"""Arrival counters for kernels in which the last program to finish a unit of work reduces it (the
fused router's per-token logit partials, the FP8 linear's split-K tiles).

The counters are int32 zeros between launches: each launch's reducing programs reset the ones they
used. One buffer per (device, kernel): launches on one stream never overlap. A request for more
counters than the buffer holds gets a larger one; the old one stays allocated, because a CUDA graph
captured before keeps reading it.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers that captured graphs may still use


def arrival_counters(device: torch.device, kernel: str, size: int) -> torch.Tensor:
    """`size` counters for `kernel` on `device`, allocated (zeroed) on first use."""
    c = _BUFFERS.get((device, kernel))
    if c is None or c.numel() < size:
        if c is not None:
            _RETIRED.append(c)
        c = _BUFFERS[(device, kernel)] = torch.zeros(size, dtype=torch.int32, device=device)
    return c
