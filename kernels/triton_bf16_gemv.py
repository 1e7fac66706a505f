"""Decode GEMV for bf16 linear layers: out = x @ w^T + bias for a few tokens (M <= 8).

At batch 1..8 gpt-oss' attention projections (QKV [5120, 2880], O [2880, 4096], with biases) are
pure weight streaming: 29.5 + 23.6 MB a layer, 7.0 + 5.6 us at 4.2 TB/s. cuBLAS runs them at
2.1-2.9 TB/s. A bf16 weight costs one convert and one float32 FMA per token on the CUDA cores
(the FP8 GEMV of `kernels.triton_fp8_linear` needs 7-13 instructions a byte to decode e4m3), so
up to a few tokens the kernel can be bound by bytes, not by instruction issue.

A program owns `block_n` weight rows and walks one split of K in `block_k` steps. Each thread
holds 8 consecutive K of a row: the weights arrive in 16-byte loads, software-pipelined by Triton
(`tl.range(num_stages=...)`: cp.async into shared memory, that many steps in flight), in the same
register layout as the activation's 16-byte loads, so nothing is re-laid out inside the K loop.
Every token keeps float32 per-thread partial sums (a thread's 8 products are summed in registers
each step) that are reduced across threads once, after the loop.

Decode grids are small (O: 360 tiles of 8 rows for 132 SMs), so K can be split over `split_k`
programs per tile (by default enough for at least 4 programs per SM). The splits are reduced as
the FP8 linear's are (`triton_fp8_linear._split_k_store`): each program stores its float32 partial,
bumps the tile's arrival counter (`kernels.arrival`), and the last to arrive sums the partials in
split order (the bias, in float32, is in split 0's), rounds once to the output dtype and resets
the counter. Results are bit-identical from run to run; no host synchronisation and a fixed grid
for a given shape: CUDA-graph capturable.

Launch shapes come from `CONFIGS` keyed by (N, K, M bucket), else `DEFAULTS` by M bucket;
`bench/bf16_gemv.py --sweep` measures candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arrival import arrival_counters
from .buffers import empty
from .fp8 import cdiv
from .pdl import enter, launch_options
from .triton_fp8_linear import _split_k_store

MAX_M = 8  # tokens a launch takes: the FMAs grow with M, past a few tokens cuBLAS' tensor cores win
NUM_SMS_H200 = 132
MAX_TILES = 1 << 16  # split-K tiles per launch (arrival counters)
# Each program reads its first K step's weights before the PDL wait (kernels/pdl.py), while the
# kernel ahead of it runs (the weights never change).
EARLY_WEIGHTS = True


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape. block_n: weight rows a program (power of two); block_k: K a step (power
    of two >= 8; 256 * num_warps gives each thread 8 consecutive K of every row, in the layout of
    the activation loads); split_k: programs sharing a tile's K steps (0 = at least
    `programs_per_sm` programs per SM); num_stages: K steps in flight (Triton's pipeliner, cp.async
    into shared memory; 1 = plain loads into registers)."""

    block_n: int = 8
    block_k: int = 512
    split_k: int = 0
    num_warps: int = 2
    num_stages: int = 4
    programs_per_sm: int = 4

    def __post_init__(self):
        if self.block_n < 1 or self.block_n & (self.block_n - 1) or self.block_n > 256:
            raise ValueError(f"block_n must be a power of two in [1, 256], got {self}")
        if self.block_k < 8 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 8, got {self}")
        if (self.split_k < 0 or self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 8
                or self.programs_per_sm < 1):
            raise ValueError(f"bad launch shape {self}")

    @property
    def label(self) -> str:
        return (f"n{self.block_n} k{self.block_k} sk{self.split_k or 'auto'} w{self.num_warps} "
                f"s{self.num_stages}")


def m_bucket(m: int) -> int:
    """The config table's token bucket: M rounded up to a power of two (1, 2, 4, 8)."""
    return triton.next_power_of_2(max(m, 1))


