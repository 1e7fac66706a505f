"""The bf16 decode GEMV (kernels/triton_bf16_gemv.py) against cuBLAS (`F.linear`), with bias.

gpt-oss' QKV [5120, 2880] and O [2880, 4096] (20b and 120b share them); `--shapes` adds the
unembedding [201088, 2880].

    python bench/bf16_gemv.py [--m 1,2,4,8] [--sweep] [--shapes qkv,o,unembed] [--budget-s 80]
                              [--jobs 8] [--out FILE.json]

Each row: us per call, the weight stream in TB/s (bf16 weights + bias) and the floor (those bytes /
the device-to-device copy bandwidth measured here) as a share of the time. Each timed call reads a
different copy of the weights (LAYERS copies, more than the 50 MB L2 holds, as consecutive layers
do), all LAYERS calls replayed from one CUDA graph, L2 flushed (by reading) before each replay
(bench/fp8_linear.py's `time_layers`). Every GEMV config is checked against a float32 reference
(within one bf16 rounding of the output, elementwise) before it is timed.

Without --sweep: cuBLAS and the config `select_config` picks for each (shape, M). With --sweep,
also every SWEEP candidate of the M bucket; the run ends with the best GEMV config per (shape, M)
as `triton_bf16_gemv.CONFIGS` entries. The Triton variants are compiled first in --jobs processes
(into Triton's on-disk cache); no config is started after --budget-s seconds (the tables still
print).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.fp8_linear import nbytes, time_layers  # noqa: E402
from pdserve.bench.kernels import copy_bandwidth, fastest_per_shape  # noqa: E402
from pdserve.kernels.fp8 import cdiv  # noqa: E402
from pdserve.kernels.triton_bf16_gemv import GemvConfig, bf16_gemv, launch_shape, m_bucket, select_config  # noqa: E402

# (N, K): QKV = 64 q + 2 x 8 kv heads of 64 over hidden 2880; unembed (--shapes): the vocabulary
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "unembed": (201088, 2880)}
LAYERS = 8  # weight copies per timed graph: 8 x 23.6-29.5 MB > L2
# Candidates by M bucket (ptxas for sm_90a, offline: no spills; "in flight" = weight bytes requested
# ahead per SM with every program resident). n rows x k K a program, w warps, s K steps in flight.
SWEEP: dict[int, list[GemvConfig]] = {
    1: [
        GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=3),   # 56 regs, 18 KB smem, 12 a SM
        GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=1),   # plain loads into registers
        GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3),  # 72 regs, 36 KB, 6 a SM
        GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),   # QKV 1280 programs
        GemvConfig(block_n=16, block_k=512, num_warps=2, num_stages=3),  # 96 regs, split 2 | 3
        GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=4, split_k=2),
    ],
    2: [
        GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=3),
        GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3),
        GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),
        GemvConfig(block_n=16, block_k=512, num_warps=2, num_stages=3),
    ],
    4: [
        GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=3),   # 127 regs, 8 a SM
        GemvConfig(block_n=8, block_k=256, num_warps=1, num_stages=4),
        GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),   # 90 regs
        GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3),  # 128 regs, 4 a SM
        GemvConfig(block_n=16, block_k=512, num_warps=2, num_stages=3),  # 206 regs: x read from L2 half as often
    ],
    8: [
        GemvConfig(block_n=4, block_k=256, num_warps=1, num_stages=4),   # 153 regs, 12 a SM
        GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=4),   # 150 regs, 6 a SM
        GemvConfig(block_n=8, block_k=512, num_warps=2, num_stages=3),   # 221 regs, 4 a SM
        GemvConfig(block_n=8, block_k=256, num_warps=1, num_stages=2),
    ],
}


def configs_for(m: int, n: int, k: int, sweep: bool) -> list[GemvConfig]:
    default = select_config(m, n, k)
    return [default] + [c for c in (SWEEP.get(m_bucket(m), []) if sweep else []) if c != default]


def _compile_one(job: tuple[int, int, int, dict]) -> str:
    """Run one (M, N, K, config) once on zeros: compiles it into Triton's on-disk cache."""
    m, n, k, cfg = job
    try:
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_gemv(x, w, torch.zeros(n, device="cuda", dtype=torch.bfloat16), config=GemvConfig(**cfg))
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported; the timing loop reports it again
        return f"M={m} {GemvConfig(**cfg).label}: {type(e).__name__}: {str(e)[:200]}"


def precompile(jobs: list[tuple[int, int, int, GemvConfig]], workers: int) -> None:
    if workers <= 0 or not jobs:
        return
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    failed = 0
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as ex:
        for err in ex.map(_compile_one, [(m, n, k, vars(c)) for m, n, k, c in jobs]):
            if err:
                failed += 1
                print(f"precompile: {err}", flush=True)
    print(f"compiled {len(jobs) - failed} of {len(jobs)} variants in {time.time() - t0:.0f} s "
          f"({workers} processes)", flush=True)


