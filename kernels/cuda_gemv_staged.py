"""bf16 GEMV for decode batches whose CTAs copy their weight rows into shared memory ahead of their
PDL wait (cuda_gemv_staged.cu says how), for the projection that follows the decode attention.

The attention is bound by latency on few CTAs, so with programmatic dependent launch
(kernels/pdl.py) this kernel's CTAs are placed beside it and stream the projection's weights
(gpt-oss' O: 23.6 MB, which fits the GPU's shared memory in 360 CTAs of 8 rows) while it runs;
after the wait only the tensor-core dot products, the bias and the store remain. Compiled at
first use by NVRTC (kernels/nvrtc.py); CUDA-graph capturable (no host synchronisation).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .nvrtc import builds_on, load_kernels
from .pdl import enabled as pdl_enabled, launch_cuda


SOURCE = Path(__file__).with_name("cuda_gemv_staged.cu")
ROWS = 8  # weight rows a CTA (the mma's 8 columns)
WARPS = 4  # warps splitting a CTA's K
PAD = 64  # bytes after each staged row: a quarter warp's 16-byte reads of rows g, g + 1 in distinct banks
MAX_M = 8  # tokens: the mma's rows 0-7
# Up to how many tokens the model takes this kernel for the attention output projection (0: never,
# the bf16 GEMV of kernels/triton_bf16_gemv instead); at one token every CTA of gpt-oss' O is resident
# at once (3 a SM), from two tokens the token rows leave room for 2
MAX_TOKENS = 1
SHARED_PER_SM = 227 * 1024  # an H100 / H200 SM's shared memory for CTAs
# the dynamic shared memory a CTA may ask for: an SM's, less the kernel's static reduction buffer
MAX_DYNAMIC_SHARED = SHARED_PER_SM - 4 * WARPS * MAX_M * ROWS


def shared_bytes(k: int, m: int) -> int:
    """A CTA's dynamic shared memory: its ROWS staged weight rows and the m token rows."""
    return (ROWS + m) * (2 * k + PAD)


def fits(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes an [m, k] x [n, k]^T projection: tokens, row and K tiling (two 32-K
    blocks a step), and a CTA's rows within an SM's shared memory."""
    return 1 <= m <= MAX_M and n % ROWS == 0 and k % (64 * WARPS) == 0 and shared_bytes(k, m) <= MAX_DYNAMIC_SHARED


def available(device: torch.device) -> bool:
    """Hopper or newer (bulk copies, mbarrier transaction counts) with NVRTC and the kernel compiled."""
    return builds_on(device, "staged GEMV", _kernel)


def compile_options() -> list[str]:
    """The compiler options of cuda_gemv_staged.cu (nvcc takes them too): this module's shape constants."""
    return [f"-DGS_ROWS={ROWS}", f"-DGS_WARPS={WARPS}", f"-DGS_MAX_M={MAX_M}", f"-DGS_PAD={PAD}", "-std=c++17"]


@functools.cache
def _kernel(device_index: int):
    """The kernel for the device, allowed the most dynamic shared memory any K that `fits` needs
    (one build serves every K)."""
    return load_kernels(SOURCE, ["gemv_staged"], compile_options(), device_index, MAX_DYNAMIC_SHARED)["gemv_staged"]


def gemv_staged(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + bias [N] -> [M, N], all bf16 on one CUDA device (`fits(M, N, K)`):
    float32 sums (tensor cores), the bias added in float32, one rounding to bf16."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    m, k = x.shape
    n = w.shape[0]
    if not fits(m, n, k):
        raise ValueError(f"the staged GEMV takes 1-{MAX_M} tokens, N a multiple of {ROWS} and K of {64 * WARPS}: "
                         f"got M {m}, N {n}, K {k}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError("the staged GEMV takes bf16 x, w and bias")
    if not w.is_contiguous() or (bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous())):
        raise ValueError("the staged GEMV takes contiguous w [N, K] and bias [N]")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or w.data_ptr() % 16:
        raise ValueError("the staged GEMV takes 16-byte aligned rows of x and w")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    launch_cuda(_kernel(dev), (n // ROWS, 1, 1), (32 * WARPS, 1, 1), shared_bytes(k, m), pdl=pdl_enabled(x.device),
                args=[x, x.stride(0), w, bias, out, out.stride(0), m, k])
    return out
