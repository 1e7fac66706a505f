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
#include "mxfp4_packed.cuh"
#define KG 90
#define GPC 24
#define BLOCKS 3
#define KS 4
#define ROWS 64
#define SCALE_BYTES 96  // a packed row's scale bytes (kernels/mxfp4.py PACKED_SCALE_PAD)
#ifndef W4_PIPE
#define W4_PIPE 1  // 1: a block's wgmmas run while the block before is rescaled; 0: one block at a time
#endif
#ifndef W4_MMA
#define W4_MMA 1  // 0: a control without the wgmmas (the decoded words folded into d instead: wrong sums)
#endif
static_assert(KS * GPC >= KG && GPC == 8 * BLOCKS, "a cluster covers K in blocks of 8 groups");
static_assert(KG - (KS - 1) * GPC > 8 * (BLOCKS - 1), "every CTA has groups in each of its blocks: no block is skipped");

__device__ __forceinline__ u32 word_of(const U4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }


// four floats as e4m3 bytes (a in byte 0), rounded to nearest even, saturated
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
  u32 r;
  asm("{\n\t.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\tcvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// Shared-memory matrix descriptor of a B tile (K-major, no swizzle): 8 rows (columns n) of 16 bytes
// (k) a core matrix, the two core matrices of k 0-15 and 16-31 128 bytes apart. With N = 8 there is one
// core matrix along N, so both byte offsets are 128: whichever of them the hardware takes for K.
__device__ __forceinline__ u64 b_desc(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(128 >> 4) << 32);
}

// the compiler may not move an operand's definition or use across this point (so the decoded A
// registers are all written before the first wgmma reads them, and ptxas needs no fence between them)
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// d (= or +=) A B: wgmma m64n8k32, e4m3 x e4m3 -> float32, A (64 rows x 32 k) from the warpgroup's
// registers (a0 / a2 row g, a1 / a3 row g + 8 of the warp's 16, k 4q..4q+3 and 16+4q..16+4q+3), B from
// shared memory; accumulate: 0 starts the sums afresh
__device__ __forceinline__ void wgmma_e4m3(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %9, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate));
}


