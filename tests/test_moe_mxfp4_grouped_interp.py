"""The expert-grouped MXFP4 kernels (kernels/triton_moe_mxfp4_grouped.py) in Triton's CPU
interpreter against `experts_forward_ref` on the dequantised (exact) weights.

Child process with TRITON_INTERPRET=1 (tests/interp.py), the routing layout built in torch
(tests/moe_routing.py). float32 activations and float32 dots
(bf16 `tl.dot` is wrong in the interpreter): the kernels and the reference differ only in the
order of float32 sums, so rel L2 < 1e-5; a wrong nibble, scale, row, expert, slot or weight is
off by > 1e-2. Every e2m1 code occurs; several experts get more routed rows than one BLOCK_M
block and some none; K (the hidden size) is not a multiple of BLOCK_K. The decode alone
(`decode_packed_expert`) is exact, every code at the scale bytes the packed layout allows
(0..PACKED_MAX_SCALE): the interpreter's float32 path computes the PTX path's products.
"""

from __future__ import annotations

import sys

import pytest
import torch

from interp import run_in_interpreter
from moe_routing import routing_torch
from mxfp4_layers import DECODE_SCALES, random_layer, reference, scale_extremes_expert
from numerics import rel_l2

pytest.importorskip("triton")

# hidden, intermediate, experts, tokens, top-k, down bias, GroupedConfig args
CASES = [
    (96, 64, 5, 7, 3, True, (16, (32, 64, 4, 2), (32, 64, 4, 2))),  # K 96: one and a half steps of 64
    (64, 96, 4, 9, 2, False, (16, (16, 32, 2, 1), (64, 64, 4, 2))),
    (160, 64, 6, 20, 4, True, (32, (64, 128, 4, 2), (16, 32, 2, 3))),  # experts with > 32 rows
]


def _child(in_path: str, out_path: str) -> None:
    from pdserve.kernels import triton_moe_mxfp4_grouped as grouped
    from pdserve.kernels.mxfp4 import MxExperts
    from pdserve.kernels.triton_moe_mxfp4_grouped import GroupedConfig, experts_forward_mxfp4_grouped

    grouped.align_routing = routing_torch  # the routing kernel's atomics do not run in the interpreter
    outs = []
    for c in torch.load(in_path):
        if "blocks" in c:
            outs.append(grouped.decode_packed_expert(c["blocks"], c["scales"], *c["tile"]))
            continue
        bm, gu, dn = c["config"]
        outs.append(experts_forward_mxfp4_grouped(c["x"], c["weights"], c["ids"], MxExperts(**c["w"]).to_packed(),
                                                  add_down_bias=c["bias"], config=GroupedConfig(bm, gu, dn)))
    torch.save(outs, out_path)


def test_grouped_mxfp4_matches_reference(tmp_path):
    from pdserve.kernels.mxfp4 import MxExperts

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    cases = []
    for h, i, e, t, k, bias, config in CASES:
        w = random_layer(e, g, h=h, i=i, scales=(122, 131), bias_std=1.0)
        # skewed routing: expert 0 in most tokens, the last expert in none
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(e - 2, generator=g)[: k - 1] + 1])
                           for _ in range(t)])
        cases.append(dict(x=torch.randn(t, h, generator=g), ids=ids, weights=torch.softmax(torch.randn(t, k, generator=g), -1),
                          w=vars(w), bias=bias, config=config))
    outs = run_in_interpreter(__file__, cases, tmp_path, seed)
    for c, got in zip(cases, outs):
        ref = reference(c["x"], c["weights"], c["ids"], MxExperts(**c["w"]), bias=c["bias"])
        assert got.shape == ref.shape and not got.isnan().any()
        assert rel_l2(got, ref) < 1e-5, (seed, rel_l2(got, ref))


def test_grouped_mxfp4_decode_is_exact_at_every_scale(tmp_path):
    from pdserve.kernels.mxfp4 import PACKED_MAX_SCALE, dequantize_mxfp4

    assert max(DECODE_SCALES) == PACKED_MAX_SCALE
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    w = scale_extremes_expert(torch.Generator().manual_seed(seed), DECODE_SCALES)
    p = w.to_packed()
    cases = [dict(blocks=p.gate_up_blocks[0], scales=p.gate_up_scales[0], tile=tile) for tile in ((16, 64), (16, 128))]
    outs = run_in_interpreter(__file__, cases, tmp_path, seed)
    want = dequantize_mxfp4(w.gate_up_blocks[0], w.gate_up_scales[0], torch.float32)
    for got in outs:
        assert torch.equal(got, want), seed


def test_grouped_mxfp4_refuses_published_blocks():
    from pdserve.kernels.mxfp4 import MxExperts
    from pdserve.kernels.triton_moe_mxfp4_grouped import GroupedConfig, experts_forward_mxfp4_grouped

    z = torch.zeros
    w = MxExperts(z(2, 64, 1, 16, dtype=torch.uint8), z(2, 64, 1, dtype=torch.uint8), z(2, 64),
                  z(2, 32, 1, 16, dtype=torch.uint8), z(2, 32, 1, dtype=torch.uint8), z(2, 32))
    with pytest.raises(ValueError, match="packed"):
        experts_forward_mxfp4_grouped(z(1, 32), z(1, 1), z(1, 1, dtype=torch.long), w)
    with pytest.raises(ValueError, match="BLOCK_K"):
        GroupedConfig(16, (64, 48, 4, 3))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