# By M bucket (sized offline with ptxas for sm_90a: no spills, every program resident at once on
# 132 SMs, 60-140 KB of weights requested ahead per SM): 8 rows a program, each thread 8
# consecutive K of every row (block_k = 256 * num_warps: the weight tile and the activation
# loads share one register layout), 3 K steps in flight; 8 tokens (221 registers): one warp a
# program, so that 9 fit on an SM.
DEFAULTS: dict[int, GemvConfig] = {
    1: GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=4),
    2: GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=4),
    4: GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=4),
    8: GemvConfig(block_n=8, block_k=256, num_warps=1, num_stages=4),
}
# (N, K, M bucket) -> config where a sweep (bench/bf16_gemv.py --sweep) found a better one than
# DEFAULTS; gpt-oss' QKV is (5120, 2880), O (2880, 4096) at TP 1.
# Measured on an H200 (docs/performance.md, 2026-12-01, bench/bf16_gemv.py --sweep).
CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (2880, 4096, 1): GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),  # 8.44 us, cuBLAS 12.18
    (2880, 4096, 2): GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),  # 8.92 us, cuBLAS 12.20
    (2880, 4096, 4): GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),  # 10.10 us, cuBLAS 12.29
    (5120, 2880, 1): GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=3),  # 9.79 us, cuBLAS 10.42
}
# Up to how many tokens the GEMV beat cuBLAS per (N, K) in that sweep (QKV ties it at 2 and loses
# from 4: cuBLAS streams QKV's 5120 rows at 2.7-2.8 TB/s already; the vocabulary projection
# [201088, 2880], bench/projections.py 2026-12-04: 260 / 262 / 281 us at 1 / 2 / 4 tokens against
# cuBLAS' 317 / 279 / 280); other shapes: one token only.
FASTER_THAN_CUBLAS_UP_TO: dict[tuple[int, int], int] = {(2880, 4096): 4, (5120, 2880): 1, (201088, 2880): 2}


def gemv_wins(m: int, n: int, k: int) -> bool:
    """Whether an [m, k] x [n, k]^T projection should take the GEMV rather than cuBLAS."""
    return 1 <= m <= FASTER_THAN_CUBLAS_UP_TO.get((n, k), 1)


def select_config(m: int, n: int, k: int) -> GemvConfig:
    b = m_bucket(m)
    return CONFIGS.get((n, k, b)) or DEFAULTS[min(b, MAX_M)]


def launch_shape(cfg: GemvConfig, n: int, k: int, num_sms: int = NUM_SMS_H200) -> tuple[int, int]:
    """(split_k, k_steps_per_split) for N x K: no split is left empty."""
    num_k = cdiv(k, cfg.block_k)
    tiles = cdiv(n, cfg.block_n)
    split = cfg.split_k or cdiv(cfg.programs_per_sm * num_sms, tiles)
    split = max(1, min(split, num_k))
    k_per = cdiv(num_k, split)
    return cdiv(num_k, k_per), k_per


