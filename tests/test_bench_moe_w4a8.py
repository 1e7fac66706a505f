"""bench/moe_w4a8.py's probe kernel, offline: its index arithmetic replayed in torch on the fragment
layouts the PTX ISA gives wgmma (m64n8k32, A in registers, B K-major in shared memory without swizzle,
float32 D), against the exact product of the decoded weights and the quantised activations; the
activation quantisation's grid; and the sm_90a build (NVRTC, as the bench builds it): 24 FP8 wgmmas
a CTA, no spills, no fence ptxas had to inject between them. The GPU run compares the kernel itself
(tests/gpu/test_moe_w4a8_gpu.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from nvrtc_offline import compile_cuda

from pdserve.bench import moe_w4a8 as mw
from pdserve.kernels.mxfp4 import (PACKED_HIGH_SHL_MASK, PACKED_HIGH_SHR_MASK, PACKED_LOW_MASK, random_experts)


def _e4m3_words(w: int) -> tuple[int, int]:
    low = w & PACKED_LOW_MASK
    high = ((w << 2) & PACKED_HIGH_SHL_MASK) | ((w >> 2) & PACKED_HIGH_SHR_MASK)
    return low, high


def _bytes_e4m3(word: int) -> list[float]:
    """A 32-bit register of 4 e4m3 bytes, byte 0 first, as floats."""
    b = torch.tensor([(word >> (8 * i)) & 0xFF for i in range(4)], dtype=torch.uint8)
    return b.view(torch.float8_e4m3fn).float().tolist()


def _replay_cta(wp, expert: int, x: torch.Tensor, tile: int, ks: int) -> torch.Tensor:
    """float64 [64]: CTA (tile, ks)'s row sums as the kernel forms them (the thread-to-data mapping of
    w4a8_gate_up, on wgmma's documented fragment layouts)."""
    words = wp.gate_up_blocks[expert].contiguous().view(torch.int32).view(-1, mw.KG, 4).long() & 0xFFFFFFFF
    scales = wp.gate_up_scales[expert].long()
    g0 = ks * mw.GROUPS_PER_CTA
    ng = min(mw.GROUPS_PER_CTA, mw.KG - g0)
    # B: 3 blocks x 8 steps x (2 core matrices x 8 columns x 16 bytes)
    bsm = torch.zeros(3, 8, 2, 8, 16)
    fxs = torch.zeros(mw.GROUPS_PER_CTA, dtype=torch.float64)
    xq = mw.quantize_groups(x)[0].double()
    for gi in range(ng):
        gvals = x[0, (g0 + gi) * 32: (g0 + gi + 1) * 32].float()
        e = max(int(gvals.abs().max().view(torch.int32)) >> 23 & 0xFF, 8)
        fxs[gi] = 2.0 ** (e - 134)
        down = 2.0 ** (134 - e)
        for wq in range(4):
            blk, gl = gi // 8, gi % 8
            s = 4 * (gl // 4) + wq
            for i in range(4):
                bsm[blk, s, 0, gl, 4 * (gl % 4) + i] = xq[(g0 + gi) * 32 + 8 * wq + i] * down
                bsm[blk, s, 1, gl, 4 * (gl % 4) + i] = xq[(g0 + gi) * 32 + 8 * wq + 4 + i] * down
    red = torch.zeros(64, dtype=torch.float64)
    for warp in range(4):
        t = torch.zeros(32, 2, dtype=torch.float64)  # per lane: rows g, g + 8
        for blk in range(3):
            if 8 * blk >= ng:
                break
            d = torch.zeros(32, 4, dtype=torch.float64)
            for s in range(8):
                # A [16 rows of this warp, 32 k] from the lanes' registers, B [32 k, 8 n] from shared memory
                a = torch.zeros(16, 32, dtype=torch.float64)
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    gi = 8 * blk + 4 * (s >> 2) + q
                    row = tile * 64 + warp * 16 + g
                    regs = []
                    for r in (row, row + 8):
                        wv = int(words[r, g0 + gi, s & 3]) if gi < ng else 0
                        regs.append(_e4m3_words(wv))
                    (l0, h0), (l1, h1) = regs
                    a[g, 4 * q: 4 * q + 4] = torch.tensor(_bytes_e4m3(l0), dtype=torch.float64)
                    a[g + 8, 4 * q: 4 * q + 4] = torch.tensor(_bytes_e4m3(l1), dtype=torch.float64)
                    a[g, 16 + 4 * q: 20 + 4 * q] = torch.tensor(_bytes_e4m3(h0), dtype=torch.float64)
                    a[g + 8, 16 + 4 * q: 20 + 4 * q] = torch.tensor(_bytes_e4m3(h1), dtype=torch.float64)
                b = bsm[blk, s].permute(0, 2, 1).reshape(32, 8).double()  # k = 16 kc + byte, n
                prod = a @ b  # [16, 8]
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    d[lane] += torch.stack([prod[g, 2 * q], prod[g, 2 * q + 1], prod[g + 8, 2 * q], prod[g + 8, 2 * q + 1]])
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                row = tile * 64 + warp * 16 + g
                for c in range(2):
                    grp = 8 * blk + 2 * q + c
                    fx = float(fxs[grp])
                    s0 = int(scales[row, g0 + grp]) if grp < ng else 0
                    s1 = int(scales[row + 8, g0 + grp]) if grp < ng else 0
                    t[lane, 0] += d[lane, c] * 2.0 ** (s0 - 121) * fx
                    t[lane, 1] += d[lane, 2 + c] * 2.0 ** (s1 - 121) * fx
        for lane in range(0, 32, 4):  # the quad's sum, written by q == 0
            g = lane >> 2
            red[warp * 16 + g] = t[lane: lane + 4, 0].sum()
            red[warp * 16 + g + 8] = t[lane: lane + 4, 1].sum()
    return red


def test_thread_mapping_reproduces_the_product():
    """Two row tiles of one expert (the last one's rows past the first tile too), every K share:
    the sums of the four CTAs of each cluster equal the decoded weights times the quantised row."""
    gen = torch.Generator().manual_seed(11)
    w = random_experts(2, gen)
    wp = w.to_packed()
    x = (torch.randn(1, mw.KG * 32, generator=gen) * 3).to(torch.bfloat16)
    ref = mw.reference(w, torch.tensor([1]), x, top_k=1)[0]
    for tile in (0, 89):
        got = sum(_replay_cta(wp, 1, x, tile, ks) for ks in range(mw.K_SPLIT))
        want = ref[tile * 64: (tile + 1) * 64]
        assert (got - want).abs().max() <= 1e-9 * want.abs().max()


def test_quantised_groups_sit_on_the_e4m3_grid_at_most_256():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 2880, generator=gen) * torch.logspace(-6, 6, 2880)).to(torch.bfloat16)
    q = mw.quantize_groups(x).reshape(2, -1, 32)
    g = x.float().reshape(2, -1, 32)
    e = ((g.abs().amax(-1).view(torch.int32) >> 23) & 0xFF).clamp(min=8)
    scaled = q * torch.ldexp(torch.ones_like(e, dtype=torch.float32), 134 - e)[..., None]
    assert scaled.abs().max() <= 256  # below 256 before rounding (e4m3: 448 at most)
    assert torch.equal(scaled, scaled.to(torch.float8_e4m3fn).float())  # on the grid
    assert (q - g).abs().max() <= (g.abs() * 2 ** -4).max()  # 3 mantissa bits: within half a step


@pytest.mark.parametrize("pipe, mma", [(True, True), (False, True), (False, False)])
def test_probe_builds_for_sm90a_with_24_fp8_wgmmas_and_no_spills(pipe, mma, tmp_path):
    """As the bench compiles it (NVRTC for sm_90a: wgmma is an sm_90a instruction); the control without
    the wgmmas has none."""
    triton = pytest.importorskip("triton")
    cubin, report = compile_cuda(mw.SOURCE, mw.compile_options(pipe, mma), arch="--gpu-architecture=sm_90a")
    assert " 0 bytes spill stores" in report, report
    assert "C7519" not in report and "C7517" not in report, report  # no fence or wait injected by ptxas
    path = tmp_path / "w4a8.cubin"
    path.write_bytes(cubin)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    assert sass.count("QGMMA.64x8x32.F32.E4M3.E4M3") == (24 if mma else 0), "3 blocks x 8 K steps of FP8 wgmma"
