"""The staged GEMV's launch rules (kernels/cuda_gemv_staged.py), without a GPU: which projections it
takes, and the clear errors for those it does not (raised before anything is launched)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cuda_gemv_staged import MAX_M, ROWS, WARPS, fits, gemv_staged, shared_bytes


def test_fits_gpt_oss_output_projections_only():
    assert fits(1, 2880, 4096) and fits(MAX_M, 2880, 4096) and fits(4, 2880, 2048)  # O, its TP-2 share
    assert not fits(0, 2880, 4096) and not fits(MAX_M + 1, 2880, 4096)
    assert not fits(1, 2880 + ROWS // 2, 4096)  # rows in CTAs of 8
    assert not fits(1, 5120, 2880)  # QKV: K not a multiple of 64 * WARPS
    assert not fits(1, 2880, 64 * WARPS * 64)  # 8 rows of K 16384 exceed an SM's shared memory
    assert shared_bytes(4096, 1) == (ROWS + 1) * (8192 + 64)


@pytest.mark.parametrize("case,match", [
    ("tokens", "takes 1-8 tokens"),
    ("dtype", "bf16"),
    ("bias shape", "contiguous w"),
    ("w strided", "contiguous w"),
    ("x strided", "16-byte aligned"),
    ("shapes", "are not"),
])
def test_rejects_what_it_cannot_take(case, match):
    m, n, k = 1, 16, 256
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    b = torch.zeros(n, dtype=torch.bfloat16)
    if case == "tokens":
        x = torch.zeros(MAX_M + 1, k, dtype=torch.bfloat16)
    elif case == "dtype":
        x = x.float()
    elif case == "bias shape":
        b = torch.zeros(n + 1, dtype=torch.bfloat16)
    elif case == "w strided":
        w = torch.zeros(n, 2 * k, dtype=torch.bfloat16)[:, ::2]
    elif case == "x strided":
        x = torch.zeros(m, k + 4, dtype=torch.bfloat16)[:, :k]
    else:
        x = torch.zeros(m, k + 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        gemv_staged(x, w, b)
