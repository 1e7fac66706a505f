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

Weights: `MxExperts` in the packed layout (kernels/mxfp4.py). A word's 8 values decode by the
packed GEMV's rotate / mask-merge, here in Triton integer ops (no inline PTX, so the CPU
interpreter runs it): each pair's bf16x2 bits read as float32 are e2m1 x 2^-126, times 2^126, times
the group's 2^(s - 127): the exact weight, exact in bf16 too, before the dot.

Not yet measured on a GPU; `kernels.moe.MXFP4_GROUPED_MIN_TOKENS` (None: off) routes batches to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .mxfp4 import PACKED_MAG_MASK, PACKED_MAG_ROT, PACKED_SIGN_MASK, PACKED_SIGN_ROT, MxExperts
from .triton_math import swiglu_f32
from .triton_moe import align_routing, combine

# _decode_tile spells the packed layout's rotations out; it must follow kernels/mxfp4.py.
assert PACKED_MAG_ROT == (0, 3, 6, 9) and PACKED_SIGN_ROT == (3, 4, 5, 6)
assert (PACKED_MAG_MASK, PACKED_SIGN_MASK) == (0x01C001C0, 0x80008000)


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


@triton.jit
def _rotl(u, R: tl.constexpr):
    """uint32 u rotated left by 0 < R < 32."""
    return (u << R) | (u >> (32 - R))


@triton.jit
def _pair(u, A: tl.constexpr, B: tl.constexpr, scale):
    """Pair (A, B) of packed words u (uint32) -> its two values (float32), scaled."""
    if A == 0:
        ra = u.to(tl.int32, bitcast=True)
    else:
        ra = _rotl(u, A).to(tl.int32, bitcast=True)
    rb = _rotl(u, B).to(tl.int32, bitcast=True)
    lane = (ra & 0x01C001C0) | (rb & -2147450880)  # magnitudes | signs (0x80008000)
    lo = (lane << 16).to(tl.float32, bitcast=True)
    hi = (lane & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
    return lo * 8.507059173023462e37 * scale, hi * 8.507059173023462e37 * scale  # 2^126


@triton.jit
def _decode_tile(words_ptr, scales_ptr, rows, row_ok, k0, K_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Weights [rows, k0 : k0 + BLOCK_K] (float32, exact) from one expert's packed words (int32,
    4 * K_GROUPS a row) and padded scale words (int32, 4 groups each)."""
    KW: tl.constexpr = BLOCK_K // 8
    S_ROW: tl.constexpr = (K_GROUPS + 15) // 16 * 4
    kw = k0 // 8 + tl.arange(0, KW)
    ok = row_ok[:, None] & (kw < 4 * K_GROUPS)[None, :]
    u = tl.load(words_ptr + rows[:, None] * (4 * K_GROUPS) + kw[None, :], mask=ok, other=0).to(tl.uint32,
                                                                                                 bitcast=True)
    g = kw // 4
    sw = tl.load(scales_ptr + rows[:, None] * S_ROW + (g // 4)[None, :], mask=ok, other=0)
    s = (sw >> ((g % 4) * 8)[None, :]) & 0xFF
    scale = tl.where(s > 0, s << 23, 0x00400000).to(tl.float32, bitcast=True)  # 2^(s - 127)
    l0, h0 = _pair(u, 0, 3, scale)
    l1, h1 = _pair(u, 3, 4, scale)
    l2, h2 = _pair(u, 6, 5, scale)
    l3, h3 = _pair(u, 9, 6, scale)
    # value 2q + l of a word, q = 2 q1 + q0: join over q1 first (the slowest axis), then q0, then l
    b0 = tl.join(tl.join(l0, l2), tl.join(l1, l3))
    b1 = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    return tl.reshape(tl.join(b0, b1), (BLOCK_N, BLOCK_K))


@triton.jit
def _routed_gemm(a_ptr, a_rows, a_ok, stride_a, words_ptr, scales_ptr, n, n_ok, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: rows a_rows of A [., K] times the expert's rows n, transposed."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :], mask=a_ok[:, None] & (kk < K)[None, :],
                    other=0.0)
        w = _decode_tile(words_ptr, scales_ptr, n, n_ok, k0, K // 32, BLOCK_N, BLOCK_K).to(a.dtype)
        if a.dtype == tl.float32:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    return acc


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


def experts_forward_mxfp4_grouped(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MxExperts,
    limit: float = 7.0, alpha: float = 1.702, add_down_bias: bool = True, config: GroupedConfig = GroupedConfig(),
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: sum over the token's top-k experts of weight * expert(x), all
    experts local, experts in the packed layout (`MxExperts.to_packed()`)."""
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
