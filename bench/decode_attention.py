"""Decode sink attention per layer call on one GPU: our Triton split-KV kernel against FlashInfer's
XQA and FA2 sink wrapper (gpt-oss: 64 q / 8 kv heads, d 64, 16-token pages, bf16).

    python -m pdserve.bench.decode_attention [--batches 1,4,16,64] [--contexts 1024,8192]
                                            [--tilings 64/64/4,32/32/4] [--cluster 8/2/1/1] [--out results.json]
    python -m pdserve.bench.decode_attention --launches 4 --batches 1 --contexts 8192   # for a profiler

Each backend runs as the engine runs it: a `FlashInferSinkAttention` graph-mode object (fixed
page-table buffers sized for the batch, plan() outside, run() replayed from a CUDA graph), the
L2 flushed (256 MB read) before each repetition, median of 25. Full layers read every key;
windowed layers (window_left = 127) read a pool holding only the pages a 128-key window reaches,
as the engine's sliding pool does. `--tilings` adds the Triton kernel with other tilings
(block_n/min_keys/num_warps[/max_splits[/num_stages[/combine_splits]]]: keys per inner step, fewest
keys per split, warps, most splits, pipeline stages, partials folded per combine step), through
the same buffers. The "vs XQA" column is our Triton kernel's output against XQA's (relative L2), a check
on real shapes. The "cluster" column is kernels/cuda_decode_attention.py, which the engine's "triton"
mode takes where it applies (the "triton" column then runs with it switched off); `--cluster` sets its
full-layer shape for the run, at any batch. Floor: the KV bytes read / the measured device-to-device
copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from pdserve.bench.kernels import (
    PAGE, _kv_bytes, _ours, _paged, copy_bandwidth, fmt_us, guarded, table, time_graph,
)

BACKENDS = ("triton", "xqa", "fa2")
COLUMNS = ("cluster",) + BACKENDS  # "cluster": kernels/cuda_decode_attention.py, where it applies
WINDOW_LEFT = 127


def _tiling(spec: str):
    from pdserve.kernels.triton_decode_attention import DecodeConfig

    fields = [int(x) for x in spec.split("/")]
    names = ("block_n", "min_keys", "num_warps", "max_splits", "num_stages", "combine_splits")
    if not 3 <= len(fields) <= len(names):
        raise SystemExit(f"a tiling is {'/'.join(names)} (the last three optional), got {spec!r}")
    return DecodeConfig(**dict(zip(names, fields)))


def _lens(b: int, ctx: int, window_left: int) -> list[int]:
    """Each request's keys: `ctx` for full layers; for windowed ones, the keys its window reaches."""
    return [ctx] * b if window_left < 0 else [min(ctx, WINDOW_LEFT + 1 + ctx % PAGE + PAGE)] * b