def make_weights(n: int, k: int, g: torch.Generator):
    """LAYERS copies of a bf16 weight (std 0.02, like trained projections) and bias."""
    return [((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
             (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)) for _ in range(LAYERS)]


def one_rounding_excess(out: torch.Tensor, x, w, b) -> float:
    """How far out exceeds one bf16 rounding of the float32 reference (<= 0: within), elementwise."""
    xf, wf, bf = x.float(), w.float(), b.float()
    ref = xf @ wf.T + bf
    mag = xf.abs() @ wf.abs().T + bf.abs()
    return float(((out.float() - ref).abs() - (2.0**-8 * ref.abs() + 1e-5 * mag)).max())


def bench(ms: list[int], shapes: list[str], sweep: bool, bw: float, g: torch.Generator,
          deadline: float) -> list[dict]:
    rows = []
    weights = {shape: make_weights(*SHAPES[shape], g) for shape in shapes}
    for m in ms:
        for shape in shapes:
            n, k = SHAPES[shape]
            layers = weights[shape]
            nb = nbytes(*layers[0])
            floor = nb / bw
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            runs = {"cuBLAS": (lambda lay: F.linear(x, lay[0], lay[1]), None)}
            default = select_config(m, n, k)
            for cfg in configs_for(m, n, k, sweep):
                runs[("table " if cfg == default else "") + cfg.label] = (
                    lambda lay, cfg=cfg: bf16_gemv(x, lay[0], lay[1], config=cfg), cfg)
            for name, (fn, cfg) in runs.items():
                if time.time() > deadline:
                    print(f"{shape} M={m} {name}: skipped (time budget spent)", flush=True)
                    continue
                try:
                    if cfg is not None:
                        excess = one_rounding_excess(fn(layers[0]), x, *layers[0])
                        if excess > 0:
                            print(f"{shape} M={m} {name}: WRONG, {excess:.2e} past one bf16 rounding", flush=True)
                            continue
                    t = time_layers(fn, layers)
                except Exception as e:  # noqa: BLE001 - a config that does not compile here: say so, go on
                    print(f"{shape} M={m} {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row = dict(shape=shape, m=m, name=name, us=t * 1e6, tb_s=nb / t / 1e12, of_floor=floor / t,
                           floor_us=floor * 1e6, config=vars(cfg) if cfg else None)
                if cfg is not None:
                    split, k_per = launch_shape(cfg, n, k)
                    row.update(split=split, k_per=k_per, programs=cdiv(n, cfg.block_n) * split)
                rows.append(row)
                print(f"{shape:3s} M={m} {name:32s} {t * 1e6:6.2f} us {nb / t / 1e12:5.2f} TB/s "
                      f"{floor / t:4.0%} of floor {floor * 1e6:.2f} us", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    base = {(r["shape"], r["m"]): r["us"] for r in rows if r["config"] is None}
    lines = ["| shape | M | kernel | programs (split x K steps) | us | TB/s | of floor | vs cuBLAS |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        grid = f"{r['programs']} ({r['split']} x {r['k_per']})" if r["config"] else ""
        cub = base.get((r["shape"], r["m"]))
        vs = f"{cub / r['us']:.2f}x" if cub and r["config"] else ""
        lines.append(f"| {r['shape']} | {r['m']} | {r['name']} | {grid} | {r['us']:.2f} | {r['tb_s']:.2f} | "
                     f"{r['of_floor']:.0%} | {vs} |")
    return "\n".join(lines)


def best_table(rows: list[dict]) -> dict:
    best = fastest_per_shape(rows)
    print("\nbest GEMV config per shape and M (triton_bf16_gemv.CONFIGS entries):")
    for (shape, m), r in sorted(best.items()):
        n, k = SHAPES[shape]
        c = r["config"]
        print(f"    ({n}, {k}, {m_bucket(m)}): GemvConfig(block_n={c['block_n']}, block_k={c['block_k']}, "
              f"split_k={c['split_k']}, num_warps={c['num_warps']}, num_stages={c['num_stages']}),"
              f"  # {r['us']:.2f} us, {r['of_floor']:.0%} of floor")
    return {f"{s}:{m}": r for (s, m), r in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,2,4,8", help="token counts (1..8)")
    ap.add_argument("--sweep", action="store_true", help="also the SWEEP candidates of each M bucket")
    ap.add_argument("--shapes", default="qkv,o", help=f"weights among {', '.join(SHAPES)}")
    ap.add_argument("--budget-s", type=float, default=80.0, help="start no config after this many seconds")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the Triton variants first (0: none)")
    ap.add_argument("--out", default=None, help="JSON file for every row")
    a = ap.parse_args(argv)
    start = time.time()
    ms = [int(v) for v in a.m.split(",")]
    shapes = a.shapes.split(",")
    if not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes: choose among {', '.join(SHAPES)}")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference
    precompile([(m, *SHAPES[s], c) for m in ms for s in shapes for c in configs_for(m, *SHAPES[s], a.sweep)],
               a.jobs)
    bw = copy_bandwidth()
    print(f"device-to-device copy (read + write): {bw / 1e12:.2f} TB/s", flush=True)
    rows = bench(ms, shapes, a.sweep, bw, torch.Generator(device="cuda").manual_seed(0), start + a.budget_s)
    print("\n" + markdown(rows), flush=True)
    best = best_table(rows)
    print(f"total {time.time() - start:.0f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(copy_bw=bw, rows=rows, best=best), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
