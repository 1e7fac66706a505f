"""CUDA kernels compiled at first use by NVRTC through torch (no build step, no headers): the one
place that compiles, loads and sizes them; kernels/pdl.py launches them."""

from __future__ import annotations

from pathlib import Path

import torch

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def load_kernels(source: Path, names: list[str], options: list[str], device_index: int, dynamic_smem: int) -> dict:
    """{name: kernel} of `source` compiled with `options` for the device, each allowed
    `dynamic_smem` bytes of dynamic shared memory (past the 48 KB a launch gets without asking)."""
    from torch.cuda._utils import _check_cuda, _cuda_load_module, _get_gpu_runtime_library, _nvrtc_compile

    with torch.cuda.device(device_index):
        cubin, _ = _nvrtc_compile(source.read_text(), names[0], nvcc_options=options)
        kernels = _cuda_load_module(cubin, names)
        libcuda = _get_gpu_runtime_library()
        for k in kernels.values():
            k.set_shared_memory_config(dynamic_smem)  # the launcher's own check, from 48 KB
            _check_cuda(libcuda.cuFuncSetAttribute(k.func, _MAX_DYNAMIC_SHARED, dynamic_smem))
    return kernels
