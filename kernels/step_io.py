"""A decode step's inputs in and its sampled ids out, through pinned host memory that the GPU's
kernels read and write directly (zero-copy), not through copy-engine transfers.

Why: a pipelined decode step around its CUDA graph used to be five stream operations: the staged
inputs copied host -> device, the previous step's ids copied device -> device into them, the
replay, the argmax, the ids copied device -> host. Each switch between a copy-engine transfer and
a kernel cost the H200 about 9 us of idle GPU (torch.profiler of the steady state, 20b at batch 1:
~45 us a step idle, ~14 us busy outside the graph, against a 1.67 ms replay). Here a step is three
kernels: `stage_step` reads the staged bytes (and the fed ids) from pinned memory into the graph's
static inputs, the replay, and an argmax whose output lives in pinned memory that the host reads
once an event says the step is done.

Pinned host memory is addressable by the GPU at its host address (unified virtual addressing: every
page-locked allocation of the CUDA runtime is mapped); `mapped` gives it a CUDA tensor view so that
kernels take it as any other device tensor. The reads cross PCIe once per step (the staging: tens of
kilobytes at small batches; larger staging buffers go through the copy engine, `STAGE_MAX_BYTES`)
and the writes are a few int64s.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_math import INTERPRET

BLOCK = 1024  # int32 words a program copies

# Staging buffers up to this size are read by `stage_step` from pinned memory; larger ones go through
# the copy engine first (the kernel then writes only the fed ids). A kernel's reads across PCIe are
# slower than the copy engine's for large buffers: on the H200, a 20b step at batch 64 (2 MB staged:
# one 131k-token page table a request) took 11.64-11.84 ms with the copy and 12.04-12.10 ms reading it
# in the kernel, while batch 8 (256 KB) was level and batch 1 (32 KB) 1-2 % faster.
STAGE_MAX_BYTES = 256 * 1024


def zero_copy(device: torch.device) -> bool:
    """Whether decode steps on `device` move their inputs and ids through mapped pinned memory
    (`PDSERVE_ZERO_COPY=0` keeps the copy-engine transfers: the benchmark's A/B)."""
    return device.type == "cuda" and not INTERPRET and os.environ.get("PDSERVE_ZERO_COPY", "1") != "0"


class _Interface:
    """__cuda_array_interface__ of a pinned host tensor's memory (the device address of a mapped
    page-locked allocation is its host address)."""

    def __init__(self, t: torch.Tensor):
        self.t = t  # keeps the memory alive as long as the view
        typestr = {torch.int64: "<i8", torch.int32: "<i4", torch.uint8: "|u1", torch.float32: "<f4"}[t.dtype]
        self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                         "strides": tuple(s * t.element_size() for s in t.stride()),
                                         "typestr": typestr, "version": 3}


def mapped(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor viewing the pinned host tensor `host` (same memory: kernels read and write the
    host's bytes; the host sees a kernel's writes once the stream has passed it)."""
    if not host.is_pinned():
        raise ValueError("only pinned (page-locked) host memory is mapped into the GPU's address space")
    view = torch.as_tensor(_Interface(host))
    if not view.is_cuda or view.data_ptr() != host.data_ptr():
        raise RuntimeError(f"pinned memory at {host.data_ptr():#x} did not map to a CUDA view of the same address")
    return view


@triton.jit
def _stage_kernel(src_ptr, dst_ptr, n_words, fed_ptr, n_fed_words, BLOCK: tl.constexpr):
    # int32 words; the first n_fed_words come from fed (its int64 ids' little-endian halves)
    w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = w < n_words
    fed_row = w < n_fed_words
    staged = tl.load(src_ptr + w, mask=ok & ~fed_row, other=0)
    fed = tl.load(fed_ptr + w, mask=ok & fed_row, other=0)
    tl.store(dst_ptr + w, tl.where(fed_row, fed, staged), mask=ok)


def stage_step(src: torch.Tensor, dst: torch.Tensor, fed: torch.Tensor | None = None) -> None:
    """dst <- src, byte for byte (uint8, same size, a multiple of 4 bytes), except that its first
    `fed.numel()` int64s are `fed`'s (the token ids the previous step sampled on the device, in the
    order of the rows they feed). src may be a `mapped` pinned buffer, fed a `mapped` or a device
    tensor; one launch on the current stream."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.numel() != dst.numel() or src.numel() % 4:
        raise ValueError(f"src and dst must be uint8 buffers of one size, a multiple of 4 bytes "
                         f"({src.dtype} {src.numel()}, {dst.dtype} {dst.numel()})")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    n_fed = 0 if fed is None else fed.numel()
    if n_fed and (fed.dtype != torch.int64 or not fed.is_contiguous() or 8 * n_fed > dst.numel()):
        raise ValueError(f"fed must be a contiguous int64 tensor of at most {dst.numel() // 8} ids")
    n_words = src.numel() // 4
    if n_words == 0:
        return
    _stage_kernel[(triton.cdiv(n_words, BLOCK),)](
        src.view(torch.int32), dst.view(torch.int32), n_words, (fed if n_fed else dst).view(torch.int32),
        2 * n_fed, BLOCK=BLOCK)
