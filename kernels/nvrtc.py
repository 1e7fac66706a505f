"""CUDA kernels compiled at first use by NVRTC through torch (no build step, no headers): the one
place that compiles, loads and sizes them, the engine's and the benchmarks' probes; kernels/pdl.py
launches them."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_NON_PORTABLE_CLUSTER = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
PORTABLE_CLUSTER = 8  # the most CTAs a cluster may hold without asking (Hopper allows 16 on request)


# The share of an SM's L1 / shared-memory array a kernel asks to be shared memory (percent; absent:
# the driver picks per kernel). An SM changes that split only while it is idle, so under PDL a CTA
# whose kernel got another split than the CTAs on an SM cannot be placed there until they retire.
# `PDSERVE_SMEM_CARVEOUT`: a percent for every kernel, or "name=percent,..." per kernel, "*" for the
# rest (the benchmarks' A/B).
def _carveouts(spec: str) -> dict[str, int]:
    if not spec:
        return {}
    items = [("*", spec)] if "=" not in spec else [item.split("=", 1) for item in spec.split(",")]
    out = {}
    for name, value in items:
        if not value.strip().isdigit() or int(value) > 100:
            raise ValueError(f"PDSERVE_SMEM_CARVEOUT: {spec!r} is not a percent 0-100 or name=percent,...")
        out[name.strip()] = int(value)
    return out


SMEM_CARVEOUT: dict[str, int] = _carveouts(os.environ.get("PDSERVE_SMEM_CARVEOUT", ""))


def set_carveout(func: int | ctypes.c_void_p, name: str) -> None:
    """Ask for kernel `name`'s SMEM_CARVEOUT on a loaded kernel (a CUfunction handle), where one is set."""
    value = SMEM_CARVEOUT.get(name, SMEM_CARVEOUT.get("*"))
    if value is None:
        return
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    handle = func if isinstance(func, ctypes.c_void_p) else ctypes.c_void_p(func)
    _check_cuda(_get_gpu_runtime_library().cuFuncSetAttribute(handle, _CARVEOUT, value))


HEADERS = Path(__file__).parent  # cuda_common.cuh, the kernels' shared header


def load_kernels(source: Path, names: list[str], options: list[str], device_index: int, dynamic_smem: int,
                 cluster: int = 1) -> dict:
    """{name: kernel} of the .cu file `source` (its directory on the include path): compile_kernels."""
    return compile_kernels(source.read_text(), names, options, device_index, dynamic_smem, cluster, source.parent)


def compile_kernels(text: str, names: list[str], options: list[str], device_index: int, dynamic_smem: int = 0,
                    cluster: int = 1, include: Path = HEADERS) -> dict:
    """{name: kernel} of the CUDA source `text` compiled with `options` for the device, each allowed
    `dynamic_smem` bytes of dynamic shared memory (past the 48 KB a launch gets without asking) and,
    where `cluster` passes PORTABLE_CLUSTER, clusters of that many CTAs; `include` on the include path."""
    from torch.cuda._utils import _check_cuda, _cuda_load_module, _get_gpu_runtime_library, _nvrtc_compile

    with torch.cuda.device(device_index):
        cubin, _ = _nvrtc_compile(text, names[0], nvcc_options=[f"-I{include}", *options])
        kernels = _cuda_load_module(cubin, names)
        libcuda = _get_gpu_runtime_library()
        for name, k in kernels.items():
            k.set_shared_memory_config(dynamic_smem)  # the launcher's own check, from 48 KB
            _check_cuda(libcuda.cuFuncSetAttribute(k.func, _MAX_DYNAMIC_SHARED, dynamic_smem))
            if cluster > PORTABLE_CLUSTER:
                _check_cuda(libcuda.cuFuncSetAttribute(k.func, _NON_PORTABLE_CLUSTER, 1))
            set_carveout(k.func, name)
    return kernels


def resident_ctas(kernel, threads: int, dynamic_smem: int, device_index: int) -> int:
    """CTAs of a `load_kernels` kernel the device holds at once at this block size and dynamic shared
    memory (CTAs an SM times the SMs): a larger launch runs in waves. A host query (capturable)."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    key = (kernel.func.value, threads, dynamic_smem, device_index)  # the CUfunction handle
    if key not in _RESIDENT:
        per_sm = ctypes.c_int()
        _check_cuda(_get_gpu_runtime_library().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(per_sm), kernel.func, threads, ctypes.c_size_t(dynamic_smem)))
        _RESIDENT[key] = per_sm.value * torch.cuda.get_device_properties(device_index).multi_processor_count
    return _RESIDENT[key]


_RESIDENT: dict[tuple[int, int, int, int], int] = {}
_BUILDS: dict[tuple[str, int], bool] = {}


def builds_on(device: torch.device | None, what: str, build: Callable[[int], object]) -> bool:
    """Whether `build(device_index)` compiles and loads on this device (Hopper or newer, NVRTC
    present), tried once per kernel family and device; where not, the callers' Triton kernels serve
    and the reason is logged once."""
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    key = (what, index)
    if key not in _BUILDS:
        ok = torch.cuda.get_device_capability(index) >= (9, 0)
        if ok:
            try:
                build(index)
            except Exception as ex:  # no NVRTC / CUDA headers on this host
                log.warning("%s unavailable (%s: %s); the Triton kernels serve instead", what, type(ex).__name__, ex)
                ok = False
        _BUILDS[key] = ok
    return _BUILDS[key]
