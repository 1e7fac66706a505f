"""FP8 linear layers for the attention projections: out = x @ (W * block scales)^T + bias.

W is e4m3 [N, K] with one float32 scale per 128x128 block (`kernels.fp8.quantize_weight_fp8`),
x is [M, K] (bf16 in the engine), out is [M, N] in x.dtype. gpt-oss' QKV is [5120, 2880] and O
[2880, 4096], both with a bias. At decode (M <= 64) the layer is bound by the weight bytes: FP8
halves them against bf16 (QKV 14.7 MB, O 11.8 MB a layer).

One kernel for every M. The weights are the tensor-core M side ("swap AB"): a program computes a
[BLOCK_N, BLOCK_M] tile of out^T, BLOCK_N weight rows against BLOCK_M (>= 16) tokens, in 128-deep
K steps, each promoted into a float32 accumulator that starts from the bias (loaded once per tile)
with its block scale: `acc += dot(w, x^T) * w_scale (* x_scale)`. Two activation modes
(`LinearConfig.x_fp8`):

- x kept as it is (bf16): each W tile is upcast to x.dtype in registers (exact: every e4m3 value
  is a bf16), so the only difference from the dequantised float32 product is the float32
  accumulation order; no activation quantisation error.
- x quantised per 1x128 group to e4m3 first (`kernels.triton_moe.quantize_act`, one more launch,
  the quantisation of the MoE GEMMs) and multiplied on the FP8 tensor cores with both scales.

Decode batches leave few weight tiles per SM (QKV: 80 tiles of 64 rows for 132 SMs), so K can be
split over `split_k` programs per tile. The reduction is deterministic without float atomics: each
program stores its float32 partial tile, then bumps the tile's arrival counter (acq_rel, after a
CTA barrier); the last to arrive sums the partials in split order (the bias is in split 0's),
writes the output and resets the counter for the next launch. Results are bit-identical from run
to run whatever the arrival order. No host synchronisation: CUDA-graph capturable.

Tiles are loaded with plain (cp.async) loads, or with `LinearConfig.tma` through TMA tensor
descriptors (one bulk copy per tile, zero fill past the edges: fewer registers and no masks).

Launch shapes come from `CONFIGS` by M (and the weight shape where a sweep found a better one:
`bench/fp8_linear.py` measures them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arrival import arrival_counters
from .buffers import empty
from .fp8 import BLOCK, FP8, cdiv
from .triton_moe import quantize_act

DECODE_MAX_M = 64  # the skinny (bandwidth-bound) regime the decode configs are for
GEMV_MAX_M = 16  # the GEMV kernel's FMAs grow with M: past a few tokens the tensor cores win
NUM_SMS_H200 = 132


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape. block_m: tokens per program (>= 16, the smallest tensor-core tile; 0 =
    the next power of two >= M, at least 16, at most 64); split_k: programs sharing a tile's K
    steps (0 = enough programs for about 4 per SM); x_fp8: quantise x to e4m3 (see module doc);
    tma: x and W tiles through TMA (tensor descriptors; falls back to pointer loads where a row
    is not 16-byte aligned); quant_in_kernel (with x_fp8): each program quantises its own x tiles
    per 1x128 group in registers (as `quantize_act` does, no launch of its own). block_k > 0 selects the GEMV kernel instead (M <= GEMV_MAX_M, no
    tensor cores, bf16 x only): block_k-deep K steps (a multiple of 128), block_n (a power of two
    dividing 128) weight rows a program, prefetch (1 or 2) steps of weights in flight in registers;
    words: weights as 32-bit words decoded by bit placement (bf16 x, K and row strides multiples
    of 4; otherwise the byte kernel runs); block_m, num_stages, x_fp8 and tma do not apply."""

    block_n: int = 64
    block_m: int = 0
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    x_fp8: bool = False
    tma: bool = False
    quant_in_kernel: bool = False
    block_k: int = 0
    prefetch: int = 1
    words: bool = False

    def __post_init__(self):
        if self.block_k:
            if self.block_k % BLOCK or self.block_k & (self.block_k - 1) or self.prefetch not in (1, 2):
                raise ValueError(f"GEMV block_k must be a power-of-two multiple of 128 and prefetch 1 or 2, got {self}")
            if self.block_n < 1 or self.block_n & (self.block_n - 1) or self.block_n > BLOCK or self.x_fp8 or self.tma:
                raise ValueError(f"GEMV block_n must be a power of two dividing 128 (bf16 x, no TMA), got {self}")
        elif self.block_n < 16 or self.block_n & (self.block_n - 1) or self.block_n > 256:
            raise ValueError(f"block_n must be a power of two in [16, 256], got {self.block_n}")
        if self.words and not self.block_k:
            raise ValueError("words is a GEMV option: set block_k")
        if self.quant_in_kernel and not self.x_fp8:
            raise ValueError("quant_in_kernel quantises x for x_fp8: set both")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m must be 0 or a power of two >= 16, got {self.block_m}")
        if self.split_k < 0 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad launch shape {self}")

    @property
    def label(self) -> str:
        s = self.split_k or "auto"
        if self.block_k:
            return f"gemv{'w' if self.words else ''} n{self.block_n} k{self.block_k} sk{s} w{self.num_warps} pf{self.prefetch}"
        m = self.block_m or "auto"
        tma = " tma" if self.tma else ""
        mode = ("fp8xq" if self.quant_in_kernel else "fp8x") if self.x_fp8 else "bf16x"
        return f"{mode} n{self.block_n} m{m} sk{s} w{self.num_warps} s{self.num_stages}{tma}"


