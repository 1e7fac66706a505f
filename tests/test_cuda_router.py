"""The cluster router's host side on CPU (the kernel itself: tests/gpu/test_fused_kernels_gpu.py::
test_router; its SASS: tests/test_pdl_early_reads_sm90.py): the source ships with the installed
package, the launch shapes, and that route_fused never takes it off the GPU or for other dtypes."""

from __future__ import annotations

from importlib import resources

import torch


def test_the_kernel_source_ships_with_the_package():
    src = resources.files("pdserve.kernels").joinpath("cuda_router.cu").read_text()
    assert 'extern "C" __global__' in src and "route(" in src


def test_launch_shapes():
    from pdserve.kernels.cuda_router import shape

    assert shape(32, 2880) == (8, 8)  # gpt-oss-20b: 8 CTAs a token, 360 columns each
    assert shape(128, 2880) == (8, 16)  # gpt-oss-120b
    assert shape(8, 64) == (8, 8)
    assert shape(32, 2888) is None  # a CTA's share would not be whole 16-byte vectors
    assert shape(40, 2880) is None  # experts do not split over 16 warps
    assert shape(2, 2880) is None  # fewer experts than the 4 picked
    assert shape(1024, 2880) is None  # more experts than CTA 0 has threads


def test_wider_clusters_by_the_number_of_experts(monkeypatch):
    from pdserve.kernels import cuda_router

    monkeypatch.setattr(cuda_router, "CLUSTERS", {128: 12})
    assert cuda_router.shape(128, 2880) == (12, 16)  # 240 columns a CTA
    assert cuda_router.shape(32, 2880) == (8, 8)  # others keep CLUSTER
    monkeypatch.setattr(cuda_router, "CLUSTERS", {128: 16})
    assert cuda_router.shape(128, 2880) is None  # 180 columns a CTA: not whole 16-byte vectors


def test_route_fused_takes_the_triton_kernel_off_the_gpu():
    from pdserve.kernels import cuda_router

    x = torch.zeros(1, 2880, dtype=torch.bfloat16)
    w = torch.zeros(32, 2880, dtype=torch.bfloat16)
    b = torch.zeros(32, dtype=torch.bfloat16)
    assert not cuda_router.applies(x, w, b)
    assert not cuda_router.applies(x.float(), w.float(), b.float())


def test_the_shared_header_ships_with_the_package():
    """Every .cu file includes cuda_common.cuh, which NVRTC finds next to them (kernels/nvrtc.py)."""
    kernels = resources.files("pdserve.kernels")
    assert "cluster_sync" in kernels.joinpath("cuda_common.cuh").read_text()
    for name in ("cuda_router.cu", "cuda_moe_mxfp4.cu", "cuda_gemv_staged.cu"):
        assert '#include "cuda_common.cuh"' in kernels.joinpath(name).read_text(), name
