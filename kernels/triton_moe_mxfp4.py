"""Decode MoE from experts kept in their published MXFP4 form (W4A16: dequantised in registers).

Why: a batch-1 decode step reads each routed expert once; MXFP4 is 4.25 bits per weight, half the
bytes of FP8, so a bandwidth-bound layer can take half the time (kernels/mxfp4.py: the layout).

Two launches, no host synchronisation, fixed shapes (CUDA-graph capturable):
1. gate/up + SwiGLU: one program per (token-slot pair, BLOCK_N rows of its expert's 2I rows);
   pairs vary fastest, so pairs that share an expert read it at about the same time (L2). The
   K loop streams [BLOCK_N, G_STEP, 16] bytes of blocks plus their scales, decodes both nibbles
   of each byte to float32 with integer ops (e2m1: exponent and mantissa bits moved into a float32,
   codes 0/1 (0 and 0.5) selected apart), multiplies by the activation's even / odd elements,
   sums each 32-group, times 2^(scale - 127), accumulates (or, with `MxConfig.lut`, decodes a byte
   by one load from a 256-entry table of bf16 pairs, which stays in L1: ~8 instead of ~30
   instructions per weight byte; v1 measured instruction-bound, docs/kernels.md); then the bias
   and gpt-oss' clamped
   SwiGLU on the interleaved (glu, linear) rows -> float32 [pairs, I].
2. down + combine: one program per (token, BLOCK_N rows of H): for each of the token's slots the
   same K loop over I, plus the bias, times the routing weight, summed in slot order (no atomics,
   deterministic) -> x.dtype [T, H].

Arithmetic: float32 throughout from the bf16 activations; the reference is
`experts_forward_ref` on the dequantised (exact) weights in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arrival import arrival_counters
from .mxfp4 import MxExperts
from .triton_math import packed_group, swiglu_f32


@dataclass(frozen=True)
class MxConfig:
    """Launch shape and nibble decode. decode: "bits" (default: each nibble placed into a float32's
    bit fields, 3-4 integer ops), "lut" (one cached table load per byte), "v1" (the first version's
    select-based decode and strided activation loads), "dot" (Triton's `tl.dot_scaled`: e2m1 x
    bf16 on the tensor cores, the token in one of 16 columns; its second entry is BLOCK_K in
    values, not G_STEP). With G_STEP 16 or 32 the K step spans many threads, so each thread keeps
    several rows on the same activations (loaded once per row set). "packed" (experts in
    `MxExperts.to_packed()` layout): two values per 32-bit register through inline PTX (e4m3 bytes
    spread into bf16x2 pairs, kernels/mxfp4.py bf16_pairs_ptx; bf16x2 FMA), G_STEP groups of [rows, 4 words] per K step."""

    gate_up: tuple[int, int, int, int] = (64, 16, 4, 3)  # BLOCK_N, G_STEP (32-groups per K step), warps, stages
    down: tuple[int, int, int, int] = (16, 16, 2, 3)
    lut: bool = False  # shorthand for decode="lut" (kept for callers of the first version)
    decode: str = "bits"

    def __post_init__(self):
        if self.decode not in ("bits", "lut", "v1", "dot", "packed"):
            raise ValueError(f"decode must be bits, lut, v1, dot or packed, not {self.decode!r}")

    @property
    def mode(self) -> int:
        return 1 if self.lut or self.decode == "lut" else {"v1": 0, "bits": 2, "dot": 3, "packed": 4}[self.decode]


# The packed decode's launch shape (experts in MxExperts.to_packed() layout).
# Fastest at 1 and 4 tokens on an H200 (2026-12-02: 36.1 / 91.6 us a 20b layer against 38.5 / 104.1
# for the 4-stage (64, 4, 2, 4) / (16, 4, 1, 4)): no cp.async pipeline (stages 1), loads straight to
# registers, 8 groups a step; the engine's batch-1 step 2.32 -> 2.19 ms in the same run.
PACKED_CONFIG = MxConfig((64, 8, 4, 1), (16, 8, 2, 1), decode="packed")


def default_config(layout: str) -> MxConfig:
    """The kernel config for experts with blocks in `layout` (MxExperts.layout)."""
    return PACKED_CONFIG if layout == "packed" else MxConfig()


_LUTS: dict[torch.device, torch.Tensor] = {}


def byte_lut(device: torch.device) -> torch.Tensor:
    """int32 [256]: byte b -> bf16 bits of e2m1(b & 15) | bf16 bits of e2m1(b >> 4) << 16."""
    lut = _LUTS.get(device)
    if lut is None:
        from .mxfp4 import FP4_VALUES

        bits = torch.tensor(FP4_VALUES, dtype=torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        b = torch.arange(256)
        lut = _LUTS[device] = (bits[b & 15] | (bits[b >> 4] << 16)).to(torch.int32).to(device)
    return lut


@triton.jit
def _bias_swiglu_store(acc, bias_row_ptr, rows, rm, act_row_ptr, n0, N2, limit, alpha, BLOCK_N: tl.constexpr,
                       OUT_SCALE: tl.constexpr = 1.0):
    """gate/up rows [n0, n0 + BLOCK_N) of one pair (glu even, linear odd) + bias -> SwiGLU (times
    OUT_SCALE, a power of two), stored as the pair's activation columns [n0 / 2, (n0 + BLOCK_N) / 2)."""
    acc += tl.load(bias_row_ptr + rows, mask=rm, other=0.0)
    glu, lin = tl.split(tl.reshape(acc, (BLOCK_N // 2, 2)))
    cols = n0 // 2 + tl.arange(0, BLOCK_N // 2)
    tl.store(act_row_ptr + cols, swiglu_f32(glu, lin, limit, alpha) * OUT_SCALE, mask=cols < N2 // 2)


@triton.jit
def _fp4_to_f32(code):
    """e2m1 codes (int32, 0..15) -> float32 values."""
    mag = code & 7
    bits = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22) | ((code & 8) << 28)
    normal = bits.to(tl.float32, bitcast=True)
    small = tl.where((code & 8) != 0, -0.5, 0.5) * (mag & 1).to(tl.float32)  # codes +-0, +-0.5
    return tl.where(mag < 2, small, normal)


@triton.jit
def _mx_dot_rows(blocks_ptr, scales_ptr, stride_row, stride_srow, rows, row_mask, a_ptr, lut_ptr,
                 K_GROUPS: tl.constexpr, G_STEP: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
                 MODE: tl.constexpr):
    """sum_k W[rows, k] * a[k] over K = 32 * K_GROUPS, W in MXFP4; a float32 or bf16 at a_ptr.
    MODE 2 ("bits"): a nibble's magnitude bits go to a float32's exponent/mantissa bits 22-24 and
    its sign to bit 31, which is the e2m1 value times 2^-126 (codes 0/1 land on float32 subnormals,
    0 and 2^-127, exactly); each group's sum is brought back by 2^126 before its scale."""
    gg = tl.arange(0, G_STEP)
    bb = tl.arange(0, 16)
    if MODE == 2:
        acc2 = tl.zeros((BLOCK_N, G_STEP), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in tl.range(0, K_GROUPS, G_STEP, num_stages=NUM_STAGES):
        g = g0 + gg
        gm = g < K_GROUPS
        w = tl.load(blocks_ptr + rows[:, None, None] * stride_row + g[None, :, None] * 16 + bb[None, None, :],
                    mask=row_mask[:, None, None] & gm[None, :, None], other=0).to(tl.int32)
        s = tl.load(scales_ptr + rows[:, None] * stride_srow + g[None, :],
                    mask=row_mask[:, None] & gm[None, :], other=127).to(tl.int32)
        if MODE == 2:
            pp = tl.arange(0, 2)
            xs = tl.load(a_ptr + g[:, None, None] * 32 + 2 * bb[None, :, None] + pp[None, None, :],
                         mask=gm[:, None, None], other=0.0).to(tl.float32)
            xe, xo = tl.split(xs)
            lo = (((w << 22) & 0x01C00000) | ((w << 28) & -2147483648)).to(tl.float32, bitcast=True)
            hi = (((w << 18) & 0x01C00000) | ((w << 24) & -2147483648)).to(tl.float32, bitcast=True)
            part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2) * 8.507059173023462e37  # 2^126
            scale = tl.where(s > 0, s << 23, 0x00400000).to(tl.float32, bitcast=True)  # 2^(s - 127)
            acc2 += part * scale
        else:
            col = g[:, None] * 32 + 2 * bb[None, :]
            xe = tl.load(a_ptr + col, mask=gm[:, None], other=0.0).to(tl.float32)
            xo = tl.load(a_ptr + col + 1, mask=gm[:, None], other=0.0).to(tl.float32)
            if MODE == 1:
                pair = tl.load(lut_ptr + w)  # two bf16 values; bf16 -> float32 is a 16-bit shift
                lo = (pair << 16).to(tl.float32, bitcast=True)
                hi = ((pair >> 16) << 16).to(tl.float32, bitcast=True)
            else:
                lo = _fp4_to_f32(w & 15)
                hi = _fp4_to_f32(w >> 4)
            part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)
            scale = (s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
            acc += tl.sum(part * scale, axis=1)
    if MODE == 2:
        acc = tl.sum(acc2, axis=1)
    return acc


@triton.jit
def _mx_dot_scaled_rows(blocks_ptr, scales_ptr, stride_row, stride_srow, rows, row_mask, a_ptr, K,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """sum_k W[rows, k] * a[k] through tl.dot_scaled (MXFP4 x bf16, float32 accumulate): the
    activation is column 0 of a [BLOCK_K, 16] operand (the tensor cores' narrowest N)."""
    kb = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 32)
    kk = tl.arange(0, BLOCK_K)
    c = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(blocks_ptr + rows[:, None] * stride_row + k0 // 2 + kb[None, :],
                    mask=row_mask[:, None] & (k0 // 2 + kb[None, :] < K // 2), other=0)
        s = tl.load(scales_ptr + rows[:, None] * stride_srow + k0 // 32 + ks[None, :],
                    mask=row_mask[:, None] & (k0 // 32 + ks[None, :] < K // 32), other=127)
        a = tl.load(a_ptr + k0 + kk[:, None] + 0 * c[None, :], mask=(c[None, :] == 0) & (k0 + kk[:, None] < K),
                    other=0.0).to(tl.bfloat16)
        acc = tl.dot_scaled(w, s, "e2m1", a, None, "bf16", acc, fast_math=True)
    return tl.sum(tl.where(c[None, :] == 0, acc, 0.0), axis=1)


@triton.jit
def _mx_gate_up_dot_kernel(
    x_ptr, ids_ptr, b_ptr, s_ptr, bias_ptr, act_ptr,
    stride_x, stride_be, stride_brow, stride_se, stride_srow, stride_bias, N2, H, limit, alpha,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    rows = n0 + tl.arange(0, BLOCK_N)
    rm = rows < N2
    acc = _mx_dot_scaled_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, stride_brow, stride_srow, rows, rm,
                              x_ptr + token * stride_x, H, BLOCK_N, BLOCK_K, NUM_STAGES)
    _bias_swiglu_store(acc, bias_ptr + e * stride_bias, rows, rm, act_ptr + pair.to(tl.int64) * (N2 // 2),
                       n0, N2, limit, alpha, BLOCK_N)


@triton.jit
def _mx_down_dot_kernel(
    act_ptr, ids_ptr, wts_ptr, b_ptr, s_ptr, bias_ptr, out_ptr,
    stride_be, stride_brow, stride_se, stride_srow, stride_bias, stride_out, H, I,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < H
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair = t * TOP_K + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        w = tl.load(wts_ptr + pair).to(tl.float32)
        y = _mx_dot_scaled_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, stride_brow, stride_srow, rows, rm,
                                act_ptr + pair * I, I, BLOCK_N, BLOCK_K, NUM_STAGES)
        if HAS_BIAS:
            y += tl.load(bias_ptr + e * stride_bias + rows, mask=rm, other=0.0)
        out += w * y
    tl.store(out_ptr + t * stride_out + rows, out.to(out_ptr.dtype.element_ty), mask=rm)


@triton.jit
def _mx_gate_up_kernel(
    x_ptr, ids_ptr, b_ptr, s_ptr, bias_ptr, act_ptr, lut_ptr,
    stride_x, stride_be, stride_brow, stride_se, stride_srow, stride_bias, N2, limit, alpha, H_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, G_STEP: tl.constexpr, NUM_STAGES: tl.constexpr,
    MODE: tl.constexpr,
):
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    rows = n0 + tl.arange(0, BLOCK_N)
    rm = rows < N2
    acc = _mx_dot_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, stride_brow, stride_srow, rows, rm,
                       x_ptr + token * stride_x, lut_ptr, H_GROUPS, G_STEP, NUM_STAGES, BLOCK_N, MODE)
    _bias_swiglu_store(acc, bias_ptr + e * stride_bias, rows, rm, act_ptr + pair.to(tl.int64) * (N2 // 2),
                       n0, N2, limit, alpha, BLOCK_N)


@triton.jit
def _mx_down_kernel(
    act_ptr, ids_ptr, wts_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, lut_ptr,
    stride_be, stride_brow, stride_se, stride_srow, stride_bias, stride_out, H, I, I_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, G_STEP: tl.constexpr,
    NUM_STAGES: tl.constexpr, MODE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < H
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair = t * TOP_K + k
        e = tl.load(ids_ptr + pair).to(tl.int64)
        w = tl.load(wts_ptr + pair).to(tl.float32)
        y = _mx_dot_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, stride_brow, stride_srow, rows, rm,
                         act_ptr + pair * I, lut_ptr, I_GROUPS, G_STEP, NUM_STAGES, BLOCK_N, MODE)
        if HAS_BIAS:
            y += tl.load(bias_ptr + e * stride_bias + rows, mask=rm, other=0.0)
        out += w * y
    tl.store(out_ptr + t * stride_out + rows, out.to(out_ptr.dtype.element_ty), mask=rm)



# ---------------------------------------------------------------- decode "packed"
# One 32-bit word of packed blocks (kernels/mxfp4.py) = 8 values = 4 bf16x2 pairs (bf16_pairs_ptx:
# e2m1 * 2^-126), times the activation pairs $2..$5 (bf16x2, pre-scaled by 2^64), so each product is
# e2m1 * x * 2^-62, a normal bf16 for any |x| above 2^-65. Four bf16x2 FMAs (the first a multiply)
# sum the word's values per lane; the two lanes are added in float32. 21 integer + 4 bf16x2 + 3
# instructions per 8 weights. (On Hopper the CUDA mma kernels serve these sizes: kernels/moe.py.)
def _packed_word_asm() -> str:
    from .mxfp4 import bf16_pairs_ptx

    lines = ["{", ".reg .b32 acc, l;", *bf16_pairs_ptx("$1")]
    for q in range(4):
        lines.append(f"mul.rn.bf16x2 acc, p{q}, ${q + 2};" if q == 0 else f"fma.rn.bf16x2 acc, p{q}, ${q + 2}, acc;")
    lines += ["shl.b32 m, acc, 16;", "and.b32 l, acc, 0xFFFF0000;", "add.f32 $0, m, l;", "}"]
    return "\n".join(lines)


_PACKED_WORD_ASM = _packed_word_asm()
MAX_TILES = 1 << 17  # (token, row tile) arrival counters of the down kernel, allocated once, before any capture
_PRESCALE_ASM = "{\n.reg .b32 c;\nmov.b32 c, 0x5F805F80;\nmul.rn.bf16x2 $0, $1, c;\n}"  # x 2^64 in both lanes


@triton.jit
def _mx_packed_rows(words_ptr, scales_ptr, rows, row_mask, xw_ptr,
                    K_GROUPS: tl.constexpr, G_STEP: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
                    WORD_ASM: tl.constexpr, PRESCALE_ASM: tl.constexpr, PRESCALE: tl.constexpr):
    """sum_k W[rows, k] * x[k] over K = 32 * K_GROUPS: W in packed MXFP4 words (int32, 4 per
    group; rows contiguous, so the row stride is the constexpr 4 * K_GROUPS and the compiler can
    prove 16-byte loads), scales as int32 words of 4 groups (rows padded to a multiple of 16
    groups: aligned, so they stream through the same prefetch pipeline as the blocks), x as bf16
    pairs in int32 at xw_ptr, already times 2^64 unless PRESCALE (then scaled here, once per
    thread for all its rows). Each group's float32 sum (values * 2^-62) times 2^(s - 65) = its
    scale 2^(s - 127). K steps of G_STEP groups = G_STEP / 4 quads of 4 groups."""
    GQ: tl.constexpr = G_STEP // 4
    S_ROW: tl.constexpr = (K_GROUPS + 15) // 16 * 4  # int32 scale words per row
    gq = tl.arange(0, GQ)
    gi = tl.arange(0, 4)
    ww = tl.arange(0, 4)
    acc = tl.zeros((BLOCK_N, GQ, 4), dtype=tl.float32)
    for g0 in tl.range(0, K_GROUPS, G_STEP, num_stages=NUM_STAGES):
        g = g0 + gq[:, None] * 4 + gi[None, :]  # [GQ, 4]
        gm = g < K_GROUPS
        w = tl.load(words_ptr + packed_group(rows[:, None, None, None], g[None, :, :, None], K_GROUPS) * 4
                    + ww[None, None, None, :], mask=row_mask[:, None, None, None] & gm[None, :, :, None], other=0)
        sq = g0 // 4 + gq
        sw = tl.load(scales_ptr + rows[:, None] * S_ROW + sq[None, :], mask=row_mask[:, None] & (sq < S_ROW)[None, :],
                     other=0)
        s = (sw[:, :, None] >> (gi * 8)[None, None, :]) & 0xFF  # [N, GQ, 4]
        xp = tl.load(xw_ptr + g[:, :, None, None] * 16 + ww[None, None, :, None] * 4 + ww[None, None, None, :],
                     mask=gm[:, :, None, None], other=0)  # [GQ, 4, word, q]: pair 4 word + q of the group
        if PRESCALE:
            xp = tl.inline_asm_elementwise(PRESCALE_ASM, "=r,r", [xp], dtype=tl.int32, is_pure=True, pack=1)
        x02, x13 = tl.split(tl.reshape(xp, (GQ, 4, 4, 2, 2)))  # q = 2 i + j: split j first
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        part = tl.inline_asm_elementwise(
            WORD_ASM, "=f,r,r,r,r,r",
            [w, x0[None, :, :, :], x1[None, :, :, :], x2[None, :, :, :], x3[None, :, :, :]],
            dtype=tl.float32, is_pure=True, pack=1)
        scale = ((s + 62) << 23).to(tl.float32, bitcast=True)  # 2^(s - 65)
        acc += tl.sum(part, axis=3) * scale
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _mx_gate_up_packed_kernel(
    x_ptr, ids_ptr, b_ptr, s_ptr, bias_ptr, act_ptr,
    stride_x, stride_be, stride_se, stride_bias, N2, limit, alpha, H_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, G_STEP: tl.constexpr, NUM_STAGES: tl.constexpr,
    WORD_ASM: tl.constexpr, PRESCALE_ASM: tl.constexpr,
):
    """Program (pair, BLOCK_N rows of 2I). x_ptr: the tokens as int32 bf16 pairs; act_ptr: bf16
    [pairs, N2 / 2], times 2^64 (the down kernel's input scale)."""
    pair = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = n0 + tl.arange(0, BLOCK_N)
    rm = rows < N2
    acc = _mx_packed_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, rows, rm, x_ptr + (pair // TOP_K) * stride_x,
                          H_GROUPS, G_STEP, NUM_STAGES, BLOCK_N, WORD_ASM, PRESCALE_ASM, True)
    _bias_swiglu_store(acc, bias_ptr + e * stride_bias, rows, rm, act_ptr + pair * (N2 // 2),
                       n0, N2, limit, alpha, BLOCK_N, 1.8446744073709552e19)  # 2^64: the down input scale


@triton.jit
def _mx_down_packed_kernel(
    act_ptr, ids_ptr, wts_ptr, b_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    stride_be, stride_se, stride_bias, stride_out, H, I_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, G_STEP: tl.constexpr,
    NUM_STAGES: tl.constexpr, WORD_ASM: tl.constexpr, PRESCALE_ASM: tl.constexpr,
):
    """Program (token-slot pair, BLOCK_N rows of H): (expert(act) + bias) * routing weight as a
    float32 partial; the last of a token's TOP_K programs on these rows to arrive sums the partials
    in slot order (deterministic, no float atomics) and stores the row tile. act_ptr: the SwiGLU
    activations times 2^64 as int32 bf16 pairs, I_GROUPS * 16 per pair."""
    pair = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = pair // TOP_K
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < H
    e = tl.load(ids_ptr + pair).to(tl.int64)
    y = _mx_packed_rows(b_ptr + e * stride_be, s_ptr + e * stride_se, rows, rm, act_ptr + pair * (I_GROUPS * 16),
                        I_GROUPS, G_STEP, NUM_STAGES, BLOCK_N, WORD_ASM, PRESCALE_ASM, False)
    if HAS_BIAS:
        y += tl.load(bias_ptr + e * stride_bias + rows, mask=rm, other=0.0)
    y *= tl.load(wts_ptr + pair).to(tl.float32)
    tl.store(part_ptr + pair * H + rows, y, mask=rm)
    tl.debug_barrier()  # every thread's partial is stored before the counter moves
    counter = count_ptr + t * tl.num_programs(1) + tile
    if tl.atomic_add(counter, 1, sem="acq_rel") == TOP_K - 1:
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            out += tl.load(part_ptr + (t * TOP_K + k) * H + rows, mask=rm, other=0.0, cache_modifier=".cg")
        tl.store(counter, 0)
        tl.store(out_ptr + t * stride_out + rows, out.to(out_ptr.dtype.element_ty), mask=rm)


def _experts_forward_packed(x, topk_weights, ids, w: MxExperts, limit, alpha, add_down_bias, config, out):
    t, h = x.shape
    k = ids.numel() // t
    e, n2, hg, _ = w.gate_up_blocks.shape
    i = n2 // 2
    gu_words, dn_words = w.gate_up_blocks.view(torch.int32), w.down_blocks.view(torch.int32)
    gu_scales, dn_scales = w.gate_up_scales.view(torch.int32), w.down_scales.view(torch.int32)
    for name, cfg in (("gate_up", config.gate_up), ("down", config.down)):
        if cfg[1] % 4 or 16 % cfg[1]:
            raise ValueError(f"packed decode: the {name} K step must be 4, 8 or 16 groups, not {cfg[1]}")
    act = torch.empty(t * k, i, dtype=torch.bfloat16, device=x.device)
    xw = x.to(torch.bfloat16).view(torch.int32)
    bn, gs, nw, ns = config.gate_up
    _mx_gate_up_packed_kernel[(t * k, triton.cdiv(n2, bn))](
        xw, ids, gu_words, gu_scales, w.gate_up_bias, act,
        xw.stride(0), gu_words.stride(0), gu_scales.stride(0), w.gate_up_bias.stride(0), n2, limit, alpha, H_GROUPS=hg,
        TOP_K=k, BLOCK_N=bn, G_STEP=gs, NUM_STAGES=ns, WORD_ASM=_PACKED_WORD_ASM, PRESCALE_ASM=_PRESCALE_ASM,
        num_warps=nw,
    )
    bn, gs, nw, ns = config.down
    tiles = triton.cdiv(h, bn)
    part = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    counters = arrival_counters(x.device, "mxfp4_down", max(MAX_TILES, t * tiles))
    _mx_down_packed_kernel[(t * k, tiles)](
        act.view(torch.int32), ids, topk_weights.contiguous().view(-1), dn_words, dn_scales, w.down_bias, out,
        part, counters, dn_words.stride(0), dn_scales.stride(0), w.down_bias.stride(0), out.stride(0), h,
        I_GROUPS=i // 32, TOP_K=k, HAS_BIAS=add_down_bias, BLOCK_N=bn, G_STEP=gs, NUM_STAGES=ns,
        WORD_ASM=_PACKED_WORD_ASM, PRESCALE_ASM=_PRESCALE_ASM, num_warps=nw,
    )
    return out


def experts_forward_mxfp4(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MxExperts,
    limit: float = 7.0, alpha: float = 1.702, add_down_bias: bool = True, config: MxConfig | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: sum over the token's top-k experts of weight * expert(x)
    (all experts local). Meant for decode batches (each pair streams its expert's rows). config:
    default_config(w.layout) when None."""
    config = config or default_config(w.layout)
    t, h = x.shape
    k = topk_ids.shape[1]
    e, n2, hg, _ = w.gate_up_blocks.shape
    i = n2 // 2
    if hg * 32 != h or w.down_blocks.shape[1] != h or w.down_blocks.shape[2] * 32 != i:
        raise ValueError(f"MXFP4 experts {tuple(w.gate_up_blocks.shape)} / {tuple(w.down_blocks.shape)} "
                         f"do not match x {tuple(x.shape)}")
    for name in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales", "gate_up_bias", "down_bias"):
        if not getattr(w, name).is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if (config.decode == "packed") != (w.layout == "packed"):
        raise ValueError(f"decode {config.decode!r} needs {'packed' if config.decode == 'packed' else 'published'} "
                         f"blocks, these are {w.layout} (MxExperts.to_packed)")
    x = x.contiguous()
    ids = topk_ids.contiguous().view(-1)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if config.mode == 4:
        return _experts_forward_packed(x, topk_weights, ids, w, limit, alpha, add_down_bias, config, out)
    act = torch.empty(t * k, i, dtype=torch.float32, device=x.device)
    if config.mode == 3:
        bn, bk, nw, ns = config.gate_up
        _mx_gate_up_dot_kernel[(t * k, triton.cdiv(n2, bn))](
            x, ids, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, act,
            x.stride(0), w.gate_up_blocks.stride(0), w.gate_up_blocks.stride(1), w.gate_up_scales.stride(0),
            w.gate_up_scales.stride(1), w.gate_up_bias.stride(0), n2, h, limit, alpha,
            TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=ns, num_warps=nw,
        )
        bn, bk, nw, ns = config.down
        _mx_down_dot_kernel[(t, triton.cdiv(h, bn))](
            act, ids, topk_weights.contiguous().view(-1), w.down_blocks, w.down_scales, w.down_bias, out,
            w.down_blocks.stride(0), w.down_blocks.stride(1), w.down_scales.stride(0), w.down_scales.stride(1),
            w.down_bias.stride(0), out.stride(0), h, i,
            TOP_K=k, HAS_BIAS=add_down_bias, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=ns, num_warps=nw,
        )
        return out
    lut = byte_lut(x.device) if config.mode == 1 else ids
    bn, gs, nw, ns = config.gate_up
    _mx_gate_up_kernel[(t * k, triton.cdiv(n2, bn))](
        x, ids, w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, act, lut,
        x.stride(0), w.gate_up_blocks.stride(0), w.gate_up_blocks.stride(1), w.gate_up_scales.stride(0),
        w.gate_up_scales.stride(1), w.gate_up_bias.stride(0), n2, limit, alpha, H_GROUPS=hg,
        TOP_K=k, BLOCK_N=bn, G_STEP=gs, NUM_STAGES=ns, MODE=config.mode, num_warps=nw,
    )
    bn, gs, nw, ns = config.down
    _mx_down_kernel[(t, triton.cdiv(h, bn))](
        act, ids, topk_weights.contiguous().view(-1), w.down_blocks, w.down_scales, w.down_bias, out, lut,
        w.down_blocks.stride(0), w.down_blocks.stride(1), w.down_scales.stride(0), w.down_scales.stride(1),
        w.down_bias.stride(0), out.stride(0), h, i, I_GROUPS=i // 32,
        TOP_K=k, HAS_BIAS=add_down_bias, BLOCK_N=bn, G_STEP=gs, NUM_STAGES=ns, MODE=config.mode, num_warps=nw,
    )
    return out
