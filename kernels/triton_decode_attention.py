"""Split-KV ("flash-decoding") paged decode attention with sinks, in Triton, for small batches.

Why: at batch 1 FlashInfer's XQA decode kernel takes ~12 us per layer for 1k keys that need
0.5 us of bandwidth; it runs too few programs to fill the GPU and pays fixed costs. Here each
(request, KV head) is split over the keys into up to `SPLITS` chunks, one program each, so a
single request spreads over ~2 programs per SM.

Semantics are `kernels.attention.sink_attention_ref` for one query per request (the last
position): keys at positions >= len - 1 - window_left (all with window_left < 0), scores x
sm_scale, a float32 softmax whose denominator also holds the head's sink logit (raw, not scaled;
its value vector is zero). Output in q.dtype.

One launch. Program (split s, request b, KV head g) handles the g-th group of Hq / Hkv query
heads (one KV read serves all of them; the group is padded to 16 rows for `tl.dot`):
1. reads the request's length, derives the key range and the number of splits it really needs
   (at least `min_keys` keys a split, block-aligned); programs past it exit at once, so the grid
   may be sized for the largest batch / context (CUDA-graph capturable: nothing on the host
   depends on the step's lengths);
2. online softmax over its chunk in float32, keys gathered through the page table;
3. a request that needs one split writes its output directly (sink folded in); otherwise the
   program stores its (max, sum, unnormalised output) partial, and the last program of the
   (request, KV head) to arrive (an arrival counter, `kernels.arrival` style; it resets it)
   combines the partials in split order with the sink: deterministic whatever the arrival order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import enter, launch_options
from .triton_math import INTERPRET

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the split kernel. block_n: keys per inner step; min_keys: fewest keys a split
    takes (short requests use fewer splits); programs: the grid a batch aims for (per GPU, in
    programs; 0 = two per SM); max_splits: cap on splits per (request, KV head), a power of two."""

    block_n: int = 64
    min_keys: int = 64
    programs: int = 0
    max_splits: int = 64
    num_warps: int = 4
    num_stages: int = 2
    combine_splits: int = 8  # partials folded per combine step (power of two)


# The tilings the engine runs, by layer type (H200, `python -m pdserve.bench.decode_attention
# --tilings ...`, docs/performance.md, 2026-12-02). Full layers: 128-key blocks, up to 32 splits folded
# in one combine step: at or below XQA's time at batches 1-16 and 1k-32k keys (batch 1: 10.9 / 17.2 /
# 31.6 us at 1k / 8k / 32k against XQA's 15.4 / 19.4 / 32.7), where the same blocks in up to 16 splits
# folded 8 at a time took 3-15 us more at 8k-32k keys. Splits of one 128-key block (so all of a split's
# cached keys are read ahead of the PDL wait) since 2026-12-04: in the decode step 1.2-1.3 % faster
# than splits of at least 256 keys at 1-2 requests of 1k keys, 0.8-1.5 % at 4, level at 16
# (`bench/launch_ab.py --settings "default,full 128-key splits"`, docs/performance.md, twenty-second
# round); with 8k keys or more a request takes the same splits either way (32 at one request).
# Windowed layers (128 keys): one 128-key block of 8 warps, no split (about 0.5 us under the
# default tiling).
FULL_LAYERS = DecodeConfig(block_n=128, min_keys=128, max_splits=32, combine_splits=32)
WINDOWED_LAYERS = DecodeConfig(block_n=128, min_keys=256, num_warps=8)

# Read each split's first block of keys before the PDL wait (kernels/pdl.py), while the kernel ahead
# (the QKV epilogue) still runs, and re-read only the step's own key after it.
EARLY_KV = True


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(
    batch_rows: int, num_kv_heads: int, max_keys: int | None, device: torch.device, cfg: DecodeConfig = DecodeConfig()
) -> int:
    """Splits per (request, KV head) for a grid of `batch_rows` requests whose keys are bounded by
    `max_keys` (a windowed layer's window; None: no bound): a power of two, so few kernel variants
    compile. The rows count as the next power of two: an eager decode step of b requests and the
    CUDA graph that runs it padded to its capture size (engine.cuda_graphs: powers of two up to 8,
    then multiples of 16) get the same splits, and with them the same split of each request's keys
    and the same folding order, so a replayed step equals the eager one bit for bit. For the same
    reason the engine passes a bound that does not depend on the step (the window, or None), not
    the longest request."""
    target = cfg.programs
    if target <= 0:
        if device.type == "cuda":
            target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        else:
            target = 2 * 132  # an H200's SMs: CPU runs (the interpreter) mimic its grid
    want = min(triton.cdiv(target, triton.next_power_of_2(max(batch_rows, 1)) * num_kv_heads), cfg.max_splits)
    if max_keys is not None:
        want = min(want, triton.cdiv(max(max_keys, 1), cfg.min_keys))
    return 1 << (max(want, 1).bit_length() - 1)  # largest power of two <= want


