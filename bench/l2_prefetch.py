"""Can the next layer's QKV weights wait in L2 while one token's MoE runs? A probe of the premise
of prefetching them during the MoE (docs/kernels.md, "MXFP4 decode MoE", item 24).

At batch 1 the MoE (gate/up + down, ~31 us a 20b layer) reads its 50 MB at under half the copy
bandwidth, and the next layer's QKV GEMV (29.5 MB of bf16 weights, 6.9 us at the floor) waits for
it. If the QKV weights could stream into L2 in the MoE's idle DRAM cycles and stay there, the QKV
would read them from L2. Two things decide it, measured here on a 20b-shaped layer:

A. Does a prefetched weight matrix survive a 50 MB stream through L2 (plain, or with the stream's
   lines marked evict_first), and how fast is the GEMV then? (flush; prefetch W; stream; GEMV.)
B. What does the prefetch, run beside the MoE (another stream), cost the MoE, and what does the
   GEMV after it save? (flush; MoE || prefetch; GEMV.)

    python bench/l2_prefetch.py [--reps 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import time_after, time_beside  # noqa: E402
from pdserve.kernels import cuda_moe_mxfp4  # noqa: E402
from pdserve.kernels.moe import experts_forward  # noqa: E402
from pdserve.kernels.mxfp4 import random_experts  # noqa: E402
from pdserve.kernels.nvrtc import compile_kernels  # noqa: E402
from pdserve.kernels.pdl import launch_cuda  # noqa: E402
from pdserve.kernels.triton_bf16_gemv import bf16_gemv  # noqa: E402

PROBE = r"""
typedef unsigned long long u64;
// mode 0: prefetch.global.L2 a line at a time; 1: the same with evict_last; 2: bulk prefetches of
// `chunk` bytes; 3: bulk with an evict_last policy
extern "C" __global__ void prefetch_l2(const char* p, int n_bytes, int mode, int chunk) {
  const long long n = n_bytes;
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  const long long step = (long long)gridDim.x * blockDim.x;
  if (mode < 2) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i * 128 < n; i += step) {
      const char* a = p + i * 128;
      if (mode == 1) asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(a));
      else asm volatile("prefetch.global.L2 [%0];" :: "l"(a));
    }
  } else {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i * chunk < n; i += step) {
      const char* a = p + i * chunk;
      const unsigned sz = (unsigned)min((long long)chunk, n - i * chunk);
      if (mode == 3) asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" :: "l"(a), "r"(sz), "l"(pol));
      else asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(sz));
    }
  }
}
// read n bytes (16 a thread a step), as a streaming kernel would: mode 1 marks the lines evict_first
extern "C" __global__ void stream_read(const uint4* p, int n16, int mode, unsigned* sink) {
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  unsigned acc = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
    unsigned x, y, z, w;
    if (mode == 1)
      asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                   : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(p + i), "l"(pol));
    else
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "l"(p + i));
    acc ^= x ^ y ^ z ^ w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}
