"""What a kernel boundary and a dependent read after it cost in a PDL chain, with nothing else in it.

A decode step is a chain of dependent kernels launched with programmatic dependent launch
(kernels/pdl.py): 8 a layer, each adding 1.6-18 us to a 120b layer of about 55 us (launch_ab
--timeline). This bench measures the chain's parts apart, so that a fusion is chosen from measured
costs: a chain of L kernels, each waiting for the one before (`griddepcontrol.wait`, then
`launch_dependents`), reading after its wait the value the kernel before wrote and then

- `hops` dependent reads through L2 (each address from the value the last one returned; every CTA
  its own chain of an L2-resident ring), the shape of a chain of loads after a wait;
- `stage` bytes a CTA read at once through L2 (16 bytes a thread, independent), the shape of a
  GEMV staging its token rows after its wait,

then CTA 0 writing the value the next kernel reads. Grids of 1, 132, 640 and 1440 CTAs of 128
threads (a norm, one CTA an SM, the FP8 QKV GEMV, one token's MXFP4 gate/up). Times: the chain
captured in one CUDA graph, median of replays, per kernel; with PDL and without.

    python -m pdserve.bench.pdl_chain [--kernels 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from pdserve import kernels

SOURCE = r"""
#include "cuda_common.cuh"

// prev: the value the kernel before wrote; ring [n] of next indices (n a power of two); row: bytes staged
extern "C" __global__ void __launch_bounds__(128) link(const u32* __restrict__ prev, u32* __restrict__ next,
                                                       const u32* __restrict__ ring, int n, int hops,
                                                       const unsigned char* __restrict__ row, int stage, int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  u32 v = load_early_u32(prev);
  if (threadIdx.x == 0) {  // this CTA's chain of dependent reads
    u32 i = (v + blockIdx.x * 2654435761u) & (n - 1);
    for (int h = 0; h < hops; h++) i = load_early_u32(ring + i);
    v += i;
  }
  for (int o = threadIdx.x * 16; o < stage; o += 128 * 16) {  // one round of independent 16-byte reads
    const U4 r = load_early(row + o);
    v += r.x ^ r.y ^ r.z ^ r.w;
  }
  __shared__ u32 acc;
  if (threadIdx.x == 0) acc = 0;
  __syncthreads();
  atomicAdd(&acc, v);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) *next = acc & 1u;  // 0 or 1: the next kernel's start stays small
}
"""

KERNELS = Path(kernels.__file__).parent  # cuda_common.cuh: the project kernels' L2 loads
GRIDS = (1, 132, 640, 1440)
HOPS = (0, 1, 2, 4)
STAGES = (0, 5760, 23040)  # bytes a CTA: one token row of 2880 bf16, four of them


@functools.cache
def _kernel():
    from pdserve.kernels.nvrtc import compile_kernels

    return compile_kernels(SOURCE, ["link"], [], torch.cuda.current_device(), include=KERNELS)["link"]


def chain_us(kernels: int, ctas: int, hops: int, stage: int, pdl: bool, replays: int = 20) -> float:
    """Median us a kernel of a graph-captured chain of `kernels` links."""
    from pdserve.bench.kernels import graphed, time_it
    from pdserve.kernels.pdl import launch_cuda

    n = 1 << 20  # 4 MB of ring: resident in the L2
    ring = torch.randperm(n, device="cuda", dtype=torch.int64).to(torch.int32)
    row = torch.randint(0, 255, (max(stage, 16),), device="cuda", dtype=torch.uint8)
    vals = torch.zeros(2, dtype=torch.int32, device="cuda")
    k = _kernel()

    def run():
        for i in range(kernels):
            launch_cuda(k, (ctas, 1, 1), (128, 1, 1), 0, pdl=pdl,
                        args=[vals[i % 2:], vals[(i + 1) % 2:], ring, n, hops, row, stage, int(pdl)])

    return time_it(graphed(run), reps=replays, warmup=1, flush=False) * 1e6 / kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=64, help="links a chain")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    rows = []
    print(f"us a kernel, chains of {a.kernels}; columns: CTAs", flush=True)
    print(f"{'pdl':>4} {'hops':>4} {'stage B':>8} " + " ".join(f"{c:>7}" for c in GRIDS), flush=True)
    for pdl in (True, False):
        for hops in HOPS:
            for stage in STAGES:
                if hops and stage:
                    continue
                us = [chain_us(a.kernels, c, hops, stage, pdl) for c in GRIDS]
                rows.append({"pdl": pdl, "hops": hops, "stage": stage, "us": dict(zip(GRIDS, us))})
                print(f"{int(pdl):>4} {hops:>4} {stage:>8} " + " ".join(f"{u:7.2f}" for u in us), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
