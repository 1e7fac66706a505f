"""One token's MXFP4 gate/up on Hopper's FP8 tensor cores (W4A8): per-pair launches of
`cuda_moe_w4a8.cu` in place of `cuda_moe_mxfp4.cu`'s `mx_gate_up`, which the down projection follows
unchanged.

The token's row is rounded to e4m3 with one power of two a group of 32 before the product (the FP8
experts' activation rounding, docs/engine.md), where the mma kernels keep it exact; so it is an option,
`ENABLED`, off by default. docs/kernels.md item 38 has the design and the figures.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .mxfp4 import PACKED_HIGH_SHL_MASK, PACKED_HIGH_SHR_MASK, PACKED_LOW_MASK, MxExperts
from .nvrtc import builds_on, load_kernels
from .pdl import launch_cuda

SOURCE = Path(__file__).with_name("cuda_moe_w4a8.cu")
ENABLED = False  # per-pair gate/up through this kernel (FP8 activations); see the module docstring
K_GROUPS = 90  # the .cuh file's KG: gpt-oss' hidden size 2880 in groups of 32
ROWS = 64  # rows a CTA (one warpgroup)
K_SPLIT = 4  # CTAs of a row tile's cluster, each a share of K


def compile_options() -> list[str]:
    """One block of 8 groups at a time (W4_PIPE 0): faster than the pipelined build (item 38)."""
    return ["-std=c++17", "-DW4_PIPE=0", f"-DMX_LOW_MASK={PACKED_LOW_MASK:#010x}u", f"-DMX_HIGH_SHL_MASK={PACKED_HIGH_SHL_MASK:#010x}u",
            f"-DMX_HIGH_SHR_MASK={PACKED_HIGH_SHR_MASK:#010x}u"]


@functools.cache
def _kernel(device_index: int):
    return load_kernels(SOURCE, ["w4a8_gate_up_swiglu"], compile_options(), device_index, 0, K_SPLIT,
                        arch="90a")["w4a8_gate_up_swiglu"]


def applies(w: MxExperts, hidden: int) -> bool:
    """Whether these packed experts' gate/up take this kernel: gpt-oss' K, whole row tiles, an sm_90
    device (wgmma is an sm_90a instruction) with the kernel built."""
    dev = w.gate_up_blocks.device
    return (w.layout == "packed" and hidden == 32 * K_GROUPS and w.gate_up_blocks.shape[1] % ROWS == 0
            and dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
            and builds_on(dev, "W4A8 gate/up kernel", _kernel))


def gate_up(w: MxExperts, x: torch.Tensor, pair_expert: torch.Tensor, top_k: int, act: torch.Tensor,
            limit: float, alpha: float, act_shift: int, early_x: bool, pdl: bool) -> None:
    """act[pair] (f16 [pairs, I], times 2^act_shift) = clamped SwiGLU of the pair's expert's gate/up rows
    (+ bias) times x[pair // top_k] (bf16 [T, 2880], contiguous rows); pair_expert int64 [pairs] (< 0:
    no local expert, its row left as it is). early_x: x predates the launch that wrote pair_expert
    (the .cu file's early_x)."""
    n_rows = w.gate_up_blocks.shape[1]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    launch_cuda(_kernel(dev), (n_rows // ROWS * K_SPLIT, pair_expert.numel(), 1), (128, 1, 1), 0, pdl=pdl,
                cluster=(K_SPLIT, 1, 1), args=[
                    w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias.contiguous(), x, x.stride(0), pair_expert,
                    top_k, n_rows, act, float(limit), float(alpha), act_shift, int(early_x)])
