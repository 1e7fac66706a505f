"""`triton_moe.align_routing`'s layout built in torch, for kernel tests in Triton's CPU interpreter
(the routing kernel's atomics do not run there; the kernel itself is checked on the GPU by
tests/gpu/test_moe_gpu.py)."""

from __future__ import annotations

import torch


def routing_torch(topk_ids, first_expert, num_experts, route_m):
    """triton_moe.align_routing's layout built in torch (its kernel's atomics do not run in the
    interpreter; the kernel itself is checked on the GPU by tests/gpu/test_moe_gpu.py)."""
    from pdserve.kernels.triton_moe import Routing

    t, k = topk_ids.shape
    pairs = t * k
    max_blocks = max(-(-pairs // route_m) + min(num_experts, pairs), 1)
    sorted_slot = torch.full((max_blocks * route_m,), -1, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    local = topk_ids.flatten() - first_expert
    row = 0
    for e in range(num_experts):
        slots = (local == e).nonzero().flatten()
        blocks = -(-len(slots) // route_m)
        sorted_slot[row : row + len(slots)] = slots.to(torch.int32)
        block_expert[row // route_m : row // route_m + blocks] = e
        row += blocks * route_m
    return Routing(sorted_slot, block_expert, route_m, k)