// out[pair, row] = sum over K of W[expert, row] x[token] for the pairs' experts (pair_expert, int64),
// token = pair / top_k; words: packed blocks [E, rows_total, KG, 16 bytes]; scales [E, rows_total, 96].
// Grid (rows_total / ROWS * KS, pairs), clusters of (KS, 1, 1).
extern "C" __global__ void __launch_bounds__(128) w4a8_gate_up(
    const U4* __restrict__ words, const unsigned char* __restrict__ scales, const long long* __restrict__ pair_expert,
    const u16* __restrict__ x, int stride_x, int top_k, int rows_total, float* __restrict__ out) {
  __shared__ __align__(128) unsigned char bsm[BLOCKS * 8 * 256];  // a block: 8 K steps of 32 k x 8 columns
  __shared__ float fxs[GPC];  // each group's activation factor (0 past the CTA's groups)
  __shared__ float red[ROWS];  // the CTA's row sums, read by the cluster
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int ks = blockIdx.x % KS, tile = blockIdx.x / KS, pair = blockIdx.y;
  const int g0 = ks * GPC, ng = min(GPC, KG - g0);
  const int expert = (int)pair_expert[pair];
  const i64 row0 = (i64)expert * rows_total + tile * ROWS + warp * 16 + g;  // and row0 + 8
  const U4* w0 = words + row0 * KG;
  const U4* w1 = w0 + 8 * KG;

  // the thread's weights: block b's groups g0 + 8b + 4h + q (h = 0, 1) of rows row0, row0 + 8, and
  // the scale bytes of its accumulator columns 2q, 2q + 1 (groups g0 + 8b + 2q, + 1)
  U4 wa[BLOCKS][2], wb[BLOCKS][2];
  u32 sa[BLOCKS], sb[BLOCKS];
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gi = 8 * b + 4 * h + q;
      wa[b][h] = gi < ng ? load_stream(w0 + g0 + gi) : U4{0u, 0u, 0u, 0u};
      wb[b][h] = gi < ng ? load_stream(w1 + g0 + gi) : U4{0u, 0u, 0u, 0u};
    }
    const int gs = 8 * b + 2 * q;  // even, and ng is even: both groups in or both out
    sa[b] = gs < ng ? __ldg(reinterpret_cast<const u16*>(scales + row0 * SCALE_BYTES + g0 + gs)) : 0u;
    sb[b] = gs < ng ? __ldg(reinterpret_cast<const u16*>(scales + (row0 + 8) * SCALE_BYTES + g0 + gs)) : 0u;
  }

  // the token's row as B, every 16-byte row of the CTA's blocks written once: thread (group gi, word
  // wq) quantises values 8 wq .. 8 wq + 7 of group gi to e4m3 times 2^(134 - e) (e: the biased exponent
  // of the group's largest |x|, at least 8), so that |values| <= 256. They sit in K step 4 (gl / 4) + wq
  // of block gi / 8 (gl = gi % 8), column gl, k 4 (gl % 4) .. + 3 and, 128 bytes on (the next core
  // matrix), k + 16; the other 12 bytes of those two rows are zero, and so are column gl's rows of
  // K step 4 (1 - gl / 4) + wq, which the thread writes too. Groups past the CTA's share: zeros.
  {
    const int gi = tid >> 2, wq = tid & 3;  // a group's 4 threads are adjacent lanes
    const bool in = gi < ng;
    const U4 v = in ? *reinterpret_cast<const U4*>(x + (i64)(pair / top_k) * stride_x + (g0 + gi) * 32 + 8 * wq)
                    : U4{0u, 0u, 0u, 0u};
    u32 m = max_bits(v);
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const u32 e = max(m >> 23, 8u);
    const float down = __int_as_float((261u - e) << 23);  // 2^(134 - e)
    if (gi < GPC) {
      const u32 vw[4] = {v.x, v.y, v.z, v.w};
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[2 * j] = __int_as_float(vw[j] << 16) * down;
        f[2 * j + 1] = __int_as_float(vw[j] & 0xFFFF0000u) * down;
      }
      const u32 lo = e4m3x4(f[0], f[1], f[2], f[3]), hi = e4m3x4(f[4], f[5], f[6], f[7]);  // zeros past ng
      const int blk = gi >> 3, gl = gi & 7, c = gl & 3;
      U4 rlo = U4{0u, 0u, 0u, 0u}, rhi = U4{0u, 0u, 0u, 0u};
      (c == 0 ? rlo.x : c == 1 ? rlo.y : c == 2 ? rlo.z : rlo.w) = lo;
      (c == 0 ? rhi.x : c == 1 ? rhi.y : c == 2 ? rhi.z : rhi.w) = hi;
      unsigned char* row = bsm + blk * 2048 + gl * 16;
      const int s = 4 * (gl >> 2) + wq, z = 4 * (1 - (gl >> 2)) + wq;
      *reinterpret_cast<U4*>(row + s * 256) = rlo;
      *reinterpret_cast<U4*>(row + s * 256 + 128) = rhi;
      *reinterpret_cast<U4*>(row + z * 256) = U4{0u, 0u, 0u, 0u};
      *reinterpret_cast<U4*>(row + z * 256 + 128) = U4{0u, 0u, 0u, 0u};
      if (wq == 0) fxs[gi] = in ? __int_as_float((e - 7u) << 23) : 0.f;  // 2^(e - 134)
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the generic writes, before wgmma reads them
  __syncthreads();

  float t0 = 0.f, t1 = 0.f;  // rows row0, row0 + 8: this thread's columns, every block
  const u32 base = smem_addr(bsm);
  u32 a[BLOCKS][8][4];  // a block's A registers: held until its wgmmas are known complete
  float d[BLOCKS][4];
  // column c of block b: group g0 + 8b + c; its weight scale 2^(s - 127) times the e4m3 bytes' 2^6,
  // times the activations' 2^(e - 134)
  auto rescale = [&](int b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operand(d[b][i]);
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_operand(a[b][s][i]);
    const float x0 = fxs[8 * b + 2 * q], x1 = fxs[8 * b + 2 * q + 1];
    t0 += d[b][0] * (__int_as_float(((sa[b] & 0xFFu) + 6u) << 23) * x0) + d[b][1] * (__int_as_float(((sa[b] >> 8) + 6u) << 23) * x1);
    t1 += d[b][2] * (__int_as_float(((sb[b] & 0xFFu) + 6u) << 23) * x0) + d[b][3] * (__int_as_float(((sb[b] >> 8) + 6u) << 23) * x1);
  };
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      u32 l0, h0, l1, h1;
      e4m3_words(word_of(wa[b][s >> 2], s & 3), l0, h0);
      e4m3_words(word_of(wb[b][s >> 2], s & 3), l1, h1);
      a[b][s][0] = l0, a[b][s][1] = l1, a[b][s][2] = h0, a[b][s][3] = h1;
    }
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_operand(a[b][s][i]);
#pragma unroll
    for (int i = 0; i < 4; ++i) d[b][i] = 0.f, fence_operand(d[b][i]);
#if W4_MMA
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < 8; ++s)
      wgmma_e4m3(d[b], a[b][s][0], a[b][s][1], a[b][s][2], a[b][s][3], b_desc(base + b * 2048 + s * 256), s);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
    {
      u32 f = 0u;
#pragma unroll
      for (int s = 0; s < 8; ++s) f ^= a[b][s][0] ^ a[b][s][1] ^ a[b][s][2] ^ a[b][s][3];
      d[b][0] = __int_as_float(f & 0x007FFFFFu);
    }
#endif
#if !W4_MMA
    rescale(b);
#elif W4_PIPE  // block b's wgmmas run while block b - 1 is rescaled
    if (b > 0) {
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      rescale(b - 1);
    }
#else  // each block waited for before the next is decoded
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    rescale(b);
#endif
  }
#if W4_MMA && W4_PIPE
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  rescale(BLOCKS - 1);
#endif
  t0 += __shfl_xor_sync(0xFFFFFFFFu, t0, 1);
  t0 += __shfl_xor_sync(0xFFFFFFFFu, t0, 2);
  t1 += __shfl_xor_sync(0xFFFFFFFFu, t1, 1);
  t1 += __shfl_xor_sync(0xFFFFFFFFu, t1, 2);
  if (q == 0) {
    red[warp * 16 + g] = t0;
    red[warp * 16 + g + 8] = t1;
  }
  cluster_sync();  // every CTA's row sums are in its shared memory
  if (tid < ROWS / KS) {  // CTA ks adds rows 16 ks .. + 15 of the cluster's K shares, in order
    const int row = ks * (ROWS / KS) + tid;
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < KS; ++r) s += load_peer(&red[row], r);
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
                    w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias, x, x.stride(0), None, pair_expert, pair_expert,
                    pair_expert, 0, top_k, n2, act, 7.0, 1.702, cm.act_shift(7.0), None, 0])


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
