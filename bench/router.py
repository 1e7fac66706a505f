"""The fused router (kernels/triton_router.py, and the thread-block clusters of kernels/cuda_router.py
that route_fused takes on Hopper) by launch shape: us per call for gpt-oss' 32
(20b) and 128 (120b) experts over hidden 2880, at decode token counts. Each timed graph calls it on
LAYERS different weight copies (as consecutive layers do; 64 x 737 KB for E = 128 passes the L2
only partly, so read it as an upper bound on the weights' cost), us = graph time / LAYERS.

    python bench/router.py [--experts 32,128] [--tokens 1,4,16,64] [--shapes 128x4,32x4,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels import cuda_router, triton_router  # noqa: E402

LAYERS = 64


def time_shape(e: int, t: int, shape: tuple[int, int] | None, cluster: bool = False) -> tuple[float, torch.Tensor]:
    """(us a call, logits) of the Triton kernel in this shape (None: its default), or of the cluster
    kernel (cluster)."""
    cuda_router.ENABLED = cluster
    if shape is None:
        triton_router.LAUNCH_SHAPES.pop(e, None)
    else:
        triton_router.LAUNCH_SHAPES[e] = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(e, 2880, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
    b = (torch.randn(e, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(t, 2880, device="cuda", generator=g).to(torch.bfloat16)
    first = triton_router.route_fused(x, ws[0], b, return_logits=True)[2]
    for w in ws:
        triton_router.route_fused(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            triton_router.route_fused(x, w, b)
    graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (10 * LAYERS), first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="32,128")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--shapes", default="16x4,32x4,64x4,64x8,128x4,128x8,256x8",
                    help="BLOCK_K x warps candidates")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in c.split("x")) for c in a.shapes.split(",")]
    for e in (int(v) for v in a.experts.split(",")):
        for t in (int(v) for v in a.tokens.split(",")):
            base_us, base = time_shape(e, t, None)
            line = [f"E={e:3d} T={t:3d} default {triton_router.launch_shape(e)}: {base_us:6.2f} us"]
            us, logits = time_shape(e, t, None, cluster=True)
            same = "" if torch.equal(logits, base) else f" (logits differ: max {float((logits.float() - base.float()).abs().max()):.1e})"
            line.append(f"cluster {cuda_router.shape(e, 2880)} {us:6.2f}{same}")
            for shape in shapes:
                us, logits = time_shape(e, t, shape)
                same = "" if torch.equal(logits, base) else f" (logits differ: max {float((logits.float() - base.float()).abs().max()):.1e})"
                line.append(f"{shape[0]}x{shape[1]} {us:6.2f}{same}")
            triton_router.LAUNCH_SHAPES.pop(e, None)
            print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
