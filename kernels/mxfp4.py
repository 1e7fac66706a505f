"""MXFP4 (OCP microscaling FP4) decoding, as stored in the published gpt-oss checkpoints.

`*_blocks` is uint8 [..., rows, cols/32, 16]: 32 e2m1 values per group, two per byte, low nibble
first. `*_scales` is uint8 [..., rows, cols/32]: the group's power-of-two exponent, biased by 127.

The decode kernels may keep the blocks in a *packed* word layout (`pack_words`): the same 16 bytes
per group (4.25 bits per weight as published), each 32-bit word's eight values with their bits
moved so that four values become e4m3 bytes in one instruction and the other four in four, which
Hopper's `cvt.rn.f16x2.e4m3x2` turns into f16 tensor-core operands two at a time
(kernels/cuda_moe_mxfp4.cu); kernels that compute in bf16 spread those bytes into bf16x2 pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# e2m1 code -> value; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
# The packed decode brings each group's sum back with the float32 2^(s - 65) (kernels/triton_moe_mxfp4.py):
# scale exponents up to 192 (2^65) fit; real checkpoints stay far below.
PACKED_MAX_SCALE = 192
# In the packed layout each row's scale bytes are zero-padded to a multiple of 16 groups (2880 / 32
# = 90 -> 96), so the kernel reads them as aligned 32-bit words it can prefetch with the blocks
# (single bytes at a 90-byte row stride cannot be).
PACKED_SCALE_PAD = 16
# A decode that multiplies each e2m1 * 2^-126 pair by its group's 2^(s - 1) in bf16 (the folded mma
# kernels, kernels/cuda_moe_mxfp4.cu MX_FOLD) is exact while that factor is a bf16 (s <= 128) and
# the smallest product, 0.5 * 2^(s - 128), a normal one (s >= 2): weights up to 12 in magnitude.
# Trained weights sit well inside (group factors 2^-9 .. 2^-4: s 118-123).
FOLD_MIN_SCALE = 2
FOLD_MAX_SCALE = 128
# The same fold in f16 (the e4m3 -> f16 conversion's e2m1 * 2^-6 times 2^(s - 121)) is exact while the
# factor is an f16 (s <= 136) and every product e2m1 * 2^(s - 127) is one: 0.5 * 2^(s - 127) at least
# 2^-24, the smallest f16 subnormal (s >= 104); 6 * 2^9 at s = 136 is far below f16's largest.
FOLD_F16_MIN_SCALE = 104
FOLD_F16_MAX_SCALE = 136


def unpack_fp4_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G, 16] -> int64 codes [..., G, 32], low nibble first."""
    lo = (blocks & 0x0F).long()
    hi = (blocks >> 4).long()
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Decode to `dtype` [..., rows, cols]. Exact for bf16/fp32 (every value is k * 2^e)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("MXFP4 blocks and scales must be uint8")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = lut[unpack_fp4_codes(blocks)]  # [..., G, 32]
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exp.unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `w` [..., rows, cols] to MXFP4 (nearest e2m1 per group, shared power-of-two scale).

    Used to write random checkpoints in the published layout; the scale is chosen so the group's
    largest magnitude lands at or below 6.0.
    """
    *lead, rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"cols ({cols}) must be a multiple of {GROUP}")
    g = w.float().reshape(*lead, rows, cols // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    mag = scaled.abs().unsqueeze(-1)
    code = (mag - lut).abs().argmin(-1)  # nearest magnitude
    code = code + 8 * (scaled < 0).long() * (code > 0).long()
    pairs = code.reshape(*lead, rows, cols // GROUP, GROUP // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales


# Packed word layout. A word holds values 8w..8w+7 of its group (as the published word does), each
# as an "e4m3 byte": sign at bit 7, the code's magnitude bits (e1, e0, m) at bits 4..2, zeros
# elsewhere, which read as e4m3 is the e2m1 value times 2^-6, exactly (the +-0.5 codes are e4m3
# subnormals). Values 0..3 are bytes 0..3 of PACKED_LOW = word & 0x9C9C9C9C (their bits stay where
# they are); values 4..7 are bytes 0..3 of PACKED_HIGH = ((word << 2) & 0x8C8C8C8C) | ((word >> 2) &
# 0x10101010), whose bits fill the other four positions of each byte (m, e0 at 0, 1; sign at 5; e1
# at 6). So a word is 5 integer instructions and 4 conversions from four f16x2 operands (values
# 2q, 2q + 1 in pair q, the K order of the published word), where bf16 operands took 13.
PACKED_LOW_MASK = 0x9C9C9C9C
PACKED_HIGH_SHL_MASK = 0x8C8C8C8C  # (word << 2) & this
PACKED_HIGH_SHR_MASK = 0x10101010  # | (word >> 2) & this


def _packed_bit_map() -> list[tuple[int, int]]:
    """[(source bit in the published word, bit in the packed word)] for all 32 bits."""
    low = (2, 3, 4, 7)  # code bits m, e0, e1, sign of values 0..3: bits of byte v
    high = (0, 1, 6, 5)  # of values 4..7: the same bits of byte v - 4, before the shifts
    pairs = [(4 * v + j, 8 * (v % 4) + (low if v < 4 else high)[j]) for v in range(8) for j in range(4)]
    assert sorted(d for _, d in pairs) == list(range(32)), "packed layout must be a bit permutation"
    return pairs


_PACKED_BITS = _packed_bit_map()


def _permute_word_bits(blocks: torch.Tensor, inverse: bool) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., {GROUP // 2}], got {blocks.dtype} {tuple(blocks.shape)}")
    words = blocks.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for src, dst in _PACKED_BITS:
        a, b = (dst, src) if inverse else (src, dst)
        out |= ((words >> a) & 1) << b
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.uint8).view(blocks.shape)


# Tile-major group order of the packed layout. The decode kernels sum 16 rows at a time (a tile), a K step of 4
# groups (64 bytes) of each row per warp instruction; row-major, that step is 16 pieces of 64 bytes, 1440
# bytes apart (gpt-oss' K = 2880). So `to_packed` stores each expert's groups tile by tile: step c of a tile is its
# 16 rows' 4 groups one after the other (1 KB), row r's at group 4 r. Where K is no multiple of 4 groups, the
# last, partial step (q = K_GROUPS % 4 groups a row) follows the whole ones, rows r and r + 8 side by side: row
# r's groups at 2 q (r % 8) + q (r // 8), so that a thread's two rows (r < 8 and r + 8) are q groups apart, and
# at gpt-oss' q = 2 row r < 8 is at 4 r as in a whole step. A 120b step at one token: x0.975 a replay against the
# row-major order (docs/kernels.md item 70).
TILE_ROWS = 16
TILE_STEP = 4  # groups
PACK_CHUNK_BYTES = 1 << 28  # experts `to_packed` converts at once


def _tile_major(blocks: torch.Tensor, inverse: bool) -> torch.Tensor:
    """uint8 groups [..., rows, G, 16] in row order <-> tile-major (rows a multiple of TILE_ROWS), into a new
    tensor. Tiles are independent, so every tile of every leading index is permuted in one pass."""
    *lead, rows, g, b = blocks.shape
    if rows % TILE_ROWS:
        raise ValueError(f"the packed layout stores rows in tiles of {TILE_ROWS}: {rows} rows")
    step, whole = TILE_STEP * b, g // TILE_STEP * TILE_STEP * b
    src = blocks.reshape(-1, TILE_ROWS * g * b)  # [tiles, a tile's bytes]
    out = torch.empty_like(src)
    rowwise, tiled = (out, src) if inverse else (src, out)
    rowwise = rowwise.view(-1, TILE_ROWS, g * b)
    tiles = rowwise.shape[0]
    # a tile's whole steps: [row, step, 64 bytes] in row order, [step, row, 64 bytes] tile-major
    by_row = rowwise[..., :whole].unflatten(-1, (-1, step))
    by_step = tiled[:, : TILE_ROWS * whole].view(tiles, -1, TILE_ROWS, step).transpose(1, 2)
    # the partial step's groups: [row, groups] in row order, [row % 8, row // 8, groups] tiled
    row_tail = rowwise[..., whole:].unflatten(1, (2, TILE_ROWS // 2)).transpose(1, 2)
    tiled_tail = tiled[:, TILE_ROWS * whole :].view(tiles, TILE_ROWS // 2, 2, -1)
    if inverse:
        by_row.copy_(by_step)
        row_tail.copy_(tiled_tail)
    else:
        by_step.copy_(by_row)
        tiled_tail.copy_(row_tail)
    return out.view(blocks.shape)


def pack_words(blocks: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Published blocks uint8 [..., 16] -> the packed word layout (same shape and bytes per group);
    in chunks of `chunk` groups so a layer's experts convert without a large int64 temporary."""
    flat = blocks.reshape(-1, GROUP // 2)
    return torch.cat([_permute_word_bits(flat[i : i + chunk], False) for i in range(0, flat.shape[0], chunk)]
                     ).view(blocks.shape)


def unpack_words(packed: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Inverse of `pack_words`."""
    flat = packed.reshape(-1, GROUP // 2)
    return torch.cat([_permute_word_bits(flat[i : i + chunk], True) for i in range(0, flat.shape[0], chunk)]
                     ).view(packed.shape)


def bf16_pairs_ptx(word: str) -> list[str]:
    """PTX (for Triton's inline asm) that decodes packed word `word` into the bf16x2 registers p0..p3
    (declared here; values 2q, 2q + 1 in pq) of e2m1 * 2^-126: its e4m3 bytes (above), two at a time
    into the high bytes of the two halves (sign at bit 15, magnitude at 12..10, by a byte permute),
    the magnitude moved down to 8..6 (+-0.5 codes are bf16 subnormals). 21 instructions a word."""
    lines = [".reg .b32 lo, hi, sa, sb, x, m, p0, p1, p2, p3;",
             f"and.b32 lo, {word}, {PACKED_LOW_MASK:#010x};",
             f"shl.b32 sa, {word}, 2;", f"shr.b32 sb, {word}, 2;", f"and.b32 sb, sb, {PACKED_HIGH_SHR_MASK:#010x};",
             f"lop3.b32 hi, sa, {PACKED_HIGH_SHL_MASK:#010x}, sb, 0xEA;"]  # (a & b) | c
    for q in range(4):
        lines += [f"prmt.b32 x, {'lo' if q < 2 else 'hi'}, 0, {0x1404 if q % 2 == 0 else 0x3424:#06x};",
                  "shr.b32 m, x, 4;", "and.b32 m, m, 0x01C001C0;", f"lop3.b32 p{q}, x, 0x80008000, m, 0xEA;"]
    return lines


def packed_e4m3_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed layout as the kernels read it: each word -> its PACKED_LOW and PACKED_HIGH words
    -> uint8 [..., G, 32], the e4m3 byte of every value in K order. For tests of the layout."""
    words = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [..., G, 4]
    low = words & PACKED_LOW_MASK
    high = ((words << 2) & PACKED_HIGH_SHL_MASK) | ((words >> 2) & PACKED_HIGH_SHR_MASK)
    both = torch.stack([low, high], dim=-1)  # [..., G, 4 words, 2]
    nbytes = torch.stack([(both >> (8 * b)) & 0xFF for b in range(4)], dim=-1)  # [..., G, 4, 2, 4]: value 4h + b
    return nbytes.flatten(-3).to(torch.uint8)


def decode_packed_words(packed: torch.Tensor) -> torch.Tensor:
    """The packed layout decoded the way the kernels do it (e4m3 bytes read as e4m3, times 2^6)
    -> float32 [..., G, 32]: the e2m1 values, unscaled. For tests of the layout."""
    return packed_e4m3_bytes(packed).view(torch.float8_e4m3fn).float() * 64.0


@dataclass
class MxExperts:
    """One layer's experts kept in MXFP4 (the layout above) with float32 biases.
    gate_up_blocks [E, 2I, H/32, 16], gate_up_scales [E, 2I, H/32], down_blocks [E, H, I/32, 16],
    down_scales [E, H, I/32] (uint8); gate_up_bias [E, 2I], down_bias [E, H].
    layout: "published" (as the checkpoint stores them) or "packed" (blocks through `pack_words`, each
    expert's groups in tile-major order (TILE_ROWS), scale rows zero-padded to a multiple of PACKED_SCALE_PAD
    groups). fold_exact (set by `to_packed`):
    every group with a nonzero code has its scale byte in FOLD_MIN_SCALE .. FOLD_MAX_SCALE;
    fold_f16_exact: the same for FOLD_F16_MIN_SCALE .. FOLD_F16_MAX_SCALE."""

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    gate_up_bias: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    down_bias: torch.Tensor
    layout: str = "published"
    fold_exact: bool = False
    fold_f16_exact: bool = False

    def __post_init__(self):
        if self.layout not in ("published", "packed"):
            raise ValueError(f"MXFP4 block layout must be published or packed, not {self.layout!r}")

    def to_packed(self) -> "MxExperts":
        """The same experts with blocks in the packed word layout (the decode kernels' "packed")."""
        if self.layout == "packed":
            return self
        for s in (self.gate_up_scales, self.down_scales):
            if int(s.max()) > PACKED_MAX_SCALE:
                raise ValueError(f"an MXFP4 scale exponent above 2^{PACKED_MAX_SCALE - 127} does not fit the packed "
                                 "decode's float32 rescale")
        def pad(scales):
            g = scales.shape[-1]
            return torch.nn.functional.pad(scales, (0, -g % PACKED_SCALE_PAD)).contiguous()

        def within(low, high):
            def exact(blocks, scales):
                out = (scales < low) | (scales > high)
                return not bool(out.any()) or not bool(blocks[out].any())

            return exact(self.gate_up_blocks, self.gate_up_scales) and exact(self.down_blocks, self.down_scales)

        def pack(blocks):  # a few experts at a time: temporaries of about PACK_CHUNK_BYTES, few launches
            out = torch.empty_like(blocks)
            n = max(1, PACK_CHUNK_BYTES // max(blocks[0].numel(), 1))
            for i in range(0, blocks.shape[0], n):
                out[i : i + n] = _tile_major(pack_words(blocks[i : i + n]), inverse=False)
            return out

        return replace(self, gate_up_blocks=pack(self.gate_up_blocks), down_blocks=pack(self.down_blocks),
                       gate_up_scales=pad(self.gate_up_scales), down_scales=pad(self.down_scales), layout="packed",
                       fold_exact=within(FOLD_MIN_SCALE, FOLD_MAX_SCALE),
                       fold_f16_exact=within(FOLD_F16_MIN_SCALE, FOLD_F16_MAX_SCALE))

    def published(self, which: str, index=slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """`which` ("gate_up" or "down") (blocks, scales) [index] in the published layout."""
        blocks = getattr(self, which + "_blocks")[index]
        scales = getattr(self, which + "_scales")[index]
        if self.layout == "packed":
            return unpack_words(_tile_major(blocks, inverse=True)), scales[..., : blocks.shape[-2]]
        return blocks, scales

    @property
    def num_experts(self) -> int:
        return self.gate_up_blocks.shape[0]


def random_experts(e: int, g: torch.Generator, device: torch.device | str = "cpu", h: int = 2880, i: int = 2880,
                   scales: tuple[int, int] = (118, 124), bias_std: float = 0.1) -> MxExperts:
    """`e` random experts [h, i] in the published layout, for kernel tests and benchmarks: random
    codes, scale bytes in [scales[0], scales[1]) (the default gives group factors 2^-9 .. 2^-4, as in
    trained weights), float32 biases ~ N(0, bias_std); everything drawn from `g`."""

    def mx(rows, cols):
        return (torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8, device=device),
                torch.randint(*scales, (e, rows, cols // 32), generator=g, dtype=torch.uint8, device=device))

    gb, gs = mx(2 * i, h)
    db, ds = mx(h, i)
    return MxExperts(gb, gs, torch.randn(e, 2 * i, device=device, generator=g) * bias_std, db, ds,
                     torch.randn(e, h, device=device, generator=g) * bias_std)
