"""The decode step's argmax over the vocabulary: torch.argmax against the split argmax of
kernels/triton_argmax.py, per call (20 calls replayed from a CUDA graph, median of 15 replays),
writing the ids into mapped pinned memory as the pipelined engine does (kernels/step_io.py).

    python bench/argmax.py [--rows 1,8,64] [--vocab 201088]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.step_io import mapped  # noqa: E402
from pdserve.kernels.triton_argmax import argmax_rows  # noqa: E402

CALLS = 20


def _per_call(fn) -> float:
    """Median us a call of `fn`, CALLS calls captured in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(15):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / CALLS)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=201088)
    a = ap.parse_args()
    for rows in [int(r) for r in a.rows.split(",")]:
        logits = torch.randn(rows, a.vocab, device="cuda")
        host = torch.empty(rows, dtype=torch.long, pin_memory=True)
        out = mapped(host)
        t_torch = _per_call(lambda: torch.argmax(logits, dim=-1, out=out))
        t_split = _per_call(lambda: argmax_rows(logits, out=out))
        torch.cuda.synchronize()
        same = torch.equal(host, torch.argmax(logits, dim=-1).cpu())
        print(f"rows {rows:3d}: torch.argmax {t_torch:6.2f} us, split {t_split:6.2f} us "
              f"(x{t_split / t_torch:.2f}), ids equal: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
