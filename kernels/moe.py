"""Mixture-of-experts: routing, expert computation and combine.

`route` and `experts_forward` are the reference (plain torch, CPU). On CUDA, `experts_forward`
hands FP8 experts to the Triton grouped GEMMs in `kernels.triton_moe` when that module is
importable, and prefill-sized batches to DeepGEMM's grouped GEMMs (`kernels.deepgemm_moe`) when
DeepGEMM is installed on a Hopper GPU; all compute the same function and are compared by the GPU
tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import dequantize_act_fp8, dequantize_weight_fp8, quantize_act_fp8
from .mxfp4 import MxExperts, dequantize_mxfp4
from .swiglu import swiglu

# Batches up to this many tokens run MXFP4 experts through kernels.triton_moe_mxfp4 on CUDA (decode)
# unless the grouped kernels take them (below); larger ones, when those are off, through
# `experts_forward_mxfp4_ref` (the routed experts decoded to bf16).
MXFP4_KERNEL_MAX_TOKENS = 256  # covers the CUDA-graph decode sizes (the reference syncs)
# Launch shape / nibble decode of that kernel (a triton_moe_mxfp4.MxConfig); None: the default for
# the experts' block layout (triton_moe_mxfp4.default_config).
MXFP4_KERNEL_CONFIG = None
# Block layout the loader gives MXFP4 experts on CUDA ("packed": kernels.mxfp4.pack_words, read by
# the "packed" decode; "published": as the checkpoint stores them).
MXFP4_CUDA_LAYOUT = "packed"
# Batches up to this many tokens run packed MXFP4 experts through the CUDA mma kernels
# (kernels.cuda_moe_mxfp4) on Hopper when NVRTC can build them; None: never. On an H200 (20b layer,
# 2026-12-02, docs/performance.md) they were faster than the Triton kernels at 1, 8, 16, 32 and 48
# tokens (33 vs 37, 134 vs 154, 186 vs 284 / 303, 241 vs 372, 300 vs 374 us), within 3 % at 2-4,
# and level at 64 (377 vs 371 us).
MXFP4_MMA_MAX_TOKENS: int | None = 63
# ... and up to this many where the grouped launches fold the scales into the weights
# (cuda_moe_mxfp4.fold_config). H200, 20b (2026-12-03): a layer with uniform random routing, 249 /
# 403 us at 64 / 128 tokens against the Triton grouped kernels' 378 / 525, 740 against 531 at 256;
# in the step (a random checkpoint, whose routing crowds a few experts) 8.3 against 10.9 ms at 64
# tokens, but 10.4 against 5.7 ms at 128: a folded launch reads an expert once per 16 of its pairs,
# the Triton kernels once per 64.
MXFP4_MMA_FOLDED_MAX_TOKENS = 64
# ... from this many tokens with the pairs grouped by expert (an expert read once for all its
# tokens; per pair below: 33 vs 39 us at one token, level at 2-4).
MXFP4_MMA_GROUPED_FROM = 4
# Batches of at least this many tokens (any size: prefill too) take the expert-grouped tensor-core
# kernels (kernels.triton_moe_mxfp4_grouped) instead of the per-pair packed GEMV, which decodes an
# expert once per (token, expert) pair; None: never. On an H200 (20b layer, 2026-12-02) the grouped
# kernels were faster from 16 tokens (294 vs 339 us; 64 tokens: 374 vs 1243 us) and slower at 8.
MXFP4_GROUPED_MIN_TOKENS: int | None = 16
# Their launch shape (a triton_moe_mxfp4_grouped.GroupedConfig); None: chosen by the batch size.
MXFP4_GROUPED_CONFIG = None
# FP8 batches with at least this many routed rows per local expert on average run through
# DeepGEMM's grouped GEMMs when it is installed (kernels.deepgemm_moe); smaller ones (decode, CUDA
# graphs, short prompts) through the Triton kernels. On an H200 the DeepGEMM path was 1.41-1.96x
# faster from 128 rows per expert (20b: 1024+ tokens; 120b: 8192 tokens) and 0.73-0.81x below
# (docs/performance.md). None: never.
DEEPGEMM_MIN_ROWS_PER_EXPERT: int | None = 128


@dataclass
class ExpertWeights:
    """One layer's local experts in (out, in) orientation.

    gate_up: [E, 2I, H] (glu/linear interleaved along 2I); down: [E, H, I]. bf16, or float8_e4m3fn
    with float32 128x128 block scales `gate_up_scale` [E, ceil(2I/128), ceil(H/128)] and
    `down_scale` [E, ceil(H/128), ceil(I/128)]. Biases are float32. `first_expert` is the global id
    of local expert 0 (expert parallelism); `num_global_experts` is the router's width.
    """

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    first_expert: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def is_fp8(self) -> bool:
        return self.gate_up.dtype == torch.float8_e4m3fn


def route(
    x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router GEMM, top-k, softmax over the k selected logits only, all in the input dtype (bf16
    as in the reference: the seed found expert weights in bf16 numerically critical).

    x [T, H] -> (weights [T, k] in x.dtype, expert ids int64 [T, k], sorted by logit).
    """
    logits = torch.nn.functional.linear(x, router_weight.to(x.dtype), router_bias.to(x.dtype))
    top = torch.topk(logits, k=top_k, dim=-1, sorted=True)
    return torch.softmax(top.values, dim=-1), top.indices


