"""How fast an SM issues each instruction the MXFP4 decode is made of, alone and mixed.

One token's MXFP4 gate/up (kernels/cuda_moe_mxfp4.cu) spends its sums, per K step of a warp, on 32
`F2FP.F16.E4M3.UNPACK_B` conversions, 40-60 integer instructions (LOP3, SHF, IMAD), 8 HMMAs and
about 20 float ones (docs/kernels.md, item 29). Whether those sums are bound by the instruction issue
(one a cycle per scheduler) or by one pipe (Hopper's conversions are reported to run at a fraction of
the integer rate) decides which decode pays: fewer integer instructions around it, the conversion
replaced by integer bit moves for part of the words, or no decode at all (W4A8 through wgmma). This
measures it: every thread runs 8 independent chains of one
instruction (or of a mix), all CTAs resident, and each CTA times its loop by `clock64`.

    python -m pdserve.bench.pipe_rates [--out FILE.json]

Reported: cycles a scheduler spends on one step of one warp's chain (for a single instruction the
inverse of its issue rate: 1 is the issue limit of one warp instruction a cycle, 2 a pipe of 16
lanes, 4 one of 8), for each op and mix, at 2, 4 and 8 warps a scheduler (all CTAs resident).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

# OP: 0 F2FP (cvt.rn.f16x2.e4m3x2), 1 LOP3, 2 SHF (funnel shift), 3 IMAD, 4 FFMA, 5 HMMA m16n8k16 f16,
# 6 the decode of a packed word (kernels/cuda_moe_mxfp4.cu: 5 integer instructions and 4 conversions),
# 7 F2FP and LOP3 alternating, 8 the decode plus one HMMA a word (the K loop's mix without its loads)
SOURCE = r"""
#include "cuda_common.cuh"

// the low half of w (e4m3x2) as f16x2: one F2FP
__device__ __forceinline__ u32 cvt_lo(u32 w) {
  u32 r;
  asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)w));
  return r;
}

template <int LUT = 0xf8>  // (a & b) | c
__device__ __forceinline__ u32 lop3(u32 a, u32 b, u32 c) {
  u32 r;
  asm volatile("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
}

__device__ __forceinline__ u32 shf(u32 a, u32 b) {
  u32 r;
  asm volatile("shf.l.wrap.b32 %0, %1, %2, 3;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ u32 imad(u32 a, u32 b) {
  u32 r;
  asm volatile("mad.lo.u32 %0, %1, %2, 0x9c9c9c9c;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ float ffma(float a, float b) {
  float r;
  asm volatile("fma.rn.f32 %0, %1, %2, %1;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// the packed word's decode (kernels/cuda_moe_mxfp4.cu decode_word): 5 integer instructions, 4 conversions
__device__ __forceinline__ void decode(u32 w, u32 p[4]) {
  const u32 low = lop3(w, 0x9c9c9c9cu, 0u);
  const u32 high = lop3(w << 2, 0x8c8c8c8cu, (w >> 2) & 0x10101010u);
  e4m3x4_f16x2(low, p[0], p[1]);
  e4m3x4_f16x2(high, p[2], p[3]);
}

// out[cta]: cycles of the CTA's loop (thread 0), and a value that keeps the chains alive
extern "C" __global__ void pipe(const u32* __restrict__ seed, long long* __restrict__ cycles, u32* __restrict__ sink,
                                int iters) {
  u32 v[8];
  float f[8], acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; i++) {
    v[i] = seed[(threadIdx.x * 8 + i) & 255];
    f[i] = __int_as_float(0x3f800000u | (v[i] & 0x7fffu));
#pragma unroll
    for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
  }
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; it++) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
#if OP == 0
      v[i] = cvt_lo(v[i]);
#elif OP == 1
      v[i] = lop3(v[i], v[(i + 1) & 7], 0x10101010u);
#elif OP == 2
      v[i] = shf(v[i], v[(i + 1) & 7]);
#elif OP == 3
      v[i] = imad(v[i], v[(i + 1) & 7]);
#elif OP == 4
      f[i] = ffma(f[i], f[(i + 1) & 7]);
#elif OP == 5
      mma<true>(acc[i], v[0], v[1], v[2], v[3], v[4], v[5]);  // 8 accumulator chains, the same operands
#elif OP == 6
      u32 p[4];
      decode(v[i], p);
      v[i] = lop3<0x96>(p[0] ^ p[1], p[2], p[3]);  // two more LOP3s: the xor of the four pairs
#elif OP == 7
      v[i] = (i & 1) ? lop3(v[i], v[(i + 1) & 7], 0x10101010u) : cvt_lo(v[i]);
#elif OP == 8
      u32 p[4];
      decode(v[i], p);
      mma<true>(acc[i], p[0], p[1], p[2], p[3], v[(i + 1) & 7], v[(i + 2) & 7]);
      v[i] = p[0] + 1u;  // one more integer instruction
#endif
    }
  }
  const long long t1 = clock64();
  u32 x = 0u;
#pragma unroll
  for (int i = 0; i < 8; i++) x ^= v[i] ^ __float_as_uint(f[i]) ^ __float_as_uint(acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3]);
  sink[blockIdx.x * blockDim.x + threadIdx.x] = x;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""

OPS = {0: "F2FP e4m3x2 -> f16x2", 1: "LOP3", 2: "SHF", 3: "IMAD", 4: "FFMA", 5: "HMMA m16n8k16 f16",
       6: "a word's decode (5 int + 4 F2FP) + 2 LOP3", 7: "F2FP, LOP3 alternating", 8: "a word's decode + HMMA + IADD"}
THREADS = 128
WARPS = (2, 4, 8)  # a scheduler's


@functools.cache
def _kernel(op: int):
    from pdserve.kernels.nvrtc import compile_kernels

    return compile_kernels(SOURCE, ["pipe"], [f"-DOP={op}", "-std=c++17"], torch.cuda.current_device())["pipe"]


def cycles_per_step(op: int, warps_per_scheduler: int, iters: int = 4096) -> float | None:
    """Cycles a scheduler spends on one chain step of one warp (the median CTA's loop cycles over the
    steps its scheduler's warps ran), all CTAs resident; None where they would not all be."""
    from pdserve.kernels.nvrtc import resident_ctas
    from pdserve.kernels.pdl import launch_cuda

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = sms * warps_per_scheduler  # 4 warps a CTA, 4 schedulers an SM
    k = _kernel(op)
    if resident_ctas(k, THREADS, 0, torch.cuda.current_device()) < ctas:
        return None
    seed = torch.randint(0, 2**31 - 1, (256,), device="cuda", dtype=torch.int32)
    cycles = torch.zeros(ctas, dtype=torch.int64, device="cuda")
    sink = torch.zeros(ctas * THREADS, dtype=torch.int32, device="cuda")
    for _ in range(2):  # the first launch warms the clocks
        launch_cuda(k, (ctas, 1, 1), (THREADS, 1, 1), 0, pdl=False, args=[seed, cycles, sink, iters])
    torch.cuda.synchronize()
    return cycles.float().median().item() / (iters * 8 * warps_per_scheduler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print("| op (cycles a scheduler a chain step) | " + " | ".join(f"{w} warps a scheduler" for w in WARPS) + " |")
    print("|---|" + "---|" * len(WARPS))
    for op, name in OPS.items():
        cycles = [cycles_per_step(op, w) for w in WARPS]
        rows.append({"op": name, "cycles": cycles})
        print(f"| {name} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cycles) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