# (max M, config), first match wins; `WEIGHT_CONFIGS[(N, K)]` overrides for one weight shape.
# Prefill tiles (M > 64): 128 weight rows x 128 tokens, one program per tile.
CONFIGS: list[tuple[int, LinearConfig]] = [
    (16, LinearConfig(block_n=64, num_stages=4)),
    (32, LinearConfig(block_n=64, num_stages=4)),
    (64, LinearConfig(block_n=64, num_stages=3)),
    (1 << 62, LinearConfig(block_n=128, block_m=128, split_k=1, num_warps=8, num_stages=3)),
]
WEIGHT_CONFIGS: dict[tuple[int, int], list[tuple[int, LinearConfig]]] = {}


def select_config(m: int, n: int, k: int) -> LinearConfig:
    for bound, cfg in WEIGHT_CONFIGS.get((n, k), CONFIGS):
        if m <= bound:
            return cfg
    return CONFIGS[-1][1]


def launch_shape(cfg: LinearConfig, m: int, n: int, k: int,
                 num_sms: int = NUM_SMS_H200) -> tuple[int, int, int]:
    """(block_m, split_k, k_steps_per_split) for M x N x K: split_k never leaves a split empty.
    K steps are 128 deep (block_k deep for the GEMV kernel, whose block_m is M rounded up)."""
    if cfg.block_k:
        block_m = triton.next_power_of_2(max(m, 1))
        num_k = cdiv(k, cfg.block_k)
    else:
        block_m = cfg.block_m or min(64, max(16, triton.next_power_of_2(max(m, 1))))
        num_k = cdiv(k, BLOCK)
    tiles = cdiv(n, cfg.block_n) * cdiv(max(m, 1), block_m)
    split = cfg.split_k or max(1, min(num_k // 2, cdiv(4 * num_sms, tiles)))
    split = max(1, min(split, num_k))
    k_per = cdiv(num_k, split)
    return block_m, cdiv(num_k, k_per), k_per


@triton.jit
def _split_k_store(acc, out_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_om, tile, pid_k,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store a [BLOCK_N, BLOCK_M] float32 tile of out^T: directly, or (split K) as this program's
    partial, the last of the tile's programs to arrive summing the partials in split order."""
    n_ok = offs_n < N
    m_ok = offs_m < M
    # int32 element offsets (the launcher checks split_k * M * N < 2^31): half the registers of
    # 64-bit pointer tiles
    out_off = offs_m[None, :] * stride_om + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:
        part_off = offs_m[None, :] * N + offs_n[:, None]
        tl.store(part_ptr + pid_k * M * N + part_off, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last of the tile's programs: sum in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, SPLIT_K):  # a loop, not unrolled: one partial tile live at a time
                total += tl.load(part_ptr + s * M * N + part_off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_e4m3(v):
    """float32 in [-448, 448] rounded to the nearest e4m3 value (ties to even), so that the cast
    to e4m3 is exact: the GPU's cast rounds the same, the CPU interpreter's (Triton 3.6) does
    not carry a rounded-up mantissa into the exponent. Adding then subtracting 1.5 * 2^23 ulp
    rounds |v| to a multiple of its e4m3 ulp (2^(e-3), e >= -6: subnormals below 2^-6)."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((e - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (a + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, xs_ptr,             # X_FP8 and not QUANT_X: e4m3 [M, K] + f32 [M, ceil(K/128)]; else [M, K] (bf16/f16/f32)
    w_ptr, ws_ptr, bias_ptr,   # e4m3 [N, K], f32 [ceil(N/128), ceil(K/128)], [N] (HAS_BIAS)
                               # TMA: x_ptr, w_ptr are tensor descriptors of [BLOCK_M | BLOCK_N, 128] blocks
    out_ptr,                   # [M, N]
    part_ptr, count_ptr,       # SPLIT: f32 [split_k, M, N] partial tiles, int32 [tiles] counters (zero)
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, X_FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER: tl.constexpr, TMA: tl.constexpr, QUANT_X: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = pid // SPLIT_K
    pid_k = pid % SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    n64 = offs_n.to(tl.int64)
    m64 = offs_m.to(tl.int64)
    if not TMA:
        offs_k0 = tl.arange(0, 128)
        w_rows = w_ptr + n64[:, None] * stride_wn
        x_rows = x_ptr + m64[:, None] * stride_xm
    ws_rows = ws_ptr + (offs_n // 128) * stride_wsn
    xs_rows = xs_ptr + m64 * stride_xsm

    if HAS_BIAS:  # in split 0's accumulator only
        bias = tl.load(bias_ptr + offs_n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32) + bias[:, None]
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)

    num_k = tl.cdiv(K, 128)
    k_lo = pid_k * K_PER
    # Scales are plain loads the software pipeliner does not stage: fetch each one a K step ahead.
    k_first = tl.minimum(k_lo, num_k - 1)
    ws_next = tl.load(ws_rows + k_first, mask=n_ok, other=0.0)
    if X_FP8 and not QUANT_X:
        xs_next = tl.load(xs_rows + k_first, mask=m_ok, other=0.0)
    # K_PER steps from k_lo; the last split's steps past K load nothing (masked, zero) and add 0.
    # (Triton 3.6's interpreter under numpy 2 takes only constexpr loop bounds.)
    for i in range(0, K_PER):
        kb = k_lo + i
        nxt = tl.minimum(kb + 1, num_k - 1)
        w_scale = ws_next
        ws_next = tl.load(ws_rows + nxt, mask=n_ok, other=0.0)
        if TMA:  # blocks past the edges (M, N, K) read as zeros
            w = w_ptr.load([pid_n * BLOCK_N, kb * 128])
            xv = x_ptr.load([pid_m * BLOCK_M, kb * 128])
        else:
            offs_k = kb * 128 + offs_k0
            k_ok = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if X_FP8:
            if QUANT_X:  # quantize_act's 1x128 groups, in registers: rows past M quantise to 0
                xf = xv.to(tl.float32)
                x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12), 448.0)
                xv = _round_e4m3(tl.clamp(tl.math.div_rn(xf, x_scale[:, None]), -448.0, 448.0)).to(w.dtype)
            else:
                x_scale = xs_next
                xs_next = tl.load(xs_rows + nxt, mask=m_ok, other=0.0)
            acc += tl.dot(w, tl.trans(xv)) * w_scale[:, None] * x_scale[None, :]
        else:
            acc += tl.dot(w.to(xv.dtype), tl.trans(xv), input_precision="ieee") * w_scale[:, None]

    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    _split_k_store(acc, out_ptr, part_ptr, count_ptr, offs_n, offs_m, M, N, stride_om, tile, pid_k,
                   BLOCK_N, BLOCK_M, SPLIT_K)


@triton.jit
def _step_scales(ws_row, kb, num_kb, offs_k0, BLOCK_K: tl.constexpr):
    """A GEMV step's weight block scales over [1, BLOCK_K], x's layout: scalar loads put in place
    (a gather would get a layout of its own, re-laid out through shared memory every step)."""
    s = tl.zeros((1, BLOCK_K), dtype=tl.float32)
    for g in tl.static_range(BLOCK_K // 128):
        s = tl.where((offs_k0 // 128)[None, :] == g, tl.load(ws_row + kb + g, mask=kb + g < num_kb, other=0.0), s)
    return s


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,                     # [M, K] (bf16/f16/f32), rows contiguous
    w_ptr, ws_ptr, bias_ptr,   # e4m3 [N, K], f32 [ceil(N/128), ceil(K/128)], [N] (HAS_BIAS)
    out_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_wsn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Decode GEMV: BLOCK_N weight rows (inside one 128-row scale block) against all BLOCK_M tokens,
    K_PER steps of BLOCK_K. The weights stream in 8-byte loads held in registers PREFETCH steps
    ahead (the scales one step ahead); each step's block scales are folded into x (float32), so a
    weight byte costs one upcast and one FMA per token. One token: per-thread partial sums,
    reduced across threads once at the end; more tokens: each token's dot reduced every step."""
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = pid // SPLIT_K
    pid_k = pid % SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # 8 contiguous K a thread: the weights' 8-byte loads then share the layout of x's 16-byte
    # (bf16) loads, where 16-byte weight loads would be re-laid out through shared memory each step
    offs_k0 = tl.max_contiguous(tl.arange(0, BLOCK_K), 8)
    cols = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_base = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn
    m_left = M - pid_m * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if BLOCK_M == 1:
        acc1 = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    # masks: K (a multiple of 16 keeps the loads 16 bytes wide) and, for a prefetch, whether the
    # step is still this split's (a scalar)
    k_lo = pid_k * (K_PER * BLOCK_K)
    num_kb = tl.cdiv(K, 128)
    offs_k = k_lo + offs_k0
    w_next = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    if PREFETCH == 2:
        offs_k2 = offs_k + BLOCK_K
        w_next2 = tl.load(w_rows + offs_k2[None, :], mask=n_ok[:, None] & (offs_k2 < K)[None, :] & (1 < K_PER),
                          other=0.0)
    s_next = _step_scales(ws_row, k_lo // 128, num_kb, offs_k0, BLOCK_K)  # scales: one step ahead
    for i in range(0, K_PER):
        w = w_next
        k_ok = offs_k < K
        offs_nk = offs_k + BLOCK_K
        if PREFETCH == 2:
            w_next = w_next2
            offs_k2 = offs_nk + BLOCK_K
            w_next2 = tl.load(w_rows + offs_k2[None, :], mask=n_ok[:, None] & (offs_k2 < K)[None, :] & (i + 2 < K_PER),
                              other=0.0)
        else:
            w_next = tl.load(w_rows + offs_nk[None, :], mask=n_ok[:, None] & (offs_nk < K)[None, :] & (i + 1 < K_PER),
                             other=0.0)
        s = s_next
        s_next = _step_scales(ws_row, (k_lo + (i + 1) * BLOCK_K) // 128, num_kb, offs_k0, BLOCK_K)
        wf = w.to(tl.float32)
        for mm in tl.static_range(BLOCK_M):
            xv = tl.load(x_base + mm * stride_xm + offs_k[None, :], mask=(k_ok & (mm < m_left))[None, :], other=0.0)
            prod = wf * (xv.to(tl.float32) * s)
            if BLOCK_M == 1:  # a thread's 8 consecutive K: summed in registers
                acc1 += tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
            else:
                acc += tl.where(cols[None, :] == mm, tl.sum(prod, axis=1)[:, None], 0.0)
        offs_k = offs_nk
    if BLOCK_M == 1:
        acc += tl.sum(acc1, axis=1)[:, None]
    if HAS_BIAS:  # in split 0's partial only
        acc += tl.load(bias_ptr + offs_n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    _split_k_store(acc, out_ptr, part_ptr, count_ptr, offs_n, pid_m * BLOCK_M + cols, M, N, stride_om, tile,
                   pid_k, BLOCK_N, BLOCK_M, SPLIT_K)


@triton.jit
def _e4m3_at(w, SHIFT: tl.constexpr):
    """The e4m3 byte at bit SHIFT of int32 words as float32, times 2^-120: magnitude bits to
    20-26, sign to 31 (exact for subnormals too: they land on float32 subnormals)."""
    if SHIFT >= 20:
        mag = (w >> (SHIFT - 20)) & 0x07F00000
    else:
        mag = (w << (20 - SHIFT)) & 0x07F00000
    return (mag | ((w << (24 - SHIFT)) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_at(xw, SHIFT: tl.constexpr):
    """The bf16 at bit SHIFT of int64 words as float32 (its bits moved to 16-31)."""
    if SHIFT >= 16:
        b = (xw >> (SHIFT - 16)) & 0xFFFF0000
    else:
        b = (xw << 16) & 0xFFFF0000
    return b.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemv_words_kernel(
    x_ptr,                     # bf16 [M, K], K and the row stride multiples of 4
    w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_wsn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER: tl.constexpr, PREFETCH: tl.constexpr,
):
    """`_fp8_gemv_kernel` on 32-bit words: a weight word (4 e4m3) and an activation word (4 bf16,
    int64) per lane, each byte placed into float32 bits by shifts and masks, where Triton's e4m3
    convert and the carried fp8 registers cost ~11 SASS instructions a weight byte (~7 here).
    The decode's 2^-120 is undone by 2^64 on the scales and 2^56 on the sums (powers of two:
    the same roundings as unscaled, products of bf16, e4m3 and scale magnitudes stay normal)."""
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = pid // SPLIT_K
    pid_k = pid % SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w0 = tl.arange(0, BLOCK_K // 4)
    cols = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    kw = K // 4
    w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + offs_n.to(tl.int64)[:, None] * (stride_wn // 4)
    x_base = x_ptr.to(tl.pointer_type(tl.int64)) + (pid_m * BLOCK_M).to(tl.int64) * (stride_xm // 4)
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn
    m_left = M - pid_m * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # up to 4 tokens: per-thread partial sums a token (reduced across threads once, at the end)
    if BLOCK_M <= 4:
        acc1 = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    if BLOCK_M >= 2 and BLOCK_M <= 4:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    if BLOCK_M == 4:
        acc3 = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
        acc4 = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    k_lo = pid_k * (K_PER * BLOCK_K)
    num_kb = tl.cdiv(K, 128)
    offs_w = k_lo // 4 + offs_w0
    w_next = tl.load(w_rows + offs_w[None, :], mask=n_ok[:, None] & (offs_w < kw)[None, :], other=0)
    if PREFETCH == 2:
        offs_w2 = offs_w + BLOCK_K // 4
        w_next2 = tl.load(w_rows + offs_w2[None, :], mask=n_ok[:, None] & (offs_w2 < kw)[None, :] & (1 < K_PER), other=0)
    for i in range(0, K_PER):
        w = w_next
        offs_nw = offs_w + BLOCK_K // 4
        if PREFETCH == 2:
            w_next = w_next2
            offs_w2 = offs_nw + BLOCK_K // 4
            w_next2 = tl.load(w_rows + offs_w2[None, :], mask=n_ok[:, None] & (offs_w2 < kw)[None, :] & (i + 2 < K_PER),
                              other=0)
        else:
            w_next = tl.load(w_rows + offs_nw[None, :], mask=n_ok[:, None] & (offs_nw < kw)[None, :] & (i + 1 < K_PER),
                             other=0)
        kb = (k_lo + i * BLOCK_K) // 128
        s = tl.zeros((BLOCK_K // 4,), dtype=tl.float32)
        for g in tl.static_range(BLOCK_K // 128):  # 32 words a scale group
            sg = tl.load(ws_row + kb + g, mask=kb + g < num_kb, other=0.0) * 18446744073709551616.0  # 2^64
            s = tl.where((offs_w0 // 32) == g, sg, s)
        f0 = _e4m3_at(w, 0)
        f1 = _e4m3_at(w, 8)
        f2 = _e4m3_at(w, 16)
        f3 = _e4m3_at(w, 24)
        for mm in tl.static_range(BLOCK_M):
            xw = tl.load(x_base + mm * (stride_xm // 4) + offs_w, mask=(offs_w < kw) & (mm < m_left), other=0)
            part = (f0 * (_bf16_at(xw, 0) * s)[None, :] + f1 * (_bf16_at(xw, 16) * s)[None, :]
                    + f2 * (_bf16_at(xw, 32) * s)[None, :] + f3 * (_bf16_at(xw, 48) * s)[None, :])
            if BLOCK_M > 4:
                acc += tl.where(cols[None, :] == mm, tl.sum(part, axis=1)[:, None], 0.0)
            elif mm == 0:
                acc1 += part
            elif mm == 1:
                acc2 += part
            elif mm == 2:
                acc3 += part
            else:
                acc4 += part
        offs_w = offs_nw
    if BLOCK_M <= 4:
        acc += tl.where(cols[None, :] == 0, tl.sum(acc1, axis=1)[:, None], 0.0)
    if BLOCK_M >= 2 and BLOCK_M <= 4:
        acc += tl.where(cols[None, :] == 1, tl.sum(acc2, axis=1)[:, None], 0.0)
    if BLOCK_M == 4:
        acc += tl.where(cols[None, :] == 2, tl.sum(acc3, axis=1)[:, None], 0.0)
        acc += tl.where(cols[None, :] == 3, tl.sum(acc4, axis=1)[:, None], 0.0)
    acc = acc * 72057594037927936.0  # 2^56
    if HAS_BIAS:  # in split 0's partial only
        acc += tl.load(bias_ptr + offs_n, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    _split_k_store(acc, out_ptr, part_ptr, count_ptr, offs_n, pid_m * BLOCK_M + cols, M, N, stride_om, tile,
                   pid_k, BLOCK_N, BLOCK_M, SPLIT_K)


MAX_TILES = 1 << 16  # split-K tiles per launch (kernels.arrival counters)
def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and row stride and contiguous rows."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
    config: LinearConfig | None = None, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] @ (w [N, K] e4m3 * 128x128 block scales)^T + bias -> [M, N] in x.dtype.

    `config`: the launch shape (default `select_config`); `x_fp8`: x already quantised (e4m3
    [M, K], float32 [M, ceil(K/128)]) for a config with x_fp8 (tests; skips the quantisation)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    m, k = x.shape
    n = w.shape[0]
    if w.dtype != FP8 or w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (cdiv(n, BLOCK), cdiv(k, BLOCK)):
        raise ValueError(f"w must be e4m3 with float32 scales [{cdiv(n, BLOCK)}, {cdiv(k, BLOCK)}], got "
                         f"{w.dtype} and {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {n} output features")
    if w.stride(1) != 1 or w_scale.stride(1) != 1 or (bias is not None and not bias.is_contiguous()):
        raise ValueError("w rows, w_scale rows and the bias must be contiguous")
    cfg = config or select_config(m, n, k)
    if cfg.block_k and m > GEMV_MAX_M:
        raise ValueError(f"the GEMV kernel takes at most {GEMV_MAX_M} tokens, got {m}: use a tensor-core config")
    out = empty((m, n), x.dtype, x.device)  # NaN-filled under buffers.POISON (tests)
    if m == 0:
        return out
    if cfg.x_fp8 and not cfg.quant_in_kernel:
        xq, xs = x_fp8 if x_fp8 is not None else quantize_act(x)
    else:
        xq = x if x.stride(1) == 1 else x.contiguous()
        xs = w_scale  # unused
    block_m, split, k_per = launch_shape(cfg, m, n, k)
    num_n, num_m = cdiv(n, cfg.block_n), cdiv(m, block_m)
    if split * m * n >= 1 << 31:
        raise ValueError(f"{m} x {n} outputs x {split} splits overflow the kernel's int32 offsets: "
                         "run fewer tokens per call")
    tma = cfg.tma and _tma_ok(xq) and _tma_ok(w)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(xq, [block_m, BLOCK])
        w_arg = TensorDescriptor.from_tensor(w, [cfg.block_n, BLOCK])
    else:
        x_arg, w_arg = xq, w
    if split > 1:
        if num_n * num_m > MAX_TILES:
            raise ValueError(f"{num_n * num_m} split-K tiles exceed {MAX_TILES}: use a larger tile")
        part = empty((split, m, n), torch.float32, x.device)
        counters = arrival_counters(x.device, "fp8_linear", MAX_TILES)
    else:
        part = counters = out  # unused
    words = (cfg.words and xq.dtype == torch.bfloat16 and k % 4 == 0 and xq.stride(0) % 4 == 0
             and w.stride(0) % 4 == 0 and xq.data_ptr() % 8 == 0 and w.data_ptr() % 4 == 0)
    if cfg.block_k:
        (_fp8_gemv_words_kernel if words else _fp8_gemv_kernel)[(num_n * split, num_m)](
            xq, w, w_scale, bias if bias is not None else w_scale, out, part, counters, m, n, k,
            xq.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
            BLOCK_N=cfg.block_n, BLOCK_M=block_m, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
            SPLIT_K=split, K_PER=k_per, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=1,
        )
        return out
    _fp8_linear_kernel[(num_n * split, num_m)](
        x_arg, xs, w_arg, w_scale, bias if bias is not None else w_scale, out, part, counters,
        m, n, k,
        xq.stride(0), xs.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=block_m, X_FP8=cfg.x_fp8, HAS_BIAS=bias is not None, QUANT_X=cfg.quant_in_kernel,
        SPLIT_K=split, K_PER=k_per, TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
