"""Can a persistent CTA per SM stream one token's MoE weights at the copy bandwidth through the
tensor-memory accelerator (TMA), with 2-D tensor maps?

The one-token MXFP4 MoE is bound by the shape of its launches (docs/kernels.md, items 14-21): many
short CTAs that each load, compute and leave in lock-step waves, so DRAM idles while a wave
computes. The persistent ring of item 21 (one CTA a SM, producer warps filling a shared-memory ring,
consumer warps computing from it) removes the waves, but its producers asked for every 1440-byte
row of a tile by its own bulk copy (or 16-byte cp.async pieces), and its stream alone reached only
2.4 TB/s. Here a tile of R rows x the whole K of one routed expert is ONE tensor-map copy
(`cp.async.bulk.tensor.2d`, the weights seen as a [experts x rows, 180] array of 8-byte elements),
so a ring of S slots needs S requests, not 16 S. Consumer warps wait on a slot's mbarrier, read
their share of it from shared memory (16 bytes a thread a step, xor-summed, so the bytes are really
read) and release it.

Same matrices and timing as bench/read_floor.py and bench/read_pattern.py (the 4 routed experts of
a 20b layer, gate/up 5760 rows and down 2880 rows of 1440 bytes, scales left out; CUDA graph,
experts rotated so that no call finds its bytes in the L2; median of 20 replays), and the best
plain-load pattern of read_pattern.py timed in the same run for the ratio. The xor of everything
the kernel read is checked against the host's.

    python bench/read_tma.py [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import copy_bandwidth, graphed, time_it  # noqa: E402
from pdserve.kernels.pdl import launch_cuda  # noqa: E402

ROW_BYTES = 1440  # 2880 e2m1 values
ROW_ELEMS = ROW_BYTES // 8  # the tensor map's 8-byte elements: 180 <= 256, one box spans a row

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
struct __align__(64) TensorMap { u64 words[16]; };
struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(u64* b, u32 n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_expect(u64* b, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(u64* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(u64* b, u32 parity) {
  asm volatile("{\n\t.reg .pred done;\n"
               "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t@!done bra WAIT;\n}"
               ::"r"(smem(b)), "r"(parity) : "memory");
}

// Grid: CTAs that take tiles b, b + gridDim.x, ... of the 4 routed experts' rows (tile t: expert
// t / TILES, rows R (t % TILES) ..). Warp 0 lane 0 produces; warps 1..C consume.
extern "C" __global__ void __launch_bounds__((C + 1) * 32, 1)
stream(const __grid_constant__ TensorMap map, const long long* __restrict__ ids, int rows_per_expert,
       int n_tiles, u32* __restrict__ out) {
  extern __shared__ __align__(128) unsigned char ring[];
  u64* full = reinterpret_cast<u64*>(ring + S * R * 1440);
  u64* empty = full + S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles = rows_per_expert / R;
  (void)tiles;  // unused when the tiles interleave
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; s++) bar_init(full + s, 1u), bar_init(empty + s, (u32)C);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  u32 acc = 0;
  if (warp == 0) {
    if (lane == 0) {
      const u64 m = reinterpret_cast<u64>(&map);
      asm volatile("prefetch.tensormap [%0];" ::"l"(m) : "memory");
      int j = 0;
      for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, j++) {
        const int s = j % S;
        if (j >= S) bar_wait(empty + s, ((j / S) & 1) ^ 1);
        bar_expect(full + s, R * 1440u);
#if INTERLEAVE  // the tiles of the 4 experts in turn (pair t % 4, row tile t / 4), as mx_gate_up_ring took them
        const int y = (int)(ids[t % 4] * rows_per_expert + (long long)(t / 4) * R);
#else  // each expert's row tiles in order: at any time the CTAs read one expert's contiguous rows
        const int y = (int)(ids[t / tiles] * rows_per_expert + (long long)(t % tiles) * R);
#endif
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
            ::"r"(smem(ring + s * R * 1440)), "l"(m), "r"(0), "r"(y), "r"(smem(full + s)) : "memory");
      }
    }
  } else {
    const int c = warp - 1;
    int j = 0;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x, j++) {
      const int s = j % S;
      bar_wait(full + s, (j / S) & 1);
      const U4* slot = reinterpret_cast<const U4*>(ring + s * R * 1440);
#if TOUCH
      if (lane == 0) acc ^= slot[c].x;  // one word: the stream alone
#else
      for (int i = c * 32 + lane; i < R * 90; i += C * 32) { const U4 v = slot[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
#endif
      __syncwarp();
      if (lane == 0) bar_arrive(empty + s);
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""


@functools.cache
def _kernel(rows: int, slots: int, consumers: int, touch: bool, interleave: bool = False):
    from pdserve.kernels.nvrtc import compile_kernels

    options = [f"-DR={rows}", f"-DS={slots}", f"-DC={consumers}", f"-DTOUCH={int(touch)}",
               f"-DINTERLEAVE={int(interleave)}", "-std=c++17"]
    smem = slots * rows * ROW_BYTES + 2 * slots * 8
    return compile_kernels(SOURCE, ["stream"], options, torch.cuda.current_device(), smem)["stream"], smem


def tensor_map(words: torch.Tensor, n_rows_total: int, box_rows: int) -> ctypes.Array:
    """A 2-D tensor map of `words` as [n_rows_total, 180] 8-byte elements, boxes of box_rows full rows."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    lib = _get_gpu_runtime_library()
    tmap = (ctypes.c_ubyte * 128)()
    dims = (ctypes.c_uint64 * 2)(ROW_ELEMS, n_rows_total)
    strides = (ctypes.c_uint64 * 1)(ROW_BYTES)
    box = (ctypes.c_uint32 * 2)(ROW_ELEMS, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # UINT64 = 4; interleave none, swizzle none, L2 promotion 256 B (3), no OOB fill
    _check_cuda(lib.cuTensorMapEncodeTiled(tmap, 4, 2, ctypes.c_void_p(words.data_ptr()), dims, strides, box, elem,
                                           0, 0, 3, 0))
    return tmap


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None, help="rows x slots x consumer warps, comma-separated (e.g. 16x6x24)")
    ap.add_argument("--interleave", action="store_true", help="also the 4 experts' tiles in turn (mx_gate_up_ring's order)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    experts, top_k, h = 32, 4, 2880
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    shapes = [(16, 8, 4), (16, 8, 8), (16, 12, 8), (32, 4, 4), (32, 4, 8), (32, 6, 8), (64, 2, 8), (64, 3, 8),
              (48, 4, 8), (24, 8, 8)]
    if a.quick:
        shapes = [(16, 8, 8), (32, 4, 8), (64, 3, 8)]
    if a.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.shapes.split(",")]
    rows_out = []
    for name, n_rows in (("gate/up", 2 * h), ("down", h)):
        # + 256 words of slack: read_pattern's tile layout reads a little past its last tile
        padded = torch.randint(-2**31, 2**31 - 1, (experts * n_rows * ROW_BYTES // 4 + 256,), dtype=torch.int32,
                               device=dev)
        words = padded[:-256]
        nbytes = top_k * n_rows * ROW_BYTES
        id_sets = [torch.arange(r * top_k, (r + 1) * top_k, device=dev) for r in range(experts // top_k)]
        host = words.view(experts, -1).cpu().numpy()
        want = np.bitwise_xor.reduce(host[id_sets[0].cpu().numpy()].ravel())
        orders = (False, True) if a.interleave else (False,)
        for (rows, slots, consumers), touch, per_sm, inter in itertools.product(shapes, (False, True), (1, 2), orders):
            smem_total = slots * rows * ROW_BYTES
            if smem_total * per_sm > 220_000 or n_rows % rows or (consumers + 1) * 32 * per_sm > 2048:
                continue
            kernel, smem = _kernel(rows, slots, consumers, touch, inter)
            tmap = tensor_map(words, experts * n_rows, rows)
            grid, threads, n_tiles = sms * per_sm, (consumers + 1) * 32, top_k * n_rows // rows
            out = torch.zeros(grid * threads, dtype=torch.int32, device=dev)
            def launch(ids, kernel=kernel, smem=smem, grid=grid, threads=threads, tmap=tmap, n_tiles=n_tiles, out=out):
                launch_cuda(kernel, (grid, 1, 1), (threads, 1, 1), smem, [tmap, ids, n_rows, n_tiles, out], pdl=False)

            if not touch:
                launch(id_sets[0])
                got = np.bitwise_xor.reduce(out.cpu().numpy())
                if got != want:
                    print(f"{name} R{rows} S{slots} C{consumers}: WRONG xor {got:#x} != {want:#x}", flush=True)
                    continue
            replay = graphed(lambda: [launch(ids) for ids in id_sets])
            us = time_it(replay, reps=20, flush=False) * 1e6 / len(id_sets)
            r = dict(matrix=name, rows=rows, slots=slots, consumers=consumers, ctas_per_sm=per_sm,
                     order="experts in turn" if inter else "expert-major",
                     reads="one word a tile" if touch else "whole tile", us=us, tb_s=nbytes / us / 1e6,
                     copy_floor_us=nbytes / bw * 1e6)
            rows_out.append(r)
            print(f"{name:8s} R{rows:3d} S{slots:2d} C{consumers} x{per_sm} {r['order']:15s} {r['reads']:16s}: {us:6.2f} us "
                  f"{r['tb_s']:5.2f} TB/s (floor {r['copy_floor_us']:5.2f})", flush=True)
        # the plain-load peers of the same run
        from pdserve.bench.read_pattern import _kernel as rp_kernel

        for nw, ksplit, p in ((4, 4, 2), (4, 2, 4), (4, 1, 6)):
            k = rp_kernel(nw, ksplit, p, 0, False)
            grid = (n_rows // 16 // (nw // ksplit), top_k, 1)
            out = torch.empty(grid[0] * top_k * nw * 32, dtype=torch.int32, device=dev)
            replay = graphed(lambda: [k(grid=grid, block=(32 * nw, 1, 1), args=[padded, ids, n_rows, out])
                                      for ids in id_sets])
            us = time_it(replay, reps=20, flush=False) * 1e6 / len(id_sets)
            rows_out.append(dict(matrix=name, plain_loads=f"{nw} warps, K split {ksplit}, {p} in flight", us=us,
                                 tb_s=nbytes / us / 1e6, copy_floor_us=nbytes / bw * 1e6))
            print(f"{name:8s} plain loads ({nw} warps, K split {ksplit}, {p} in flight): {us:6.2f} us "
                  f"{nbytes / us / 1e6:5.2f} TB/s", flush=True)
        del words, padded
    if a.out:
        Path(a.out).write_text(json.dumps(dict(copy_bandwidth=bw, rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
