"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's kernels.

A decode step at batch 1 is a chain of ~220 short dependent kernels (9 a layer), each a few
microseconds; between two of them the GPU idles while the next grid is launched and its CTAs are
placed and run their prologue. With PDL a kernel is launched with programmatic stream
serialisation: its CTAs may start as soon as every CTA of the kernel before it has signalled
(`griddepcontrol.launch_dependents`), and they block in `griddepcontrol.wait` until that kernel has
finished and its memory is visible. So the launch and placement of kernel N + 1 overlap kernel N.

The contract every PDL kernel keeps: it takes `enter(PDL)` (wait, then let the next kernel launch)
before it writes anything or reads anything the kernel before it may write, so nothing races with
that kernel, and a kernel launched after it waits for it in turn (one kernel of look-ahead, never
more). Since the kernel two back has finished before the next one can launch, a kernel may read
ahead of its wait what never changes (weights) and what was written before the kernel ahead of it
ran (the step's staged inputs, KV rows of earlier steps, the routing two launches back), so those
reads overlap the kernel ahead: the decode attention's first block of keys
(`triton_decode_attention.EARLY_KV`), the router's and the bf16 GEMV's first weight tiles
(`triton_router.EARLY_WEIGHTS`, `triton_bf16_gemv.EARLY_WEIGHTS`), the MXFP4 down projection's
routing, routing weights and first weights (`cuda_moe_mxfp4.EARLY_DOWN`, `EARLY_BIAS`), all of
the attention output projection's weights (`cuda_gemv_staged`, into shared memory), the residual add
+ RMSNorm's weights and residual row (`triton_norm.EARLY_READS`), and, as an option, the next layer's FP8
QKV and O weights, which the MXFP4 launches request into L2 (`GptOssModel.prefetch_next`). Such reads of
data a kernel of the step wrote go through L2 only (`.cg`), so that no L1 line of the SM from
before it stands in for them.
Kernels launched without PDL (cuBLAS, torch) keep plain stream order on both sides. CUDA graphs
capture the programmatic edges, so replays keep them.

One exception to "wait, then launch": a kernel whose dependent reads nothing but weights ahead of
its wait may let it launch at its start (`launch_then_wait`): the residual + RMSNorm before the
attention block, one short CTA a token, where the QKV projection after it is the FP8 GEMV
(`cuda_gemv_fp8`), which requests all of its weights ahead of the wait (`GptOssModel`'s
`early_qkv_launch`). Its CTAs are then placed while the kernel two back (the MoE's down
projection) still runs, wherever that leaves room, and its weights stream during that kernel's
tail instead of after it. It is safe: the GEMV reads nothing else before its wait, which the norm's
completion releases, and that follows the kernel two back; and it cannot starve that kernel of SMs,
because the norm launches only once every CTA of the kernel before it has started. Measured
(docs/performance.md, twentieth round), it pays there only: before the bf16 QKV kernels (which read
one weight tile ahead) and before the router it made the step slower. `GptOssModel.early_router_launch` (off by
default) takes the exception before the router again, whose fused kernels read only weights ahead of their
waits, for the benchmark's A/B beside a router of more, smaller CTAs. `GptOssModel.early_o_launch` (off by
default) takes it in the cluster decode attention (`cuda_decode_attention`, `DA_EARLY_LAUNCH`) where the
output projection after it is the FP8 GEMV or the staged bf16 GEMV, both of which request all of their
weights ahead of their wait and read nothing else there; the projection launches only once every CTA of the
attention has started, so its CTAs cannot take SMs that the attention's CTAs need.

`PDSERVE_PDL=0` turns it off (the benchmark's A/B); it is off on the CPU, under Triton's
interpreter and before Hopper.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import triton
import triton.language as tl

from .nvrtc import SMEM_CARVEOUT, set_carveout
from .triton_math import INTERPRET

if SMEM_CARVEOUT and not INTERPRET:  # the Triton kernels' splits too (nvrtc.py)
    triton.knobs.runtime.kernel_load_end_hook.add(lambda module, function, name, *rest: set_carveout(function, name))


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    if device.type != "cuda" or INTERPRET or os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch whose kernel takes `PDL: tl.constexpr`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL kernel's wait for the kernel before it, then the next one's launch (the contract above)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_then_wait(PDL: tl.constexpr):
    """The next kernel's launch, then the wait for the kernel before: only where every dependent reads
    nothing but weights ahead of its own wait (the exception above)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


# The driver's launch structures (cuda.h, CUDA >= 12.0).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def launch_cuda(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, args: list,
                pdl: bool, cluster: tuple[int, int, int] | None = None) -> None:
    """Launch a kernel of `torch.cuda._utils._cuda_load_module` on the current stream, with PDL when
    `pdl` (its source must then keep the contract above with `griddepcontrol.wait`), in thread-block
    clusters of `cluster` CTAs when given (each grid dimension a multiple of the cluster's). Arguments
    as torch's launcher takes them: tensors as pointers (None: a null one), ints as int, floats as
    double; a ctypes array is passed by value (a struct parameter, such as a TMA descriptor)."""
    if cluster is not None and any(g % c for g, c in zip(grid, cluster)):
        raise ValueError(f"grid {tuple(grid)} is not a whole number of clusters {tuple(cluster)}")
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    keep = []
    for a in args:
        if isinstance(a, torch.Tensor):
            keep.append(ctypes.c_void_p(a.data_ptr()))
        elif a is None:  # a null pointer
            keep.append(ctypes.c_void_p(None))
        elif isinstance(a, int):
            keep.append(ctypes.c_int(a))
        elif isinstance(a, float):
            keep.append(ctypes.c_double(a))
        elif isinstance(a, ctypes.Array):  # a struct parameter by value (a TMA descriptor)
            keep.append(a)
        else:
            raise TypeError(f"unsupported kernel argument {type(a).__name__}")
    params = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in keep])
    values = ([(_PROGRAMMATIC_STREAM_SERIALIZATION, (ctypes.c_int * 1)(1))] if pdl else []) + (
        [(_CLUSTER_DIMENSION, (ctypes.c_uint * 3)(*cluster))] if cluster is not None else [])
    attrs = (_LaunchAttribute * max(1, len(values)))()
    for attr, (key, value) in zip(attrs, values):
        attr.id = key
        ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, ctypes.byref(value), ctypes.sizeof(value))
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                        torch.cuda.current_stream().cuda_stream, attrs, len(values))
    libcuda = _get_gpu_runtime_library()
    _check_cuda(libcuda.cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, params, None))
