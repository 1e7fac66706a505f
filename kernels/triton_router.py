"""The MoE router in one Triton launch: logits, top-4, softmax over the selected four.

The plain path (`kernels.experts.route`) is a cuBLAS GEMM with bias, `torch.topk` and `torch.softmax`
(about six launches per layer at decode, ~15 us). Here each token's logits are split over
programs of 4096 / E columns each (23 for 20b), so the weights stream from many SMs at once; each
program writes float32 partial sums and the token's last program to arrive (a per-token counter)
sums them in a fixed order (deterministic), adds the bias and rounds the logits to x.dtype (as the
GEMM's epilogue does), picks the top 4 (equal logits: the lower expert id first) and takes the
softmax of the four rounded logits the way torch's warp softmax does for a 4-wide row: float32,
exp(v - max) with the accurate exp, the sum as (e0 + e2) + (e1 + e3), a correctly rounded division,
rounded to x.dtype.

Against the plain path: the logits may differ by one rounding step of x.dtype where the float32
sums (different order) straddle a rounding boundary; given the same logits, expert ids and
weights are bit-identical (except among exactly equal logits, where torch.topk's order is not
specified). Meant for decode-sized batches (`MAX_TOKENS`): every token reads all of the router
weights (from L2 after the first), so larger batches go to the GEMM path. On Hopper with bf16
inputs, route_fused launches kernels/cuda_router.py instead: the same numerics, with a token's
partial logits meeting in a thread-block cluster's shared memory rather than in global memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cuda_router
from .arrival import arrival_counters
from .pdl import enter, launch_options
from .triton_math import INTERPRET, exp_f32

MAX_TOKENS = 256  # above this a cuBLAS GEMM reads the router weights once for many tokens
TOP_K = 4


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, b_ptr, weight_ptr, ids_ptr, logits_ptr, part_ptr, count_ptr, stride_x, stride_w,
    H: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr, WRITE_LOGITS: tl.constexpr, ACCURATE_EXP: tl.constexpr,
    EARLY_WEIGHTS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, s): token t's partial logits over the s-th BLOCK_K columns -> float32 scratch;
    the token's last program to finish (a counter per token) sums the partials in split order,
    picks the top 4 and writes the softmax, then resets the counter for the next launch.
    EARLY_WEIGHTS: the weight tile is read before the PDL wait (the weights never change)."""
    if not EARLY_WEIGHTS:
        enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    e = tl.arange(0, BLOCK_E)
    em = e < E
    k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    km = k < H
    wv = tl.load(w_ptr + e[:, None] * stride_w + k[None, :], mask=em[:, None] & km[None, :], other=0.0)
    if EARLY_WEIGHTS:
        enter(PDL)
    xv = tl.load(x_ptr + t * stride_x + k, mask=km, other=0.0).to(tl.float32)
    part = tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
    tl.store(part_ptr + (t * SPLITS + s) * BLOCK_E + e, part)
    tl.debug_barrier()  # every thread's partial is stored before the counter moves
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if done == SPLITS - 1:
        sp = tl.arange(0, SPLITS_P2)
        parts = tl.load(part_ptr + (t * SPLITS + sp[:, None]) * BLOCK_E + e[None, :],
                        mask=(sp < SPLITS)[:, None], other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + t, 0)
        bias = tl.load(b_ptr + e, mask=em, other=0.0).to(tl.float32)
        logits = (tl.sum(parts, axis=0) + bias).to(dt)
        if WRITE_LOGITS:
            tl.store(logits_ptr + t * E + e, logits, mask=em)
        # a NaN logit competes as -inf; experts picked already and padding columns take no part, so
        # every pick is a real expert not picked before, whatever the logits
        lf = logits.to(tl.float32)
        cur = tl.where(lf == lf, lf, float("-inf"))
        free = em
        slot = tl.arange(0, 4)
        vals = tl.zeros((4,), dtype=tl.float32)
        ids = tl.zeros((4,), dtype=tl.int32)
        for i in tl.static_range(4):
            m = tl.max(tl.where(free, cur, float("-inf")), axis=0)
            idx = tl.min(tl.where(free & (cur == m), e, BLOCK_E), axis=0)
            vals = tl.where(slot == i, m, vals)
            ids = tl.where(slot == i, idx, ids)
            free = free & (e != idx)
        ex = exp_f32(vals - tl.max(vals, axis=0), ACCURATE_EXP)
        pair = tl.sum(tl.reshape(ex, (2, 2)), axis=0)  # [e0 + e2, e1 + e3]
        total = tl.sum(pair, axis=0)
        w = tl.math.div_rn(ex, tl.zeros((4,), dtype=tl.float32) + total)
        tl.store(weight_ptr + t * 4 + slot, w.to(weight_ptr.dtype.element_ty))
        tl.store(ids_ptr + t * 4 + slot, ids.to(tl.int64))


