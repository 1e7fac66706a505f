"""Which kernel computes a layer's experts (`experts_forward`), by device, weight format and batch.

Off CUDA, the plain-torch references of `kernels.experts`. On CUDA, MXFP4 experts go to the CUDA
mma kernels (`kernels.cuda_moe_mxfp4`, decode batches on Hopper) or the Triton MXFP4 kernels; FP8
experts to the Triton grouped GEMMs (`kernels.triton_moe`), and prefill-sized batches to DeepGEMM's
grouped GEMMs (`kernels.deepgemm_moe`) when DeepGEMM is installed on a Hopper GPU. All compute the
reference's function and are compared with it by the GPU tests.
"""

from __future__ import annotations

import torch

from .experts import ExpertWeights, experts_forward_mxfp4_ref, experts_forward_ref
from .mxfp4 import MxExperts

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
# the Triton kernels once per 64. With the fold in f16 (2026-12-05, H100) still 12.5 against 8.5 ms at 128.
MXFP4_MMA_FOLDED_MAX_TOKENS = 64
# ... from this many tokens with the pairs grouped by expert (an expert read once for all its
# tokens; per pair below: 33 vs 39 us at one token, level at 2-4; with grouped launches folded in f16,
# the 20b step on an H200 2026-12-05: 2 / 3 tokens grouped x1.167 / x1.032 against per pair).
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
    l2_prefetch: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch to the fastest implementation for the device and weight format. x_before_routing: x
    was written before the launch that computed the routing (kernels that read ahead of their PDL
    wait may then read it early; cuda_moe_mxfp4.EARLY_X). l2_prefetch: {"gate_up" / "down": weights a later
    kernel reads}, which that launch of the MXFP4 mma path requests into L2 (a hint; the other paths ignore it)."""
    if isinstance(w, MxExperts):
        t = x.shape[0]
        if x.is_cuda and w.layout == "packed" and _mma_serves(w, t):
            from . import cuda_moe_mxfp4

            if cuda_moe_mxfp4.available(x.device):
                return cuda_moe_mxfp4.experts_forward_mxfp4_mma(x, topk_weights, topk_ids, w, limit, alpha, add_down_bias,
                                                                grouped=t >= MXFP4_MMA_GROUPED_FROM,
                                                                x_before_routing=x_before_routing,
                                                                l2_prefetch=l2_prefetch)
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
