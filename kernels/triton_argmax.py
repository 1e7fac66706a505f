"""The argmax of each row of a decode step's logits, split over many programs.

Why: torch's argmax reduces a row in one thread block, which for the 201088 float32 logits of a
batch-1 step on the H200 took 8.3 us, on the step's critical path: the next step's input is this
id. Here each program takes a chunk of a row and writes the chunk's maximum and its first index; the
last program of the row to arrive (an arrival counter, kernels/arrival.py) reduces the chunks and
stores the id (int64, where the caller wants it: a mapped pinned buffer in the pipelined engine).

The result is torch.argmax's: the first index of the maximum, and where a row holds NaN, its first
NaN (torch orders NaN above every number).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrival import arrival_counters

BLOCK = 2048  # logits a program reads (a 201088 vocabulary: 99 programs a row)


@triton.jit
def _first_max(v, idx, ok, BIG: tl.constexpr):
    """(value, index) of the first maximum of v over `ok` lanes, NaN first (as torch.argmax)."""
    nan = (v != v) & ok
    nan_idx = tl.min(tl.where(nan, idx, BIG), axis=0)
    vals = tl.where(ok & ~nan, v, float("-inf"))
    m = tl.max(vals, axis=0)
    m_idx = tl.min(tl.where(ok & ~nan & (vals == m), idx, BIG), axis=0)
    has_nan = nan_idx < BIG
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_idx, m_idx)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, part_v_ptr, part_i_ptr, count_ptr, n, stride_x,
                   CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(x_ptr + r.to(tl.int64) * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    m, m_idx = _first_max(v, offs, ok, 1 << 30)
    slot = r * CHUNKS + c
    tl.store(part_v_ptr + slot, m)
    tl.store(part_i_ptr + slot, m_idx)
    tl.debug_barrier()  # the partial is stored before the counter moves
    done = tl.atomic_add(count_ptr + r, 1, sem="acq_rel")
    if done == CHUNKS - 1:
        tl.store(count_ptr + r, 0)
        k = tl.arange(0, CHUNKS_P2)
        k_ok = k < CHUNKS
        pv = tl.load(part_v_ptr + r * CHUNKS + k, mask=k_ok, other=0.0, cache_modifier=".cg")
        pi = tl.load(part_i_ptr + r * CHUNKS + k, mask=k_ok, other=0, cache_modifier=".cg")
        # chunks are in index order and each holds its first maximum: the smallest index among the
        # chunks that hold the row's maximum is the row's first
        _, best = _first_max(pv, pi, k_ok, 1 << 30)
        tl.store(out_ptr + r, best.to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for a [rows, V] tensor (V < 2^30; any row stride is taken as it
    is, columns that are not contiguous are copied first) on the GPU, into `out` (int64 [rows], any
    CUDA-addressable memory) when given. No host synchronisation."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, V], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:  # the kernel steps along a row by one element
        logits = logits.contiguous()
    rows, n = logits.shape
    if not 0 < n < 1 << 30:
        raise ValueError(f"argmax_rows takes 1 to 2^30 - 1 columns, got {n}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.dtype != torch.int64 or out.shape != (rows,) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [{rows}], got {out.dtype} {tuple(out.shape)}")
    if rows == 0:
        return out
    chunks = triton.cdiv(n, BLOCK)
    part_v = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    counters = arrival_counters(logits.device, "argmax_rows", rows)
    _argmax_kernel[(chunks, rows)](logits, out, part_v, part_i, counters, n, logits.stride(0),
                                   CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks), BLOCK=BLOCK,
                                   num_warps=4)
    return out
