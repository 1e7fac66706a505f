"""The MXFP4 decode MoE (kernels/triton_moe_mxfp4.py) in Triton's CPU interpreter against
`experts_forward_ref` on the dequantised weights (MXFP4 decodes exactly to float32).

Runs in a child process with TRITON_INTERPRET=1 (read at import). float32 activations: the
kernel and the reference differ only in summation order, so rel L2 < 1e-5; a wrong nibble,
scale, row, slot, bias or weight is off by > 1e-2. Every e2m1 code and scales 2^-3..2^3 occur.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from mxfp4_layers import random_layer, reference
from numerics import rel_l2

pytest.importorskip("triton")

# hidden, intermediate, experts, tokens, top-k, down bias, (gate_up config, down config[, lut, decode]); the
# default decode is "bits"
CASES = [
    (96, 64, 6, 3, 4, True, ((32, 2, 4, 2), (16, 2, 4, 2))),  # K steps ragged (3 and 2 groups)
    (64, 96, 4, 1, 2, False, ((16, 1, 2, 1), (8, 4, 2, 3))),
    (96, 64, 6, 2, 4, True, ((32, 2, 4, 2), (16, 2, 4, 2), True)),  # byte-table decode
    (96, 64, 6, 2, 4, True, ((32, 2, 4, 2), (16, 2, 4, 2), False, "v1")),  # the first version's decode
    (160, 96, 5, 2, 3, True, ((16, 16, 4, 2), (8, 32, 1, 3))),  # default shape: K step wider than K
]


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels.triton_moe_mxfp4 import MxConfig, MxExperts, experts_forward_mxfp4

    outs = []
    for c in torch.load(in_path):
        cfg = MxConfig(*c["config"])
        outs.append(experts_forward_mxfp4(c["x"], c["weights"], c["ids"], MxExperts(**c["w"]), add_down_bias=c["bias"],
                                          config=cfg))
    torch.save(outs, out_path)


def test_mxfp4_moe_matches_reference(tmp_path):
    from pdserve.kernels.triton_moe_mxfp4 import MxExperts

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    cases = []
    for h, i, e, t, k, bias, config in CASES:
        w = random_layer(e, g, h=h, i=i, scales=(124, 131), bias_std=1.0)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, k, generator=g), -1)
        cases.append(dict(x=torch.randn(t, h, generator=g), ids=ids, weights=weights, w=vars(w), bias=bias,
                          config=config))
    for c, got in zip(cases, run_in_interpreter(__file__, cases, tmp_path, seed)):
        ref = reference(c["x"], c["weights"], c["ids"], MxExperts(**c["w"]), bias=c["bias"])
        assert not got.isnan().any()
        assert rel_l2(got, ref) < 1e-5, (seed, rel_l2(got, ref))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
