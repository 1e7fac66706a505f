"""The FP8 GEMV's launch rules (kernels/cuda_gemv_fp8.py), without a GPU: which projections it takes,
and the clear errors for those it does not (raised before anything is launched)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cuda_gemv_fp8 import MAX_M, ROWS, fits, fits_rope, gemv_fp8, qkv_rope_fp8, shared_bytes, w_stride
from pdserve.kernels.fp8 import FP8


def test_fits_gpt_oss_projections():
    for n, k in [(5120, 2880), (2880, 4096), (2560, 2880), (2880, 2048)]:  # QKV, O, their TP-2 shares
        assert fits(1, n, k) and fits(MAX_M, n, k)
    assert not fits(0, 2880, 4096) and not fits(MAX_M + 1, 2880, 4096)
    assert not fits(1, 2880 + ROWS // 2, 4096)  # rows in CTAs of 8
    assert not fits(1, 2880, 2880 + 32)  # K in steps of 64
    assert not fits(1, 2880, 8192 + 64)  # past the kernel's 64 scale blocks
    assert fits_rope(8, 2880, 64, 8, 64) and not fits_rope(1, 2880, 64, 8, 128)


def test_sixteen_row_ctas(monkeypatch):
    """CTAs of 16 rows: N a multiple of 16; the QKV launch (cuda_gemv_fp8.QKV_ROWS) takes a head's 32 rotation
    pairs in CTAs of 8; three CTAs of gpt-oss' QKV fit an SM's shared memory, four do not."""
    from pdserve.kernels import cuda_gemv_fp8 as gf

    assert fits(1, 5120, 2880, 16) and not fits(1, 2880 + 8, 4096, 16)
    assert shared_bytes(2880, 1, 16) == 16 * 2880 + 2 * 2880 + 16
    cta = shared_bytes(2880, 1, 16) + gf.static_shared(16)
    assert 3 * cta <= gf.SHARED_PER_SM < 4 * cta
    monkeypatch.setattr(gf, "QKV_ROWS", 16)
    assert fits_rope(8, 2880, 64, 8, 64) and not fits_rope(1, 2880 + 32, 64, 8, 64)
    with pytest.raises(ValueError, match="8 or 16"):
        gf.compile_options(rows=4)


def test_staged_rows_fall_in_distinct_banks():
    """Rows g and g + 1 of a quarter warp's 16-byte reads: 64 bytes apart modulo 128."""
    for k in (2048, 2880, 4096):
        assert w_stride(k) % 128 == 64 and w_stride(k) >= k
    assert shared_bytes(2880, 1) == 8 * 2880 + 2 * 2880 + 16


def _args(case: str):
    m, n, k = 1, 16, 256
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=FP8)
    s = torch.ones(1, 2)
    b = torch.zeros(n, dtype=torch.bfloat16)
    if case == "tokens":
        x = torch.zeros(MAX_M + 1, k, dtype=torch.bfloat16)
    elif case == "dtype":
        w = torch.zeros(n, k, dtype=torch.bfloat16)
    elif case == "scales":
        s = torch.ones(1, 3)
    elif case == "bias shape":
        b = torch.zeros(n + 1, dtype=torch.bfloat16)
    elif case == "x strided":
        x = torch.zeros(m, k + 4, dtype=torch.bfloat16)[:, :k]
    elif case == "shapes":
        x = torch.zeros(m, k + 8, dtype=torch.bfloat16)
    return x, w, s, b


@pytest.mark.parametrize("case,match", [
    ("tokens", "takes 1-8 tokens"),
    ("dtype", "e4m3 w"),
    ("scales", "128x128 grid"),
    ("bias shape", "contiguous w"),
    ("x strided", "16-byte aligned"),
    ("shapes", "are not"),
])
def test_rejects_what_it_cannot_take(case, match):
    with pytest.raises(ValueError, match=match):
        gemv_fp8(*_args(case))


