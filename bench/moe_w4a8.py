"""One token's MXFP4 gate/up on Hopper's FP8 tensor cores (W4A8 through `wgmma`), against the
engine's per-pair mma kernel (kernels/cuda_moe_mxfp4.cu `mx_gate_up`), on the same experts.

Why (docs/kernels.md, MXFP4 decode MoE, items 17, 22, 26, 29): the mma kernels spend about 12
instructions a packed word (5 integer ones to e4m3 bytes, 4 conversions to f16, an f16 `mma.sync`,
the activations read from shared memory, the group's rescale) on schedulers that hold 2-3 warps.
On sm_90 the FP8 `mma.sync` is not native (ptxas lowers it to conversions and f16 mmas), so item 17's
W4A8 probe measured an emulation; the FP8 tensor cores are reached through `wgmma` only. Here the
e4m3 bytes of the packed layout (kernels/mxfp4.py) are the A operand as they are (5 integer
instructions a word, no conversion), the token's row is B in shared memory, quantised to e4m3 with
one power of two a group of 32, and one `wgmma.m64n8k32` is one K step of 64 rows: about 6.5
instructions a word. This measures what that instruction stream is worth before anything is built
on it; the cost is the FP8 experts' activation rounding (docs/engine.md).

The kernel (`w4a8_gate_up`): a CTA is one warpgroup, 64 rows of one pair's expert over 24 of the
90 groups of K (the last 18), the 4 CTAs of a row tile one cluster that adds their partial sums in
distributed shared memory: 1440 CTAs a token, as the engine's per-pair launch. The 8 columns of the
mma are 8 groups (the mma kernels' trick): in K step s of a block of 8 groups the thread of quad
position q supplies word s % 4 of group 4 (s / 4) + q of its two rows, and B's column n holds the
activations of group n only where those k sit, so each group's sum stays in its own column and is
scaled by its own weight scale and activation factor after the block's 8 steps. Output: each row's
float32 sum (no bias, no SwiGLU: those are a few instructions a row in either kernel).

    python -m pdserve.bench.moe_w4a8 [--reps 20] [--out FILE.json]

Prints the time a layer (CUDA graph of 8 layers on disjoint experts, so no call finds its weights in
the L2) of the probe's gate/up (and of a control without its wgmmas: loads, decode, staging and the
cluster sum only) against `mx_gate_up`'s, and of the probe on gate/up's and then down's
rows (one bf16 row a pair standing in for the SwiGLU outputs; no epilogues) against the engine's whole
one-token MoE, each against the copy floor of its bytes; and the probe's error against an exact
emulation of its arithmetic (`reference`, float64) and against the unquantised activations, on both
row shapes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pdserve.bench.kernels import copy_bandwidth, graphed, time_it
from pdserve.kernels.mxfp4 import (PACKED_HIGH_SHL_MASK, PACKED_HIGH_SHR_MASK, PACKED_LOW_MASK, dequantize_mxfp4,
                                   random_experts)
from pdserve.kernels.nvrtc import HEADERS

KG = 90  # 32-groups along K (gpt-oss: 2880)
GROUPS_PER_CTA = 24  # a CTA's share of K: 3 blocks of 8 groups (the last CTA of a cluster 18)
K_SPLIT = 4  # CTAs of a cluster, one row tile
ROWS = 64  # rows a CTA (a warpgroup: 16 a warp)
TOP_K, EXPERTS = 4, 32

SOURCE = r"""
#include "cuda_common.cuh"
#include "cuda_moe_w4a8.cuh"

