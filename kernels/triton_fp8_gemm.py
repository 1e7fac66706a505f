"""Grouped FP8 GEMMs of the MoE experts (Triton; WGMMA on Hopper), on block-aligned routed rows.

Both kernels read the routing layout written by `kernels.triton_moe.align_routing`: rows are
(token, slot) pairs sorted by local expert, each expert's segment padded to whole ROUTE_M blocks;
`sorted_slot[r]` is the flat pair index t * top_k + j of row r (-1 for padding) and
`block_expert[b]` the expert of block b (-1 for unused blocks, whose programs return at once).
A program covers BLOCK_M rows (ROUTE_M is a multiple of BLOCK_M, so they share one expert).

Arithmetic is the one `kernels.experts._expert_mlp_fp8` emulates: e4m3 operands, one float32 scale
per 1x128 activation group and per 128x128 weight block, promoted once per 128-wide K step, and
a float32 accumulator that starts from the expert bias (loaded once per output tile, before the K
loop). K = 2880 ends in a 64-wide block: the loads are masked with zero fill. BLOCK_K is the
128-wide scale group (the launchers enforce it), so K step kb uses scale column kb.

- `_gate_up_kernel`: [rows, H] x [2I, H]^T + bias, clamped SwiGLU on the interleaved columns
  (glu even, linear odd) in the epilogue, then 1x128 FP8 quantisation of the I-wide result for the
  down GEMM. A tile of 256 gate/up columns gives exactly one 128-wide activation group, so
  BLOCK_N is 256. Its A operand is either pre-quantised FP8 (gathered by token) or bf16 that is
  quantised in the prologue (decode: saves a launch, the tile is a few rows).
- `_down_kernel`: [rows, I] x [H, I]^T (+ bias), scaled by the routing weight and scattered to
  one float32 row per (token, slot) pair; `kernels.triton_moe` sums a token's pairs.

Small decode batches leave most of the 132 SMs idle and each program's K loop latency-bound, so
both kernels can split K over SPLIT_K programs: gate/up then writes float32 partial sums and
`_swiglu_quant_kernel` adds them, the bias (once) and applies SwiGLU + quantisation; down writes
one partial row per split, which the combine step sums with the token's other pairs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_math import swiglu_f32

FP8_MAX = 448.0
GROUP = 128  # activation group and weight block edge


@triton.jit
def _quantize_rows(a, GROUP_MAX: tl.constexpr):
    """[BM, 128] float32 -> (e4m3 [BM, 128], float32 scale [BM]): amax / 448, round to nearest."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), GROUP_MAX)
    q = tl.math.div_rn(a, scale[:, None])
    q = tl.clamp(q, -GROUP_MAX, GROUP_MAX).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _gate_up_kernel(
    a_ptr, a_scale_ptr,          # A_FP8: e4m3 [T, K] + f32 [T, ceil(K/128)]; else bf16 [T, K]
    w_ptr, w_scale_ptr, bias_ptr,  # e4m3 [E, N, K], f32 [E, N/128, ceil(K/128)], f32 [E, N]
    out_ptr, out_scale_ptr,      # e4m3 [rows, N/2], f32 [rows, N/256]   (sorted row order)
                                 # SPLIT_K > 1: out_ptr is f32 [SPLIT_K, rows, N] partial sums
    sorted_slot_ptr, block_expert_ptr,
    N, K, top_k, limit, alpha,
    stride_am, stride_asm,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_be,
    stride_om, stride_osm, stride_split,
    ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid % SPLIT_K
    pid_mn = pid // SPLIT_K
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_slot_ptr + offs_m)
    row_ok = slot >= 0
    token = tl.where(row_ok, slot // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)

    a_rows = a_ptr + token[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    ws_rows = w_scale_ptr + expert * stride_wse + (offs_n // 128) * stride_wsn

    if SPLIT_K == 1:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + bias[None, :]
    else:  # partial sums; _swiglu_quant_kernel adds the bias once
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # K steps of this program (all of them unless split along K for small decode batches)
    num_k = tl.cdiv(K, BLOCK_K)
    k_per = tl.cdiv(num_k, SPLIT_K)
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, num_k)

    # The scales are small register loads that Triton's software pipeliner leaves synchronous
    # (it stages only the loads feeding tl.dot). PREFETCH_SCALES fetches each K step's scales one
    # step ahead so their latency overlaps the current step (decode tiles); the big prefill tiles
    # run faster without the extra live registers. (Two or more steps ahead makes Triton 3.6 drop
    # the operand pipelining altogether: one shared-memory stage, checked with ptxas.)
    k_first = tl.minimum(k_lo, num_k - 1)  # (an empty split still reads in bounds)
    b_next = tl.load(ws_rows + k_first, mask=n_ok, other=0.0)
    if A_FP8:
        a_sc = a_scale_ptr + token * stride_asm
        a_next = tl.load(a_sc + k_first, mask=row_ok, other=0.0)
    else:  # A is quantised per K step below
        a_next = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for kb in range(k_lo, k_hi):
        if PREFETCH_SCALES:
            nxt = tl.minimum(kb + 1, num_k - 1)
            b_scale = b_next
            b_next = tl.load(ws_rows + nxt, mask=n_ok, other=0.0)
            a_scale = a_next
            if A_FP8:
                a_next = tl.load(a_sc + nxt, mask=row_ok, other=0.0)
        else:
            b_scale = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
            a_scale = a_next
            if A_FP8:
                a_scale = tl.load(a_sc + kb, mask=row_ok, other=0.0)
        offs_k = kb * BLOCK_K + offs_k0
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if not A_FP8:
            a, a_scale = _quantize_rows(a.to(tl.float32), 448.0)
        b = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]

    rows = offs_m.to(tl.int64)
    if SPLIT_K > 1:
        tl.store(out_ptr + pid_k * stride_split + rows[:, None] * stride_om + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])
    else:
        q, q_scale = _swiglu_quantize(acc, limit, alpha, BLOCK_M, BLOCK_N)
        offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + rows[:, None] * stride_om + offs_o[None, :], q)
        tl.store(out_scale_ptr + rows * stride_osm + pid_n, q_scale)


