"""kernels/step_io.stage_step in Triton's CPU interpreter: the staged bytes copied whole, the first
int64s replaced by the fed ids, on fresh random buffers of ragged sizes (one word to several
programs), with no ids fed and with up to the whole first row fed; plus its refusals and the
engine-side choice of path (`zero_copy`). The mapped pinned memory itself needs a GPU
(tests/gpu/test_step_io_gpu.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter

pytest.importorskip("triton")

# name: (bytes, ids fed)
CASES = {"one-word": (4, 0), "one-id": (16, 1), "ragged-one-program": (1000, 3),
         "programs-and-a-tail": (4 * 1024 * 3 + 52, 7), "many-ids": (4 * 1024 * 2 + 48, 1024 + 5),
         "none-fed": (4 * 1024 + 4, 0), "all-bytes-fed": (64, 8)}


def _case(name: str, seed: int) -> dict:
    n, m = CASES[name]
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    fed = torch.randint(-2**62, 2**62, (m,), generator=g, dtype=torch.int64) if m else None
    return dict(name=name, src=src, fed=fed)


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels.step_io import stage_step

    results = {}
    for c in torch.load(in_path):
        dst = torch.full_like(c["src"], 0xA5)  # an unwritten byte shows
        stage_step(c["src"], dst, c["fed"])
        results[c["name"]] = dst
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    seed = module_seed
    cases = [_case(name, seed + i) for i, name in enumerate(CASES)]
    results = run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("step_io_interp"), seed)
    return {c["name"]: c for c in cases}, results


@pytest.mark.parametrize("name", list(CASES))
def test_staged_bytes_with_fed_ids(run, name):
    cases, results = run
    c, dst = cases[name], results[name]
    want = c["src"].clone()
    if c["fed"] is not None:
        want[: 8 * c["fed"].numel()] = c["fed"].view(torch.uint8)
    assert torch.equal(dst, want)


def test_bad_buffers_are_refused():
    from pdserve.kernels.step_io import stage_step

    u8 = torch.zeros(16, dtype=torch.uint8)
    for src, dst, fed, what in (
        (torch.zeros(4, dtype=torch.int32), u8[:16], None, "uint8"),
        (u8, torch.zeros(12, dtype=torch.uint8), None, "one size"),
        (torch.zeros(6, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8), None, "multiple of 4"),
        (u8, u8.clone(), torch.zeros(3, dtype=torch.int64), "at most 2 ids"),
        (u8, u8.clone(), torch.zeros(1, dtype=torch.int32), "int64"),
    ):
        with pytest.raises(ValueError, match=what):
            stage_step(src, dst, fed)


def test_zero_copy_only_on_cuda_and_not_when_turned_off(monkeypatch):
    from pdserve.kernels.step_io import mapped, zero_copy

    assert not zero_copy(torch.device("cpu"))
    monkeypatch.setenv("PDSERVE_ZERO_COPY", "0")
    assert not zero_copy(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="pinned"):
        mapped(torch.zeros(4))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