def _expert_mlp_bf16(
    x: torch.Tensor, w: ExpertWeights, e: int, limit: float, alpha: float, add_down_bias: bool
) -> torch.Tensor:
    dt = x.dtype
    h = torch.nn.functional.linear(x, w.gate_up[e].to(dt), w.gate_up_bias[e].to(dt))
    a = swiglu(h, limit, alpha)
    bias = w.down_bias[e].to(dt) if add_down_bias else None
    return torch.nn.functional.linear(a, w.down[e].to(dt), bias)


def _expert_mlp_fp8(
    x: torch.Tensor, w: ExpertWeights, e: int, limit: float, alpha: float, add_down_bias: bool
) -> torch.Tensor:
    """Dequantising emulation of the FP8 kernels: 1x128 activation quantisation before each GEMM,
    float32 accumulation from the bias, SwiGLU in float32."""
    xq, xs = quantize_act_fp8(x)
    h = dequantize_act_fp8(xq, xs) @ dequantize_weight_fp8(w.gate_up[e], w.gate_up_scale[e]).T
    h = h + w.gate_up_bias[e]
    a = swiglu(h, limit, alpha)
    aq, as_ = quantize_act_fp8(a)
    out = dequantize_act_fp8(aq, as_) @ dequantize_weight_fp8(w.down[e], w.down_scale[e]).T
    if add_down_bias:
        out = out + w.down_bias[e]
    return out


def experts_forward_ref(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    limit: float = 7.0,
    alpha: float = 1.702,
    add_down_bias: bool = True,
) -> torch.Tensor:
    """Sum over the routed *local* experts of weight * expert(x); other experts contribute zero
    (their rank adds them in the combine all-reduce). x [T, H] -> [T, H] in x.dtype.

    Dispatch sorts the (token, slot) pairs by expert so each expert runs one GEMM over its tokens,
    as the grouped kernels do.
    """
    t, hdim = x.shape
    local = topk_ids - w.first_expert
    mine = (local >= 0) & (local < w.num_local_experts)
    flat_e = torch.where(mine, local, torch.full_like(local, -1)).flatten()
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e[mine.flatten()], minlength=w.num_local_experts).tolist()
    start = int((~mine).sum())  # -1 entries sort first
    token_of = order // topk_ids.shape[1]
    weight_of = topk_weights.flatten()[order]
    mlp = _expert_mlp_fp8 if w.is_fp8 else _expert_mlp_bf16
    out = torch.zeros(t, hdim, dtype=torch.float32, device=x.device)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        y = mlp(x[tok], w, e, limit, alpha, add_down_bias)
        # combine: weight in the activation dtype (as the reference's bf16 einsum), sum in fp32;
        # index_add_: a token routed twice to one expert gets both pairs, as in the kernels (indexed
        # `+=` would keep one of them)
        out.index_add_(0, tok, (y * weight_of[start : start + n, None].to(y.dtype)).float())
        start += n
    return out.to(x.dtype)


