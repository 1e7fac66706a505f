"""What one short kernel can read: the weight bytes of one MoE layer at one token (the 4 routed
experts' gate/up blocks, 33 MB for 20b; their down blocks, 17 MB; scales left out) read by a
Triton kernel that only sums them, timed like bench/moe_mxfp4.py (CUDA graph, experts rotated so
that no call finds its bytes in the L2; median of 20 replays). The MXFP4 floors of
docs/performance.md divide bytes by the large-copy bandwidth; this says how much of that a kernel
of this size reaches when it does nothing but read.

    python bench/read_floor.py [--experts 32] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import copy_bandwidth, graphed, time_it  # noqa: E402


@triton.jit
def _read_rows(words, ids, out, rows_per_expert, row_words: tl.constexpr, ROWS: tl.constexpr,
               BLOCK: tl.constexpr):
    """Program (r, k): rows [ROWS r, +ROWS) of routed expert k, xor-summed."""
    r, k = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids + k).to(tl.int64)
    base = words + (e * rows_per_expert + r * ROWS) * row_words
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(0, ROWS * row_words, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc ^= tl.load(base + idx, mask=idx < ROWS * row_words, other=0, cache_modifier=".cg")
    tl.store(out + k * tl.num_programs(0) + r, tl.xor_sum(acc, 0))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    e, k, h = a.experts, 4, 2880
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name, n_rows in (("gate/up", 2 * h), ("down", h)):
        row_words = h // 8  # 2880 e2m1 values = 1440 bytes = 360 words a row
        words = torch.randint(-2**31, 2**31 - 1, (e * n_rows * row_words,), dtype=torch.int32, device=dev)
        nbytes = k * n_rows * row_words * 4
        id_sets = [torch.arange(r * k, (r + 1) * k, device=dev) for r in range(e // k)]
        for rows_per_prog, block, warps in ((16, 1024, 4), (32, 1024, 4), (64, 2048, 4), (64, 2048, 8),
                                            (128, 4096, 8), (8, 512, 2)):
            out = torch.empty(k * (n_rows // rows_per_prog), dtype=torch.int32, device=dev)

            def run(ids):
                _read_rows[(n_rows // rows_per_prog, k)](words, ids, out, n_rows, row_words, rows_per_prog, block,
                                                         num_warps=warps)

            replay = graphed(lambda: [run(ids) for ids in id_sets])
            us = time_it(replay, reps=20, flush=False) * 1e6 / len(id_sets)  # each call on experts not in the L2
            rows.append(dict(matrix=name, mb=nbytes / 1e6, rows_per_program=rows_per_prog, block=block,
                             warps=warps, us=us, tb_s=nbytes / us / 1e6, copy_floor_us=nbytes / bw * 1e6))
            print(f"{name:8s} {nbytes / 1e6:5.1f} MB  {rows_per_prog:3d} rows x {block} words, {warps} warps: "
                  f"{us:6.2f} us  {nbytes / us / 1e6:5.2f} TB/s  (copy floor {nbytes / bw * 1e6:5.2f} us)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(copy_bandwidth=bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
