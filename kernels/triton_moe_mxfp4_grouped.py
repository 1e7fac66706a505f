"""MXFP4 experts as grouped W4A16 GEMMs on the tensor cores, for decode batches past a few tokens.

Why: the packed GEMV (kernels/triton_moe_mxfp4.py) decodes an expert's weights once per (token,
expert) pair, so its time grows with the tokens (a 20b layer at 64 tokens: 1.8 ms against a
0.1 ms weight floor). Here the pairs are grouped by expert as the FP8 grouped path groups them
(`triton_moe.align_routing`), and each program decodes one [BLOCK_N, BLOCK_K] tile of its expert
once for the BLOCK_M rows routed to it; the products run on the tensor cores (`tl.dot`, bf16 x bf16
into float32), so the decode is paid once per expert tile, not once per token.

Launches (no host synchronisation: CUDA-graph capturable): the routing layout, gate/up + bias +
clamped SwiGLU -> activations per routed row (x.dtype), down + bias times the routing weight ->
float32 per pair, `triton_moe.combine` (each token's pairs in slot order: deterministic).

Weights: `MxExperts` in the packed layout (kernels/mxfp4.py; 16-row tiles tile-major, addressed by
triton_math.packed_group), loaded as [rows, groups, 4 words]
with one scale byte per group. On the GPU (bf16 activations) inline PTX decodes a word into four
bf16x2 registers, as the packed GEMV does (kernels/mxfp4.py bf16_pairs_ptx: e2m1 x 2^-126), then times 2^64
and times the group's 2^(s - 65) (bf16x2 multiplies; one 2^(s - 1) is no bf16 past s = 128): the
exact weight in bf16 for every scale byte the packed layout allows (0..192; s = 0, 1 give bf16
subnormals, exact where the multiply keeps them: tests/gpu checks), with no float32 step. Float32
activations (Triton's CPU interpreter, which runs no PTX) take the same products in float32. The
dot is W A^T: the decoded tile is the wgmma's register operand and BLOCK_M may be 16 (the wgmma's
N); one layout conversion remains in the K loop, decode order -> wgmma operand order, through
shared memory (STS.128 + LDSM per 16 of K).

Measured on one H200 (2026-12-02, us per 20b layer, 32 experts, top-4; docs/performance.md):
| tokens | first version (float32 decode per value, A W^T), best | this decode, best | packed GEMV | FP8 grouped |
| 16     | 692                                                  | 294               | 339         | 227         |
| 64     | 789                                                  | 366               | 1243        | 256         |
| 256    |                                                      | 412               | 4908        | 295         |
2.1x the first version, faster than the packed GEMV from 16 tokens (`kernels.moe.MXFP4_GROUPED_MIN_TOKENS`
routes those batches here, prefill included), still slower than the FP8 experts: ~1.1 TB/s, bound
by the decode and the layout conversion in the K loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .mxfp4 import PACKED_HIGH_SHL_MASK, PACKED_HIGH_SHR_MASK, PACKED_LOW_MASK, MxExperts, bf16_pairs_ptx
from .triton_math import INTERPRET, packed_group, swiglu_f32
from .triton_moe import align_routing, combine

# _decode_tile spells the packed layout's masks out (as int32); it must follow kernels/mxfp4.py.
assert (PACKED_LOW_MASK, PACKED_HIGH_SHL_MASK, PACKED_HIGH_SHR_MASK) == (0x9C9C9C9C, 0x8C8C8C8C, 0x10101010)


@dataclass(frozen=True)
class GroupedConfig:
    """BLOCK_M routed rows (also the routing layout's alignment) x BLOCK_N outputs, BLOCK_K deep
    steps (a multiple of 32), per GEMM: (BLOCK_N, BLOCK_K, warps, stages)."""

    block_m: int = 16
    gate_up: tuple[int, int, int, int] = (64, 128, 4, 3)
    down: tuple[int, int, int, int] = (64, 128, 4, 3)

    def __post_init__(self):
        for bn, bk, _, _ in (self.gate_up, self.down):
            if bk % 32 or bn % 2 or self.block_m < 16:
                raise ValueError(f"grouped MXFP4 tiles need BLOCK_K % 32 == 0, even BLOCK_N, BLOCK_M >= 16: {self}")


def _word_asm() -> str:
    """PTX: packed word $4 and bf16x2 scale $5 -> four bf16x2 (values 2q, 2q + 1 of the word in $q):
    the bf16 pairs of kernels/mxfp4.py (e2m1 x 2^-126), x 2^64, x the scale. Two multiplies: 2^(s - 1)
    in one is no bf16 past s = 128."""
    lines = ["{", ".reg .b32 l, c;", "mov.b32 c, 0x5F805F80;", *bf16_pairs_ptx("$4")]  # c = 2^64
    for q in range(4):
        lines += [f"mul.rn.bf16x2 l, p{q}, c;", f"mul.rn.bf16x2 ${q}, l, $5;"]
    return "\n".join(lines + ["}"])


_WORD_ASM = tl.constexpr(_word_asm())
_ASM = tl.constexpr(not INTERPRET)  # the interpreter runs no inline PTX


@triton.jit
def _e4m3_value(b):
    """e4m3 byte b (int32, sign at bit 7, magnitude at 4..2) -> float32 e2m1 * 2^-126 (the asm's
    bf16 pair lane, widened)."""
    return (((b & 0x80) << 24) | ((b & 0x1C) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def _pair(e4m3, H: tl.constexpr, scale):
    """Bytes 2H, 2H + 1 of e4m3 words (int32) -> their two values (float32), x 2^64 x scale: the
    asm's numbers (every product exact)."""
    lo = _e4m3_value((e4m3 >> (16 * H)) & 0xFF)
    hi = _e4m3_value((e4m3 >> (16 * H + 8)) & 0xFF)
    return lo * 1.8446744073709552e19 * scale, hi * 1.8446744073709552e19 * scale  # 2^64


@triton.jit
def _decode_tile(words_ptr, scales_ptr, rows, row_ok, k0, K_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Weights [rows, k0 : k0 + BLOCK_K] (exact: bf16 by inline PTX if ASM, else float32) from one
    expert's packed words (int32, 4 a group, tiles stored tile-major: packed_group) and padded scale words (int32,
    4 groups each).
    Loaded as [rows, groups, 4 words] (a group's 16 bytes in one thread) and the scales per group,
    not per word."""
    G: tl.constexpr = BLOCK_K // 32
    SW: tl.constexpr = (G + 3) // 4  # scale words the step touches (BLOCK_K 32 and 64: part of one)
    S_ROW: tl.constexpr = (K_GROUPS + 15) // 16 * 4
    g = k0 // 32 + tl.arange(0, G)
    ww = tl.arange(0, 4)
    ok = row_ok[:, None] & (g < K_GROUPS)[None, :]
    u = tl.load(words_ptr + packed_group(rows[:, None, None], g[None, :, None], K_GROUPS) * 4 + ww[None, None, :],
                mask=ok[:, :, None], other=0)
    sq = k0 // 128 + tl.arange(0, SW)
    sw = tl.load(scales_ptr + rows[:, None] * S_ROW + sq[None, :], mask=row_ok[:, None] & (sq < S_ROW)[None, :],
                 other=0)
    if G >= 4:
        s = tl.reshape(sw[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :], (BLOCK_N, G)) & 0xFF
    else:
        s = (sw >> (g % 4 * 8)[None, :]) & 0xFF
    if ASM:
        c = (s + 62) * 0x00800080  # bf16 2^(s - 65) in both halves
        p0, p1, p2, p3 = tl.inline_asm_elementwise(_WORD_ASM, "=r,=r,=r,=r,r,r",
                                                   [u, tl.broadcast_to(c[:, :, None], u.shape)],
                                                   dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        pairs = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BLOCK_N, BLOCK_K // 2))
        lo = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    else:
        u = u.to(tl.int32, bitcast=True)
        low = u & -1667457892  # PACKED_LOW_MASK 0x9C9C9C9C
        high = ((u << 2) & -1936946036) | ((u >> 2) & 0x10101010)  # the SHL mask 0x8C8C8C8C, the SHR one
        scale = ((s + 62) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^(s - 65)
        l0, h0 = _pair(low, 0, scale)
        l1, h1 = _pair(low, 1, scale)
        l2, h2 = _pair(high, 0, scale)
        l3, h3 = _pair(high, 1, scale)
        # value 2q + l of a word, q = 2 q1 + q0: join over q1 first (the slowest axis), then q0, then l
        b0 = tl.join(tl.join(l0, l2), tl.join(l1, l3))
        b1 = tl.join(tl.join(h0, h2), tl.join(h1, h3))
        return tl.reshape(tl.join(b0, b1), (BLOCK_N, BLOCK_K))


@triton.jit
def _routed_gemm(a_ptr, a_rows, a_ok, stride_a, words_ptr, scales_ptr, n, n_ok, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: rows a_rows of A [., K] times the expert's rows n, transposed.
    Computed as W A^T ([BLOCK_N, BLOCK_M]): the decoded weights are the MMA's first operand, K-major
    as decoded (and BLOCK_M may be below the wgmma's 64 rows)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :], mask=a_ok[:, None] & (kk < K)[None, :],
                    other=0.0)
        if a.dtype == tl.bfloat16 and _ASM:
            w = _decode_tile(words_ptr, scales_ptr, n, n_ok, k0, K // 32, BLOCK_N, BLOCK_K, True)
            acc += tl.dot(w, tl.trans(a))
        else:
            w = _decode_tile(words_ptr, scales_ptr, n, n_ok, k0, K // 32, BLOCK_N, BLOCK_K, False).to(a.dtype)
            if a.dtype == tl.float32:
                acc += tl.dot(w, tl.trans(a), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(a))
    return tl.trans(acc)


@triton.jit
def _routed_block(slot_ptr, block_expert_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program id -> (local expert or -1, its routed rows, their pair slots (-1: padding), which
    rows are real, output columns, which columns exist): blocks of BLOCK_M rows x BLOCK_N columns."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(N, BLOCK_N)
    blk = pid // tiles
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slot_ptr + rows)
    n = (pid % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(block_expert_ptr + blk), rows, slot, slot >= 0, n, n < N


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, slot_ptr, block_expert_ptr,
    stride_x, stride_we, stride_se, stride_bias, N2, limit, alpha,
    H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program (routed block, BLOCK_N of 2I): act[routed row, n / 2] = SwiGLU(x[token] W^T + b)."""
    e, rows, slot, m_ok, n, n_ok = _routed_block(slot_ptr, block_expert_ptr, N2, BLOCK_M, BLOCK_N)
    if e < 0:
        return
    tok = tl.where(m_ok, slot // TOP_K, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    acc = _routed_gemm(x_ptr, tok, m_ok, stride_x, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, n, n_ok, H,
                       BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
    acc += tl.load(bias_ptr + e64 * stride_bias + n, mask=n_ok, other=0.0)[None, :]
    glu, lin = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    cols = (tl.program_id(0) % tl.cdiv(N2, BLOCK_N)) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * (N2 // 2) + cols[None, :], swiglu_f32(glu, lin, limit, alpha),
             mask=m_ok[:, None] & (cols < N2 // 2)[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, bias_ptr, wts_ptr, out_ptr, slot_ptr, block_expert_ptr,
    stride_we, stride_se, stride_bias, H,
    I: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (routed block, BLOCK_N of H): out[pair, n] = (act[routed row] W^T + b) * weight."""
    e, rows, slot, m_ok, n, n_ok = _routed_block(slot_ptr, block_expert_ptr, H, BLOCK_M, BLOCK_N)
    if e < 0:
        return
    e64 = e.to(tl.int64)
    acc = _routed_gemm(act_ptr, rows.to(tl.int64), m_ok, I, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, n,
                       n_ok, I, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * stride_bias + n, mask=n_ok, other=0.0)[None, :]
    acc *= tl.load(wts_ptr + tl.where(m_ok, slot, 0), mask=m_ok, other=0.0).to(tl.float32)[:, None]
    pair = tl.where(m_ok, slot, 0).to(tl.int64)
    tl.store(out_ptr + pair[:, None] * H + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _decode_kernel(words_ptr, scales_ptr, out_ptr, N, K_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _decode_tile(words_ptr, scales_ptr, rows, rows < N, k0, K_GROUPS, BLOCK_N, BLOCK_K, ASM)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * (32 * K_GROUPS) + kk[None, :], w.to(tl.float32),
             mask=(rows < N)[:, None] & (kk < 32 * K_GROUPS)[None, :])


def decode_packed_expert(blocks: torch.Tensor, scales: torch.Tensor, block_n: int = 16, block_k: int = 64
                         ) -> torch.Tensor:
    """One expert's packed blocks [N, K/32, 16] and padded scales [N, G] -> float32 [N, K] through
    the GEMMs' decode alone (inline PTX on the GPU): for tests of it at any scale byte."""
    n, kg, _ = blocks.shape
    out = torch.empty(n, 32 * kg, dtype=torch.float32, device=blocks.device)
    _decode_kernel[(triton.cdiv(n, block_n), triton.cdiv(32 * kg, block_k))](
        blocks.contiguous().view(torch.int32), scales.contiguous().view(torch.int32), out, n, K_GROUPS=kg,
        BLOCK_N=block_n, BLOCK_K=block_k, ASM=not INTERPRET)
    return out


# Launch shapes that measured fastest on an H200 (20b layer, 2026-12-02, docs/performance.md):
# BLOCK_M 16 for decode batches (16-64 tokens: 294-374 us), BLOCK_M 64 from a few hundred tokens
# (256 tokens: 412 us against 777 us with BLOCK_M 16, whose blocks are then many per expert).
DECODE_CONFIG = GroupedConfig(16, (128, 64, 4, 4), (128, 64, 4, 4))
PREFILL_CONFIG = GroupedConfig(64, (128, 64, 4, 3), (128, 64, 4, 3))
PREFILL_FROM_TOKENS = 128


def default_config(tokens: int) -> GroupedConfig:
    """The launch shape for a batch of `tokens` tokens."""
    return DECODE_CONFIG if tokens < PREFILL_FROM_TOKENS else PREFILL_CONFIG


def experts_forward_mxfp4_grouped(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MxExperts,
    limit: float = 7.0, alpha: float = 1.702, add_down_bias: bool = True, config: GroupedConfig | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: sum over the token's top-k experts of weight * expert(x), all
    experts local, experts in the packed layout (`MxExperts.to_packed()`). config: by the batch size
    (`default_config`) when None."""
    if w.layout != "packed":
        raise ValueError("the grouped MXFP4 kernels read packed blocks (MxExperts.to_packed)")
    t, h = x.shape
    e, n2, hg, _ = w.gate_up_blocks.shape
    i = n2 // 2
    if hg * 32 != h or w.down_blocks.shape[1] != h or w.down_blocks.shape[2] * 32 != i:
        raise ValueError(f"MXFP4 experts {tuple(w.gate_up_blocks.shape)} / {tuple(w.down_blocks.shape)} "
                         f"do not match x {tuple(x.shape)}")
    if t == 0:
        return torch.empty_like(x)
    config = config or default_config(t)
    x = x.contiguous()
    routing = align_routing(topk_ids, 0, e, config.block_m)
    gu_words, dn_words = w.gate_up_blocks.view(torch.int32), w.down_blocks.view(torch.int32)
    gu_scales, dn_scales = w.gate_up_scales.view(torch.int32), w.down_scales.view(torch.int32)
    act = torch.empty(routing.max_rows, i, dtype=x.dtype, device=x.device)
    bn, bk, nw, ns = config.gate_up
    _gate_up_kernel[(routing.max_blocks * triton.cdiv(n2, bn),)](
        x, gu_words, gu_scales, w.gate_up_bias, act, routing.sorted_slot, routing.block_expert,
        x.stride(0), gu_words.stride(0), gu_scales.stride(0), w.gate_up_bias.stride(0), n2, limit, alpha,
        H=h, TOP_K=topk_ids.shape[1], BLOCK_M=config.block_m, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=ns,
        num_warps=nw,
    )
    pair_out = torch.empty(topk_ids.numel(), h, dtype=torch.float32, device=x.device)  # every pair is local
    bn, bk, nw, ns = config.down
    _down_kernel[(routing.max_blocks * triton.cdiv(h, bn),)](
        act, dn_words, dn_scales, w.down_bias, topk_weights.contiguous().view(-1), pair_out,
        routing.sorted_slot, routing.block_expert, dn_words.stride(0), dn_scales.stride(0), w.down_bias.stride(0), h,
        I=i, HAS_BIAS=add_down_bias, BLOCK_M=config.block_m, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=ns, num_warps=nw,
    )
    return combine(pair_out, topk_ids, 0, e, x.dtype)