# E -> (K columns a program, warps) where `bench/router.py` measured better than the default (4096
# weights a program, 4 warps). 120b's 128 experts: 45 programs of 64 columns instead of 90 of 32, so
# the token's last program sums 45 partial rows, not 90 (H200, 2026-12-02: 5.5 / 5.7 / 6.9 / 11.8 us
# at 1 / 4 / 16 / 64 tokens, against 8.1 / 8.6 / 10.3 / 19.5). 20b's 32 experts keep the default
# (128 columns: 3.2 / 3.4 / 3.8 / 5.3 us; 64 columns is faster by 0.1-0.3 us up to 4 tokens, slower
# from 16).
LAUNCH_SHAPES: dict[int, tuple[int, int]] = {128: (64, 4)}

# Each program reads its weight tile before the PDL wait (kernels/pdl.py), while the norm ahead of it runs.
EARLY_WEIGHTS = True


def launch_shape(num_experts: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of the router launch for E experts."""
    return LAUNCH_SHAPES.get(num_experts) or (max(16, 4096 // triton.next_power_of_2(num_experts)), 4)


def route_fused(
    x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int = TOP_K,
    return_logits: bool = False,
):
    """x [T, H] -> (weights [T, 4] in x.dtype, expert ids int64 [T, 4] by descending logit), and
    the x.dtype logits [T, E] with return_logits (for tests)."""
    if top_k != TOP_K:
        raise ValueError(f"the fused router picks {TOP_K} experts, asked for {top_k}")
    t, h = x.shape
    e = router_weight.shape[0]
    if router_weight.shape != (e, h) or router_bias.shape != (e,) or e < TOP_K:
        raise ValueError(f"router weight {tuple(router_weight.shape)} / bias {tuple(router_bias.shape)} "
                         f"do not match x {tuple(x.shape)}")
    if x.stride(1) != 1 or router_weight.stride(1) != 1 or not router_bias.is_contiguous():
        raise ValueError("x rows, router weight rows and the bias must be contiguous")
    weights = torch.empty(t, TOP_K, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, TOP_K, dtype=torch.int64, device=x.device)
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device) if return_logits else weights
    if t > MAX_TOKENS:
        raise ValueError(f"the fused router takes up to {MAX_TOKENS} tokens, got {t}")
    if t and cuda_router.applies(x, router_weight, router_bias):
        cuda_router.route_cluster(x, router_weight, router_bias, weights, ids, logits if return_logits else None)
    elif t:
        block_e = triton.next_power_of_2(e)
        block_k, num_warps = launch_shape(e)
        splits = triton.cdiv(h, block_k)
        part = torch.empty(t, splits, block_e, dtype=torch.float32, device=x.device)
        _router_kernel[(t, splits)](
            x, router_weight, router_bias, weights, ids, logits, part, arrival_counters(x.device, "router", MAX_TOKENS),
            x.stride(0), router_weight.stride(0), H=h, E=e, BLOCK_E=block_e, BLOCK_K=block_k,
            SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), WRITE_LOGITS=return_logits,
            ACCURATE_EXP=not INTERPRET, EARLY_WEIGHTS=EARLY_WEIGHTS, num_warps=num_warps,
            **launch_options(x.device),
        )
    return (weights, ids, logits) if return_logits else (weights, ids)
