"""The QKV epilogue in one Triton launch: YaRN RoPE on q and k, and the paged KV-cache write; and,
for one token (batch-1 decode), the QKV projection itself in the same launch (`qkv_rope_write`:
the bf16 GEMV's rows taken in rotation pairs, so each program rotates what it computed).

The QKV GEMM keeps its bias (cuBLAS adds it in its epilogue). What follows it in the plain path
is about 20 small kernels per layer (table gathers, casts, chunk, four multiplies, two adds, cat,
for q and for k, then two `index_put`s into the cache); this is one program per token that reads
the token's q, k and v rows once, writes the rotated q contiguously (what attention reads) and the
rotated k and v into the token's slot of the layer's pages.

Same arithmetic as `engine.rope.RotaryEmbedding` + `PagedKVCache.write`: cos and sin (float32
tables, concentration folded in) are rounded to the activation dtype, each product and each
sum/difference is rounded to it, half-split rotation. So the outputs are bit-identical to the
plain path's, provided the compiler does not contract a product and a sum into one FMA (LLVM
narrows rounded float32 products to bf16 multiplies and would then fuse them into the
subtraction, skipping the product's rounding): the products are PTX round-to-nearest
multiplies, which it cannot narrow (`_rotate`), and the RoPE-only launch also turns FMA fusion off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_bf16_gemv
from .pdl import enter, launch_options
from .triton_bf16_gemv import DEFAULTS, _gemv_tile, select_config
from .triton_math import INTERPRET


@triton.jit
def _mul_rounded(a, b, dt, ACCURATE: tl.constexpr):
    """a * b rounded to dt, as float32: a product LLVM cannot narrow and contract into the sum after
    it (PTX `mul.rn.f32`, which ptxas does not fuse either; no flush of subnormals; a product of two
    dt values is exact in float32, so this is the torch op's rounding), which a kernel with a GEMV
    needs without turning FMA fusion off."""
    if ACCURATE:
        p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
        return p.to(dt).to(tl.float32)
    else:
        return (a * b).to(dt).to(tl.float32)


@triton.jit
def _rotate(x1, x2, cos, sin, dt, ACCURATE: tl.constexpr):
    """Half-split rotation of float32 halves x1, x2 as the torch ops round it: each product and
    each sum / difference rounded to dt. Returns the two halves in dt."""
    a = _mul_rounded(x1, cos, dt, ACCURATE)
    b = _mul_rounded(x2, sin, dt, ACCURATE)
    c = _mul_rounded(x2, cos, dt, ACCURATE)
    d = _mul_rounded(x1, sin, dt, ACCURATE)
    return (a - b).to(dt), (c + d).to(dt)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, stride_cos, cols, dt):
    """The position's cos and sin at `cols`, rounded to dt (as the torch path's tables are), float32."""
    cos = tl.load(cos_ptr + pos * stride_cos + cols).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + cols).to(dt).to(tl.float32)
    return cos, sin


@triton.jit
def _slot_base(cache_ptr, slot, page_size, stride_cb, stride_co):
    """Where a flat KV slot's K heads start in a [blocks, 2, page, Hkv, D] layer cache."""
    page = slot // page_size
    return cache_ptr + page * stride_cb + (slot - page * page_size) * stride_co


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_ptr, page_size,
    stride_qkv, stride_cos, stride_q,
    stride_cb, stride_ckv, stride_co, stride_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, ACCURATE: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    dt = qkv_ptr.dtype.element_ty
    j = tl.arange(0, HALF)
    cos, sin = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr + t), stride_cos, j, dt)
    cos, sin = cos[None, :], sin[None, :]
    kv_base = _slot_base(cache_ptr, tl.load(slot_ptr + t), page_size, stride_cb, stride_co)

    # q heads 0..HQ-1 and k heads HQ..HQ+HKV-1 are adjacent D-wide column groups of the row
    h = tl.arange(0, BLOCK_H)
    rot = (h < HQ + HKV)[:, None]
    src = qkv_ptr + t * stride_qkv + h[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=rot, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, cos, sin, dt, ACCURATE)
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
            BLOCK_V=triton.next_power_of_2(num_kv_heads), ACCURATE=not INTERPRET, num_warps=4,
            enable_fp_fusion=False,  # nothing else to fuse here; a product must be rounded before the sum
            **launch_options(qkv.device),
        )
    return q


