"""The packed MXFP4 word layout (kernels/mxfp4.py: pack_words) on the CPU: a bit permutation of
each word (unpack_words inverts it), each expert's 16-row tiles stored tile-major, and the kernels'
decode (a mask, or two shifts and masks, to e4m3 bytes read as e4m3 times 2^6; emulated by
decode_packed_words) gives back every published e2m1 value at every position, with bytes that hold
nothing but the value's bits. The GPU kernels that read it: tests/gpu/test_moe_mxfp4*_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mxfp4_layers import random_layer
from pdserve.kernels.experts import experts_forward_mxfp4_ref
from pdserve.kernels.mxfp4 import (FP4_VALUES, PACKED_MAX_SCALE, MxExperts, decode_packed_words, pack_words,
                                   packed_e4m3_bytes, unpack_fp4_codes, unpack_words)


def test_pack_is_a_bit_permutation_and_decodes_every_code():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    blocks = torch.randint(0, 256, (3, 5, 7, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(0, 256, 16, dtype=torch.uint8) | torch.arange(16, dtype=torch.uint8)  # all codes
    packed = pack_words(blocks, chunk=16)  # several chunks
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert not torch.equal(packed, blocks)
    assert torch.equal(unpack_words(packed), blocks)
    # the number of set bits per word is kept (a permutation)
    pop = lambda t: sum(((t.view(torch.int32).to(torch.int64) >> b) & 1).sum() for b in range(32))  # noqa: E731
    assert pop(packed) == pop(blocks)
    want = torch.tensor(FP4_VALUES)[unpack_fp4_codes(blocks)]
    got = decode_packed_words(packed)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0
    # each e4m3 byte: sign at bit 7, magnitude at bits 4..2, nothing else (what the kernels convert)
    e4m3 = packed_e4m3_bytes(packed)
    assert not (e4m3 & 0x63).any()
    assert torch.equal(e4m3 >> 7, unpack_fp4_codes(blocks) >> 3)


@pytest.mark.parametrize("groups", [90, 8, 5, 3, 2, 1])
def test_packed_experts_store_each_tile_tile_major(groups):
    """to_packed orders each expert's 16-row tiles tile-major: K step c (4 groups) of a tile's 16 rows is one
    contiguous piece, row r's groups at 4 r; the partial last step (q = groups % 4 a row) follows, row r's at
    2 q (r % 8) + q (r // 8). published() gives the row order back."""
    from pdserve.kernels.mxfp4 import TILE_ROWS

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    blocks = torch.randint(0, 256, (2, 3 * TILE_ROWS, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.full((2, 3 * TILE_ROWS, groups), 120, dtype=torch.uint8)
    w = MxExperts(blocks, scales, torch.zeros(2, 3 * TILE_ROWS), blocks, scales, torch.zeros(2, 3 * TILE_ROWS))
    p = w.to_packed()
    words = pack_words(blocks).view(2, 3, TILE_ROWS * groups, 16)  # [expert, tile, group slot, 16 bytes]
    stored = p.gate_up_blocks.view(2, 3, TILE_ROWS * groups, 16)
    whole, q = divmod(groups, 4)
    for r in range(TILE_ROWS):
        for k in range(groups):
            at = 64 * (k // 4) + 4 * r + k % 4 if k < 4 * whole else 64 * whole + 2 * q * (r % 8) + q * (r // 8) + k % 4
            assert torch.equal(stored[:, :, at], words[:, :, r * groups + k]), (r, k)
    assert torch.equal(p.published("gate_up")[0], blocks) and torch.equal(p.published("down", [1])[0], blocks[[1]])
    with pytest.raises(ValueError, match="tiles of 16"):
        MxExperts(blocks[:, :8], scales[:, :8], torch.zeros(2, 8), blocks, scales, torch.zeros(2, 48)).to_packed()


def test_packing_in_chunks_of_experts_changes_nothing(monkeypatch):
    """to_packed converts PACK_CHUNK_BYTES of experts at a time: one expert a chunk gives the same blocks."""
    from pdserve.kernels import mxfp4

    w = _experts(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item())))
    whole = w.to_packed()
    monkeypatch.setattr(mxfp4, "PACK_CHUNK_BYTES", 1)
    chunked = w.to_packed()
    assert torch.equal(chunked.gate_up_blocks, whole.gate_up_blocks) and torch.equal(chunked.down_blocks, whole.down_blocks)


def _experts(g):
    return random_layer(4, g, h=64, i=64, scales=(120, 130), bias_std=1.0)


def test_packed_experts_keep_the_reference_path():
    """The prefill/reference path reads packed experts through published_blocks: same output."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = _experts(g)
    p = w.to_packed()
    assert p.layout == "packed" and p.to_packed() is p
    blocks, scales = p.published("down", [1, 3])
    assert torch.equal(blocks, w.down_blocks[[1, 3]]) and torch.equal(scales, w.down_scales[[1, 3]])
    assert p.gate_up_scales.shape[-1] % 16 == 0 and torch.equal(p.gate_up_scales[..., :2], w.gate_up_scales)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    wts = torch.softmax(torch.randn(5, 2, generator=g), -1).to(torch.bfloat16)
    assert torch.equal(experts_forward_mxfp4_ref(x, wts, ids, p), experts_forward_mxfp4_ref(x, wts, ids, w))


def test_packed_layout_refuses_what_it_cannot_decode():
    g = torch.Generator().manual_seed(0)
    w = _experts(g)
    w.down_scales[0, 0, 0] = PACKED_MAX_SCALE + 1
    with pytest.raises(ValueError, match="scale exponent"):
        w.to_packed()
    with pytest.raises(ValueError, match="layout"):
        MxExperts(w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, w.down_blocks, w.down_scales, w.down_bias,
                  layout="shuffled")
    with pytest.raises(ValueError, match="uint8"):
        pack_words(torch.zeros(2, 16, dtype=torch.int32))