"""

# The MoE kernels with their weight loads marked evict_first in L2 (a copy of the source, edited)
_EVICT_FIRST_LOAD = """__device__ __forceinline__ U4 load_stream(const U4* p) {
  U4 v;
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
"""


@functools.cache
def _probe(index: int) -> dict:
    return compile_kernels(PROBE, ["prefetch_l2", "stream_read"], ["-std=c++17"], index)


def _evict_first_source() -> Path:
    src = cuda_moe_mxfp4.SOURCE.read_text()
    start = src.index("__device__ __forceinline__ U4 load_stream")
    end = src.index("}\n", src.index("return v;", start)) + 2
    out = Path(tempfile.mkdtemp()) / cuda_moe_mxfp4.SOURCE.name
    out.write_text(src[:start] + _EVICT_FIRST_LOAD + src[end:])
    (out.parent / "cuda_common.cuh").write_text((cuda_moe_mxfp4.SOURCE.parent / "cuda_common.cuh").read_text())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    index = torch.cuda.current_device()
    k = _probe(index)
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = (torch.randn(5120, 2880, device=dev, generator=g) * 0.02).to(torch.bfloat16)  # 20b QKV, 29.5 MB
    x = torch.randn(1, 2880, device=dev, generator=g).to(torch.bfloat16)
    stream_buf = torch.empty(50 << 20, dtype=torch.uint8, device=dev)  # the MoE's bytes
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    w = random_experts(32, g, dev).to_packed()
    xs = torch.randn(1, 2880, device=dev, generator=g).to(torch.bfloat16)
    wts = torch.softmax(torch.randn(1, 4, device=dev, generator=g), -1).to(torch.bfloat16)
    id_sets = [torch.arange(r * 4, r * 4 + 4, device=dev)[None] for r in range(8)]
    side = torch.cuda.Stream()
    nbytes = qkv.numel() * 2

    def prefetch(mode: int, grid: int, threads: int = 128, chunk: int = 4096) -> None:
        launch_cuda(k["prefetch_l2"], (grid, 1, 1), (threads, 1, 1), 0, pdl=False, args=[qkv, nbytes, mode, chunk])

    def stream(mode: int) -> None:
        launch_cuda(k["stream_read"], (132 * 8, 1, 1), (256, 1, 1), 0, pdl=False,
                    args=[stream_buf, stream_buf.numel() // 16, mode, sink])

    def gemv() -> None:
        bf16_gemv(x, qkv)

    r = {"round": 0}

    def moe() -> None:
        experts_forward(xs, wts, id_sets[r["round"] % len(id_sets)], w)
        r["round"] += 1

    # warm: compile every kernel
    for f in (lambda: prefetch(0, 132), lambda: prefetch(3, 132), lambda: stream(0), lambda: stream(1), gemv, moe):
        f()
    torch.cuda.synchronize()

    def timed(before, what) -> float:
        return time_after(before, what, a.reps)

    res = {}
    nothing = lambda: None  # noqa: E731
    res["gemv cold"] = timed(nothing, gemv)
    res["gemv after a warm read of W"] = timed(gemv, gemv)
    modes = {"line": 0, "line evict_last": 1, "bulk 4K": 2, "bulk 4K evict_last": 3}
    for name, mode in modes.items():
        res[f"prefetch alone, {name}, 132x128"] = timed(nothing, lambda mode=mode: prefetch(mode, 132))
        res[f"gemv after prefetch ({name})"] = timed(lambda mode=mode: prefetch(mode, 132), gemv)
        for sm, sname in ((0, "plain"), (1, "evict_first")):
            res[f"gemv after prefetch ({name}) + 50 MB stream ({sname})"] = timed(
                lambda mode=mode, sm=sm: (prefetch(mode, 132), stream(sm)), gemv)
    res["50 MB stream alone (plain)"] = timed(nothing, lambda: stream(0))
    res["50 MB stream alone (evict_first)"] = timed(nothing, lambda: stream(1))
    for name, v in res.items():
        print(f"A  {name:60s} {v:8.2f} us", flush=True)

    # B: the MoE with a prefetch beside it, then the GEMV
    def scenario(mode: int | None, grid: int, threads: int = 128) -> tuple[float, float]:
        side_fn = None if mode is None else lambda: prefetch(mode, grid, threads)
        return time_beside(moe, side_fn, gemv, a.reps, side)

    rows = {}
    builds = {"moe loads plain": cuda_moe_mxfp4.SOURCE, "moe loads evict_first": _evict_first_source()}
    for bname, src in builds.items():
        cuda_moe_mxfp4.SOURCE = src
        cuda_moe_mxfp4._kernels.cache_clear()
        moe()
        torch.cuda.synchronize()
        for pname, mode, grid, threads in (("no prefetch", None, 0, 0), ("line evict_last 132x128", 1, 132, 128),
                                           ("line evict_last 16x128", 1, 16, 128),
                                           ("line evict_last 4x64", 1, 4, 64),
                                           ("bulk evict_last 132x128", 3, 132, 128),
                                           ("bulk evict_last 8x32", 3, 8, 32),
                                           ("line plain 132x128", 0, 132, 128)):
            m, gv = scenario(mode, grid, threads)
            rows[f"{bname}, {pname}"] = dict(moe_us=m, gemv_us=gv, sum_us=m + gv)
            print(f"B  {bname:22s} {pname:26s} moe {m:7.2f}  gemv {gv:6.2f}  sum {m + gv:7.2f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(a=res, b=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