@triton.jit
def _swiglu_quantize(h, limit, alpha, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BM, 256] gate/up pre-activations (glu even, linear odd columns) -> clamped SwiGLU,
    quantised to e4m3 [BM, 128] + one float32 scale per row."""
    glu, lin = tl.split(tl.reshape(h, (BLOCK_M, BLOCK_N // 2, 2)))
    return _quantize_rows(swiglu_f32(glu, lin, limit, alpha), 448.0)


@triton.jit
def _swiglu_quant_kernel(
    partial_ptr,                 # [SPLIT_K, rows, N] gate/up partial sums (valid rows only), f32 or bf16
    bias_ptr,                    # f32 [E, N]
    out_ptr, out_scale_ptr,      # e4m3 [rows, N/2], f32 [rows, N/256] (any strides)
    sorted_slot_ptr, block_expert_ptr,
    N, limit, alpha,
    stride_split, stride_pm, stride_be, stride_om, stride_osm, stride_osg,
    ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Epilogue of a gate/up GEMM without one (split-K partials, or DeepGEMM's bf16 output):
    sum the partials, add the bias, SwiGLU, quantise."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)
    row_ok = tl.load(sorted_slot_ptr + offs_m) >= 0
    offs_n = pid_n * 256 + tl.arange(0, 256)
    ptrs = partial_ptr + rows[:, None] * stride_pm + offs_n[None, :]
    h = tl.zeros((BLOCK_M, 256), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        h += tl.load(ptrs + s * stride_split, mask=row_ok[:, None], other=0.0).to(tl.float32)
    h += tl.load(bias_ptr + expert * stride_be + offs_n)[None, :]
    q, q_scale = _swiglu_quantize(h, limit, alpha, BLOCK_M, 256)
    offs_o = pid_n * 128 + tl.arange(0, 128)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_o[None, :], q)
    tl.store(out_scale_ptr + rows * stride_osm + pid_n * stride_osg, q_scale)


@triton.jit
def _down_kernel(
    a_ptr, a_scale_ptr,           # e4m3 [rows, K] + f32 [rows, K/128]   (sorted row order)
    w_ptr, w_scale_ptr, bias_ptr,  # e4m3 [E, N, K], f32 [E, ceil(N/128), K/128], f32 [E, N]
    route_w_ptr,                  # [T * top_k] routing weights (any float dtype)
    out_ptr,                      # f32 [SPLIT_K, T * top_k, N], one row per (token, slot) pair
    sorted_slot_ptr, block_expert_ptr,
    N, K,
    stride_am, stride_asm,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_be,
    stride_om, stride_split,
    ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH_SCALES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid % SPLIT_K
    pid_mn = pid // SPLIT_K
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ROUTE_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)
    slot = tl.load(sorted_slot_ptr + offs_m)
    row_ok = slot >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)

    a_rows = a_ptr + rows[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    ws_rows = w_scale_ptr + expert * stride_wse + (offs_n // 128) * stride_wsn

    if HAS_BIAS:  # the first K split carries the bias
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok & (pid_k == 0), other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + bias[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    num_k = tl.cdiv(K, BLOCK_K)
    k_per = tl.cdiv(num_k, SPLIT_K)
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, num_k)
    # scales one K step ahead (see _gate_up_kernel)
    a_sc = a_scale_ptr + rows * stride_asm
    k_first = tl.minimum(k_lo, num_k - 1)  # (an empty split still reads in bounds)
    a_next = tl.load(a_sc + k_first)
    b_next = tl.load(ws_rows + k_first, mask=n_ok, other=0.0)
    for kb in range(k_lo, k_hi):
        if PREFETCH_SCALES:
            nxt = tl.minimum(kb + 1, num_k - 1)
            a_scale = a_next
            a_next = tl.load(a_sc + nxt)
            b_scale = b_next
            b_next = tl.load(ws_rows + nxt, mask=n_ok, other=0.0)
        else:
            a_scale = tl.load(a_sc + kb)
            b_scale = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
        offs_k = kb * BLOCK_K + offs_k0
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        b = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]

    route_w = tl.load(route_w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    out_rows = tl.where(row_ok, slot, 0).to(tl.int64)
    tl.store(out_ptr + pid_k * stride_split + out_rows[:, None] * stride_om + offs_n[None, :], acc,
             mask=row_ok[:, None] & n_ok[None, :])
