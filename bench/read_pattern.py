"""How fast the MXFP4 MoE kernels' access pattern can read, with nothing else in the kernel.

The one-token MXFP4 MoE (kernels/cuda_moe_mxfp4.cu) takes ~34 us a 20b layer for ~15 us of reads.
bench/read_floor.py showed that a Triton kernel summing whole 16-row blocks reaches 3.6 TB/s; this
bench asks the same of the mma kernels' own pattern and of a tile-major alternative, so that a new
kernel shape is chosen from measured reads, not guessed:

- "rows": the row-major layout the kernels read until 2026-12-07: a warp owns 16 rows, and in each K
  step of 4 16-byte groups its thread (g, q) loads group 4c + q of rows g and g + 8 (8 rows x 64 B per
  warp load, rows 1440 B apart);
- "tile": the same bytes stored tile-major, so a warp's K step is 1 KB contiguous (two fully
  coalesced warp loads): the packed layout since then (kernels/mxfp4.py TILE_ROWS).

Each warp keeps P K steps in flight (a register ring refilled as each step is consumed) and may
add WORK dependent integer operations per K step to stand in for the decode. Grid: the 4 routed
experts' row tiles of one layer (gate/up 2 x 2880 rows, down 2880 rows, K 2880), warps per CTA NW,
K split over KSPLIT warps. Times: CUDA graph, experts rotated so no call finds its bytes in the L2,
median of 20 replays.

    python -m bench.read_pattern [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch

from pdserve.bench.kernels import copy_bandwidth, graphed, time_it

SOURCE = r"""
typedef unsigned int u32;
struct __align__(16) U4 { u32 x, y, z, w; };
#define KG 90
#define CHUNKS ((KG + 3) / 4)
#define STEPS ((CHUNKS + KSPLIT - 1) / KSPLIT)
__device__ __forceinline__ U4 ld(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// address of the thread's two 16-byte groups (rows g and g + 8, or the tile's two halves) in K step c
__device__ __forceinline__ const U4* at(const U4* base, int c, int which, int g, int q) {
#if TILE
  return base + (long long)c * 64 + which * 32 + g * 4 + q;  // a tile: CHUNKS steps of 64 U4
#else
  return base + (long long)(g + 8 * which) * KG + 4 * c + q;
#endif
}
extern "C" __global__ void __launch_bounds__(NW * 32) rd(const U4* __restrict__ words, const long long* __restrict__ ids,
                                                         int n_rows, u32* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int ks = warp % KSPLIT;
  const long long e = ids[blockIdx.y];
  const int tile = blockIdx.x * (NW / KSPLIT) + warp / KSPLIT;  // 16-row tile of the expert
  const U4* base = words + (e * n_rows + 16LL * tile) * KG;
  U4 a[P], b[P];
  #pragma unroll
  for (int j = 0; j < P; j++) {
    const int c = ks + j * KSPLIT;
    a[j] = b[j] = U4{0u, 0u, 0u, 0u};
    if (c < CHUNKS && 4 * c + q < KG) { a[j] = ld(at(base, c, 0, g, q)); b[j] = ld(at(base, c, 1, g, q)); }
  }
  u32 acc = 0;
  #pragma unroll
  for (int i = 0; i < STEPS; i++) {
    const int c = ks + i * KSPLIT;
    if (c >= CHUNKS) break;
    u32 v = a[i % P].x ^ a[i % P].y ^ a[i % P].z ^ a[i % P].w ^ b[i % P].x ^ b[i % P].y ^ b[i % P].z ^ b[i % P].w;
    #pragma unroll
    for (int k = 0; k < WORK; k++) v = __funnelshift_l(v, v, 7) ^ (v * 0x9E3779B1u);
    acc += v;
    const int cn = c + P * KSPLIT;
    if (cn < CHUNKS && 4 * cn + q < KG) { a[i % P] = ld(at(base, cn, 0, g, q)); b[i % P] = ld(at(base, cn, 1, g, q)); }
  }
  out[(blockIdx.y * gridDim.x + blockIdx.x) * NW * 32 + threadIdx.x] = acc;
}
"""


@functools.cache
def _kernel(nw: int, ksplit: int, p: int, work: int, tile: bool):
    from pdserve.kernels.nvrtc import compile_kernels

    options = [f"-DNW={nw}", f"-DKSPLIT={ksplit}", f"-DP={p}", f"-DWORK={work}", f"-DTILE={int(tile)}", "-std=c++17"]
    return compile_kernels(SOURCE, ["rd"], options, torch.cuda.current_device())["rd"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    experts, top_k, h, kg = 32, 4, 2880, 90
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    shapes = list(itertools.product((4, 8), (1, 2, 4), (2, 4, 6, 8), (0, 60)))
    if a.quick:
        shapes = [s for s in shapes if s[3] == 0 and s[2] in (2, 6)]
    rows = []
    for name, n_rows in (("gate/up", 2 * h), ("down", h)):
        # + one tile's slack: the tile layout's last K step reads a little past its tile
        words = torch.randint(-2**31, 2**31 - 1, ((experts * n_rows * kg + 64) * 4,), dtype=torch.int32, device=dev)
        nbytes = top_k * n_rows * kg * 16
        id_sets = [torch.arange(r * top_k, (r + 1) * top_k, device=dev) for r in range(experts // top_k)]
        for tile, (nw, ksplit, p, work) in itertools.product((False, True), shapes):
            tiles_per_cta = nw // ksplit
            if n_rows // 16 % tiles_per_cta:
                continue
            grid = (n_rows // 16 // tiles_per_cta, top_k, 1)
            out = torch.empty(grid[0] * top_k * nw * 32, dtype=torch.int32, device=dev)
            k = _kernel(nw, ksplit, p, work, tile)

            def run(ids, k=k, grid=grid, nw=nw, out=out):
                k(grid=grid, block=(32 * nw, 1, 1), args=[words, ids, n_rows, out])

            replay = graphed(lambda: [run(ids) for ids in id_sets])
            us = time_it(replay, reps=20, flush=False) * 1e6 / len(id_sets)
            r = dict(matrix=name, layout="tile" if tile else "rows", warps=nw, ksplit=ksplit, in_flight=p, work=work,
                     us=us, tb_s=nbytes / us / 1e6, copy_floor_us=nbytes / bw * 1e6)
            rows.append(r)
            print(f"{name:8s} {r['layout']:4s} warps {nw} ksplit {ksplit} in-flight {p} work {work:3d}: "
                  f"{us:6.2f} us {r['tb_s']:5.2f} TB/s (floor {r['copy_floor_us']:5.2f})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(copy_bandwidth=bw, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
