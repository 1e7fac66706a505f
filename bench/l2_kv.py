"""Can a full layer's keys wait in L2 while the layer before's MoE runs? A probe of the premise of
prefetching one request's KV pages during one token's MoE (docs/kernels.md, "MXFP4 decode MoE").

At one token of 8k keys a 120b full-attention layer's attention adds 12-16 us to the step for the
16.8 MB of its cache (3.9 us at the copy bandwidth), most of it after its PDL wait, while the MoE
before it (~28 us) reads its 50 MB at under half the copy bandwidth. If the request's pages could
stream into L2 in the MoE's idle DRAM cycles and stay there, the attention would read them from L2.
Measured here with the engine's attention object (the cluster kernel of the "triton" decode mode,
CUDA graph, one request, 64 q / 8 KV heads, d 64, 16-key pages scattered over the pool):

A. the attention with its pages in DRAM (L2 flushed), in L2 (read by the same kernel just before),
   and after a prefetch of its pages alone;
B. one token's MoE with the prefetch of the pages beside it on another stream: what the prefetch
   costs the MoE, and what the attention after both takes.

    python -m pdserve.bench.l2_kv [--contexts 8192,16384] [--reps 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from pdserve.bench.kernels import _ours, _paged, graphed, time_after, time_beside
from pdserve.kernels.moe import experts_forward
from pdserve.kernels.mxfp4 import random_experts
from pdserve.kernels.nvrtc import compile_kernels
from pdserve.kernels.pdl import launch_cuda

PROBE = r"""
typedef unsigned long long u64;
// one request's KV pages (page_bytes each, numbered by `pages`) into L2, `chunk` bytes a bulk
// prefetch, marked evict_last when `keep`
extern "C" __global__ void prefetch_pages(const char* kv, const int* pages, int n_pages, int page_bytes,
                                          int chunk, int keep) {
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  const int per_page = page_bytes / chunk;
  const int n = n_pages * per_page;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const char* a = kv + (long long)pages[i / per_page] * page_bytes + (long long)(i % per_page) * chunk;
    if (keep) asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" :: "l"(a), "r"(chunk), "l"(pol));
    else asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(chunk));
  }
}
"""

@functools.cache
def _probe(index: int) -> dict:
    return compile_kernels(PROBE, ["prefetch_pages"], ["-std=c++17"], index)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,16384")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    k = _probe(torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    w = random_experts(32, g, dev).to_packed()
    xs = torch.randn(1, 2880, device=dev, generator=g).to(torch.bfloat16)
    wts = torch.softmax(torch.randn(1, 4, device=dev, generator=g), -1).to(torch.bfloat16)
    id_sets = [torch.arange(r * 4, r * 4 + 4, device=dev)[None] for r in range(8)]
    side = torch.cuda.Stream()
    rounds = {"moe": 0}

    def moe() -> None:
        experts_forward(xs, wts, id_sets[rounds["moe"] % len(id_sets)], w)
        rounds["moe"] += 1

    results = {}
    for ctx in (int(c) for c in a.contexts.split(",")):
        batch, kv, q = _paged([ctx], [1], torch.Generator().manual_seed(ctx))
        sinks = torch.randn(q.shape[1], device=dev)
        pages = batch.kv_indices[: int(batch.kv_indptr[-1])].to(device=dev, dtype=torch.int32)
        page_bytes = kv[0].numel() * kv.element_size()
        attn = _ours(-1, decode_backend="triton", cuda_graph_batch_size=1, max_pages_per_request=pages.numel())
        attn.plan(batch)
        out = torch.empty_like(q)
        attention = graphed(lambda: attn.run(q, kv, sinks, out=out))

        def prefetch(keep: int = 1, grid: int = 132, threads: int = 128, chunk: int = 4096) -> None:
            launch_cuda(k["prefetch_pages"], (grid, 1, 1), (threads, 1, 1), 0, pdl=False,
                        args=[kv, pages, pages.numel(), page_bytes, chunk, keep])

        moe(), prefetch(), prefetch(0)
        torch.cuda.synchronize()

        def timed(before, what) -> float:
            return time_after(before, what, a.reps)

        def beside(grid: int | None, threads: int = 128) -> tuple[float, float]:
            """(MoE us, attention-after us): the MoE with the prefetch beside it (None: without)."""
            return time_beside(moe, None if grid is None else lambda: prefetch(1, grid, threads), attention,
                               a.reps, side)

        nothing = lambda: None  # noqa: E731
        r = {"kv_mb": pages.numel() * page_bytes / 1e6}
        r["attention, keys in DRAM"] = timed(nothing, attention)
        r["attention, keys in L2 (read just before)"] = timed(attention, attention)
        r["prefetch alone (132x128, 4 KB, evict_last)"] = timed(nothing, prefetch)
        r["attention after prefetch (evict_last)"] = timed(prefetch, attention)
        r["attention after prefetch (plain)"] = timed(lambda: prefetch(0), attention)
        for name, v in r.items():
            print(f"A  ctx {ctx:6d}  {name:48s} {v:8.2f}", flush=True)
        for pname, grid, threads in (("no prefetch", None, 0), ("prefetch 132x128", 132, 128),
                                     ("prefetch 16x128", 16, 128), ("prefetch 4x32", 4, 32)):
            m, at = beside(grid, threads)
            r[f"moe, {pname}"] = dict(moe_us=m, attention_us=at, sum_us=m + at)
            print(f"B  ctx {ctx:6d}  {pname:18s} moe {m:7.2f}  attention after {at:6.2f}  sum {m + at:7.2f} us",
                  flush=True)
        results[ctx] = r
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
