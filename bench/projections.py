"""The attention output projection at decode, alone: the Triton bf16 GEMV (kernels/triton_bf16_gemv.py)
against the GEMV that stages its weights in shared memory (kernels/cuda_gemv_staged.py), gpt-oss'
O [2880, 4096] with bias.

    python bench/o_projection.py [--m 1,2,4]

Each row: median us of one call replayed from a CUDA graph, L2 flushed before each replay (50
replays; the replay's launch is in the time), and the weight stream in TB/s. Alone, nothing runs
ahead of the staged GEMV for it to overlap: its gain is in the step (bench/launch_ab.py's "O triton
gemv" setting against the default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import graphed, time_it  # noqa: E402
from pdserve.kernels.cuda_gemv_staged import gemv_staged  # noqa: E402
from pdserve.kernels.triton_bf16_gemv import bf16_gemv  # noqa: E402

N, K = 2880, 4096


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,2,4", help="token counts (1..8)")
    a = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(N, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    for m in (int(v) for v in a.m.split(",")):
        x = torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16)
        for name, fn in (("triton bf16 gemv", lambda: bf16_gemv(x, w, b)), ("staged", lambda: gemv_staged(x, w, b))):
            t = time_it(graphed(fn), reps=50)
            print(f"O M={m} {name:16s} {t * 1e6:6.2f} us {N * K * 2 / t / 1e12:5.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
