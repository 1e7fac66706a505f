"""The FlashInfer peer's hand-over (bench/peer_flashinfer_moe.py): gate/up rows go from the published
interleave (glu even, linear odd) to FlashInfer's [linear; glu] halves, codes, scales and biases alike; K and
rows are padded to whole 128-wide blocks with zero codes, unit scales and zero biases (its SM90 scale
interleave takes no partial block); and FlashInfer's own SM90 interleave helpers get the packed bytes
[E, rows, K / 2] and the E8M0 scales [E, rows, K / 32]. Whether that is the layout its kernels read is what
the GPU run's rel L2 against the reference shows."""

import types

import torch

from pdserve.bench.peer_flashinfer_moe import FlashInferExperts, halves_padded, pad_to
from pdserve.kernels.mxfp4 import random_experts


def test_linear_rows_come_first_then_the_glu_rows_each_half_padded():
    rows = torch.arange(12).view(1, 12, 1).expand(2, 12, 3)
    out = halves_padded(rows, 8)
    assert out[0, :, 0].tolist() == [1, 3, 5, 7, 9, 11, 0, 0, 0, 2, 4, 6, 8, 10, 0, 0]
    assert torch.equal(out[1], out[0]) and out.is_contiguous()
    assert torch.equal(pad_to(rows, 2, 5, 127)[..., 3:], torch.full((2, 12, 2), 127))


def test_the_helpers_get_every_byte_and_scale_in_the_published_order_padded():
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
    # hidden 64 and intermediate 96 both run 128 wide
    assert fw.hidden == 64 and fw.padded == 128
    assert seen == [("weights", (3, 256, 64), "fp4"), ("weights", (3, 128, 64), "fp4"),
                    ("scales", (3, 256, 4), 32), ("scales", (3, 128, 4), 32)]
    e = 1
    glu_row, lin_row = 2 * 5, 2 * 5 + 1  # the sixth (glu, linear) pair of the published layout
    assert torch.equal(fw.fc1[e, 5, :32], w.gate_up_blocks[e, lin_row].flatten())
    assert torch.equal(fw.fc1[e, 128 + 5, :32], w.gate_up_blocks[e, glu_row].flatten())
    assert not fw.fc1[:, :, 32:].any() and not fw.fc1[:, 96:128].any() and not fw.fc1[:, 224:].any()
    assert torch.equal(fw.scales[0][e, 128 + 5, :2], w.gate_up_scales[e, glu_row])
    assert (fw.scales[0][:, :, 2:] == 127).all() and (fw.scales[0][:, 96:128] == 127).all()
    assert torch.equal(fw.fc1_bias[e, 5], w.gate_up_bias[e, lin_row].to(torch.bfloat16))
    assert not fw.fc1_bias[:, 96:128].any() and not fw.fc1_bias[:, 224:].any()
    assert torch.equal(fw.fc2[:, :64, :48].reshape(3, 64, 3, 16), w.down_blocks)
    assert not fw.fc2[:, :, 48:].any() and not fw.fc2[:, 64:].any() and not fw.fc2_bias[:, 64:].any()
    assert (fw.scales[1][:, :64, 3:] == 127).all() and torch.equal(fw.scales[1][:, :64, :3], w.down_scales)
    assert torch.allclose(fw.alpha, torch.full((3,), 1.702))
    assert fw.limit.tolist() == [7.0] * 3 and fw.beta.tolist() == [1.0] * 3
