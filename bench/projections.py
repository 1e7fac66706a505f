"""gpt-oss' projections at decode, alone, by path: QKV [5120, 2880] and O [2880, 4096] with bias and the
vocabulary projection [201088, 2880] without, bf16 weights (cuBLAS, the Triton bf16 GEMV of
kernels/triton_bf16_gemv.py, for O the GEMV that stages its weights in shared memory,
kernels/cuda_gemv_staged.py) and FP8 weights with 128x128 block scales (the Triton FP8 linear of
kernels/triton_fp8_linear.py, the staged FP8 GEMV of kernels/cuda_gemv_fp8.py, and its streaming
entry for many rows).

    python bench/projections.py [--m 1,2,4,8] [--shapes qkv,o,vocab] [--stream-configs 6/4,8/3]

Each row: median us of one call replayed from a CUDA graph, L2 flushed before each replay (50
replays; the replay's launch is in the time), the weight stream in TB/s and the share of the floor
(the path's weight bytes at the copy bandwidth measured in the same run). Alone, nothing runs ahead
of the staged GEMVs for them to overlap: their gain is in the step (bench/launch_ab.py's "O triton
gemv" and "attention fp8" settings against the default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import copy_bandwidth, graphed, time_it  # noqa: E402
from pdserve.kernels.cuda_gemv_fp8 import fits as fp8_gemv_fits, gemv_fp8, gemv_fp8_stream, stream_fits  # noqa: E402
from pdserve.kernels.cuda_gemv_staged import gemv_staged  # noqa: E402
from pdserve.kernels.fp8 import quantize_weight_fp8  # noqa: E402
from pdserve.kernels.triton_bf16_gemv import MAX_M as GEMV_MAX_M, bf16_gemv  # noqa: E402
from pdserve.kernels.triton_fp8_linear import fp8_linear  # noqa: E402

# the vocabulary projection (unembedding) has no bias
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "vocab": (201088, 2880)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,2,4,8", help="token counts (the GEMVs take 1..8)")
    ap.add_argument("--shapes", default="qkv,o")
    ap.add_argument("--stream-configs", default="6/4",
                    help="the streaming FP8 GEMV's (ring depth / CTAs an SM) shapes to time, comma-separated")
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        b = None if shape == "vocab" else (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        wq, ws = quantize_weight_fp8(w)
        for m in (int(v) for v in a.m.split(",")):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            # the GEMVs where they take m tokens (past 8: cuBLAS and the Triton FP8 linear's tensor-core form)
            paths = [("cuBLAS bf16", 2, lambda: F.linear(x, w, b))]
            if m <= GEMV_MAX_M:
                paths.append(("triton bf16 gemv", 2, lambda: bf16_gemv(x, w, b)))
            if shape == "o" and m <= GEMV_MAX_M:
                paths.append(("staged bf16", 2, lambda: gemv_staged(x, w, b)))
            paths.append(("triton fp8 linear", 1, lambda: fp8_linear(x, wq, ws, b)))
            if fp8_gemv_fits(m, n, k):
                paths.append(("staged fp8", 1, lambda: gemv_fp8(x, wq, ws, b)))
            if stream_fits(m, n, k):
                for c in a.stream_configs.split(","):
                    depth, ctas = (int(v) for v in c.split("/"))
                    paths.append((f"stream fp8 {depth}/{ctas}", 1,
                                  lambda d=depth, c=ctas: gemv_fp8_stream(x, wq, ws, b, depth=d, ctas_per_sm=c)))
            for name, itemsize, fn in paths:
                t = time_it(graphed(fn), reps=50)
                nbytes = n * k * itemsize + (ws.numel() * 4 if itemsize == 1 else 0)
                print(f"{shape:5s} M={m} {name:20s} {t * 1e6:6.2f} us {nbytes / t / 1e12:5.2f} TB/s "
                      f"{nbytes / bw / t:4.0%} of floor", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
