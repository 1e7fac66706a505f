"""The MXFP4 MoE in Marlin's shape (bench/moe_tiles.py, a bench until it is measured against the engine's
launches) on the GPU: gpt-oss' expert shape, fresh random weights and routing.

- Each GEMM's kernel alone (float32 sums of the f16-folded weights times f16 B rows, no epilogue)
  against a float64 product: the products are exact in float32, only the sums' order rounds (rel L2
  1e-4).
- The whole layer (gate/up + clamped SwiGLU, down + the weighted top-k sum) against the float32
  reference of tests/mxfp4_layers.py at the engine's tolerance (rel L2 4e-3: f16 activations, bf16
  output), close to the engine's folded launches, deterministic, and replayed from a CUDA graph on new
  inputs."""

from __future__ import annotations

import pytest
import torch

from mxfp4_layers import random_layer, reference
from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

DEV = torch.device("cuda")
LAYER_SHAPES = [((2, 4, 2), (2, 4, 1)), ((1, 4, 1), (1, 4, 1)), ((4, 3, 1), (2, 3, 3))]


def _tiles():
    from pdserve.kernels import cuda_moe_mxfp4

    if not cuda_moe_mxfp4.available(DEV):
        pytest.skip("the tiles kernels need Hopper and NVRTC")
    from pdserve.bench import moe_tiles

    return moe_tiles


def _seeded():
    return torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))


def _problem(t: int, e: int, g: torch.Generator):
    w = random_layer(e, g, DEV)
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    return w, x, ids, weights


SHAPES = [(1, 4, 1), (2, 4, 1), (4, 3, 1), (2, 4, 2), (2, 3, 3)]
ROWS = {"gate_up": 5760, "down": 2880}  # gpt-oss' rows of each GEMM
PART_SHAPES = [(part, shape) for part in ROWS for shape in SHAPES if ROWS[part] % (64 * shape[2]) == 0]


@pytest.mark.parametrize("part,shape", PART_SHAPES)
@pytest.mark.parametrize("t,e", [(1, 8), (16, 32), (64, 8)])
def test_each_gemm_alone_against_float64(part, shape, t, e):
    from pdserve.kernels.mxfp4 import dequantize_mxfp4
    from pdserve.kernels.triton_moe import align_routing

    mt = _tiles()
    g = _seeded()
    w, x, ids, _ = _problem(t, e, g)
    wp = w.to_packed()
    rows = getattr(wp, part + "_blocks").shape[1]
    assert rows == ROWS[part] and rows % mt.rows(shape[2]) == 0
    probe = mt.Probe(*shape, part, wp.gate_up_blocks.shape[2], DEV)
    out = torch.full((t * 4, rows), float("nan"), device=DEV)
    if part == "gate_up":
        routing, b, inv = align_routing(ids, 0, e, mt.SLOTS, x_f16=x)
        b_rows = x.double()[torch.arange(t * 4, device=DEV) // 4]
    else:
        routing, inv = align_routing(ids, 0, e, mt.SLOTS), None
        b = (torch.randn(t * 4, 2880, device=DEV, generator=g) * 0.5).to(torch.float16)
        b_rows = b.double()
    probe(wp, routing, b, inv, 4, out)
    want = torch.empty(t * 4, rows, dtype=torch.float64, device=DEV)
    for expert in ids.unique().tolist():  # one expert decoded at a time
        pairs = (ids.view(-1) == expert).nonzero().view(-1)
        want[pairs] = b_rows[pairs] @ dequantize_mxfp4(*w.published(part, expert), dtype=torch.float64).t()
    assert torch.isfinite(out).all()  # every (pair, row) written
    assert rel_l2(out.double(), want) < 1e-4, rel_l2(out.double(), want)


@pytest.mark.parametrize("shapes", range(len(LAYER_SHAPES)))
@pytest.mark.parametrize("t,e", [(1, 8), (4, 32), (37, 32), (64, 8), (64, 128)])
def test_whole_layer_against_reference(shapes, t, e):
    from pdserve.kernels.cuda_moe_mxfp4 import experts_forward_mxfp4_mma

    mt = _tiles()
    g = _seeded()
    w, x, ids, weights = _problem(t, e, g)
    wp = w.to_packed()
    layer = mt.Layer(*LAYER_SHAPES[shapes], wp.gate_up_blocks.shape[2], DEV)
    out = layer(wp, x, ids, weights)
    ref = reference(x, weights, ids, w)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_l2(out, ref) < 4e-3, rel_l2(out, ref)
    assert rel_l2(out, experts_forward_mxfp4_mma(x, weights, ids, wp, grouped=True)) < 4e-3
    assert torch.equal(out, layer(wp, x, ids, weights))  # the top-k sum is in order: deterministic


def test_whole_layer_replays_from_a_cuda_graph():
    mt = _tiles()
    g = _seeded()
    t, e = 40, 8
    w, x, ids, weights = _problem(t, e, g)
    wp = w.to_packed()
    layer = mt.Layer(*LAYER_SHAPES[0], wp.gate_up_blocks.shape[2], DEV)
    layer(wp, x, ids, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(wp, x, ids, weights)
    x.copy_(torch.randn(t, 2880, device=DEV, generator=g))
    ids.copy_(torch.stack([torch.randperm(e, device=DEV, generator=g)[:4] for _ in range(t)]))
    weights.copy_(torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1))
    graph.replay()
    assert torch.equal(out, layer(wp, x, ids, weights))
    assert rel_l2(out, reference(x, weights, ids, w)) < 4e-3
