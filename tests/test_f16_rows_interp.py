"""The routing launch's f16 rows (kernels/triton_moe.py `_extra_program` with F16_ROW: the tokens of the MXFP4
experts folded in f16) in Triton's CPU interpreter, against the same arithmetic in torch, bit for bit, on
fresh random rows: rows of ordinary values, rows spanning 2^-40 .. 2^20, rows of zeros, rows with one huge
value, rows shorter than the program's block. The property that makes the fold exact is checked too:
every value down to 2^-24 of its row's largest |x| comes back exactly as f16 times the inverse factor.

The kernel runs in a child process with TRITON_INTERPRET=1 (read when triton is imported); this process
draws the inputs and compares. (Program 0 of the routing launch, whose atomics the interpreter does not
run, is not launched here: a one-line wrapper launches the row programs alone.)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from mxfp4_layers import f16_rows_reference

triton = pytest.importorskip("triton")
tl = triton.language

from pdserve.kernels.triton_moe import _extra_program  # noqa: E402


@triton.jit
def _rows_kernel(x_ptr, xf_ptr, inv_ptr, T, K, stride_x, stride_f, F16_ROW: tl.constexpr):
    """The routing launch's row programs alone (program i: row i)."""
    _extra_program(tl.program_id(0), x_ptr, xf_ptr, inv_ptr, T, K, stride_x, stride_f, 1, 0, F16_ROW)


def _rows(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ordinary = torch.randn(5, 2880, generator=g)
    spread = torch.randn(3, 2880, generator=g) * torch.exp2(torch.randint(-40, 21, (3, 2880), generator=g).float())
    zeros = torch.zeros(2, 2880)
    spike = torch.randn(2, 2880, generator=g) * 1e-3
    spike[0, 17], spike[1, 2000] = 3.0e4, -2.5e-20
    short = torch.randn(4, 300, generator=g) * 64
    return [t.to(torch.bfloat16) for t in (torch.cat([ordinary, spread, zeros, spike]), short)]


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    outs = []
    for x in torch.load(in_path):
        xf = torch.full(x.shape, float("nan"), dtype=torch.float16)
        inv = torch.full((x.shape[0],), float("nan"))
        _rows_kernel[(x.shape[0],)](x, xf, inv, x.shape[0], x.shape[1], x.stride(0), xf.stride(0),
                                   F16_ROW=triton.next_power_of_2(x.shape[1]))
        outs.append((xf, inv))
    torch.save(outs, out_path)


def test_f16_rows_match_their_arithmetic_bit_for_bit(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    cases = _rows(seed)
    outs = run_in_interpreter(__file__, cases, tmp_path, seed)
    for x, (xf, inv) in zip(cases, outs):
        ref_xf, ref_inv = f16_rows_reference(x)
        assert torch.equal(xf.view(torch.int16), ref_xf.view(torch.int16)), seed
        assert torch.equal(inv.view(torch.int32), ref_inv.view(torch.int32)), seed
        # the largest |x| of a nonzero row lands in [2^14, 2^15); values down to 2^-24 of it come back exactly
        big = xf.float().abs().amax(1)
        live = x.float().abs().amax(1) > 0
        assert ((big[live] >= 2.0**14) & (big[live] < 2.0**15)).all(), seed
        keep = x.float().abs() >= x.float().abs().amax(1, keepdim=True) * 2.0**-24
        assert torch.equal((xf.float() * inv[:, None])[keep], x.float()[keep]), seed


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