def experts_forward_mxfp4_ref(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: MxExperts,
    limit: float = 7.0,
    alpha: float = 1.702,
    add_down_bias: bool = True,
) -> torch.Tensor:
    """`experts_forward_ref` for MXFP4 experts: the routed experts decoded (exactly) to bf16, the
    rest left alone; same arithmetic as loading the experts as bf16 (one host sync: reference
    and prefill path)."""
    used = torch.unique(topk_ids).tolist()
    local = torch.full((w.num_experts,), -1, dtype=torch.long, device=topk_ids.device)
    local[used] = torch.arange(len(used), device=topk_ids.device)
    sub = ExpertWeights(
        dequantize_mxfp4(*w.published("gate_up", used)), w.gate_up_bias[used],
        dequantize_mxfp4(*w.published("down", used)), w.down_bias[used],
    )
    return experts_forward_ref(x, topk_weights, local[topk_ids], sub, limit, alpha, add_down_bias)


def _mma_serves(w: MxExperts, tokens: int) -> bool:
    """Whether the CUDA mma kernels take a batch of `tokens` on these (packed) experts."""
    if MXFP4_MMA_MAX_TOKENS is None:
        return False
    if tokens <= MXFP4_MMA_MAX_TOKENS:
        return True
    from .cuda_moe_mxfp4 import fold_config

    return tokens <= MXFP4_MMA_FOLDED_MAX_TOKENS and fold_config(w, tokens) is not None


def experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights | MxExperts,
    limit: float = 7.0,
    alpha: float = 1.702,
    add_down_bias: bool = True,
    x_before_routing: bool = False,
) -> torch.Tensor:
    """Dispatch to the fastest implementation for the device and weight format. x_before_routing: x
    was written before the launch that computed the routing (kernels that read ahead of their PDL
    wait may then read it early; cuda_moe_mxfp4.EARLY_X)."""
    if isinstance(w, MxExperts):
        t = x.shape[0]
        if x.is_cuda and w.layout == "packed" and _mma_serves(w, t):
            from . import cuda_moe_mxfp4

            if cuda_moe_mxfp4.available(x.device):
                return cuda_moe_mxfp4.experts_forward_mxfp4_mma(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias,
                                                                grouped=t >= MXFP4_MMA_GROUPED_FROM,
                                                                x_before_routing=x_before_routing)
        if x.is_cuda and MXFP4_GROUPED_MIN_TOKENS is not None and t >= MXFP4_GROUPED_MIN_TOKENS and w.layout == "packed":
            from .triton_moe_mxfp4_grouped import experts_forward_mxfp4_grouped

            return experts_forward_mxfp4_grouped(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias,
                                                 config=MXFP4_GROUPED_CONFIG)
        if x.is_cuda and t <= MXFP4_KERNEL_MAX_TOKENS:
            try:
                from .triton_moe_mxfp4 import experts_forward_mxfp4
            except ImportError:
                experts_forward_mxfp4 = None
            if experts_forward_mxfp4 is not None:
                return experts_forward_mxfp4(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias,
                                             config=MXFP4_KERNEL_CONFIG)
        return experts_forward_mxfp4_ref(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias)
    if x.is_cuda and w.is_fp8:
        rows = topk_ids.numel() / max(w.num_local_experts, 1)
        if DEEPGEMM_MIN_ROWS_PER_EXPERT is not None and rows >= DEEPGEMM_MIN_ROWS_PER_EXPERT:
            from . import deepgemm_moe

            out = deepgemm_moe.experts_forward_or_none(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias)
            if out is not None:
                return out
        try:
            from . import triton_moe
        except ImportError:
            triton_moe = None
        if triton_moe is not None:
            return triton_moe.experts_forward(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias)
    return experts_forward_ref(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias)
