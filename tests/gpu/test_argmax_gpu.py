"""The split argmax (kernels/triton_argmax.py) on the GPU against torch.argmax, on fresh random
logits of the gpt-oss vocabulary: batch sizes of the decode step, a tie across chunks (the first
index), NaN (the first NaN), a row of -inf, written into mapped pinned memory as the pipelined
engine does (kernels/step_io.py), and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

VOCAB = 201088


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g, device="cuda")
    if rows >= 4:
        x[0, 5000] = x[0, 150000] = x[0].max() + 1  # a tie across chunks
        x[1, 190000] = float("nan")
        x[1, 20] = float("nan")
        x[2] = float("-inf")
        x[3, VOCAB - 1] = float("inf")
    return x


@pytest.mark.parametrize("rows", [1, 4, 7, 64])
def test_matches_torch_argmax_into_pinned_memory(seed, rows):
    from pdserve.kernels.step_io import mapped
    from pdserve.kernels.triton_argmax import argmax_rows

    x = _logits(rows, seed)
    host = torch.full((rows,), -1, dtype=torch.long).pin_memory()
    argmax_rows(x, out=mapped(host))
    torch.cuda.synchronize()
    want = torch.argmax(x, dim=-1).cpu()
    assert torch.equal(host, want)
    if rows >= 4:
        assert host[:4].tolist() == [5000, 20, 0, VOCAB - 1]


def test_graph_replay_follows_new_logits(seed):
    from pdserve.kernels.triton_argmax import argmax_rows

    x = _logits(8, seed)
    out = torch.empty(8, dtype=torch.long, device="cuda")
    argmax_rows(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(x, out=out)
    for s in range(3):
        x.copy_(_logits(8, seed + 1 + s))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1))
