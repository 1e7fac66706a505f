"""bench/pipe_rates.py's kernels, compiled by NVRTC for sm_90 as the bench builds them: the loop each op
times holds that op's instructions and only loop control besides, so its cycles are the op's."""

from __future__ import annotations

import collections
import re
import subprocess

import pytest

from nvrtc_offline import compile_cuda

triton = pytest.importorskip("triton")

from pathlib import Path  # noqa: E402

_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
_LOOP_CONTROL = {"VIADD", "IADD3", "UIADD3", "ISETP.NE.AND", "BRA", "NOP"}


def _timed_loop(op: int, tmp_path: Path) -> collections.Counter:
    """The SASS mnemonics of the kernel's largest loop (the unrolled timed loop)."""
    from pdserve.bench import pipe_rates

    cubin, _ = compile_cuda(pipe_rates.SOURCE, [f"-DOP={op}", "-std=c++17"])
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(_CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2), m.group(3).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", sass)]
    loops = [(int(arg, 16), at) for at, op_, arg in ins if op_ == "BRA" and re.fullmatch(r"0x[0-9a-f]+", arg)
             and int(arg, 16) < at]
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    return collections.Counter(op_ for at, op_, _ in ins if first <= at <= last)


@pytest.mark.parametrize("op,expected", [
    (0, {"F2FP.F16.E4M3.UNPACK_B": 1}), (1, {"LOP3.LUT": 1}), (2, {"SHF.L.W.U32.HI": 1}), (3, {"IMAD": 1}),
    (4, {"FFMA": 1}), (5, {"HMMA.16816.F32": 1}), (7, {"F2FP.F16.E4M3.UNPACK_B": 0.5, "LOP3.LUT": 0.5}),
    (6, {"F2FP.F16.E4M3.UNPACK_B": 4, "LOP3.LUT": 5, "SHF.R.U32.HI": 1, "IMAD.SHL.U32": 1}),
])
def test_each_timed_loop_holds_its_op_and_loop_control_only(op, expected, tmp_path):
    body = _timed_loop(op, tmp_path)
    steps = body[next(iter(expected))] / next(iter(expected.values()))  # chain steps in the unrolled body
    assert steps >= 8 and steps == int(steps), body
    for name, per_step in expected.items():
        assert body[name] == per_step * steps, (name, body)
    assert set(body) <= set(expected) | _LOOP_CONTROL, body


def test_the_k_loop_mix_decodes_and_multiplies_every_word(tmp_path):
    """op 8: a word's 4 conversions and its mma in every chain step (the kernels' K loop without loads)."""
    body = _timed_loop(8, tmp_path)
    assert body["F2FP.F16.E4M3.UNPACK_B"] == 4 * body["HMMA.16816.F32"] and body["HMMA.16816.F32"] >= 8, body