@triton.jit
def _token_part(wf, x_row, offs_k, k_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's products with a [BLOCK_N, BLOCK_K] float32 weight tile, each thread's 8
    consecutive K summed in registers: [BLOCK_N, BLOCK_K // 8]."""
    xv = tl.load(x_row + offs_k[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
    return tl.sum(tl.reshape(wf * xv, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)


@triton.jit
def _token_out(acc, part, cols, TOKEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] with column TOKEN set to the row sums of part (across threads)."""
    return tl.where(cols[None, :] == TOKEN, tl.sum(part, axis=1)[:, None], acc)


@triton.jit
def _accumulate(a0, a1, a2, a3, a4, a5, a6, a7, w, x_ptr, stride_xm, offs_k, k_ok, TOKENS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step: each of the first TOKENS accumulators += that token's products with the weight tile w."""
    wf = w.to(tl.float32)
    a0 += _token_part(wf, x_ptr, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 1:
        a1 += _token_part(wf, x_ptr + stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 2:
        a2 += _token_part(wf, x_ptr + 2 * stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 3:
        a3 += _token_part(wf, x_ptr + 3 * stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 4:
        a4 += _token_part(wf, x_ptr + 4 * stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 5:
        a5 += _token_part(wf, x_ptr + 5 * stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 6:
        a6 += _token_part(wf, x_ptr + 6 * stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    if TOKENS > 7:
        a7 += _token_part(wf, x_ptr + 7 * stride_xm, offs_k, k_ok, BLOCK_N, BLOCK_K)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _gemv_tile(x_ptr, w_rows, n_ok, K, stride_xm, k_lo, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER: tl.constexpr, NUM_STAGES: tl.constexpr,
               EARLY: tl.constexpr, PDL: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_M]: the rows at `w_rows` (pointers [BLOCK_N, 1]; `n_ok` masks them)
    times the first TOKENS rows of x over K_PER steps of BLOCK_K from k_lo. EARLY: the first K
    step's weights are read before the PDL wait, which this function then takes (`enter`); else
    the caller has taken it."""
    offs_k0 = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), 8), 8)
    cols = tl.arange(0, BLOCK_M)
    zero = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero  # past TOKENS: unused
    if EARLY:
        k_ok = (k_lo + offs_k0) < K
        w = tl.load(w_rows + (k_lo + offs_k0)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        enter(PDL)
        a0, a1, a2, a3, a4, a5, a6, a7 = _accumulate(a0, a1, a2, a3, a4, a5, a6, a7, w, x_ptr, stride_xm,
                                                     k_lo + offs_k0, k_ok, TOKENS, BLOCK_N, BLOCK_K)
    # K_PER steps from k_lo; the last split's steps past K load nothing (masked) and add 0.
    # (Triton 3.6's interpreter under numpy 2 takes only constexpr loop bounds.)
    for i in tl.range(1 if EARLY else 0, K_PER, num_stages=NUM_STAGES):
        offs_k = k_lo + i * BLOCK_K + offs_k0
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a0, a1, a2, a3, a4, a5, a6, a7 = _accumulate(a0, a1, a2, a3, a4, a5, a6, a7, w, x_ptr, stride_xm,
                                                     offs_k, k_ok, TOKENS, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _token_out(acc, a0, cols, 0)
    if TOKENS > 1:
        acc = _token_out(acc, a1, cols, 1)
    if TOKENS > 2:
        acc = _token_out(acc, a2, cols, 2)
    if TOKENS > 3:
        acc = _token_out(acc, a3, cols, 3)
    if TOKENS > 4:
        acc = _token_out(acc, a4, cols, 4)
    if TOKENS > 5:
        acc = _token_out(acc, a5, cols, 5)
    if TOKENS > 6:
        acc = _token_out(acc, a6, cols, 6)
    if TOKENS > 7:
        acc = _token_out(acc, a7, cols, 7)
    return acc


@triton.jit
def _bf16_gemv_kernel(
    x_ptr,                      # [M, K], rows contiguous
    w_ptr, bias_ptr,            # [N, K] rows contiguous, [N] (HAS_BIAS)
    out_ptr,                    # [M, N]
    part_ptr, count_ptr,        # SPLIT_K > 1: f32 [SPLIT_K, M, N] partials, int32 [tiles] counters (zero)
    M, N, K,
    stride_xm, stride_wn, stride_om,
    TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, K_PER: tl.constexpr, NUM_STAGES: tl.constexpr,
    EARLY: tl.constexpr, PDL: tl.constexpr,
):
    if not EARLY:
        enter(PDL)
    pid = tl.program_id(0)
    pid_n = pid // SPLIT_K
    pid_k = pid % SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * (K_PER * BLOCK_K)
    acc = _gemv_tile(x_ptr, w_rows, n_ok, K, stride_xm, k_lo, TOKENS, BLOCK_M, BLOCK_N, BLOCK_K, K_PER, NUM_STAGES,
                     EARLY, PDL)
    if HAS_BIAS:  # in split 0's partial only
        acc += tl.load(bias_ptr + offs_n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
    _split_k_store(acc, out_ptr, part_ptr, count_ptr, offs_n, cols, M, N, stride_om, pid_n, pid_k,
                   BLOCK_N, BLOCK_M, SPLIT_K)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + bias [N] -> [M, N] in x.dtype, for 1 <= M <= MAX_M.

    bf16 in the engine (float16 / float32 also run: the CPU interpreter tests use float32).
    float32 accumulation, the bias added in float32, one rounding to x.dtype at the end.
    `config`: the launch shape (default `select_config`)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"bf16_gemv takes 1 to {MAX_M} tokens, got {m}: use F.linear")
    if not (x.dtype.is_floating_point and w.dtype.is_floating_point) or x.dtype.itemsize < 2 or w.dtype.itemsize < 2:
        raise ValueError(f"x and w must be bf16, float16 or float32, got {x.dtype} and {w.dtype}")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} is not a contiguous [{n}] vector")
    if w.stride(1) != 1:
        raise ValueError("w rows must be contiguous")
    cfg = config or select_config(m, n, k)
    xc = x if x.stride(1) == 1 else x.contiguous()
    out = empty((m, n), x.dtype, x.device)  # NaN-filled under buffers.POISON (tests)
    split, k_per = launch_shape(cfg, n, k)
    tiles = cdiv(n, cfg.block_n)
    if split > 1:
        if tiles > MAX_TILES:
            raise ValueError(f"{tiles} split-K tiles exceed {MAX_TILES}: use a larger block_n")
        part = empty((split, m, n), torch.float32, x.device)
        counters = arrival_counters(x.device, "bf16_gemv", MAX_TILES)
    else:
        part = counters = out  # unused
    _bf16_gemv_kernel[(tiles * split,)](
        xc, w, bias if bias is not None else w, out, part, counters, m, n, k,
        xc.stride(0), w.stride(0), out.stride(0),
        TOKENS=m, BLOCK_M=m_bucket(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
        SPLIT_K=split, K_PER=k_per, NUM_STAGES=cfg.num_stages, EARLY=EARLY_WEIGHTS, num_warps=cfg.num_warps,
        **launch_options(x.device),
    )
    return out
