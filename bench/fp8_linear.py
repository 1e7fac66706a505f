"""FP8 attention projections (kernels/triton_fp8_linear.py) against bf16 cuBLAS and the MoE's FP8
GEMM, on gpt-oss' QKV [5120, 2880] and O [2880, 4096] (20b and 120b share them), with bias.

    python bench/fp8_linear.py [--m 1,2,4,8,16,32,64] [--prefill-m 1024,8192] [--quick] [--out FILE.json]
    python bench/fp8_linear.py --candidates [--budget-s 110]   # CANDIDATES only, M 1/4/16/64, < 2 min

Decode (M <= 64) is bound by the weight bytes: each row reports us per call, the weight stream in
TB/s (weights + scales; bf16 for cuBLAS) and the FP8 floor (FP8 weights + scales / the copy
bandwidth measured here) as a share of the time. Each timed call reads a different copy of the
weights (LAYERS copies, > the 50 MB L2, as consecutive layers do), all LAYERS calls replayed from
one CUDA graph, L2 flushed (by reading) before each replay (pdserve.bench.kernels' timing). Every
config is checked against the float32 reference of its mode before it is timed. "moe fp8 gemm" is
the MoE down kernel (kernels/triton_fp8_gemm.py) run as a dense GEMM (one expert; float32 out,
activations pre-quantised, launch alone). Prefill rows (--prefill-m) report TFLOP/s.
Ends with the best config per (shape, M): the table for `triton_fp8_linear.WEIGHT_CONFIGS`.
--candidates times only the CANDIDATES of each M (and cuBLAS bf16), measures the copy bandwidth
alone, and stops starting new configs after --budget-s seconds (the best table still prints).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import measure_ceilings, time_it  # noqa: E402
from pdserve.kernels.fp8 import (fp8_linear_ref, fp8_weight_linear_ref,  # noqa: E402
                                 quantize_weight_fp8)
from pdserve.bench.kernels import copy_bandwidth, fastest_per_shape  # noqa: E402
from pdserve.kernels.triton_fp8_linear import (GEMV_MAX_M, LinearConfig, fp8_linear, launch_shape,  # noqa: E402
                                               select_config)

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}  # (N, K): 64 q + 2 x 8 kv heads of 64; hidden 2880
LAYERS = 8  # weight copies per timed graph: 8 x 11.8-14.7 MB FP8 (2x that in bf16) > L2
DECODE_CONFIGS = [
    LinearConfig(block_n=64, num_stages=4),
    LinearConfig(block_n=64, split_k=1, num_stages=4),
    LinearConfig(block_n=64, split_k=2, num_stages=4),
    LinearConfig(block_n=32, num_stages=4),
    LinearConfig(block_n=16, split_k=1, num_stages=6),
    LinearConfig(block_n=128, num_stages=3),
    LinearConfig(block_n=64, num_stages=4, x_fp8=True),
    LinearConfig(block_n=64, split_k=1, num_stages=4, x_fp8=True),
    LinearConfig(block_n=64, num_stages=4, tma=True),
    LinearConfig(block_n=64, split_k=1, num_stages=4, tma=True),
    LinearConfig(block_n=64, split_k=2, num_stages=4, tma=True),
    LinearConfig(block_n=32, num_stages=4, tma=True),
    LinearConfig(block_n=64, num_stages=4, x_fp8=True, tma=True),
]
# The decode short list by M (ptxas for sm_90a, offline: no spills; 8-byte weight loads, no layout
# conversion in the K loop; "in flight" = weight bytes requested ahead per SM, about 40 KB hides
# HBM latency). GEMV rows: (block_n, block_k, warps, prefetch) -> QKV | O programs, registers.
# fp8xq: x quantised in the kernel, FP8 tensor cores (no upcast: the bf16x kernel's W tile goes
# through 2-byte shared loads and per-element converts).
CANDIDATES: dict[int, list[LinearConfig]] = {
    1: [
        # 32-bit-word decode: 7-9 SASS instructions a weight byte against 11-13 for the byte kernel
        LinearConfig(block_n=16, block_k=512, num_warps=4, prefetch=2, words=True),  # 640 | 540 progs (split 2 | 3), 126 regs
        LinearConfig(block_n=8, block_k=512, num_warps=2, prefetch=2, words=True),   # 640 | 720 (split 2), 125 regs
        LinearConfig(block_n=8, block_k=512, num_warps=4, prefetch=2, words=True),   # 640 | 720, 68 regs, 8.8 a byte
        LinearConfig(block_n=4, block_k=512, num_warps=2, prefetch=2, words=True),   # 1280 | 720, 69 regs
        LinearConfig(block_n=8, block_k=1024, num_warps=4, prefetch=2, words=True),  # 640 | 720 (split 2), 104-127 regs
        LinearConfig(block_n=4, block_k=512, num_warps=2, prefetch=2),    # 1280 | 720 progs, 92 regs, ~39 | 22 KB
        LinearConfig(block_n=8, block_k=512, num_warps=2, prefetch=2),    # 640 | 720 (split 2), 126-137 regs
        LinearConfig(block_n=2, block_k=512, num_warps=1, prefetch=2),    # 2560 | 1440, 89 regs, ~39 | 22 KB, no barrier
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True),
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, tma=True),
    ],
    4: [
        LinearConfig(block_n=16, block_k=512, num_warps=4, prefetch=2, words=True),  # 244 regs, 12.8 a byte
        LinearConfig(block_n=8, block_k=512, num_warps=2, prefetch=2, words=True),   # 244 regs, 13.7 a byte
        LinearConfig(block_n=8, block_k=512, num_warps=4, prefetch=2, words=True),   # 152 regs, 15.5 a byte
        LinearConfig(block_n=2, block_k=512, num_warps=1, prefetch=2),    # 96 regs, ~39 | 22 KB, no barrier
        LinearConfig(block_n=8, block_k=512, num_warps=2, prefetch=2),    # 165-177 regs, ~39 | 40 KB
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True),
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, tma=True),
    ],
    # From 16 tokens the split-K partials ([split, M, N] float32, written then read back) grow
    # with M: at 64 tokens the default split 6 moves 7.9 MB of them for QKV's 14.7 MB of weights.
    16: [
        LinearConfig(block_n=2, block_k=512, num_warps=1, prefetch=2),    # 168 regs: 16 FMAs a weight
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True),
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, tma=True),
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, split_k=3),
        LinearConfig(block_n=128, x_fp8=True, quant_in_kernel=True, num_warps=8, num_stages=3, tma=True),
        LinearConfig(block_n=64, x_fp8=True),
    ],
    64: [
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, split_k=2),
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True, split_k=3, tma=True),
        LinearConfig(block_n=128, x_fp8=True, quant_in_kernel=True, num_warps=8, num_stages=3, split_k=4, tma=True),
        LinearConfig(block_n=64, x_fp8=True, quant_in_kernel=True),
        LinearConfig(block_n=64, x_fp8=True, split_k=2),
    ],
}
PREFILL_CONFIGS = [  # no register spills (ptxas for sm_90a, offline)
    LinearConfig(block_n=128, block_m=128, split_k=1, num_warps=8, num_stages=3),
    LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4),
    LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4, x_fp8=True),
    LinearConfig(block_n=64, block_m=256, split_k=1, num_warps=8, num_stages=3, x_fp8=True),
    LinearConfig(block_n=128, block_m=128, split_k=1, num_warps=8, num_stages=3, tma=True),
    LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4, tma=True),
    LinearConfig(block_n=64, block_m=128, split_k=1, num_warps=4, num_stages=4, x_fp8=True, tma=True),
    LinearConfig(block_n=64, block_m=256, split_k=1, num_warps=8, num_stages=3, x_fp8=True, tma=True),
]


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_weights(n: int, k: int, g: torch.Generator):
    """LAYERS copies of a bf16 weight (std 0.02, like trained projections), its FP8 form, a bias."""
    out = []
    for _ in range(LAYERS):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wq, ws = quantize_weight_fp8(w)
        out.append((w, wq, ws, (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)))
    return out


def time_layers(fn, layers) -> float:
    """Seconds per call: fn(layer) over every layer copy in one CUDA graph, L2 flushed per replay."""
    for lay in layers:
        fn(lay)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for lay in layers:
            fn(lay)
    torch.cuda.synchronize()
    return time_it(graph.replay, reps=20, warmup=2) / len(layers)


def moe_gemm_runner(m: int, n: int, k: int, layers):
    """The MoE FP8 down GEMM (kernels.triton_fp8_gemm._down_kernel) as a dense [m, k] x [n, k]^T."""
    from pdserve.kernels import triton_moe as tm
    from pdserve.kernels.experts import ExpertWeights

    cfg = tm.select_config(m, 1)
    routing = tm.align_routing(torch.zeros(m, 1, dtype=torch.int64, device="cuda"), 0, 1, cfg.route_m)
    a = torch.randn(routing.max_rows, k, device="cuda").to(torch.float8_e4m3fn)
    a_scale = torch.rand(routing.max_rows, -(-k // 128), device="cuda") * 1e-2
    route_w = torch.ones(m, 1, device="cuda", dtype=torch.bfloat16)
    experts = [ExpertWeights(wq[None], b.float()[None], wq[None], b.float()[None], ws[None], ws[None])
               for _, wq, ws, b in layers]
    by_id = {id(lay): e for lay, e in zip(layers, experts)}
    return lambda lay: tm.down_weighted(a, a_scale, routing, by_id[id(lay)], route_w, True, cfg.down)


def bench_decode(ms: list[int], configs, bw: float, g: torch.Generator, moe: bool = True,
                 deadline: float = float("inf")) -> list[dict]:
    """configs: a list, or a function of M giving one; configs start until `deadline` (time.time()).
    Token counts outermost: a spent budget leaves out the largest M of both shapes."""
    rows = []
    weights = {shape: make_weights(n, k, g) for shape, (n, k) in SHAPES.items()}
    for m in ms:
        for shape, (n, k) in SHAPES.items():
            layers = weights[shape]
            fp8_bytes = nbytes(layers[0][1], layers[0][2], layers[0][3])
            bf16_bytes = nbytes(layers[0][0], layers[0][3])
            floor = fp8_bytes / bw
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            runs = {"cuBLAS bf16": (lambda lay: F.linear(x, lay[0], lay[3]), bf16_bytes)}
            try:
                if moe:
                    runs["moe fp8 gemm"] = (moe_gemm_runner(m, n, k, layers), fp8_bytes)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                print(f"{shape} M={m}: moe fp8 gemm unavailable: {type(e).__name__}: {e}", flush=True)
            default = select_config(m, n, k)
            listed = configs(m) if callable(configs) else configs
            for cfg in [default] + [c for c in listed if c != default and (not c.block_k or m <= GEMV_MAX_M)]:
                runs[("default " if cfg == default else "") + cfg.label] = (
                    lambda lay, cfg=cfg: fp8_linear(x, lay[1], lay[2], lay[3], config=cfg), fp8_bytes, cfg)
            _, wq, ws, b = layers[0]
            refs = {False: fp8_weight_linear_ref(x, wq, ws, b), True: fp8_linear_ref(x, wq, ws, b)}
            for name, (fn, nb, *cfg) in runs.items():
                if time.time() > deadline:
                    print(f"{shape} M={m} {name}: skipped (time budget spent)", flush=True)
                    continue
                try:
                    if cfg:
                        err = rel_l2(fn(layers[0]), refs[cfg[0].x_fp8])
                        if err > 2e-2:
                            print(f"{shape} M={m} {name}: WRONG, rel L2 {err:.2e} against its reference", flush=True)
                            continue
                    t = time_layers(fn, layers)
                except Exception as e:  # noqa: BLE001 - a config that does not compile here: say so, go on
                    print(f"{shape} M={m} {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                extra = ""
                if cfg:
                    bm, split, _ = launch_shape(cfg[0], m, n, k)
                    extra = f" (block_m {bm}, split {split})"
                rows.append(dict(shape=shape, m=m, name=name, us=t * 1e6, tb_s=nb / t / 1e12,
                                 of_floor=floor / t, config=vars(cfg[0]) if cfg else None))
                print(f"{shape:3s} M={m:3d} {name:40s} {t * 1e6:7.2f} us {nb / t / 1e12:5.2f} TB/s "
                      f"{floor / t:5.0%} of FP8 floor {floor * 1e6:.2f} us{extra}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


def bench_prefill(ms: list[int], bw: float, g: torch.Generator) -> list[dict]:
    rows = []
    for shape, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wq, ws = quantize_weight_fp8(w)
        b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            flops = 2 * m * n * k
            runs = {"cuBLAS bf16": (lambda: F.linear(x, w, b), None)}
            for cfg in PREFILL_CONFIGS:
                runs[cfg.label] = (lambda cfg=cfg: fp8_linear(x, wq, ws, b, config=cfg), cfg)
            ref = {False: fp8_weight_linear_ref(x, wq, ws, b), True: fp8_linear_ref(x, wq, ws, b)}
            for name, (fn, cfg) in runs.items():
                try:
                    if cfg is not None:
                        err = rel_l2(fn(), ref[cfg.x_fp8])
                        if err > 2e-2:
                            print(f"{shape} M={m} {name}: WRONG, rel L2 {err:.2e}", flush=True)
                            continue
                    t = time_it(fn, reps=10)
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} M={m} {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                rows.append(dict(shape=shape, m=m, name=name, us=t * 1e6, tflops=flops / t / 1e12))
                print(f"{shape:3s} M={m:5d} {name:40s} {t * 1e6:8.1f} us {flops / t / 1e12:6.0f} TFLOP/s", flush=True)
    return rows


def best_table(rows: list[dict]) -> dict:
    best = fastest_per_shape(rows)
    print("\nbest FP8 config per shape and M (us, % of FP8 floor, vs cuBLAS bf16):", flush=True)
    base = {(r["shape"], r["m"]): r["us"] for r in rows if r["name"] == "cuBLAS bf16"}
    for (shape, m), r in sorted(best.items()):
        cub = base.get((shape, m))
        vs = f"{cub / r['us']:.2f}x cuBLAS" if cub else ""
        print(f"  {shape:3s} M={m:3d} {r['us']:7.2f} us {r['of_floor']:5.0%}  {vs}  LinearConfig(**{r['config']})")
    return {f"{s}:{m}": r for (s, m), r in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,2,4,8,16,32,64", help="decode token counts")
    ap.add_argument("--prefill-m", default="1024,8192", help="prefill token counts ('' = none)")
    ap.add_argument("--quick", action="store_true", help="the default config and two others only")
    ap.add_argument("--out", default=None, help="JSON file for every row")
    ap.add_argument("--candidates", action="store_true",
                    help="CANDIDATES at M 1, 4, 16, 64 (--m ignored), cuBLAS bf16 alongside, no prefill")
    ap.add_argument("--budget-s", type=float, default=110.0, help="--candidates: start no config after this")
    a = ap.parse_args(argv)
    start = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    if a.candidates:
        ceil = {"copy_bw": copy_bandwidth()}
        print(f"device-to-device copy (read + write): {ceil['copy_bw'] / 1e12:.2f} TB/s", flush=True)
        rows = bench_decode(sorted(CANDIDATES), CANDIDATES.get, ceil["copy_bw"], g, moe=False,
                            deadline=start + a.budget_s)
        best = best_table(rows)
        print(f"total {time.time() - start:.0f} s", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(dict(ceilings=ceil, decode=rows, best=best), indent=1))
        return 0
    ceil = measure_ceilings()
    bw = ceil["copy_bw"]
    configs = DECODE_CONFIGS[:3] + [c for c in DECODE_CONFIGS if c.tma][:1] if a.quick else DECODE_CONFIGS
    rows = bench_decode([int(v) for v in a.m.split(",")], configs, bw, g)
    best = best_table(rows)
    prefill = bench_prefill([int(v) for v in a.prefill_m.split(",") if v], bw, g)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(ceilings=ceil, decode=rows, best=best, prefill=prefill), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
