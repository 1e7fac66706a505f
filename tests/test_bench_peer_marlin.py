"""The Marlin peer's repack (bench/peer_marlin.py) moves every code, scale and bias once and keeps codes
in their 16-row K tile; whether it is Marlin's order is what the GPU run's rel L2 against the reference
shows."""

import torch

from pdserve.bench.peer_marlin import (MarlinExperts, marlin_bias_order, marlin_group_order, marlin_tile_order,
                                       marlin_weight_perm)
from pdserve.kernels.mxfp4 import random_experts, unpack_fp4_codes


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], -1).reshape(words.shape[0], -1)


def test_the_tile_permutation_takes_every_position_once():
    assert torch.equal(marlin_weight_perm().sort().values, torch.arange(1024))


def test_codes_stay_in_their_k_tile_and_none_is_lost():
    g = torch.Generator().manual_seed(1)
    n, k = 128, 96
    codes = torch.randint(0, 16, (n, k), generator=g)
    words = marlin_tile_order(codes)
    assert words.shape == (k // 16, 2 * n) and words.dtype == torch.int32
    nib = _nibbles(words)
    for tile in range(k // 16):
        want = codes[:, 16 * tile:16 * (tile + 1)].flatten().sort().values
        assert torch.equal(nib[tile].sort().values, want)
    one = torch.zeros(n, k, dtype=torch.int64)
    one[37, 53] = 1
    nib = _nibbles(marlin_tile_order(one))
    assert int(nib.sum()) == 1 and int(nib[53 // 16].sum()) == 1


def test_scale_and_bias_orders_are_permutations():
    s = torch.arange(4 * 128).reshape(4, 128)
    assert torch.equal(marlin_group_order(s).flatten().sort().values, s.flatten())
    assert not torch.equal(marlin_group_order(s), s)
    b = torch.arange(256)
    assert torch.equal(marlin_bias_order(b).sort().values, b)


def test_padding_keeps_the_published_values():
    g = torch.Generator().manual_seed(2)
    w = random_experts(2, g, h=64, i=64)
    m = MarlinExperts(w, 128, 128)
    assert m.gate_up.shape == (2, 128 // 16, 2 * 2 * 128) and m.down.shape == (2, 128 // 16, 2 * 128)
    nib = _nibbles(m.down[1])
    assert int(nib.count_nonzero()) == int(unpack_fp4_codes(w.down_blocks[1]).count_nonzero())
    scales = m.down_scales[1].view(torch.uint8)
    assert int((scales != 127).sum()) <= w.down_scales[1].numel()
    assert int((m.gate_up_bias[1] != 0).sum()) == int((w.gate_up_bias[1].to(torch.bfloat16) != 0).sum())
