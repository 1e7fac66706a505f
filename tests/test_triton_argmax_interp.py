"""The split argmax (kernels/triton_argmax.py) in Triton's CPU interpreter, against torch.argmax on
fresh random rows: the gpt-oss vocabulary (201088, not a multiple of the chunk) and small widths,
ties inside one chunk and across chunks (the first index wins), NaN before and after the maximum
and in several chunks (the first NaN wins), rows of -inf only, +inf beside NaN, one column, views
with strided columns and strided rows. The
ids must be torch's exactly; a second launch gives the same and the arrival counters are back to
zero. The kernel runs in a child process with TRITON_INTERPRET=1 (tests/interp.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter

pytest.importorskip("triton")

VOCAB = 201088


def _rows(n: int, g: torch.Generator) -> torch.Tensor:
    """Random rows with the edge cases planted at random places."""
    x = torch.randn(10, n, generator=g)
    pick = lambda: int(torch.randint(0, n, (), generator=g))  # noqa: E731
    a, b = sorted({pick(), pick(), pick()})[:2] if n > 2 else (0, n - 1)
    x[1, a] = x[1, b] = x[1].max() + 1  # a tie: the first index
    if n > 4096:  # a tie in two different chunks, and a later chunk's value just below
        x[2, 100] = x[2, 4100] = x[2].max() + 2
        x[2, 4099] = x[2, 100] - 1e-3
    x[3, b] = float("nan")  # NaN after (or at) the maximum's place
    x[4, a] = x[4, b] = float("nan")  # two NaNs: the first
    x[4, pick()] = float("inf")
    x[5] = float("-inf")  # nothing above -inf: index 0
    x[6, pick()] = float("inf")
    x[6, pick()] = float("inf")
    x[7, n - 1] = x[7].max() + 1  # the last column
    x[8, 0] = float("nan")
    return x


def _cases(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [_rows(VOCAB, g), _rows(1, g), _rows(2047, g), _rows(2049, g), _rows(5000, g)[:3],
            _rows(4096, g).to(torch.bfloat16),
            _rows(3000, g)[:, ::2], _rows(3000, g)[::2, 1000:]]  # strided columns; strided rows


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels.arrival import arrival_counters
    from pdserve.kernels.triton_argmax import argmax_rows

    results = []
    for x in torch.load(in_path):
        out = torch.full((x.shape[0],), -7, dtype=torch.int64)
        argmax_rows(x, out=out)
        again = argmax_rows(x)
        counters = arrival_counters(x.device, "argmax_rows", x.shape[0])[: x.shape[0]].clone()
        results.append(dict(ids=out, again=again, counters=counters))
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    seed = module_seed
    cases = _cases(seed)
    return cases, run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("argmax_interp"), seed)


def test_ids_are_torch_argmax(run):
    cases, results = run
    for x, r in zip(cases, results):
        want = torch.argmax(x, dim=-1)
        assert torch.equal(r["ids"], want), f"width {x.shape[1]}: {r['ids'].tolist()} vs {want.tolist()}"


def test_planted_cases_hold(run):
    """The planted ties and NaNs are what the kernel was judged on (a check of the test itself)."""
    cases, results = run
    ids = results[0]["ids"].tolist()
    x = cases[0]
    assert ids[2] == 100 and x[2, 100] == x[2, 4100]
    assert ids[5] == 0 and ids[8] == 0
    assert x[3].isnan().any() and x[3, ids[3]].isnan()


def test_second_launch_same_and_counters_reset(run):
    _, results = run
    for r in results:
        assert torch.equal(r["ids"], r["again"])
        assert not r["counters"].any()


def test_rejects_bad_shapes():
    from pdserve.kernels.triton_argmax import argmax_rows

    with pytest.raises(ValueError, match=r"\[rows, V\]"):
        argmax_rows(torch.zeros(4))
    with pytest.raises(ValueError, match="columns"):
        argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="int64"):
        argmax_rows(torch.zeros(2, 5), out=torch.zeros(2, dtype=torch.int32))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