class DecodeScratch:
    """Partials and arrival counters of one launch geometry (rows x KV heads x splits). Owned by
    one attention object, so a captured graph's pointers stay valid; layers reuse it in turn."""

    def __init__(self, rows: int, num_kv_heads: int, group: int, head_dim: int, splits: int, device):
        g = triton.next_power_of_2(group)
        f32 = dict(dtype=torch.float32, device=device)
        self.shape = (rows, num_kv_heads, splits)
        self.o = torch.empty(rows, num_kv_heads, splits, g, head_dim, **f32)
        self.m = torch.empty(rows, num_kv_heads, splits, g, **f32)
        self.l = torch.empty(rows, num_kv_heads, splits, g, **f32)
        self.count = torch.zeros(rows * num_kv_heads, dtype=torch.int32, device=device)  # zero between launches

    def fits(self, rows: int, num_kv_heads: int, splits: int) -> bool:
        return self.shape[0] >= rows and self.shape[1] == num_kv_heads and self.shape[2] == splits


@triton.jit
def _load_block(n0, hi, table, kv_ptr, g, stride_page, stride_kv, stride_tok, D: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N (those < hi) of KV head g, gathered through the page table:
    (k, v, key positions, their row offsets in the cache)."""
    d = tl.arange(0, D)
    keys = n0 + tl.arange(0, BLOCK_N)
    k_ok = keys < hi
    page = tl.load(table + keys // PAGE, mask=k_ok, other=0, cache_modifier=CACHE).to(tl.int64)
    base = page * stride_page + (keys % PAGE) * stride_tok + g * D
    k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=k_ok[:, None], other=0.0, cache_modifier=CACHE)
    v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :], mask=k_ok[:, None], other=0.0,
                cache_modifier=CACHE)
    return k, v, keys, base


@triton.jit
def _softmax_step(q, m_i, l_i, acc, k, v, k_ok, qk_scale, DOT_F32: tl.constexpr):
    """Online-softmax step over one block of keys (k, v; `k_ok` masks them)."""
    if DOT_F32:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(k_ok[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_block(q, m_i, l_i, acc, n0, hi, table, kv_ptr, g, stride_page, stride_kv, stride_tok, qk_scale,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Online-softmax step over keys n0 .. n0 + BLOCK_N (those < hi), gathered through the page table."""
    k, v, keys, _ = _load_block(n0, hi, table, kv_ptr, g, stride_page, stride_kv, stride_tok, D, PAGE, BLOCK_N, "")
    return _softmax_step(q, m_i, l_i, acc, k, v, keys < hi, qk_scale, DOT_F32)


# the window and the page-table width vary by layer type and captured size: one compiled variant for all
@triton.jit(do_not_specialize=["stride_table", "window_left"])
def _decode_kernel(
    q_ptr, kv_ptr, table_ptr, lens_ptr, sinks_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, count_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_kv, stride_tok, stride_table,
    qk_scale, window_left,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr, SPLITS: tl.constexpr,
    COMBINE: tl.constexpr, DOT_F32: tl.constexpr, WHILE_LOOP: tl.constexpr,
    EARLY_KV: tl.constexpr, PDL: tl.constexpr,
):
    if not EARLY_KV:
        enter(PDL)
    s = tl.program_id(0)
    b = tl.program_id(1)
    g = tl.program_id(2)
    hkv = tl.num_programs(2)
    seq_len = tl.load(lens_ptr + b, cache_modifier=".cg")  # staged before the step
    start = tl.maximum(seq_len - 1 - window_left, 0)  # window_left: 2**30 for full attention
    n_keys = seq_len - start
    n_split = tl.maximum(tl.minimum(tl.cdiv(n_keys, MIN_KEYS), SPLITS), 1)
    chunk = tl.cdiv(tl.cdiv(n_keys, n_split), BLOCK_N) * BLOCK_N
    n_split = tl.cdiv(n_keys, chunk)
    lo = start + s * chunk
    hi = tl.where(s < n_split, tl.minimum(lo + chunk, seq_len), lo)  # idle programs: no keys
    table = table_ptr + b.to(tl.int64) * stride_table
    if EARLY_KV:
        # The split's first block is in the cache before the kernel ahead of this one (the QKV
        # epilogue) runs, but for the step's own key (position seq_len - 1), which that kernel
        # writes: read the block now (L2 only, so no stale line stays in L1), wait, then re-read
        # that one row.
        k0, v0, keys0, base0 = _load_block(lo, hi, table, kv_ptr, g, stride_page, stride_kv, stride_tok, D, PAGE,
                                           BLOCK_N, ".cg")
        enter(PDL)
    if s < n_split:
        rows = tl.arange(0, BLOCK_H)
        row_ok = rows < GROUP
        heads = g * GROUP + rows
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, D), dtype=tl.float32)
        key0 = lo
        if EARLY_KV:
            new = (keys0 == seq_len - 1) & (keys0 < hi)
            k0 = tl.where(new[:, None], tl.load(kv_ptr + base0[:, None] + d[None, :], mask=new[:, None], other=0.0,
                                                cache_modifier=".cg"), k0)
            v0 = tl.where(new[:, None], tl.load(kv_ptr + stride_kv + base0[:, None] + d[None, :], mask=new[:, None],
                                                other=0.0, cache_modifier=".cg"), v0)
            m_i, l_i, acc = _softmax_step(q, m_i, l_i, acc, k0, v0, keys0 < hi, qk_scale, DOT_F32)
            key0 = lo + BLOCK_N
        if WHILE_LOOP:  # Triton's interpreter cannot take tensor loop bounds (numpy >= 2.3)
            n0 = key0
            while n0 < hi:
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, n0, hi, table, kv_ptr, g, stride_page, stride_kv,
                                              stride_tok, qk_scale, D, PAGE, BLOCK_N, DOT_F32)
                n0 += BLOCK_N
        else:
            for n0 in range(key0, hi, BLOCK_N):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, n0, hi, table, kv_ptr, g, stride_page, stride_kv,
                                              stride_tok, qk_scale, D, PAGE, BLOCK_N, DOT_F32)
        if n_split == 1:
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            scale = tl.exp2(m_i - m_f) / (l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f))
            o = acc * scale[:, None]
            tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        elif SPLITS > 1:  # (a grid of one split per request compiles no combine)
            bg = b * hkv + g
            slot = (bg.to(tl.int64) * SPLITS + s) * GROUP_P2
            tl.store(po_ptr + (slot + rows[:, None]) * D + d[None, :], acc, mask=(rows < GROUP_P2)[:, None])
            tl.store(pm_ptr + slot + rows, m_i, mask=rows < GROUP_P2)
            tl.store(pl_ptr + slot + rows, l_i, mask=rows < GROUP_P2)
            tl.debug_barrier()  # every thread's partial is stored before the counter moves
            done = tl.atomic_add(count_ptr + bg, 1, sem="acq_rel")
            if done == n_split - 1:
                tl.store(count_ptr + bg, 0)
                r = tl.arange(0, GROUP_P2)
                r_ok = r < GROUP
                sp = tl.arange(0, SPLITS)
                first = bg.to(tl.int64) * SPLITS * GROUP_P2
                ml = first + sp[:, None] * GROUP_P2 + r[None, :]
                sp_ok = (sp < n_split)[:, None]
                m_all = tl.load(pm_ptr + ml, mask=sp_ok, other=float("-inf"), cache_modifier=".cg")
                l_all = tl.load(pl_ptr + ml, mask=sp_ok, other=0.0, cache_modifier=".cg")
                sink = tl.load(sinks_ptr + g * GROUP + r, mask=r_ok, other=0.0) * 1.4426950408889634
                m_f = tl.maximum(tl.max(m_all, axis=0), sink)
                denom = tl.sum(l_all * tl.exp2(m_all - m_f[None, :]), axis=0) + tl.exp2(sink - m_f)
                o = tl.zeros((GROUP_P2, D), dtype=tl.float32)
                c = tl.arange(0, COMBINE)
                for c0 in range(0, SPLITS, COMBINE):  # masked past n_split
                    cs = c0 + c
                    cs_ok = cs < n_split
                    m_c = tl.load(pm_ptr + first + cs[:, None] * GROUP_P2 + r[None, :], mask=cs_ok[:, None],
                                  other=float("-inf"), cache_modifier=".cg")
                    w = tl.exp2(m_c - m_f[None, :])  # [COMBINE, GROUP_P2]
                    part = tl.load(po_ptr + ((first + cs[:, None, None] * GROUP_P2 + r[None, :, None]) * D
                                             + d[None, None, :]), mask=cs_ok[:, None, None], other=0.0,
                                   cache_modifier=".cg")
                    o += tl.sum(part * w[:, :, None], axis=0)
                o = o / denom[:, None]
                tl.store(out_ptr + b.to(tl.int64) * stride_ot + (g * GROUP + r)[:, None] * stride_oh + d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    window_left: int,
    scratch: DecodeScratch,
    out: torch.Tensor | None = None,
    cfg: DecodeConfig = DecodeConfig(),
) -> torch.Tensor:
    """One query per request over a paged KV cache.

    Parameters
    ----------
    q : [B, Hq, D] bf16/fp16/fp32, row b = request b's last position.
    kv_cache : [pages, 2, page_size, Hkv, D], q.dtype (index 0 = K, 1 = V; NHD).
    block_tables : int32 [>= B, max_pages] page ids of each request in logical order (entries past
        a request's last page are not read).
    seq_lens : int32 [>= B] keys of each request (>= 1).
    sinks : float32 [Hq] raw sink logits.
    window_left : keys at positions >= len - 1 - window_left are visible; -1 = all.
    scratch : partials + arrival counters for B rows, Hkv heads and the launch's split count
        (`DecodeScratch(B, Hkv, Hq // Hkv, D, num_splits(...))`).
    out : optional [B, Hq, D] output (q.dtype), written in place.
    Returns [B, Hq, D] in q.dtype. No host synchronisation: capturable in a CUDA graph.
    """
    t, hq, d = q.shape
    n_pages, two, page_size, hkv, d_kv = kv_cache.shape
    if two != 2 or d_kv != d or hq % hkv:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match q {tuple(q.shape)}")
    if kv_cache.dtype != q.dtype or kv_cache.stride(-1) != 1 or kv_cache.stride(-2) != d or q.stride(-1) != 1:
        raise ValueError("q and kv_cache must share a dtype and have contiguous heads")
    if d & (d - 1) or d < 16 or page_size & (page_size - 1):
        raise ValueError(f"head_dim ({d}) and page_size ({page_size}) must be powers of two, head_dim >= 16")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables (row-contiguous) and seq_lens must be int32")
    if block_tables.shape[0] < t or seq_lens.shape[0] < t:
        raise ValueError(f"{t} query rows but {block_tables.shape[0]} page-table rows / {seq_lens.shape[0]} lengths")
    if sinks.dtype != torch.float32 or sinks.shape != (hq,):
        raise ValueError(f"sinks must be float32 [{hq}], got {sinks.dtype} {tuple(sinks.shape)}")
    splits = scratch.shape[2]
    if not scratch.fits(t, hkv, splits):
        raise ValueError(f"scratch {scratch.shape} does not fit {t} rows x {hkv} KV heads")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with contiguous heads")
    if t == 0:
        return out
    group = hq // hkv
    _decode_kernel[(splits, t, hkv)](
        q, kv_cache, block_tables, seq_lens, sinks, out, scratch.o, scratch.m, scratch.l, scratch.count,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), block_tables.stride(0), float(sm_scale) * LOG2E, int(window_left) if window_left >= 0 else 1 << 30,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), BLOCK_H=max(16, triton.next_power_of_2(group)),
        D=d, PAGE=page_size, BLOCK_N=cfg.block_n, MIN_KEYS=cfg.min_keys, SPLITS=splits,
        COMBINE=min(cfg.combine_splits, splits), DOT_F32=INTERPRET or q.dtype == torch.float32, WHILE_LOOP=INTERPRET,
        EARLY_KV=EARLY_KV, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(q.device),
    )
    return out