// out[pair, row] = sum over K of W[expert, row] x[token] for the pairs' experts (pair_expert, int64),
// token = pair / top_k; words: packed blocks [E, rows_total, KG, 16 bytes]; scales [E, rows_total, 96].
// Grid (rows_total / ROWS * KS, pairs), clusters of (KS, 1, 1).
extern "C" __global__ void __launch_bounds__(128) w4a8_gate_up(
    const U4* __restrict__ words, const unsigned char* __restrict__ scales, const long long* __restrict__ pair_expert,
    const u16* __restrict__ x, int stride_x, int top_k, int rows_total, float* __restrict__ out) {
  __shared__ W4Smem sm;
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2;
  const int ks = blockIdx.x % KS, tile = blockIdx.x / KS, pair = blockIdx.y;
  const int g0 = ks * GPC, ng = min(GPC, KG - g0);
  const int expert = (int)pair_expert[pair];
  W4Regs r;  // requested before the row is staged: in flight meanwhile
  w4a8_load(r, words, scales, (i64)expert * rows_total + tile * ROWS + warp * 16 + g, g0, ng);
  w4a8_stage_b(sm, x + (i64)(pair / top_k) * stride_x, g0, ng);
  w4a8_row_sums(sm, r);
  if (tid < ROWS / KS) {  // CTA ks adds rows 16 ks .. + 15 of the cluster's K shares, in order
    const int row = ks * (ROWS / KS) + tid;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) s += load_peer(&sm.red[row], k);
    out[(i64)pair * rows_total + tile * ROWS + row] = s;
  }
  cluster_sync_relaxed();  // the peers' shared memory stays until every read of it is done
}
"""


def compile_options(pipe: bool = True, mma: bool = True) -> list[str]:
    """pipe: a block's wgmmas overlap the rescale of the block before (W4_PIPE); mma False: the control
    without the wgmmas (W4_MMA)."""
    return ["-std=c++17", f"-DW4_PIPE={int(pipe)}", f"-DW4_MMA={int(mma)}", f"-DMX_LOW_MASK={PACKED_LOW_MASK:#010x}u", f"-DMX_HIGH_SHL_MASK={PACKED_HIGH_SHL_MASK:#010x}u",
            f"-DMX_HIGH_SHR_MASK={PACKED_HIGH_SHR_MASK:#010x}u"]


def _kernel(device_index: int, pipe: bool = True, mma: bool = True):
    """NVRTC for sm_90a (wgmma is an sm_90a instruction: kernels.nvrtc compiles for sm_90)."""
    from torch.cuda._utils import _cuda_load_module, _nvrtc_compile

    with torch.cuda.device(device_index):
        cubin, _ = _nvrtc_compile(SOURCE, "w4a8_gate_up", compute_capability="90a",
                                  nvcc_options=[f"-I{HEADERS}", *compile_options(pipe, mma)])
        return _cuda_load_module(cubin, ["w4a8_gate_up"])["w4a8_gate_up"]


def rows_w4a8(kernel, blocks: torch.Tensor, scales: torch.Tensor, pair_expert: torch.Tensor, x: torch.Tensor,
              top_k: int, out: torch.Tensor) -> None:
    """Launch the probe: the pairs' experts' rows (packed blocks [E, R, 90, 16], padded scales [E, R,
    96]) times row pair // top_k of x (bf16 [T, 2880]) -> out float32 [P, R]. Gate/up: the experts'
    gate/up blocks and the tokens; down-shaped: the down blocks and one row a pair (top_k 1)."""
    from pdserve.kernels.pdl import launch_cuda

    rows = blocks.shape[1]
    launch_cuda(kernel, (rows // ROWS * K_SPLIT, pair_expert.numel(), 1), (128, 1, 1), 0, pdl=False,
                cluster=(K_SPLIT, 1, 1), args=[blocks, scales, pair_expert, x, x.stride(0), top_k, rows, out])


def gate_up_w4a8(kernel, w, pair_expert: torch.Tensor, x: torch.Tensor, top_k: int, out: torch.Tensor) -> None:
    """The probe on packed experts' gate/up rows: out float32 [P, 2I]."""
    rows_w4a8(kernel, w.gate_up_blocks, w.gate_up_scales, pair_expert, x, top_k, out)


def quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] bf16 -> float32 [T, H]: each group of 32 as the probe quantises it (e4m3 of x times
    2^(134 - e), e the biased exponent of the group's largest |x|, at least 8), times the power back."""
    g = x.float().reshape(x.shape[0], -1, 32)
    e = ((g.abs().amax(-1).view(torch.int32) >> 23) & 0xFF).clamp(min=8)
    down = torch.ldexp(torch.ones_like(e, dtype=torch.float32), 134 - e)[..., None]
    return ((g * down).to(torch.float8_e4m3fn).float() / down).reshape(x.shape)


def reference(w, pair_expert: torch.Tensor, x: torch.Tensor, top_k: int, quantize: bool = True,
              which: str = "gate_up") -> torch.Tensor:
    """float64 [P, R]: the pairs' `which` rows (exact dequantisation) times row pair // top_k of x,
    quantised as the probe quantises it (or not)."""
    wd = dequantize_mxfp4(*w.published(which, pair_expert), dtype=torch.float64)  # [P, R, K]
    token = torch.arange(pair_expert.numel(), device=x.device) // top_k
    xs = (quantize_groups(x) if quantize else x.float()).double()[token]
    return torch.einsum("prh,ph->pr", wd, xs)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _mx_gate_up(w, pair_expert: torch.Tensor, x: torch.Tensor, top_k: int, act: torch.Tensor):
    """The engine's per-pair gate/up launch (kernels.cuda_moe_mxfp4, PAIR_CONFIG), alone."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels.pdl import launch_cuda

    cfg, (_, n2, hg, _) = cm.PAIR_CONFIG, w.gate_up_blocks.shape
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = cm._kernels(dev, hg, 1, cfg.gate_up, False, cm.EARLY_DOWN, False, cm.EARLY_BIAS, cm.CLUSTER_SUM)["mx_gate_up"]
    launch_cuda(kernel, (n2 // cfg.rows("gate_up"), pair_expert.numel(), 1), (32 * cfg.gate_up[0], 1, 1),
                cm._shared_bytes(hg, 1, cfg.gate_up), pdl=False, args=[
                    w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, x, x.stride(0), pair_expert, pair_expert,
                    pair_expert, 0, top_k, n2, act, 7.0, 1.702, cm.act_shift(7.0)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = random_experts(EXPERTS, gen, dev)
    wg = w.to_packed()
    xg = (torch.randn(1, KG * 32, generator=gen, device=dev) * 2).to(torch.bfloat16)
    sets_g = [torch.arange(TOP_K * r, TOP_K * (r + 1), dtype=torch.int64, device=dev) for r in range(EXPERTS // TOP_K)]
    n2 = wg.gate_up_blocks.shape[1]
    kernels = {pipe: _kernel(dev.index or 0, pipe) for pipe in (True, False)}
    name = {True: "pipelined", False: "a block at a time"}
    act = (torch.randn(TOP_K, KG * 32, generator=gen, device=dev)).to(torch.bfloat16)  # down's input, a row a pair
    errors = {}
    for which, inp, top_k in (("gate_up", xg, TOP_K), ("down", act, 1)):
        ref_q = reference(w, sets_g[0], inp, top_k, which=which)
        ref_x = reference(w, sets_g[0], inp, top_k, quantize=False, which=which)
        for pipe, kernel in kernels.items():
            out = torch.full(ref_q.shape, float("nan"), device=dev)
            rows_w4a8(kernel, getattr(wg, which + "_blocks"), getattr(wg, which + "_scales"), sets_g[0], inp, top_k, out)
            torch.cuda.synchronize()
            errors[f"{which}, {name[pipe]}"] = e = (rel_l2(out, ref_q), rel_l2(out, ref_x))
            unwritten = " (NaN: rows left unwritten)" if bool(torch.isnan(out).any()) else ""
            print(f"probe, {which} rows, {name[pipe]}: rel L2 {e[0]:.2e} against its arithmetic emulated, {e[1]:.2e} "
                  f"against the unquantised activations{unwritten}", flush=True)

    from pdserve.kernels.cuda_moe_mxfp4 import experts_forward_mxfp4_mma

    outs = [torch.empty(TOP_K, n2, device=dev) for _ in sets_g]
    outs_dn = [torch.empty(TOP_K, KG * 32, device=dev) for _ in sets_g]
    acts = [torch.empty(TOP_K, n2 // 2, dtype=torch.float16, device=dev) for _ in sets_g]
    weights = torch.full((1, TOP_K), 1.0 / TOP_K, dtype=torch.bfloat16, device=dev)

    def w4a8_moe(pipe):
        for s, o, od in zip(sets_g, outs, outs_dn):
            gate_up_w4a8(kernels[pipe], wg, s, xg, TOP_K, o)
            rows_w4a8(kernels[pipe], wg.down_blocks, wg.down_scales, s, act, 1, od)

    no_mma = _kernel(dev.index or 0, pipe=False, mma=False)
    gate_up = {
        **{f"w4a8 gate/up, {name[p]}": (lambda p=p: [gate_up_w4a8(kernels[p], wg, s, xg, TOP_K, o)
                                                     for s, o in zip(sets_g, outs)]) for p in (True, False)},
        "w4a8 gate/up without the wgmmas (wrong sums)": lambda: [gate_up_w4a8(no_mma, wg, s, xg, TOP_K, o)
                                                                 for s, o in zip(sets_g, outs)],
        "mx_gate_up (engine)": lambda: [_mx_gate_up(wg, s, xg, TOP_K, a) for s, a in zip(sets_g, acts)],
    }
    moe = {
        **{f"w4a8 gate/up + down rows, {name[p]}": (lambda p=p: w4a8_moe(p)) for p in (True, False)},
        "engine MoE (mx_gate_up + mx_down)": lambda: [experts_forward_mxfp4_mma(xg, weights, s[None], wg)
                                                     for s in sets_g],
    }
    bw = copy_bandwidth()
    bytes_gu = TOP_K * n2 * (KG * 16 + KG)
    bytes_moe = bytes_gu + TOP_K * KG * 32 * (KG * 16 + KG)
    result = {}
    for runs, nbytes in ((gate_up, bytes_gu), (moe, bytes_moe)):
        for label, fn in runs.items():
            us = time_it(graphed(fn), reps=args.reps, flush=False) * 1e6 / len(sets_g)
            result[label] = us
            print(f"{label:46s} {us:7.2f} us a layer ({nbytes / us / 1e6:.2f} TB/s; floor {nbytes / bw * 1e6:.2f} us)",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_bandwidth=bw, bytes_gate_up=bytes_gu, bytes_moe=bytes_moe, us=result, rel_l2=errors),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
