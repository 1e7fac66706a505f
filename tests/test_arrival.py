"""kernels/arrival.py: one zeroed counter buffer per (device, kernel), grown on demand without
freeing the old one (a CUDA graph captured earlier keeps its pointer)."""

from __future__ import annotations

import weakref

import torch

from pdserve.kernels.arrival import arrival_counters


def test_counters_are_shared_grown_and_the_outgrown_buffer_stays_alive():
    dev = torch.device("cpu")
    small = arrival_counters(dev, "test-arrival", 8)
    assert small.dtype == torch.int32 and small.numel() == 8 and not small.any()
    assert arrival_counters(dev, "test-arrival", 4) is small  # enough: the same buffer
    assert arrival_counters(dev, "test-arrival-other", 4) is not small  # one per kernel
    old = weakref.ref(small)
    del small
    big = arrival_counters(dev, "test-arrival", 64)
    assert big.numel() == 64 and not big.any()
    assert old() is not None and old().numel() == 8  # still allocated
