"""bench/moe_stream.py without a GPU: its kernel's tiles agree with the module's constants, and it
compiles for sm_90 (nvcc, where installed) without spills in its largest shape, the waiting build
counting gate/up tiles with global atomics and the others not."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from pdserve.bench import moe_stream


def test_kernel_tiles_match_the_module():
    src = moe_stream.SOURCE
    macro = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define (KG|TILES_GU|TILES_DN) (\d+)", src)}
    assert macro == {"KG": moe_stream.KG, "TILES_GU": moe_stream.TILES_GU, "TILES_DN": moe_stream.TILES_DN}
    assert moe_stream.TILES_GU * 16 == moe_stream.ROWS_GU and moe_stream.TILES_DN * 16 == moe_stream.ROWS_DN


@pytest.mark.parametrize("dep", [0, 1])
def test_compiles_without_spills(tmp_path, dep):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this host")
    src = tmp_path / "stream.cu"
    src.write_text(moe_stream.SOURCE)
    cubin = tmp_path / "stream.cubin"
    options = [f"-I{moe_stream.KERNELS}", "-DNW=8", "-DP=12", "-DWORK=60", f"-DDEP={dep}", "-std=c++17", str(src)]
    report = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", "-Xptxas", "-v", *options, "-o", str(cubin)],
                            check=True, capture_output=True, text=True).stderr
    assert "0 bytes spill stores" in report, report
    ptx = subprocess.run([nvcc, "-ptx", "-arch=sm_90", *options, "-o", "-"], check=True, capture_output=True,
                         text=True).stdout
    assert ("atom.global.add" in ptx or "red.global.add" in ptx) == bool(dep)
