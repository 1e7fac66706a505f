"""Decode-regime FP8 MoE experts for tiny batches (1..~8 tokens): two GEMV launches on CUDA cores.

At batch 1 the layer is pure weight streaming (4 experts x (6144 x 2880 + 2880 x 3072) e4m3 =
106 MB, 0.2 GFLOP). Instead of the grouped tensor-core path of `kernels.triton_moe` (routing
layout, 16-row padded tiles, four launches), every (token, top-k slot) pair streams its expert's
weights straight through the FMA units, in two launches and without a routing layout:

1. `_gate_up_gemv_kernel`, grid (N-tiles of the 2I gate/up rows) x (T * top_k pairs): a program
   whose pair routes to another rank's expert (EP) returns at once and writes nothing. Otherwise
   it quantises its token's x row to 1x128 e4m3 exactly as `kernels.fp8.quantize_act_fp8` does,
   streams its [BLOCK_N, H] slice of the expert's weights, applies the 128x128 block scales, adds
   the float32 bias and writes the clamped SwiGLU of its interleaved glu/linear rows as float32
   `act` [T * top_k, I].
2. `_down_gemv_kernel`, grid (N-tiles of H) x T: quantises each local slot's `act` row per 1x128
   group (the reference's second `quantize_act_fp8`), streams [BLOCK_N, I] of each local expert's
   W_down, applies the scales and routing weights, adds weight * bias when asked and writes the
   token's output row in x.dtype. The slots are summed in float32 inside the program (fixed
   order, no atomics): the combine is part of this launch.
   With gate/up tiles of 256 rows (`GemvConfig.fused_act_quant`) a gate/up program holds a whole
   128-wide activation group and quantises it in its epilogue instead, so the down programs
   skip that step (fewer, larger gate/up programs; the benchmark decides which is faster).

Why `act` is float32: the reference quantises the float32 SwiGLU output; rounding it to bf16
first would change the e4m3 codes. (It is I * 4 bytes per pair, < 0.5 % of the weight bytes.)

Arithmetic, against `kernels.moe._expert_mlp_fp8`: the activation codes and scales are
bit-identical (amax / 448 and x / scale correctly rounded, e4m3 round to nearest even); each
weight element is multiplied by x_deq * w_scale (one float32 vector per K step, so the 128x128
block scale costs one multiply per activation element, not per weight; for down the routing
weight is folded into x_deq) with float32 FMAs into a [BLOCK_N, BLOCK_K] accumulator that is
reduced once at the end; biases are added after the sum, as in the reference. A pair's float32
result therefore differs from the reference by summation order and one or two roundings per
term (~1e-7 relative); the layer can differ more where that moves an activation across an e4m3
rounding boundary (one e4m3 step is 6 %; see tests/gpu/test_moe_gpu.py).

Quantising in every program: all programs of a token quantise the same rows and write identical
values into per-token float32 scratch rows (`x_deq`, `act_deq`: code * scale), then read them
back after a CTA barrier (cross-program writes of identical values are benign). Reading them per
K step costs ~1 load per activation element, where quantising inside the K loop would cost an
amax reduction and a division per element, repeated for every row group of the tile.

The K loops are software-pipelined by Triton (`num_stages`: cp.async into shared memory, that
many K steps in flight). Carrying weights across loop iterations in registers instead does not
work in Triton 3.6: every loop-carried e4m3 element gets its own 32-bit register (byte permutes,
4x the registers), as the sm_90a SASS shows.

No host synchronisation and fixed buffer shapes for a given T: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import triton_moe as tm
from .fp8 import BLOCK, cdiv
from .moe import ExpertWeights
from .pdl import enter, launch_options
from .triton_math import swiglu_f32


@dataclass(frozen=True)
class GemvTile:
    """One GEMV launch's tile: BLOCK_N weight rows per program, BLOCK_K columns per K step,
    `num_stages` K steps in flight (Triton's software pipeliner; 1: none). The float32
    accumulator is [BLOCK_N, BLOCK_K]: BLOCK_N * BLOCK_K / (32 * num_warps) registers per thread.

    block_n <= 128 divides 128, so a program's rows share one row of 128x128 weight scales.
    Gate/up counts glu + linear rows (twice the activation columns a program writes) and also
    takes 256: a program then holds a whole 128-wide activation group and quantises it itself.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        if not (pow2(self.block_n) and 2 <= self.block_n <= 2 * BLOCK):
            raise ValueError(f"block_n must be a power of two in [2, {2 * BLOCK}], got {self.block_n}")
        if not (pow2(self.block_k) and 32 <= self.block_k <= 1024):
            raise ValueError(f"block_k must be a power of two in [32, 1024], got {self.block_k}")
        if not (pow2(self.num_warps) and self.num_warps <= 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be 1..8, got {self.num_stages}")

    def label(self) -> str:
        return f"{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class GemvConfig:
    """Launch shapes of the two kernels; gate_up.block_n == 256 moves the activation
    quantisation from every down program into the gate/up epilogue."""

    gate_up: GemvTile
    down: GemvTile

    def __post_init__(self):
        if self.down.block_n > BLOCK:
            raise ValueError(f"down block_n must be <= {BLOCK}, got {self.down.block_n}")

    @property
    def fused_act_quant(self) -> bool:
        return self.gate_up.block_n == 2 * BLOCK

    def label(self) -> str:
        return f"gate_up {self.gate_up.label()} | down {self.down.label()}"


# Default for H200 at H = 2880, I = 3072, chosen from sm_90a SASS before any device run
# (docs/kernels.md "v5": ~4 instructions per weight byte in both K loops, no spills, one wave);
# `python -m pdserve.bench.kernels --sections gemv` times the alternatives (bench.kernels.gemv_sweep_configs).
# Batch 1: gate/up 4 pairs x 6144 / 64 = 384 programs of 4 warps (127 registers: all resident
# at once); down 2880 / 16 = 180 programs of 4 warps, each lane 4 rows x 16 columns per step.
DEFAULT_CONFIG = GemvConfig(
    gate_up=GemvTile(block_n=64, block_k=128, num_warps=4, num_stages=4),
    down=GemvTile(block_n=16, block_k=512, num_warps=4, num_stages=3),
)

_QUANT_GROUPS = 8  # 1x128 groups quantised per prologue step: [8, 128] tiles


@triton.jit
def _round_e4m3(v, HW_CVT: tl.constexpr):
    """Round float32 v (|v| <= 448) to the nearest e4m3 value, ties to even, as float32.

    HW_CVT: the hardware conversion (cvt.rn.satfinite.e4m3x2.f32, sm_89+). Otherwise the same
    rounding in IEEE arithmetic, for Triton's CPU interpreter, whose float8 cast is wrong when
    rounding carries into the next binade (127.55 -> 64 instead of 128, Triton 3.6): e4m3 has 3
    mantissa bits and a smallest normal exponent of -6, so the grid spacing is
    2^(max(exponent, -6) - 3), and adding then subtracting 1.5 * 2^23 rounds the scaled value to
    an integer, ties to even."""
    if HW_CVT:
        return v.to(tl.float8e4nv).to(tl.float32)
    else:
        bits = v.to(tl.int32, bitcast=True)
        ex = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        inv_ulp = ((127 + 3 - ex) << 23).to(tl.float32, bitcast=True)
        ulp = ((127 - 3 + ex) << 23).to(tl.float32, bitcast=True)
        return ((v * inv_ulp + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _div_rn(a, b, rb, HW_CVT: tl.constexpr):
    """a / b correctly rounded, given rb = 1 / b correctly rounded. GPU: q0 = a * rb, then
    q0 + (a - q0 * b) * rb with both corrections as single-rounding FMAs, which Markstein's
    theorem makes the correctly rounded quotient (3 instructions instead of an IEEE division
    with its special-case branch; also checked exhaustively over a binade for b = 448 and on
    2e7 random pairs). The interpreter's fma rounds twice, so there it divides."""
    if HW_CVT:
        q0 = a * rb
        return tl.fma(tl.fma(-q0, b, a), rb, q0)
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _act_scale(amax, HW_CVT: tl.constexpr):
    """1x128 group scale as `quantize_act_fp8`: max(amax, 1e-12) / 448, correctly rounded
    (0.002232142857142857 is 1 / 448 rounded to float32)."""
    return _div_rn(tl.maximum(amax, 1e-12), 448.0, 0.002232142857142857, HW_CVT)


@triton.jit
def _fake_quant(x, scale, HW_CVT: tl.constexpr):
    """x -> (e4m3 code of x / scale, clamped to +-448, round to nearest even) * scale in float32,
    i.e. what `dequantize_act_fp8(*quantize_act_fp8(x))` holds; scale broadcasts against x."""
    rs = tl.math.div_rn(scale * 0.0 + 1.0, scale)
    q = _round_e4m3(tl.clamp(_div_rn(x, scale, rs, HW_CVT), -448.0, 448.0), HW_CVT)
    return q * scale


@triton.jit
def _quantize_row_to_scratch(src_ptr, dst_ptr, mult, K: tl.constexpr, QG: tl.constexpr, ok,
                             HW_CVT: tl.constexpr):
    """One row of K values -> dst = fake-quantised row * mult (float32): the quantisation is
    bit-identical to `quantize_act_fp8` (a ragged last group is zero-padded for its amax).
    Nothing is read or written unless `ok`."""
    NUM_G: tl.constexpr = (K + 127) // 128
    for g0 in tl.static_range(0, NUM_G, QG):
        g = g0 + tl.arange(0, QG)
        cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        m = (g < NUM_G)[:, None] & (cols < K) & ok
        x = tl.load(src_ptr + cols, mask=m, other=0.0).to(tl.float32)
        scale = _act_scale(tl.max(tl.abs(x), axis=1), HW_CVT)
        tl.store(dst_ptr + cols, _fake_quant(x, scale[:, None], HW_CVT) * mult, mask=m)


@triton.jit
def _swiglu(acc_g, acc_l, b_rows, limit, alpha):
    """Row sums of the glu / linear accumulators + biases -> gpt-oss' clamped SwiGLU."""
    return swiglu_f32(tl.sum(acc_g, axis=1) + tl.load(b_rows), tl.sum(acc_l, axis=1) + tl.load(b_rows + 1),
                      limit, alpha)


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,            # [T, H] float (bf16 / fp16 / fp32), contiguous
    x_deq_ptr,        # f32 [T, H] scratch: fake-quantised x
    ids_ptr,          # int [T * TOP_K] global expert ids
    rw_ptr,           # [T * TOP_K] routing weights (read when QUANT_OUT)
    w_ptr,            # e4m3 [E, N2, H]
    ws_ptr,           # f32 [E, N2 / 128, ceil(H / 128)]
    b_ptr,            # f32 [E, N2]
    act_ptr,          # f32 [T * TOP_K, N2 / 2]: SwiGLU (QUANT_OUT: routing weight * fake-quantised)
    num_pairs, first_expert, num_experts, limit, alpha,
    H: tl.constexpr, N2: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, QG: tl.constexpr,
    QUANT_OUT: tl.constexpr, HW_CVT: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    pid = tl.program_id(0)
    pair = pid % num_pairs  # pairs vary fastest: tokens sharing an expert read it together (L2)
    n_tile = pid // num_pairs
    e = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
    if (e < 0) | (e >= num_experts):
        return  # another rank's expert: this pair contributes nothing here
    tok = (pair // TOP_K).to(tl.int64)
    x_deq = x_deq_ptr + tok * H
    _quantize_row_to_scratch(x_ptr + tok * H, x_deq, 1.0, H, QG, True, HW_CVT)
    tl.debug_barrier()  # the scratch row is read back below by other threads of this program

    # BLOCK_N = 256 is two 128-row weight-scale blocks: one glu/linear tile pair per block
    SUB: tl.constexpr = BLOCK_N if BLOCK_N < 128 else 128
    NSUB: tl.constexpr = BLOCK_N // SUB
    HALF: tl.constexpr = SUB // 2
    KB: tl.constexpr = (H + 127) // 128
    e64 = e.to(tl.int64)
    row0 = n_tile * BLOCK_N
    rows_g0 = row0 + 2 * tl.arange(0, HALF)  # glu rows (even); linear rows are +1
    w_g0 = w_ptr + e64 * N2 * H + rows_g0[:, None] * H
    ws0 = ws_ptr + e64 * (N2 // 128) * KB + (row0 // 128) * KB
    rows_g1 = rows_g0 + SUB
    w_g1 = w_g0 + SUB * H
    ws1 = ws0 + KB
    # A K step covers BLOCK_K columns = NSEG segments of KSEG <= 128 columns, one weight scale
    # each; the scales are folded into the activation vector (one multiply per element per
    # step, shared by all rows of the tile).
    KSEG: tl.constexpr = BLOCK_K if BLOCK_K < 128 else 128
    NSEG: tl.constexpr = BLOCK_K // KSEG
    acc_g0 = tl.zeros((HALF, BLOCK_K), dtype=tl.float32)
    acc_l0 = tl.zeros((HALF, BLOCK_K), dtype=tl.float32)
    acc_g1 = tl.zeros((HALF, BLOCK_K), dtype=tl.float32)
    acc_l1 = tl.zeros((HALF, BLOCK_K), dtype=tl.float32)
    for step in tl.range(0, (H + BLOCK_K - 1) // BLOCK_K, num_stages=NUM_STAGES):
        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H  # ragged last 128-block (H = 2880) and segments past the end
        kb = tl.minimum((step * BLOCK_K + tl.arange(0, NSEG) * KSEG) // 128, KB - 1)
        xd = tl.reshape(tl.load(x_deq + offs_k, mask=k_ok, other=0.0), (NSEG, KSEG))
        w_k = offs_k[None, :]
        m = k_ok[None, :]
        xe = tl.reshape(xd * tl.load(ws0 + kb)[:, None], (BLOCK_K,))[None, :]
        acc_g0 += tl.load(w_g0 + w_k, mask=m, other=0.0).to(tl.float32) * xe
        acc_l0 += tl.load(w_g0 + H + w_k, mask=m, other=0.0).to(tl.float32) * xe
        if NSUB == 2:
            xe = tl.reshape(xd * tl.load(ws1 + kb)[:, None], (BLOCK_K,))[None, :]
            acc_g1 += tl.load(w_g1 + w_k, mask=m, other=0.0).to(tl.float32) * xe
            acc_l1 += tl.load(w_g1 + H + w_k, mask=m, other=0.0).to(tl.float32) * xe

    b_rows = b_ptr + e64 * N2
    act0 = _swiglu(acc_g0, acc_l0, b_rows + rows_g0, limit, alpha)
    out = act_ptr + pair.to(tl.int64) * (N2 // 2) + n_tile * (BLOCK_N // 2) + tl.arange(0, HALF)
    if NSUB == 2:
        act1 = _swiglu(acc_g1, acc_l1, b_rows + rows_g1, limit, alpha)
        if QUANT_OUT:  # the program holds a whole 128-wide activation group: quantise it here
            scale = _act_scale(tl.maximum(tl.max(tl.abs(act0), axis=0), tl.max(tl.abs(act1), axis=0)), HW_CVT)
            rw = tl.load(rw_ptr + pair).to(tl.float32)
            act0 = _fake_quant(act0, scale, HW_CVT) * rw
            act1 = _fake_quant(act1, scale, HW_CVT) * rw
        tl.store(out + HALF, act1)
    tl.store(out, act0)


@triton.jit
def _down_gemv_kernel(
    act_ptr,          # f32 [T * TOP_K, I] SwiGLU output (rows of non-local pairs are never read)
    act_deq_ptr,      # f32 [T * TOP_K, I] scratch: routing weight * fake-quantised act
    ids_ptr,          # int [T * TOP_K]
    rw_ptr,           # [T * TOP_K] routing weights (any float dtype)
    w_ptr,            # e4m3 [E, H, I]
    ws_ptr,           # f32 [E, ceil(H / 128), I / 128]
    b_ptr,            # f32 [E, H]
    out_ptr,          # [T, H] in x.dtype
    T, first_expert, num_experts,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, QG: tl.constexpr,
    QUANT_ACT: tl.constexpr, HW_CVT: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    pid = tl.program_id(0)
    tok = pid % T  # tokens vary fastest (L2 sharing of common experts)
    n_tile = pid // T
    pair0 = tok.to(tl.int64) * TOP_K
    if QUANT_ACT:  # act is the raw SwiGLU output: quantise the token's local rows first
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + pair0 + j).to(tl.int32) - first_expert
            local = (e >= 0) & (e < num_experts)
            rw = tl.load(rw_ptr + pair0 + j).to(tl.float32)
            _quantize_row_to_scratch(act_ptr + (pair0 + j) * I, act_deq_ptr + (pair0 + j) * I, rw,
                                     I, QG, local, HW_CVT)
        tl.debug_barrier()
        src = act_deq_ptr
    else:  # the gate/up launch already quantised and weighted it
        src = act_ptr

    KB: tl.constexpr = I // 128
    NK: tl.constexpr = (I + BLOCK_K - 1) // BLOCK_K  # K steps per slot
    KSEG: tl.constexpr = BLOCK_K if BLOCK_K < 128 else 128  # scale segments, as in gate/up
    NSEG: tl.constexpr = BLOCK_K // KSEG
    rows = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < H
    w_rows = w_ptr + rows[:, None] * I
    ws_nb = ws_ptr + (n_tile * BLOCK_N // 128) * KB
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # one flat loop over (slot, K step), so the pipeline runs on across slot boundaries
    for step in tl.range(0, TOP_K * NK, num_stages=NUM_STAGES):
        pair = pair0 + step // NK
        k0 = (step % NK) * BLOCK_K
        e = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
        local = (e >= 0) & (e < num_experts)
        e64 = tl.where(local, e, 0).to(tl.int64)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < I) & local
        kb = tl.minimum((k0 + tl.arange(0, NSEG) * KSEG) // 128, KB - 1)
        xe = tl.reshape(tl.load(src + pair * I + offs_k, mask=k_ok, other=0.0), (NSEG, KSEG))
        xe = tl.reshape(xe * tl.load(ws_nb + e64 * (((H + 127) // 128) * KB) + kb)[:, None], (BLOCK_K,))
        w = tl.load(w_rows + e64 * H * I + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xe[None, :]

    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + pair0 + j).to(tl.int32) - first_expert
            local = (e >= 0) & (e < num_experts)
            rw = tl.load(rw_ptr + pair0 + j).to(tl.float32)
            e64 = tl.where(local, e, 0).to(tl.int64)
            out += tl.load(b_ptr + e64 * H + rows, mask=n_ok & local, other=0.0) * rw
    tl.store(out_ptr + tok.to(tl.int64) * H + rows, out.to(out_ptr.dtype.element_ty), mask=n_ok)


# Under TRITON_INTERPRET=1 @triton.jit returns an interpreted function; the interpreter needs the
# arithmetic e4m3 rounding and plain division (see _round_e4m3, _div_rn).
_HW_CVT = isinstance(_down_gemv_kernel, JITFunction)


def _check_gemv_weights(w: ExpertWeights) -> None:
    e, n2, h = w.gate_up.shape
    kb_h, kb_i = cdiv(h, BLOCK), n2 // 2 // BLOCK
    expect = {
        "gate_up_scale": (e, n2 // BLOCK, kb_h), "down_scale": (e, kb_h, kb_i),
        "gate_up_bias": (e, n2), "down_bias": (e, h),
    }
    for name, shape in expect.items():
        t = getattr(w, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"ExpertWeights.{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != torch.float32:
            raise TypeError(f"ExpertWeights.{name} must be float32, got {t.dtype}")


def gate_up_swiglu_gemv(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: ExpertWeights,
    limit: float, alpha: float, tile: GemvTile, x_deq: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> float32 act [T * top_k, I]: SwiGLU(gate/up(1x128-quantised x) + bias) of each
    local (token, slot) pair; rows of pairs whose expert is not local are not written. With
    tile.block_n == 256 the rows hold routing weight * fake-quantised SwiGLU (code * scale per
    1x128 group), ready for `down_combine_gemv(..., act_quantised=True)`.

    x_deq: optional float32 [T, H] scratch that receives the fake-quantised x (tests read it to
    check the quantisation bit for bit); allocated when None."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e, n2, _ = w.gate_up.shape
    if n2 % tile.block_n:
        raise ValueError(f"gate/up rows {n2} are not a multiple of block_n {tile.block_n}")
    x = x.contiguous()
    act = tm._empty((t * k, n2 // 2), torch.float32, x.device)
    if x_deq is None:
        x_deq = tm._empty((t, h), torch.float32, x.device)
    if t == 0:
        return act
    grid = (t * k * (n2 // tile.block_n),)
    _gate_up_gemv_kernel[grid](
        x, x_deq, topk_ids.contiguous(), topk_weights.contiguous(), w.gate_up, w.gate_up_scale,
        w.gate_up_bias, act, t * k, w.first_expert, e, float(limit), float(alpha),
        H=h, N2=n2, TOP_K=k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
        QG=_QUANT_GROUPS, QUANT_OUT=tile.block_n == 2 * BLOCK, HW_CVT=_HW_CVT,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **launch_options(x.device),
    )
    return act


def down_combine_gemv(
    act: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: ExpertWeights,
    add_down_bias: bool, dtype: torch.dtype, tile: GemvTile, act_quantised: bool = False,
    act_deq: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 act [T * top_k, I] -> [T, H] in `dtype`: for each token, the sum over its local
    slots of routing weight * (down(1x128-quantised act) [+ bias]), accumulated in float32.

    act_quantised: act already holds routing weight * fake-quantised SwiGLU (gate/up with
    block_n 256), so the programs do not quantise it. Otherwise act_deq, an optional float32
    [T * top_k, I] scratch, receives routing weight * fake-quantised act for the local pairs
    (tests read it); allocated when None."""
    t, k = topk_ids.shape
    e, h, i = w.down.shape
    if tile.block_n > BLOCK:
        raise ValueError(f"down block_n must be <= {BLOCK}, got {tile.block_n}")
    out = tm._empty((t, h), dtype, act.device)
    if act_deq is None:
        act_deq = act if act_quantised else tm._empty((t * k, i), torch.float32, act.device)
    if t == 0:
        return out
    grid = (t * cdiv(h, tile.block_n),)
    _down_gemv_kernel[grid](
        act, act_deq, topk_ids.contiguous(), topk_weights.contiguous(), w.down, w.down_scale,
        w.down_bias, out, t, w.first_expert, e,
        H=h, I=i, TOP_K=k, HAS_BIAS=bool(add_down_bias), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        NUM_STAGES=tile.num_stages, QG=_QUANT_GROUPS, QUANT_ACT=not act_quantised, HW_CVT=_HW_CVT,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **launch_options(act.device),
    )
    return out


def experts_forward_gemv(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    limit: float = 7.0,
    alpha: float = 1.702,
    add_down_bias: bool = True,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.moe.experts_forward_ref` for FP8 experts (and as
    `kernels.triton_moe.experts_forward`): x [T, H] -> [T, H] in x.dtype, the routing-weighted sum
    over each token's *local* experts (a token with none gets zeros). Two launches, no host
    synchronisation, fixed shapes: CUDA-graph capturable. Meant for T <= ~8 (each pair streams
    its expert's weights; pairs sharing an expert share them through L2); correct for any T."""
    tm._check_inputs(x, topk_weights, topk_ids, w)
    _check_gemv_weights(w)
    cfg = config or DEFAULT_CONFIG
    act = gate_up_swiglu_gemv(x, topk_weights, topk_ids, w, limit, alpha, cfg.gate_up)
    return down_combine_gemv(act, topk_weights, topk_ids, w, add_down_bias, x.dtype, cfg.down,
                             act_quantised=cfg.fused_act_quant)
