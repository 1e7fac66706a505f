"""One layer's experts: their weights and what they compute, in plain torch (the reference).

`route` picks each token's experts and weights; `experts_forward_ref` and
`experts_forward_mxfp4_ref` compute the routing-weighted sum over a token's local experts, the
function every kernel of the MoE (dispatched by `kernels.moe.experts_forward`) is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import dequantize_act_fp8, dequantize_weight_fp8, quantize_act_fp8
from .mxfp4 import MxExperts, dequantize_mxfp4
from .swiglu import swiglu


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