def _case(b: int, ctx: int, window_left: int, tilings: list[str], gen: torch.Generator) -> dict:
    """Times (seconds) per backend for one batch shape, plus the Triton / XQA difference."""
    from pdserve.kernels.triton_decode_attention import DecodeScratch, num_splits, paged_decode_attention

    lens = _lens(b, ctx, window_left)
    batch, kv, q = _paged(lens, [1] * b, gen)
    sinks = torch.randn(q.shape[1], device=q.device)
    max_pages = -(-max(lens) // PAGE)
    res, outs = {}, {}
    for backend in BACKENDS:
        def run(backend=backend):
            a = _ours(window_left, decode_backend=backend, cuda_graph_batch_size=b, max_pages_per_request=max_pages)
            a.plan(batch)
            out = outs[backend] = torch.empty_like(q)
            t = time_graph(lambda: a.run(q, kv, sinks, out=out))
            if backend == "triton":  # the object's "triton" mode takes the cluster kernel where it applies
                from pdserve.kernels import cuda_decode_attention as cda

                if cda.applies(q, kv, window_left):
                    res["cluster"], outs["cluster"] = t, out
                    cda.ENABLED = False
                    try:
                        out = outs[backend] = torch.empty_like(q)
                        t = time_graph(lambda: a.run(q, kv, sinks, out=out))
                    finally:
                        cda.ENABLED = True
                res["splits"] = a._scratch.shape[2]
                for spec in tilings:
                    cfg = _tiling(spec)
                    keys = max_pages * PAGE if window_left < 0 else WINDOW_LEFT + 1
                    s = DecodeScratch(b, a.num_kv_heads, a.num_qo_heads // a.num_kv_heads, a.head_dim,
                                      num_splits(b, a.num_kv_heads, keys, q.device, cfg), q.device)
                    o = torch.empty_like(q)
                    res[f"triton {spec}"] = guarded(spec, time_graph, lambda s=s, o=o, cfg=cfg: paged_decode_attention(
                        q, kv, a._block_tables, a._seq_lens, sinks, a.sm_scale, window_left, s, out=o, cfg=cfg))
            return t
        res[backend] = guarded(f"{backend} b{b} ctx{ctx} wl{window_left}", run)
    if res.get("triton") and res.get("xqa"):
        ref = outs["xqa"].float()
        res["diff"] = ((outs["triton"].float() - ref).norm() / ref.norm()).item()
    if "cluster" in outs and "triton" in outs:
        ref = outs["triton"].float()
        res["cluster_diff"] = ((outs["cluster"].float() - ref).norm() / ref.norm()).item()
    res["kv_bytes"] = _kv_bytes(lens, window_left)
    return res


def _launch_only(launches: int, batches: list[int], contexts: list[int]) -> None:
    """The engine's decode attention launched `launches` times a case, eagerly, nothing timed."""
    gen = torch.Generator().manual_seed(1)
    for b in batches:
        for ctx in contexts:
            for window_left in (-1, WINDOW_LEFT):
                lens = _lens(b, ctx, window_left)
                batch, kv, q = _paged(lens, [1] * b, gen)
                sinks = torch.randn(q.shape[1], device=q.device)
                a = _ours(window_left, decode_backend="triton", cuda_graph_batch_size=b,
                          max_pages_per_request=-(-max(lens) // PAGE))
                a.plan(batch)
                out = torch.empty_like(q)
                for _ in range(launches):
                    a.run(q, kv, sinks, out=out)
                torch.cuda.synchronize()
                print(f"batch {b} context {ctx} {'full' if window_left < 0 else 'window'}: {launches} launches",
                      flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--tilings", default="", help="extra Triton tilings, block_n/min_keys/num_warps[/max_splits[/num_stages[/combine_splits]]], comma-separated")
    ap.add_argument("--cluster", default=None, metavar="C/S/G[/L]",
                    help="the cluster kernel's full-layer shape for this run: CTAs a cluster / blocks of shared "
                         "memory a CTA / most clusters a request [/ blocks ahead whose page-table entries are "
                         "requested], at every batch (default: the engine's, kernels.cuda_decode_attention."
                         "FULL_LAYERS, and FULL_LAYERS_FEW up to its max_rows requests)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--launches", type=int, default=0, metavar="N",
                    help="time nothing: launch the engine's \"triton\" decode attention (the cluster kernel where it "
                         "applies) N times eagerly for each batch, context and layer type, in that order, for a "
                         "profiler to pick one launch (ncu --launch-skip)")
    args = ap.parse_args(argv)
    if args.cluster:
        from pdserve.kernels import cuda_decode_attention as cda

        c, st, gr, *look = (int(x) for x in args.cluster.split("/"))
        cda.FULL_LAYERS = cda.ClusterConfig(cluster=c, stages=st, max_rows=64, max_groups=gr,
                                            lookahead=look[0] if look else 1)
        cda.FULL_LAYERS_FEW = None
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.launches:
        _launch_only(args.launches, [int(x) for x in args.batches.split(",")],
                     [int(x) for x in args.contexts.split(",")])
        return 0
    t0 = time.time()
    tilings = [t for t in args.tilings.split(",") if t]
    bw = copy_bandwidth(1 << 30)
    gen = torch.Generator().manual_seed(1)
    rows, records = [], []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            for window_left in (-1, WINDOW_LEFT):
                r = _case(b, ctx, window_left, tilings, gen)
                records.append(dict(batch=b, context=ctx, window_left=window_left, **r))
                best_fi = min((r[k] for k in ("xqa", "fa2") if r.get(k)), default=None)
                rows.append([
                    b, ctx, "full" if window_left < 0 else "window", r.get("splits", "-"),
                    *(fmt_us(r.get(k)) for k in COLUMNS), *(fmt_us(r.get(f"triton {s}")) for s in tilings),
                    fmt_us(r["kv_bytes"] / bw),
                    f"{r['triton'] / best_fi:.2f}" if r.get("triton") and best_fi else "-",
                    f"{r['cluster'] / r['triton']:.2f}" if r.get("cluster") and r.get("triton") else "-",
                    f"{r['diff']:.1e}" if "diff" in r else "-",
                    f"{r['cluster_diff']:.1e}" if "cluster_diff" in r else "-",
                ])
                torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    title = (f"Decode sink attention per layer call (us, CUDA graphs, L2 flushed; {props.name}, "
             f"{props.multi_processor_count} SMs)")
    text = table(title, ["batch", "context", "layer", "triton splits", "cluster", "triton", "XQA", "FA2 sink",
                         *(f"triton {s}" for s in tilings), "KV floor", "triton / best FlashInfer",
                         "cluster / triton", "triton vs XQA (rel L2)", "cluster vs triton (rel L2)"], rows)
    print(f"bench: {time.time() - t0:.0f}s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), device=props.name, copy_bw=bw,
                           command="python -m pdserve.bench.decode_attention " + " ".join(
                               argv if argv is not None else sys.argv[1:]),
                           table=text, results=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
