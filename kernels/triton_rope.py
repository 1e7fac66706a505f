"""The QKV epilogue in one Triton launch: YaRN RoPE on q and k, and the paged KV-cache write.

The QKV GEMM keeps its bias (cuBLAS adds it in its epilogue). What follows it in the plain path
is about 20 small kernels per layer (table gathers, casts, chunk, four multiplies, two adds, cat,
for q and for k, then two `index_put`s into the cache); this is one program per token that reads
the token's q, k and v rows once, writes the rotated q contiguously (what attention reads) and the
rotated k and v into the token's slot of the layer's pages.

Same arithmetic as `engine.rope.RotaryEmbedding` + `PagedKVCache.write`: cos and sin (float32
tables, concentration folded in) are rounded to the activation dtype, each product and each
sum/difference is rounded to it, half-split rotation. So the outputs are bit-identical to the
plain path's, provided the compiler does not contract a product and a sum into one FMA (LLVM
narrows the rounded float32 products to bf16 multiplies and would then fuse them into the
subtraction, skipping the product's rounding): the launch turns FMA fusion off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enter, launch_options


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_ptr, page_size,
    stride_qkv, stride_cos, stride_q,
    stride_cb, stride_ckv, stride_co, stride_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    dt = qkv_ptr.dtype.element_ty
    j = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + pos * stride_cos + j).to(dt).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + j).to(dt).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t)
    page = slot // page_size
    off = slot - page * page_size
    kv_base = cache_ptr + page * stride_cb + off * stride_co

    # q heads 0..HQ-1 and k heads HQ..HQ+HKV-1 are adjacent D-wide column groups of the row
    h = tl.arange(0, BLOCK_H)
    rot = (h < HQ + HKV)[:, None]
    src = qkv_ptr + t * stride_qkv + h[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=rot, other=0.0).to(tl.float32)
    a = (x1 * cos).to(dt).to(tl.float32)
    b = (x2 * sin).to(dt).to(tl.float32)
    c = (x2 * cos).to(dt).to(tl.float32)
    d = (x1 * sin).to(dt).to(tl.float32)
    o1 = (a - b).to(dt)
    o2 = (c + d).to(dt)
    is_q = (h < HQ)[:, None]
    qdst = q_ptr + t * stride_q + h[:, None] * D + j[None, :]
    tl.store(qdst, o1, mask=is_q)
    tl.store(qdst + HALF, o2, mask=is_q)
    is_k = rot & (h >= HQ)[:, None]
    kdst = kv_base + (h - HQ)[:, None] * stride_ch + j[None, :]
    tl.store(kdst, o1.to(cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(kdst + HALF, o2.to(cache_ptr.dtype.element_ty), mask=is_k)

    # v heads: copied as they are
    hv = tl.arange(0, BLOCK_V)
    dv = tl.arange(0, D)
    vm = (hv < HKV)[:, None]
    v = tl.load(qkv_ptr + t * stride_qkv + (HQ + HKV) * D + hv[:, None] * D + dv[None, :], mask=vm)
    tl.store(kv_base + stride_ckv + hv[:, None] * stride_ch + dv[None, :],
             v.to(cache_ptr.dtype.element_ty), mask=vm)


def rope_qkv_write(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    slots: torch.Tensor, layer_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] (q | k | v columns, bias added), positions and flat KV slots [T]
    (int64), cos/sin float32 [max_pos, D/2], layer_cache [blocks, 2, page, Hkv, D] (K at 0, V at 1).
    Writes rotated k and v at each token's slot; returns rotated q [T, Hq, D], contiguous."""
    t = qkv.shape[0]
    blocks, two, page_size, hkv, d = layer_cache.shape
    if two != 2 or hkv != num_kv_heads or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match cache {tuple(layer_cache.shape)} "
                         f"with {num_q_heads} q heads")
    if qkv.stride(1) != 1 or layer_cache.stride(-1) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("qkv rows, cache heads and cos/sin rows must be contiguous")
    if positions.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be [{t}]")
    q = torch.empty(t, num_q_heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_kv_kernel[(t,)](
            qkv, positions, cos, sin, slots, layer_cache, q, page_size,
            qkv.stride(0), cos.stride(0), q.stride(0),
            layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
            HQ=num_q_heads, HKV=num_kv_heads, D=d,
            BLOCK_H=triton.next_power_of_2(num_q_heads + num_kv_heads),
            BLOCK_V=triton.next_power_of_2(num_kv_heads), num_warps=4,
            enable_fp_fusion=False,  # a product must be rounded before the sum, as in torch
            **launch_options(qkv.device),
        )
    return q
