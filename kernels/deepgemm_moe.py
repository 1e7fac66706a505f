"""MoE experts at prefill through DeepGEMM's grouped FP8 GEMMs (Hopper), pdserve's kernels around them.

DeepGEMM's m-grouped contiguous GEMM (a TMA producer warpgroup feeding two math warpgroups, FP32
promotion every 128 of K) runs the two expert GEMMs at about twice the rate of our Triton grouped
kernels at prefill sizes (docs/performance.md). It has no bias, activation or routing weight, so
the work around it is ours, in three Triton launches that each read the GEMM output once:

1. `_gather_quant_kernel`: the routed rows of x, in the routing layout of `triton_moe.align_routing`
   (each local expert's rows padded to DeepGEMM's M alignment), quantised to e4m3 with one float32
   scale per 1x128 group (MN-major, as DeepGEMM's SM90 kernel reads them, so it transposes
   nothing); also each row's expert (-1 for padding: DeepGEMM skips those blocks) and each pair's
   row for the combine.
2. gate/up GEMM (bf16 out) -> `triton_fp8_gemm._swiglu_quant_kernel`: + bias, clamped SwiGLU,
   e4m3 requantisation (MN-major scales) -> down GEMM (bf16 out).
3. `_combine_kernel`: each token sums (down + bias) x routing weight over its local pairs, in slot
   order (deterministic).

The bias is added to the GEMM's bf16 output rather than starting its accumulator (DeepGEMM has no
such input); the difference is one bf16 rounding of the pre-bias sum. No host synchronisation:
buffer sizes follow from T and the expert count, so the path is CUDA-graph capturable, but DeepGEMM
compiles each shape the first time it sees it (seconds, cached on disk in $DG_JIT_CACHE_DIR).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from .buffers import empty
from .experts import ExpertWeights
from .fp8 import BLOCK, FP8, cdiv
from .triton_fp8_gemm import _quantize_rows, _swiglu_quant_kernel
from .triton_moe import GATE_UP_BLOCK_N, _check_inputs, align_routing

GATHER_ROWS = 32  # rows per program of the gather/quantise launch

log = logging.getLogger(__name__)
_failed: str | None = None  # why DeepGEMM failed in this process (then it is not used again)


def available() -> bool:
    """DeepGEMM importable and working so far, and the GPU a Hopper (its SM90 FP8 kernels).
    `PDSERVE_DEEPGEMM=0` turns it off."""
    return _failed is None and _importable()


@functools.cache
def _importable() -> bool:
    if os.environ.get("PDSERVE_DEEPGEMM", "1") == "0" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import deep_gemm  # noqa: F401  (built from source: README, "Real weights")
    except Exception:  # missing, or built against another torch / CUDA
        return False
    return hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous")


@functools.cache
def _m_alignment() -> int:
    import deep_gemm

    return int(deep_gemm.get_mk_alignment_for_contiguous_layout())


@triton.jit
def _gather_quant_kernel(
    x_ptr, sorted_slot_ptr, block_expert_ptr,
    a_ptr, a_scale_ptr, m_index_ptr, row_of_pair_ptr,
    K, top_k, stride_x, stride_a, stride_as_group,
    ROUTE_M: tl.constexpr, ROWS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    slot = tl.load(sorted_slot_ptr + rows)
    ok = slot >= 0
    token = tl.where(ok, slot // top_k, 0).to(tl.int64)
    cols = g * 128 + tl.arange(0, 128)
    k_ok = cols < K
    x = tl.load(x_ptr + token[:, None] * stride_x + cols[None, :], mask=ok[:, None] & k_ok[None, :],
                other=0.0)
    q, scale = _quantize_rows(x.to(tl.float32), 448.0)
    rows64 = rows.to(tl.int64)
    tl.store(a_ptr + rows64[:, None] * stride_a + cols[None, :], q, mask=k_ok[None, :])
    tl.store(a_scale_ptr + g * stride_as_group + rows64, scale)
    if g == 0:
        expert = tl.load(block_expert_ptr + rows // ROUTE_M)
        tl.store(m_index_ptr + rows, tl.where(ok, expert, -1))
        tl.store(row_of_pair_ptr + slot, rows, mask=ok)


@triton.jit
def _combine_kernel(
    y_ptr, row_of_pair_ptr, ids_ptr, route_w_ptr, bias_ptr, out_ptr,
    H, first_expert, num_experts, stride_y, stride_be, stride_o,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j) - first_expert
        local = (e >= 0) & (e < num_experts)
        row = tl.load(row_of_pair_ptr + t * TOP_K + j, mask=local, other=0).to(tl.int64)
        y = tl.load(y_ptr + row * stride_y + offs, mask=ok & local, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + tl.where(local, e, 0).to(tl.int64) * stride_be + offs,
                         mask=ok & local, other=0.0)
        wt = tl.load(route_w_ptr + t * TOP_K + j).to(tl.float32)
        acc += tl.where(local, y * wt, 0.0)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _grouped_gemm(a: torch.Tensor, a_scale_t: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  m_index: torch.Tensor) -> torch.Tensor:
    """[rows, K] e4m3 (scales [ceil(K/128), rows]) x expert weights [E, N, K] -> bf16 [rows, N]."""
    import deep_gemm

    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_scale_t.t()), (w, w_scale), out, m_index)
    return out


def experts_forward_or_none(*args, **kwargs) -> torch.Tensor | None:
    """`experts_forward`, or None when DeepGEMM is unavailable or fails: a build against another
    torch fails its host-side checks on the first call (`dim == 2 or dim == 3`), and the caller
    then runs the Triton kernels instead; the failure is logged once and DeepGEMM is not tried
    again in this process. (Its checks run before anything is launched, so nothing is half done.)"""
    global _failed
    if not available():
        return None
    try:
        return experts_forward(*args, **kwargs)
    except torch.cuda.OutOfMemoryError:
        raise  # the request's own failure, not DeepGEMM's
    except (RuntimeError, AssertionError) as e:
        _failed = f"{type(e).__name__}: {e}"
        log.warning("DeepGEMM MoE path failed; using the Triton kernels from now on: %s", _failed)
        return None


def experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    limit: float = 7.0,
    alpha: float = 1.702,
    add_down_bias: bool = True,
) -> torch.Tensor:
    """Same contract as `kernels.experts.experts_forward_ref` for FP8 experts: x [T, H] -> [T, H] in
    x.dtype, the routing-weighted sum over the token's *local* experts."""
    _check_inputs(x, topk_weights, topk_ids, w)
    t, h = x.shape
    if t == 0:
        return torch.empty_like(x)
    e = w.num_local_experts
    n2 = w.gate_up.shape[1]
    inter = n2 // 2
    x = x.contiguous()
    routing = align_routing(topk_ids, w.first_expert, e, _m_alignment())
    rows, dev = routing.max_rows, x.device

    a = empty((rows, h), FP8, dev)
    a_scale_t = empty((cdiv(h, BLOCK), rows), torch.float32, dev)
    m_index = empty((rows,), torch.int32, dev)
    row_of_pair = empty((topk_ids.numel(),), torch.int32, dev)
    _gather_quant_kernel[(rows // GATHER_ROWS, cdiv(h, BLOCK))](
        x, routing.sorted_slot, routing.block_expert, a, a_scale_t, m_index, row_of_pair,
        h, routing.top_k, x.stride(0), a.stride(0), a_scale_t.stride(0),
        ROUTE_M=routing.route_m, ROWS=GATHER_ROWS, num_warps=4,
    )
    gate_up = _grouped_gemm(a, a_scale_t, w.gate_up, w.gate_up_scale, m_index)

    act = empty((rows, inter), FP8, dev)
    act_scale_t = empty((inter // BLOCK, rows), torch.float32, dev)
    _swiglu_quant_kernel[(rows // 16, n2 // GATE_UP_BLOCK_N)](
        gate_up, w.gate_up_bias, act, act_scale_t, routing.sorted_slot, routing.block_expert,
        n2, float(limit), float(alpha),
        0, gate_up.stride(0), w.gate_up_bias.stride(0), act.stride(0), 1, act_scale_t.stride(0),
        ROUTE_M=routing.route_m, BLOCK_M=16, SPLIT_K=1, num_warps=4,
    )
    down = _grouped_gemm(act, act_scale_t, w.down, w.down_scale, m_index)

    out = empty((t, h), x.dtype, dev)
    block_h = 1024
    _combine_kernel[(t, cdiv(h, block_h))](
        down, row_of_pair, topk_ids.contiguous(), topk_weights.contiguous(), w.down_bias, out,
        h, w.first_expert, e, down.stride(0), w.down_bias.stride(0), out.stride(0),
        TOP_K=topk_ids.shape[1], HAS_BIAS=add_down_bias, BLOCK_H=block_h, num_warps=4,
    )
    return out
