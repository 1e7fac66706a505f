"""kernels.experts.experts_forward_ref, the plain-torch MoE every kernel is measured against: each
(token, slot) pair adds weight * expert(x) once, pairs on experts of another rank add nothing, and a
token routed twice to one expert gets both pairs, as the kernels give it (routers never repeat an
expert; a test that masks a pair with a placeholder id may)."""

from __future__ import annotations

import torch

from pdserve.kernels.swiglu import swiglu
from pdserve.kernels.experts import ExpertWeights, experts_forward_ref


def _layer(g, e=6, h=32, i=16, first_expert=0):
    return ExpertWeights(torch.randn(e, 2 * i, h, generator=g) / 4, torch.randn(e, 2 * i, generator=g) / 4,
                         torch.randn(e, h, i, generator=g) / 4, torch.randn(e, h, generator=g) / 4,
                         first_expert=first_expert)


def _by_pairs(x, weights, ids, w):
    """The definition, pair by pair, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - w.first_expert
            if not 0 <= e < w.num_local_experts:
                continue
            a = swiglu(x[t].double() @ w.gate_up[e].double().T + w.gate_up_bias[e].double(), 7.0, 1.702)
            out[t] += float(weights[t, k]) * (a @ w.down[e].double().T + w.down_bias[e].double())
    return out


def test_every_pair_adds_once_repeated_experts_included():
    g = torch.Generator().manual_seed(0)
    w = _layer(g, first_expert=2)  # local experts 2 .. 7 of a wider router
    x = torch.randn(3, 32, generator=g)
    ids = torch.tensor([[2, 5, 7, 3], [4, 4, 6, 0], [9, 2, 2, 2]])  # repeats; ids 0 and 9 on other ranks
    weights = torch.rand(3, 4, generator=g)
    got = experts_forward_ref(x, weights, ids, w)
    assert torch.allclose(got.double(), _by_pairs(x, weights, ids, w), rtol=1e-5, atol=1e-5)
    # a repeated pair counts: the same as one pair of the summed weight
    merged = experts_forward_ref(x[1:2], torch.tensor([[weights[1, 0] + weights[1, 1], weights[1, 2]]]),
                                 torch.tensor([[4, 6]]), w)
    assert torch.allclose(got[1:2], merged, rtol=1e-5, atol=1e-5)