def test_rope_entry_rejects_mismatched_cache_and_positions():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = torch.zeros((4 + 2 * 2) * 64, 256, dtype=FP8)
    s = torch.ones(4, 2)
    cos = torch.zeros(128, 32)
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)
    pos = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not match cache"):
        qkv_rope_fp8(x, w, s, None, pos, cos, cos, pos, cache, 8, 2)
    with pytest.raises(ValueError, match="int64"):
        qkv_rope_fp8(x, w, s, None, pos.int(), cos, cos, pos, cache, 4, 2)
    with pytest.raises(ValueError, match="bf16 cache"):
        qkv_rope_fp8(x, w, s, None, pos, cos, cos, pos, cache.float(), 4, 2)


def _kernel_params(name: str) -> int:
    """Parameters of a kernel of cuda_gemv_fp8.cu, with its timing build's trace buffer (GF_TRACE_PARAM)."""
    import re

    from pdserve.kernels.cuda_gemv_fp8 import SOURCE

    match = re.search(rf'extern "C" __global__[^;{{]*?\b{name}\(([^)]*)\)', SOURCE.read_text())
    params = match.group(1)
    return params.replace("GF_TRACE_PARAM", "").count(",") + 1, "GF_TRACE_PARAM" in params


def _launch_both(monkeypatch, traced: bool, capturing: bool = True) -> list[tuple[str, dict, list]]:
    """gemv_fp8 and qkv_rope_fp8 launched with the compile and the launch stubbed out (no GPU): (entry, build,
    arguments) of each."""
    from pdserve.kernels import cuda_gemv_fp8 as gf

    launched = []
    monkeypatch.setattr(gf, "_kernels", lambda dev, **build: {k: (k, build) for k in ("gemv_fp8", "gemv_fp8_rope")})
    monkeypatch.setattr(gf, "launch_cuda", lambda kernel, *a, args, **k: launched.append((*kernel, args)))
    monkeypatch.setattr(gf, "_index", lambda x: 0)
    monkeypatch.setattr(gf, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    if traced:
        monkeypatch.setattr(gf, "TRACE", gf.Trace(buffer=torch.zeros(100 * gf.TRACE_WORDS, dtype=torch.int64),
                                                  scratch=torch.zeros(64 * gf.TRACE_WORDS, dtype=torch.int64)))
    x, w, s, b = _args("none")
    gemv_fp8(x, w, s, b)
    wq = torch.zeros((4 + 2 * 2) * 64, 256, dtype=FP8)
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.int64)
    qkv_rope_fp8(x, wq, torch.ones(4, 2), None, pos, torch.zeros(128, 32), torch.zeros(128, 32), pos, cache, 4, 2)
    return launched


@pytest.mark.parametrize("traced", [False, True])
def test_every_launch_passes_each_kernel_its_parameters(monkeypatch, traced):
    """Both staged entries get as many arguments as their signatures have, the timing build's trace buffer
    included where a Trace is set (and only then): cuLaunchKernelEx would read a short list past its end."""
    launched = _launch_both(monkeypatch, traced)
    assert [k for k, _, _ in launched] == ["gemv_fp8", "gemv_fp8_rope"]
    for kernel, build, args in launched:
        n, has_trace = _kernel_params(kernel)
        assert has_trace
        assert len(args) == n + traced and build == {"rows": 8, **({"trace": True} if traced else {})}


def test_the_timing_build_writes_each_captured_launch_into_its_own_part_of_the_trace(monkeypatch):
    """Captured launches take consecutive parts of the buffer (CTAs x TRACE_WORDS each) and are listed; launches
    outside a capture (a graph's warm-up) share the scratch and are not; a full buffer is an error."""
    from pdserve.kernels import cuda_gemv_fp8 as gf

    launched = _launch_both(monkeypatch, traced=True)
    trace = gf.TRACE
    assert trace.launches == [("gemv_fp8", 0, 2), ("gemv_fp8_rope", 2 * gf.TRACE_WORDS, 64)]  # 16 / 8, 512 rows / 8
    for (_, _, args), (_, start, ctas) in zip(launched, trace.launches):
        buf = args[-1]
        assert buf.data_ptr() == trace.buffer[start:].data_ptr() and buf.numel() == ctas * gf.TRACE_WORDS
    with pytest.raises(ValueError, match="full"):
        trace.take("gemv_fp8_rope", 64)
    launched = _launch_both(monkeypatch, traced=True, capturing=False)
    assert gf.TRACE.launches == [] and all(args[-1] is gf.TRACE.scratch for _, _, args in launched)
