"""The FlashInfer peer's hand-over (bench/peer_flashinfer_moe.py): gate/up rows go from the published
interleave (glu even, linear odd) to FlashInfer's [linear; glu] halves, codes, scales and biases alike, and
FlashInfer's own SM90 interleave helpers get the packed bytes [E, rows, K / 2] and the E8M0 scales
[E, rows, K / 32]. Whether that is the layout its kernels read is what the GPU run's rel L2 against the
reference shows."""

import types

import torch

from pdserve.bench.peer_flashinfer_moe import FlashInferExperts, linear_first
from pdserve.kernels.mxfp4 import random_experts


def test_linear_rows_come_first_then_the_glu_rows():
    rows = torch.arange(12).view(1, 12, 1).expand(2, 12, 3)
    out = linear_first(rows)
    assert out[0, :, 0].tolist() == [1, 3, 5, 7, 9, 11, 0, 2, 4, 6, 8, 10]
    assert torch.equal(out[1], out[0]) and out.is_contiguous()


def test_the_helpers_get_every_byte_and_scale_in_the_published_order():
    w = random_experts(3, torch.Generator().manual_seed(0), h=64, i=96)
    seen = []

    def weights(t, kind):
        seen.append(("weights", tuple(t.shape), kind))
        return t.clone()

    def scales(t, group_size):
        seen.append(("scales", tuple(t.shape), group_size))
        return t.clone()

    fw = FlashInferExperts(w, types.SimpleNamespace(interleave_moe_weights_for_sm90_mixed_gemm=weights,
                                                    interleave_moe_scales_for_sm90_mixed_gemm=scales))
    assert seen == [("weights", (3, 192, 32), "fp4"), ("weights", (3, 64, 48), "fp4"),
                    ("scales", (3, 192, 2), 32), ("scales", (3, 64, 3), 32)]
    e = 1
    glu_row, lin_row = 2 * 5, 2 * 5 + 1  # the sixth (glu, linear) pair of the published layout
    assert torch.equal(fw.fc1[e, 5], w.gate_up_blocks[e, lin_row].flatten())
    assert torch.equal(fw.fc1[e, 96 + 5], w.gate_up_blocks[e, glu_row].flatten())
    assert torch.equal(fw.scales[0][e, 96 + 5], w.gate_up_scales[e, glu_row])
    assert torch.equal(fw.fc1_bias[e, 5], w.gate_up_bias[e, lin_row].to(torch.bfloat16))
    assert torch.equal(fw.fc2.view(3, 64, 3, 16), w.down_blocks)
    assert torch.allclose(fw.alpha, torch.full((3,), 1.702))
    assert fw.limit.tolist() == [7.0] * 3 and fw.beta.tolist() == [1.0] * 3
