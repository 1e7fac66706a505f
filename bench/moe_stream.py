"""How fast one token's MXFP4 MoE could stream its weights from warps that stay resident.

At one token a layer's four routed experts are 33 MB of gate/up and 17 MB of down blocks; the mma
kernels (kernels/cuda_moe_mxfp4.cu) take ~28 us for them in the decode step (12.4 at the copy
bandwidth): a gate/up launch of 1440 CTAs in 2.2 waves, then a down launch of 720 whose CTAs find
room only as gate/up's retire (docs/kernels.md, items 14-35). This bench measures the read side of
the design those items point at, before it is built: one launch of CTAs that all stay resident
(SMs x CTAs a SM, within the occupancy the driver reports), every warp owning whole 16-row tiles
over all of K (no K split, so no reduction across warps), taking the items w, w + W, ... (W warps)
of one list, gate/up tiles first, then down tiles, and streaming them through a ring of P K steps in
registers that runs on across its items, so that a warp's next tile is in flight while it finishes
one. A K step is the mma kernels' pattern (4 16-byte groups of rows g and g + 8 a thread). Options:

- WORK dependent integer operations a K step stand in for the decode (60: about today's kernels);
- DEP: a down tile of a pair waits (lane 0 polling a counter, bounded) until all of that pair's
  gate/up tiles are done, as the real kernel must; its first P steps are in flight meanwhile.

Against it, in the same run: the same warps in two launches, gate/up's tiles then down's ("two
launches"), and the copy floor of the 50 MB. CUDA graph of 8 layers on disjoint experts (no call finds
its bytes in the L2), median of 20 replays, us a layer.

    python -m pdserve.bench.moe_stream [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch

from pdserve.bench.kernels import copy_bandwidth, graphed, time_it
from pdserve.kernels.nvrtc import compile_kernels, resident_ctas


KG = 90  # 32-groups along K (gpt-oss: K 2880)
ROWS_GU, ROWS_DN, TOP_K, EXPERTS = 5760, 2880, 4, 32
TILES_GU, TILES_DN = ROWS_GU // 16, ROWS_DN // 16

SOURCE = r"""
#include "cuda_common.cuh"
#define KG 90
#define CHUNKS ((KG + 3) / 4)
#define TILES_GU 360
#define TILES_DN 180
#define N_GU (4 * TILES_GU)
#define SPIN_LIMIT (1 << 22)
__device__ __forceinline__ U4 ld(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Items [first, last) of the list (gate/up tiles 0 .. N_GU - 1, then down tiles): warp w of W takes
// first + w, first + w + W, ... out[warp's thread] gets a checksum, or ~0u where a poll gave up.
extern "C" __global__ void __launch_bounds__(NW * 32) stream(const U4* __restrict__ gu, const U4* __restrict__ dn,
                                                             const long long* __restrict__ ids, int* counters,
                                                             int first, int last, u32* __restrict__ out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  // warps numbered across CTAs first: consecutive items (the gate/up tiles first) spread over every SM
  const int W = gridDim.x * NW, w = (threadIdx.x >> 5) * gridDim.x + blockIdx.x;
  auto row_g = [&](int item) -> const U4* {  // row g of the item's 16-row tile
    if (item < N_GU) return gu + (ids[item / TILES_GU] * (16LL * TILES_GU) + 16LL * (item % TILES_GU) + g) * KG;
    const int d = item - N_GU;
    return dn + (ids[d / TILES_DN] * (16LL * TILES_DN) + 16LL * (d % TILES_DN) + g) * KG;
  };
  U4 a[P], b[P];
  int li = first + w, lc = 0;  // the next step to request: item li, K step lc
  const U4* lrow = li < last ? row_g(li) : gu;
  auto request = [&](U4& ra, U4& rb) {
    ra = rb = U4{0u, 0u, 0u, 0u};
    if (li >= last) return;
    if (4 * lc + q < KG) {
      ra = ld(lrow + 4 * lc + q);
      rb = ld(lrow + 8 * KG + 4 * lc + q);
    }
    if (++lc == CHUNKS) {
      lc = 0;
      li += W;
      if (li < last) lrow = row_g(li);
    }
  };
#pragma unroll
  for (int j = 0; j < P; j++) request(a[j], b[j]);
  u32 acc = 0;
  int ui = first + w, uc = 0;
  bool done = ui >= last, gave_up = false;
  while (!done) {
#pragma unroll
    for (int j = 0; j < P; j++) {
      if (!done) {
        if (DEP && uc == 0 && ui >= N_GU) {  // the pair's gate/up tiles, all done
          int spins = 0;
          if (lane == 0)
            while (*(volatile int*)&counters[(ui - N_GU) / TILES_DN] < TILES_GU && ++spins < SPIN_LIMIT) {}
          gave_up |= __shfl_sync(0xFFFFFFFFu, spins, 0) >= SPIN_LIMIT;
          __syncwarp();
        }
        u32 v = a[j].x ^ a[j].y ^ a[j].z ^ a[j].w ^ b[j].x ^ b[j].y ^ b[j].z ^ b[j].w;
#pragma unroll
        for (int k = 0; k < WORK; k++) v = __funnelshift_l(v, v, 7) ^ (v * 0x9E3779B1u);
        acc += v;
        request(a[j], b[j]);  // step n + P of the warp's list
        if (++uc == CHUNKS) {
          uc = 0;
          if (DEP && ui < N_GU) {
            __syncwarp();
            if (lane == 0) atomicAdd(&counters[ui / TILES_GU], 1);
          }
          ui += W;
          done = ui >= last;
        }
      }
    }
  }
  out[(long long)w * 32 + lane] = gave_up ? ~0u : acc >> 1;  // (a checksum is never ~0u)
}
"""


@functools.cache
def _kernel(nw: int, p: int, work: int, dep: bool):
    options = [f"-DNW={nw}", f"-DP={p}", f"-DWORK={work}", f"-DDEP={int(dep)}", "-std=c++17"]
    return compile_kernels(SOURCE, ["stream"], options, torch.cuda.current_device())["stream"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth()
    gu = torch.randint(-2**31, 2**31 - 1, (EXPERTS * ROWS_GU * KG * 4,), dtype=torch.int32, device=dev)
    dn = torch.randint(-2**31, 2**31 - 1, (EXPERTS * ROWS_DN * KG * 4,), dtype=torch.int32, device=dev)
    id_sets = [torch.arange(r * TOP_K, (r + 1) * TOP_K, device=dev) for r in range(EXPERTS // TOP_K)]
    n_gu, n_all = TOP_K * TILES_GU, TOP_K * (TILES_GU + TILES_DN)
    nbytes = TOP_K * (ROWS_GU + ROWS_DN) * KG * 16
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; one token's experts {nbytes / 1e6:.1f} MB: floor "
          f"{nbytes / bw * 1e6:.2f} us", flush=True)
    shapes = list(itertools.product((4, 8), (1, 2, 3, 4), (4, 8, 12), (0, 60)))
    if a.quick:
        shapes = [s for s in shapes if s[1] in (2, 4) and s[2] in (8, 12)]
    rows = []
    for nw, per_sm, p, work in shapes:
        counters = torch.zeros(TOP_K * len(id_sets), dtype=torch.int32, device=dev)
        result = {}
        for mode in ("two launches", "one launch", "one launch, down waits"):
            dep = mode == "one launch, down waits"
            k = _kernel(nw, p, work, dep)
            ctas = sms * per_sm
            # every CTA resident, or a waiting down tile could wait forever
            if ctas > resident_ctas(k, 32 * nw, 0, torch.cuda.current_device()):
                continue
            out = torch.empty(ctas * nw * 32, dtype=torch.int32, device=dev)
            spans = [(0, n_gu), (n_gu, n_all)] if mode == "two launches" else [(0, n_all)]

            def run(k=k, ctas=ctas, nw=nw, out=out, spans=spans):
                for s, ids in enumerate(id_sets):
                    for first, last in spans:
                        k(grid=(ctas, 1, 1), block=(32 * nw, 1, 1),
                          args=[gu, dn, ids, counters[TOP_K * s:], first, last, out])

            def layer(run=run):
                counters.zero_()
                run()

            replay = graphed(layer)
            result[mode] = time_it(replay, reps=20, flush=False) * 1e6 / len(id_sets)
            if dep:
                replay()
                torch.cuda.synchronize()
                if (out == -1).any():
                    raise SystemExit(f"a down tile gave up waiting ({nw} warps, {per_sm} a SM, {p} in flight)")
        if not result:
            continue
        r = dict(warps=nw, ctas_per_sm=per_sm, in_flight=p, work=work, floor_us=nbytes / bw * 1e6, **result)
        rows.append(r)
        print(f"warps {nw} x {per_sm} a SM, {p:2d} steps in flight, work {work:2d}: "
              + "  ".join(f"{m} {us:6.2f} us ({nbytes / us / 1e6:4.2f} TB/s)" for m, us in result.items()),
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(copy_bandwidth=bw, bytes=nbytes, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
