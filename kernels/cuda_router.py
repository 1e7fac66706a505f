"""The MoE router for decode batches as thread-block clusters (cuda_router.cu), compiled at first use
by NVRTC through torch, no build step.

Why CUDA: the Triton router (kernels/triton_router.py) splits a token's logits over 23-45 programs
that meet through float32 partials in global memory, a fence and an arrival counter: two memory
round trips on the step's critical path, every layer. Here a token's CTAs are one cluster and meet
in distributed shared memory: CTA 0 reads its peers' partial logits after a cluster barrier.
Numerics as the Triton router's (logits may differ from it by one bf16 rounding step where the
float32 sums, added in another order, straddle a rounding boundary; given the same logits, ids and
weights are bit-identical). bf16 activations, weights and bias only; route_fused takes the Triton
kernel for anything else, and where these cannot be built.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .nvrtc import builds_on, load_kernels
from .pdl import enabled as pdl_enabled, launch_cuda


SOURCE = Path(__file__).with_name("cuda_router.cu")
TOP_K = 4
# CTAs a token (the cluster; 8 is the portable size); a CTA's warps (8 up to 32 experts, else 16)
# hold E / warps expert rows' shares of the weights each, in registers, read before the PDL wait
CLUSTER = 8
# CTAs a token by the number of experts where it is not CLUSTER (up to 16, which Hopper allows on request):
# each CTA reads and holds a smaller share of the weights (at 12 CTAs for 120b: 54 registers a thread, not 104)
CLUSTERS: dict[int, int] = {}
# route_fused takes these kernels where they apply (False: the Triton router always)
ENABLED = True
# Most tokens a launch, by the number of experts (others: any batch route_fused takes): a token's
# cluster reads all the weights, 8 CTAs of 512 threads for 128 experts, one CTA a SM; from 16 tokens
# the Triton router's many small programs win (H200, bench/router.py, us at 1 / 8 / 16 / 32 tokens: 120b 2.85 / 3.34 / 6.39 / 10.25 against
# Triton's 3.44 / 4.32 / 4.75 / 7.38; 20b 2.03 / 2.37 / 2.71 / 3.23 against 2.49 / 2.76 / 3.00 /
# 3.80, and 3.9 against 4.9 at 64)
MAX_TOKENS = {128: 8}


def shape(num_experts: int, hidden: int) -> tuple[int, int] | None:
    """(CTAs a token, warps a CTA) for this router, or None where the kernel does not apply."""
    warps = 8 if num_experts <= 32 else 16
    cluster = CLUSTERS.get(num_experts, CLUSTER)
    if num_experts % warps or hidden % (cluster * 8) or num_experts < TOP_K or num_experts > 32 * warps:
        return None
    return cluster, warps


def applies(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor) -> bool:
    """Whether route_fused can take these kernels for this call (device, dtypes, shapes)."""
    bf16 = x.dtype == router_weight.dtype == router_bias.dtype == torch.bfloat16
    t, e = x.shape[0], router_weight.shape[0]
    return (ENABLED and x.is_cuda and bf16 and shape(*router_weight.shape) is not None
            and t <= MAX_TOKENS.get(e, t)
            and router_weight.is_contiguous() and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and router_weight.data_ptr() % 16 == 0
            and available(x.device))


def available(device: torch.device) -> bool:
    """Hopper or newer (clusters, distributed shared memory) with NVRTC loadable."""
    return builds_on(device, "CUDA router", lambda index: _kernel(index, 32, 2880, *shape(32, 2880)))


def compile_options(num_experts: int, hidden: int, cluster: int, warps: int) -> list[str]:
    """The compiler options of a build of cuda_router.cu (nvcc takes them too)."""
    return [f"-DRT_E={num_experts}", f"-DRT_H={hidden}", f"-DRT_C={cluster}", f"-DRT_NW={warps}", "-std=c++17"]


@functools.cache
def _kernel(device_index: int, num_experts: int, hidden: int, cluster: int, warps: int):
    return load_kernels(SOURCE, ["route"], compile_options(num_experts, hidden, cluster, warps), device_index, 0,
                        cluster=cluster)["route"]


def route_cluster(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor | None) -> None:
    """route_fused's outputs for x [T, H] into weights [T, 4] bf16 and ids [T, 4] int64 (and logits
    [T, E] bf16 where given); the caller checked `applies`."""
    t = x.shape[0]
    e, h = router_weight.shape
    cluster, warps = shape(e, h)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    launch_cuda(_kernel(dev, e, h, cluster, warps), (cluster, t, 1), (32 * warps, 1, 1), 0,
                pdl=pdl_enabled(x.device), cluster=(cluster, 1, 1),
                args=[x, x.stride(0), router_weight, router_bias, weights, ids, logits])
