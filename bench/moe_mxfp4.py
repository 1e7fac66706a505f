"""The MXFP4 decode MoE (kernels/triton_moe_mxfp4.py, the CUDA mma kernels of
kernels/cuda_moe_mxfp4.py: "mma pair" / "mma grouped") on a 20b-shaped layer: time per layer for
1-64 tokens against its weight floor (the routed experts' MXFP4 bytes / copy bandwidth measured
here), over launch configs and nibble decodes (v1 = the first version), and the engine's default
FP8 grouped path on the same layer shape (floor / time against the MXFP4 floor; TB/s of its own
FP8 bytes).

    python bench/moe_mxfp4.py [--experts 32] [--tokens 1,2,4,8,16,64] [--no-fp8] [--out FILE.json]

Each timed call routes to experts no earlier call of the round touched (routing sets rotate over
all experts; the layer's 423 MB exceed the 50 MB L2), replayed from a CUDA graph. Each MXFP4 row
also gives its output's rel L2 against the v2 decode's (float32 sums) on the same inputs, so a
launch shape that computes wrong shows (bf16 partial sums: ~5e-3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import copy_bandwidth  # noqa: E402
from pdserve.kernels.cuda_moe_mxfp4 import FOLD_CONFIG, MmaConfig, experts_forward_mxfp4_mma  # noqa: E402
from pdserve.kernels.experts import ExpertWeights  # noqa: E402
from pdserve.kernels.moe import experts_forward  # noqa: E402
from pdserve.kernels.mxfp4 import MxExperts, random_experts  # noqa: E402
from pdserve.kernels.triton_moe_mxfp4 import MxConfig, experts_forward_mxfp4  # noqa: E402
from pdserve.kernels.triton_moe_mxfp4_grouped import GroupedConfig, experts_forward_mxfp4_grouped  # noqa: E402

CONFIGS = {
    "v1 gu32x4 d16x4": MxConfig((32, 4, 4, 3), (16, 4, 4, 3), decode="v1"),
    "v1-lut gu32x4 d16x4": MxConfig((32, 4, 4, 3), (16, 4, 4, 3), decode="lut"),
    "bits gu64x16w4 d16x16w2": MxConfig((64, 16, 4, 3), (16, 16, 2, 3)),
    "bits gu32x16w2 d16x16w2": MxConfig((32, 16, 2, 3), (16, 16, 2, 3)),
    "bits gu128x16w8 d32x16w4": MxConfig((128, 16, 8, 3), (32, 16, 4, 3)),
    "dot gu64k256w4 d32k256w4": MxConfig((64, 256, 4, 3), (32, 256, 4, 3), decode="dot"),
    "dot gu32k256w4 d16k256w4": MxConfig((32, 256, 4, 3), (16, 256, 4, 3), decode="dot"),
    "dot gu128k128w4 d32k128w4": MxConfig((128, 128, 4, 3), (32, 128, 4, 3), decode="dot"),
    "dot gu16k512w4s2 d16k512w4s2": MxConfig((16, 512, 4, 2), (16, 512, 4, 2), decode="dot"),
    "dot gu64k512w8s2 d16k256w2": MxConfig((64, 512, 8, 2), (16, 256, 2, 3), decode="dot"),
    "packed gu64x8w4 d16x8w2": MxConfig((64, 8, 4, 3), (16, 8, 2, 3), decode="packed"),
    "packed gu64x4w2s4 d16x4w1s4": MxConfig((64, 4, 2, 4), (16, 4, 1, 4), decode="packed"),
    # without the cp.async pipeline (stages 1: loads straight into registers) or a shallow one, and
    # more warps per SM
    "packed gu64x4w2s1 d16x4w1s1": MxConfig((64, 4, 2, 1), (16, 4, 1, 1), decode="packed"),
    "packed gu64x4w4s1 d16x4w2s1": MxConfig((64, 4, 4, 1), (16, 4, 2, 1), decode="packed"),
    "packed gu32x4w2s1 d16x4w2s1": MxConfig((32, 4, 2, 1), (16, 4, 2, 1), decode="packed"),
    "packed gu64x8w4s1 d16x8w2s1": MxConfig((64, 8, 4, 1), (16, 8, 2, 1), decode="packed"),
    "packed gu64x4w2s2 d16x4w1s2": MxConfig((64, 4, 2, 2), (16, 4, 1, 2), decode="packed"),
    "packed gu32x4w1s4 d16x4w1s4": MxConfig((32, 4, 1, 4), (16, 4, 1, 4), decode="packed"),
    "packed gu64x4w2s6 d16x4w1s6": MxConfig((64, 4, 2, 6), (16, 4, 1, 6), decode="packed"),
}


# The expert-grouped tensor-core kernels (kernels/triton_moe_mxfp4_grouped.py): BLOCK_M, then
# (BLOCK_N, BLOCK_K, warps, stages) for gate/up and down.
GROUPED = {
    "grouped m16 gu128k128w4 d128k128w4": GroupedConfig(16, (128, 128, 4, 3), (128, 128, 4, 3)),
    "grouped m16 gu128k64w4s4 d128k64w4s4": GroupedConfig(16, (128, 64, 4, 4), (128, 64, 4, 4)),
    "grouped m32 gu128k64w4 d128k64w4": GroupedConfig(32, (128, 64, 4, 3), (128, 64, 4, 3)),
    "grouped m64 gu128k64w4 d128k64w4": GroupedConfig(64, (128, 64, 4, 3), (128, 64, 4, 3)),
    "grouped m64 gu128k128w4 d128k128w4": GroupedConfig(64, (128, 128, 4, 3), (128, 128, 4, 3)),
    "grouped m16 gu64k128w4 d64k128w4": GroupedConfig(16, (64, 128, 4, 3), (64, 128, 4, 3)),
}

# The CUDA mma kernels (kernels/cuda_moe_mxfp4.py): per pair or grouped by expert; gate/up and down
# shapes as (warps, K split, K steps per register batch).
MMA = {
    f"mma {'grouped' if grouped else 'pair'} gu{gu[0]}k{gu[1]}d{gu[2]} dn{dn[0]}k{dn[1]}d{dn[2]}": (MmaConfig(gu, dn), grouped)
    for grouped in (False, True)
    for gu, dn in (((4, 1, 2), (4, 2, 2)), ((4, 1, 3), (4, 2, 3)), ((4, 2, 2), (4, 4, 2)), ((2, 1, 3), (2, 2, 3)),
                   ((4, 1, 4), (4, 2, 4)), ((4, 1, 4), (4, 2, 2)), ((4, 1, 2), (4, 2, 4)),
                   # K split over 2 warps of 2-warp CTAs, one K step a batch: ~92 registers, so all
                   # 1440 gate/up CTAs of one token are resident at once (11 a SM, 22 warps)
                   ((2, 2, 1), (2, 2, 1)), ((2, 2, 1), (4, 2, 2)), ((4, 2, 1), (4, 4, 1)), ((2, 2, 1), (4, 4, 1)))
}
# Grouped with the scales folded into the decoded weights (MX_FOLD): one mma a word serves 8 pairs;
# `slots` pairs a CTA (the routing layout's block). Since 2026-12-05 these fold in f16 (the experts here
# allow it); before, in bf16.
# Shapes as (warps, K split, K steps a batch[, CTAs an SM must hold]).
MMA.update({
    f"mma fold{slots} gu{','.join(map(str, gu))} dn{','.join(map(str, dn))}": (MmaConfig(gu, dn, slots=slots, fold=True), True)
    for slots, gu, dn in ((8, (4, 1, 2), (4, 2, 2)), (16, (4, 1, 2), (4, 2, 2)), (16, (4, 1, 3), (4, 2, 3)),
                          (16, (4, 1, 3), (4, 2, 2)), (16, (4, 2, 2), (4, 4, 2)), (16, (2, 1, 2), (2, 2, 2)),
                          (16, (4, 1, 2), (4, 1, 2)), (16, (4, 1, 2), (4, 4, 2)), (16, (4, 1, 2, 5), (4, 2, 2, 5)),
                          (16, (8, 2, 2), (8, 4, 2)), (32, (4, 1, 2), (4, 2, 2)))
})
# The engine's folded shape (FOLD_CONFIG), in f16 (MX_FOLD 2: folded launches take it where the experts'
# scale bytes allow, as these random experts' do) and in bf16 (MX_FOLD 1, as before the f16 fold)
MMA.update({"mma fold engine f16": (FOLD_CONFIG, True),
            "mma fold engine bf16": (dataclasses.replace(FOLD_CONFIG, fold_f16=False), True)})


def random_layer(experts: int, dev: torch.device) -> tuple[MxExperts, MxExperts, torch.Generator]:
    """The MoE benches' layer: `experts` random experts of gpt-oss' shape (2880 x 2880) drawn from a generator
    seeded 0, in the published and the packed layout, and that generator (the routing sets draw from it next)."""
    g = torch.Generator(device=dev).manual_seed(0)
    w = random_experts(experts, g, dev, h=2880, i=2880)
    return w, w.to_packed(), g


def expert_bytes(w: MxExperts, parts: tuple[str, ...] = ("gate_up", "down"), biases: bool = True) -> int:
    """Bytes one expert of `w` reads in the given GEMMs (MXFP4 blocks and scales, and the biases): the MoE
    benches' floors are the routed experts' bytes over the copy bandwidth."""
    names = [f"{p}_{kind}" for p in parts for kind in ("blocks", "scales")] + (
        [f"{p}_bias" for p in parts] if biases else [])
    return sum(getattr(w, n)[0].numel() * getattr(w, n).element_size() for n in names)


def layer_batch(t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list, float]:
    """A batch of t tokens for the whole-layer peers: x [t, 2880] and softmaxed routing weights [t, k] in
    bf16 (the global generator), the routing sets (from g) and how many experts a set touches on average."""
    dev = g.device
    x = torch.randn(t, 2880, device=dev).to(torch.bfloat16)
    wts = torch.softmax(torch.randn(t, k, device=dev), -1).to(torch.bfloat16)
    id_sets = routing_sets(t, e, k, g)
    return x, wts, id_sets, sum(len(set(s.flatten().tolist())) for s in id_sets) / len(id_sets)


def routing_sets(t: int, e: int, k: int, g: torch.Generator) -> list[torch.Tensor]:
    """Routing ids [t, k] of the rounds one timed graph replays: one token walks disjoint experts through all
    e; larger batches draw 4 uniform random sets (from g), so no round reads experts the round before left in
    the L2 (the 32-expert layer's 423 MB exceed the 50 MB L2)."""
    dev = g.device
    if t == 1:
        return [torch.arange(r * k, (r + 1) * k, device=dev)[None] for r in range(max(1, e // k))]
    return [torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(t)]) for _ in range(4)]


def graph_us(fn, id_sets: list[torch.Tensor], reps: int = 20) -> float:
    """us a call of fn(ids), the calls over all routing sets captured in one CUDA graph and replayed (after
    one replay untimed)."""
    for s in id_sets:
        fn(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in id_sets:
            fn(s)
    graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (reps * len(id_sets))


def time_runs(runs: dict, errors: dict, t: int, floor_us: float, rows: list, against: str) -> None:
    """Time each of runs {name: (fn(ids), routing sets)} with graph_us, append a row per run to `rows` and print
    it beside its error (errors[name], against `against`) and the floor. Timed right after a reference that
    decodes gigabytes of experts, the first config ran 9-12 % slow (H100, 2026-12-05): one untimed round goes
    first, and the first config is timed again last as a control."""
    first = next(iter(runs))
    graph_us(*runs[first])
    for n, name in enumerate([*runs, first]):
        fn, sets = runs[name]
        err, label = errors[name], name if n < len(runs) else name + ", again"
        us = graph_us(fn, sets)
        rows.append(dict(tokens=t, run=label, us=us, floor_us=floor_us, of_floor=floor_us / us, rel_l2=err))
        print(f"T={t:3d} {label:22s} {us:8.1f} us  floor {floor_us:7.1f} us  {floor_us / us:5.0%}  "
              f"rel L2 vs {against} {err:.1e}", flush=True)


def save_rows(path: str | None, bw: float, rows: list) -> None:
    if path:
        Path(path).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows),
                                         indent=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 grouped path (the engine's default)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="", help="comma-separated prefixes of CONFIGS names to run (default all)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    h = 2880
    e, k = a.experts, 4
    w, w_packed, g = random_layer(e, dev)
    gb, gs, db, ds = w.gate_up_blocks, w.gate_up_scales, w.down_blocks, w.down_scales
    configs = {n: c for n, c in CONFIGS.items()
               if not a.configs or any(n.startswith(pre) for pre in a.configs.split(","))}
    per_expert = sum(t[0].numel() * t.element_size() for t in (gb, gs, db, ds, w.gate_up_bias, w.down_bias))
    fp8 = None
    if not a.no_fp8:  # the same layer shape as the engine loads it by default: FP8 128x128 blocks, I padded
        ip = 3072

        def f8(rows, cols):
            return (torch.randn(e, rows, cols, device=dev, generator=g) * 0.5).to(torch.float8_e4m3fn)

        fp8 = ExpertWeights(f8(2 * ip, h), torch.randn(e, 2 * ip, device=dev) * 0.1, f8(h, ip),
                            torch.randn(e, h, device=dev) * 0.1,
                            torch.rand(e, 2 * ip // 128, (h + 127) // 128, device=dev) * 1e-2,
                            torch.rand(e, (h + 127) // 128, ip // 128, device=dev) * 1e-2)
        fp8_per_expert = sum(t[0].numel() * t.element_size() for t in vars(fp8).values() if torch.is_tensor(t))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; per expert {per_expert / 1e6:.2f} MB", flush=True)
    rows = []
    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        wts = torch.softmax(torch.randn(t, k, device=dev), -1).to(torch.bfloat16)
        id_sets = routing_sets(t, e, k, g)
        rounds = len(id_sets)
        touched = sum(len(set(s.flatten().tolist())) for s in id_sets) / rounds
        floor = touched * per_expert / bw
        runs = {name: (lambda s, cfg=cfg: experts_forward_mxfp4(x, wts, s, w_packed if cfg.decode == "packed" else w,
                                                                 config=cfg))
                for name, cfg in configs.items()}
        runs.update({name: (lambda s, cfg=cfg: experts_forward_mxfp4_grouped(x, wts, s, w_packed, config=cfg))
                     for name, cfg in GROUPED.items()
                     if not a.configs or any(name.startswith(pre) for pre in a.configs.split(","))})
        for name, (cfg, grouped) in MMA.items():
            if not a.configs or any(name.startswith(pre) for pre in a.configs.split(",")):
                runs[name] = lambda s, cfg=cfg, grouped=grouped: experts_forward_mxfp4_mma(
                    x, wts, s, w_packed, grouped=grouped, config=cfg)
        if fp8 is not None:
            runs["fp8 grouped (engine default)"] = lambda s: experts_forward(x, wts, s, fp8)
        check = experts_forward_mxfp4(x, wts, id_sets[0], w, config=MxConfig())  # v2: float32 sums
        for name, fn in runs.items():
            try:
                for s in id_sets:
                    fn(s)  # compile, warm
                torch.cuda.synchronize()
                err = (float("nan") if name.startswith("fp8")  # other weights
                       else float((fn(id_sets[0]).float() - check.float()).norm() / check.float().norm()))
            except Exception as ex:  # a config that does not compile on this device: say so, go on
                print(f"T={t:3d} {name:14s} failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            us = graph_us(fn, id_sets)
            nbytes = touched * (fp8_per_expert if name.startswith("fp8") else per_expert)
            rows.append(dict(tokens=t, config=name, us=us, floor_us=floor * 1e6, of_floor=floor * 1e6 / us,
                             tb_s=nbytes / (us * 1e-6) / 1e12, own_floor_us=nbytes / bw * 1e6, rel_l2_vs_v2=err))
            print(f"T={t:3d} {name:14s} {us:8.1f} us  floor {floor * 1e6:7.1f} us  {floor * 1e6 / us:5.0%}  "
                  f"{rows[-1]['tb_s']:.2f} TB/s  rel L2 vs v2 {err:.1e}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(copy_bandwidth=bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