@triton.jit
def _qkv_rope_kernel(
    x_ptr, w_ptr, bias_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_ptr, page_size, K,
    stride_wn, stride_cos, stride_cb, stride_ckv, stride_co, stride_ch,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr, K_PER: tl.constexpr, NUM_STAGES: tl.constexpr, ACCURATE: tl.constexpr,
    EARLY: tl.constexpr, PDL: tl.constexpr,
):
    """One token. Program p: 4 rotation pairs of one head, rows h D + j + {0..3} and + D / 2 (the
    GEMV of kernels.triton_bf16_gemv on those 8 weight rows, bias in float32, rounded to x.dtype as
    its output is), then `_rotate` as `_rope_kv_kernel` does: q heads to q, k heads rotated and v
    heads as they are into the token's KV slot."""
    if not EARLY:
        enter(PDL)
    HALF: tl.constexpr = D // 2
    p = tl.program_id(0)
    h = p // (HALF // 4)
    j = (p % (HALF // 4)) * 4
    r = tl.arange(0, 8)
    rows = h * D + j + (r % 4) + (r // 4) * HALF  # [x1 of dims j..j+3, x2 of the same dims]
    n_ok = rows < (HQ + 2 * HKV) * D
    acc = _gemv_tile(x_ptr, w_ptr + rows.to(tl.int64)[:, None] * stride_wn, n_ok, K, 0, 0,
                     1, 1, 8, BLOCK_K, K_PER, NUM_STAGES, EARLY, PDL)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
    dt = x_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dt).to(tl.float32), (2, 4)), (1, 0)))
    jj = j + tl.arange(0, 4)
    cos, sin = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr), stride_cos, jj, dt)
    if h < HQ + HKV:  # q or k: rotate
        o1, o2 = _rotate(x1, x2, cos, sin, dt, ACCURATE)
    else:
        o1 = x1.to(dt)
        o2 = x2.to(dt)
    if h < HQ:
        tl.store(q_ptr + h * D + jj, o1)
        tl.store(q_ptr + h * D + HALF + jj, o2)
    else:
        head = tl.where(h < HQ + HKV, h - HQ, h - HQ - HKV)
        dst = (_slot_base(cache_ptr, tl.load(slot_ptr), page_size, stride_cb, stride_co) + head * stride_ch
               + tl.where(h < HQ + HKV, 0, stride_ckv))
        tl.store(dst + jj, o1.to(cache_ptr.dtype.element_ty))
        tl.store(dst + HALF + jj, o2.to(cache_ptr.dtype.element_ty))


def qkv_rope_write(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, slots: torch.Tensor, layer_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """One token's QKV projection, RoPE and KV-cache write in one launch: x [1, K] (bf16), w
    [(Hq + 2 Hkv) D, K] (bf16, rows contiguous), bias [N] or None; the rest as `rope_qkv_write`.
    Returns rotated q [1, Hq, D]; equals `bf16_gemv` then `rope_qkv_write` bit for bit where the GEMV
    does not split K (gpt-oss' QKV at TP 1: 640 tiles of 8 rows; K is never split here)."""
    blocks, two, page_size, hkv, d = layer_cache.shape
    n, k = w.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be one contiguous token row of w {tuple(w.shape)}'s K")
    if two != 2 or hkv != num_kv_heads or n != (num_q_heads + 2 * num_kv_heads) * d or d % 8:
        raise ValueError(f"w {tuple(w.shape)} does not match cache {tuple(layer_cache.shape)} "
                         f"with {num_q_heads} q heads")
    if layer_cache.stride(-1) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cache heads and cos/sin rows must be contiguous")
    if positions.shape != (1,) or slots.shape != (1,):
        raise ValueError(f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be [1]")
    cfg = select_config(1, n, k)  # the GEMV's launch shape for these weights, in tiles of 8 rows
    if cfg.block_n != 8:
        cfg = DEFAULTS[1]
    q = torch.empty(1, num_q_heads, d, dtype=x.dtype, device=x.device)
    _qkv_rope_kernel[(n // 8,)](
        x, w, bias if bias is not None else w, positions, cos, sin, slots, layer_cache, q, page_size, k,
        w.stride(0), cos.stride(0), layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3), HQ=num_q_heads, HKV=num_kv_heads, D=d, HAS_BIAS=bias is not None,
        BLOCK_K=cfg.block_k, K_PER=triton.cdiv(k, cfg.block_k), NUM_STAGES=cfg.num_stages,
        ACCURATE=not INTERPRET, EARLY=triton_bf16_gemv.EARLY_WEIGHTS, num_warps=cfg.num_warps,
        **launch_options(x.device),
    )
    return q
