"""NVRTC on a host without a GPU (the nvidia-cuda-nvrtc wheel of the test extra): the CUDA kernels
compiled as the engine compiles them at first use on the GPU (kernels/nvrtc.py, through torch), into
a cubin and ptxas' report, for tests that read their SASS or only need them to build."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest

SM90 = "--gpu-architecture=sm_90"  # what torch's _nvrtc_compile passes on an H100 / H200


def libnvrtc() -> ctypes.CDLL:
    """The wheel's NVRTC library; skips the test where it is not installed."""
    spec = importlib.util.find_spec("nvidia")
    paths = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    found = sorted(p for d in paths for p in Path(d).glob("cu*/lib/libnvrtc.so*"))
    if not found:
        pytest.skip("no NVRTC library (pip install nvidia-cuda-nvrtc: the test extra)")
    # NVRTC opens its builtins library by name at the first compile; the wheel's folder is on no search
    # path, so load it first, globally, where NVRTC will find it loaded
    for builtins in found[-1].parent.glob("libnvrtc-builtins.so*"):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(found[-1]))


def compile_cuda(source: str, options: list[str], arch: str = SM90) -> tuple[bytes, str]:
    """(cubin, NVRTC's log with ptxas' -v report) of `source`, kernels/ on the include path; fails the
    test with the log where NVRTC refuses it."""
    from pdserve.kernels.nvrtc import HEADERS

    lib = libnvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    opts = [arch, f"-I{HEADERS}", "--ptxas-options=-v", *options]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = b""
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, f"NVRTC refused the build ({' '.join(options)}):\n{log.value.decode()}"
    return cubin, log.value.decode()
