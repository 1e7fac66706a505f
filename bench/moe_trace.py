"""Where the time of one MXFP4 MoE layer goes, CTA by CTA: the CUDA mma kernels
(kernels/cuda_moe_mxfp4.py) built with MX_TRACE record each CTA's start, the end of its weight
sums, its end (%globaltimer, ns) and its SM. A 20b-shaped layer (32 experts, H = I = 2880, top 4),
per-pair launches at `--tokens` tokens, each repetition on experts not read in the previous ones
(more bytes than the L2 holds), after a warm-up.

    python bench/moe_trace.py [--tokens 1] [--reps 8] [--out FILE.json]

Prints per kernel: its span (first CTA start to last CTA end), when the CTAs start (offsets from
the first), how long each takes (start to sums done, to end), CTAs per SM, and the gap between
gate/up's last CTA and down's first (the calls are eager, so that gap holds host time; in a CUDA
graph the two launches follow each other directly); the bytes each kernel reads over its span.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.cuda_moe_mxfp4 import PAIR_CONFIG, experts_forward_mxfp4_mma  # noqa: E402
from pdserve.kernels.mxfp4 import random_experts  # noqa: E402


def _pct(v: torch.Tensor, q: float) -> float:
    return float(torch.quantile(v.double(), q))


def summarize(rec: torch.Tensor, nbytes: float) -> dict:
    """rec [CTAs, 4] int64: start, sums done, end (ns), SM -> span and distributions in us."""
    start, dot, end, sm = (rec[:, i] for i in range(4))
    t0 = int(start.min())
    span = (int(end.max()) - t0) / 1e3
    per_sm = torch.bincount(sm, minlength=132)
    return dict(
        start_ns=t0, end_ns=int(end.max()), span_us=span, ctas=rec.shape[0], tb_s=nbytes / (span * 1e-6) / 1e12,
        start_offset_us={q: _pct((start - t0) / 1e3, q) for q in (0.5, 0.9, 1.0)},
        sums_us={q: _pct((dot - start) / 1e3, q) for q in (0.1, 0.5, 0.9, 1.0)},
        cta_us={q: _pct((end - start) / 1e3, q) for q in (0.1, 0.5, 0.9, 1.0)},
        last_start_us=(int(start.max()) - t0) / 1e3, first_end_us=(int(end.min()) - t0) / 1e3,
        ctas_per_sm={int(k): int((per_sm == k).sum()) for k in per_sm.unique()},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    e, k, h, i, t = 32, 4, 2880, 2880, a.tokens
    w = random_experts(e, torch.Generator(device=dev).manual_seed(0), dev, h=h, i=i).to_packed()
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    wts = torch.softmax(torch.randn(t, k, device=dev), -1).to(torch.bfloat16)
    rows_gu, rows_dn = PAIR_CONFIG.rows("gate_up"), PAIR_CONFIG.rows("down")  # per-pair launches
    ctas = (2 * i // rows_gu * t * k, h // rows_dn * t * k)
    bufs = [torch.zeros(n * 4, dtype=torch.int64, device=dev) for n in ctas]
    gu_bytes = t * k * (w.gate_up_blocks[0].numel() + w.gate_up_scales[0].numel())
    dn_bytes = t * k * (w.down_blocks[0].numel() + w.down_scales[0].numel())
    print(f"tokens {t}: gate/up {ctas[0]} CTAs ({gu_bytes / 1e6:.1f} MB), down {ctas[1]} CTAs "
          f"({dn_bytes / 1e6:.1f} MB), config {PAIR_CONFIG}", flush=True)
    rows = []
    for rep in range(a.reps + 2):
        ids = torch.stack([(torch.arange(k, device=dev) + k * ((rep * t + j) % (e // k))) for j in range(t)])
        experts_forward_mxfp4_mma(x, wts, ids, w, trace=(bufs[0], bufs[1]))
        torch.cuda.synchronize()
        if rep < 2:  # compile, warm
            continue
        gu, dn = (b.view(-1, 4).cpu() for b in bufs)
        sg, sd = summarize(gu, gu_bytes), summarize(dn, dn_bytes)
        gap = (sd["start_ns"] - sg["end_ns"]) / 1e3
        rows.append(dict(gate_up=sg, down=sd, gap_us=gap, layer_us=(sd["end_ns"] - sg["start_ns"]) / 1e3))
        for name, s in (("gate/up", sg), ("down", sd)):
            print(f"rep {rep - 2} {name:7s} span {s['span_us']:5.1f} us ({s['tb_s']:.2f} TB/s) | start offsets "
                  f"p50/p90/max {s['start_offset_us'][0.5]:.1f}/{s['start_offset_us'][0.9]:.1f}/"
                  f"{s['start_offset_us'][1.0]:.1f} | sums p10/p50/p90/max {s['sums_us'][0.1]:.1f}/"
                  f"{s['sums_us'][0.5]:.1f}/{s['sums_us'][0.9]:.1f}/{s['sums_us'][1.0]:.1f} | CTA end-start "
                  f"p50/max {s['cta_us'][0.5]:.1f}/{s['cta_us'][1.0]:.1f} | first end {s['first_end_us']:.1f} | "
                  f"CTAs per SM {s['ctas_per_sm']}", flush=True)
        print(f"rep {rep - 2} gap gate/up end -> down start {gap:.1f} us; layer {rows[-1]['layer_us']:.1f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
