"""Where a full layer's decode attention spends its time, warp by warp and block by block: the
cluster kernel (kernels/cuda_decode_attention.py) built with DA_TRACE, each warp recording when
its copies landed and its sums were done for every 128-key block it walks (%globaltimer).

A full layer's attention at one token of 8k keys adds 12-16 us to a 120b step for 16.8 MB of cache
(3.9 us at the copy bandwidth), and alone each block a CTA walks after its first costs 1.3-1.6 us
whether its keys come from DRAM or L2 (docs/kernels.md, "Cluster decode attention"). This says which
part of a block that is: waiting for the copies, or the sums after they landed.

Each case (requests x keys, the engine's full-layer shape for that batch) runs three ways, each a
CUDA graph as the engine runs it, the GPU first sleeping while the host queues the rep, then the L2
flushed:
- alone: nothing before it but the flush (its PDL wait passes as soon as the flush ends);
- behind a spin: a one-CTA kernel (launched with PDL, as the engine's kernels are) that lets its
  dependents launch at once and then spins `--lead-us`, so the attention's CTAs can be placed, issue
  their first blocks' copies and wait: its best case (`python -m pdserve.bench.pdl_chain --overlap`
  says whether and when such a dependent is placed early);
- behind the QKV projection: the engine's FP8 QKV + RoPE launch of the step's tokens
  (kernels/cuda_gemv_fp8.qkv_rope_fp8, random weights of gpt-oss' shape) writing their keys into the
  cache, as in the step: when the attention's CTAs find room beside its 640 CTAs, and what follows.

    python -m pdserve.bench.attention_trace [--contexts 1024,8192,32768] [--batches 1] [--lead-us 20]
                                            [--clusters 16,8,1] [--reps 10] [--out FILE.json]

`--clusters` runs the full layers with these cluster sizes (two blocks of shared memory a CTA)
instead of the engine's shape for the batch.

Prints per case, in us from the moment the PDL wait passed (the earliest warp's), medians and p90
over every warp of every rep: when the warps started and issued their first copies, each block's
copies landed and sums done, how long a warp waited for a block's copies after its previous sums (the
copies' part), how long the sums took after the landing (the arithmetic's part), the warps' fold in
the CTA, the cluster's partials met (its barrier passed), and the end (max: what the step waits for).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pdserve.bench.kernels import HKV, HQ, PAGE, QUEUE_SLEEP, SM_SCALE, _ours, _paged, flush_l2, graphed
from pdserve.bench.pdl_chain import overlap_kernels
from pdserve.kernels import cuda_decode_attention as cda
from pdserve.kernels.pdl import launch_cuda

# word offsets of a warp's record (the .cu file's `Trace`)
T_START, T_ISSUED, T_PDL, T_BLOCKS, TRACE_BLOCKS = 0, 1, 2, 3, 16
T_FOLDED = T_BLOCKS + 2 * TRACE_BLOCKS
T_END, T_SM, T_MY_BLOCKS, T_MET = T_FOLDED + 1, T_FOLDED + 2, T_FOLDED + 3, T_FOLDED + 4
MODES = ("alone", "behind a spin", "behind the QKV projection")


def _qkv_projection(attn, kv: torch.Tensor, rows: int, ctx: int):
    """The engine's FP8 QKV + RoPE launch of `rows` tokens at position ctx - 1 (random weights of
    gpt-oss' shape), writing each token's key and value into the cache slot the attention reads last."""
    from pdserve.engine.config import preset
    from pdserve.engine.rope import RotaryEmbedding
    from pdserve.kernels.cuda_gemv_fp8 import qkv_rope_fp8
    from pdserve.kernels.fp8 import quantize_weight_fp8

    dev, hidden = kv.device, 2880
    g = torch.Generator(device=dev).manual_seed(ctx)
    w, scale = quantize_weight_fp8(torch.randn((HQ + 2 * HKV) * kv.shape[-1], hidden, device=dev, generator=g) * 0.02)
    bias = (torch.randn(w.shape[0], device=dev, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, hidden, device=dev, generator=g).to(torch.bfloat16)
    rope = RotaryEmbedding(preset("120b"), dev)
    positions = torch.full((rows,), ctx - 1, dtype=torch.int64, device=dev)
    pages = attn._block_tables[:rows, (ctx - 1) // PAGE].to(torch.int64)
    slots = (pages * PAGE + (ctx - 1) % PAGE).contiguous()
    return lambda: qkv_rope_fp8(x, w, scale, bias, positions, rope.cos, rope.sin, slots, kv, HQ, HKV)


def _q(v: torch.Tensor, p: float) -> float:
    return float(torch.quantile(v.double(), p)) if v.numel() else float("nan")


def summarize(recs: list[torch.Tensor], stages: int) -> dict:
    """recs: one [warps, TRACE_WORDS] int64 record per rep -> times in us from each rep's PDL pass."""
    rel, rows = [], []
    for r in recs:
        r = r[r[:, T_START] > 0]  # warps of idle clusters leave no record
        times = r.clone()
        times[:, T_SM:T_MET] = 0  # plain numbers, not times
        rel.append((times - r[:, T_PDL].min()).double() / 1e3)
        rows.append(r[:, T_MY_BLOCKS])
    t, blocks = torch.cat(rel), torch.cat(rows)
    marks = t[t > -1e6]
    diffs = (marks.sort().values.diff())
    out = {"warps": int(t.shape[0]) // max(len(recs), 1), "blocks_per_warp": sorted({int(b) for b in blocks}),
               "timer_step_ns": float(diffs[diffs > 0].min() * 1e3) if (diffs > 0).any() else None,
               "start": _q(t[:, T_START], 0.5), "issued": _q(t[:, T_ISSUED], 0.5),
               "folded": (_q(t[:, T_FOLDED], 0.5), _q(t[:, T_FOLDED], 0.9)),
               "met": (_q(t[:, T_MET], 0.5), _q(t[:, T_MET], 0.9)) if bool((t[:, T_MET] > -1e6).all()) else None,
               "end": (_q(t[:, T_END], 0.5), _q(t[:, T_END], 0.9), float(t[:, T_END].max())), "blocks": []}
    for j in range(min(int(blocks.max()), TRACE_BLOCKS)):
        has = blocks > j
        landed, summed = t[has, T_BLOCKS + 2 * j], t[has, T_BLOCKS + 2 * j + 1]
        before = t[has, T_BLOCKS + 2 * j - 1] if j else t[has, T_PDL]  # the warp's previous sums (or its wait)
        out["blocks"].append({
            "block": j, "landed": (_q(landed, 0.5), _q(landed, 0.9)), "summed": (_q(summed, 0.5), _q(summed, 0.9)),
            "waited": (_q(landed - before, 0.5), _q(landed - before, 0.9)),
            "sums": (_q(summed - landed, 0.5), _q(summed - landed, 0.9)),
            # copies requested when the block `stages` before was summed (the first ones before the wait)
            "in_flight": (_q(landed - t[has, T_BLOCKS + 2 * (j - stages) + 1], 0.5) if j >= stages else None)})
    return out


def _fmt(p: tuple | None) -> str:
    return "-" if p is None else " / ".join(f"{v:6.2f}" for v in p)


def report(name: str, s: dict) -> str:
    lines = [(f"{name}: {s['warps']} warps, blocks a warp {s['blocks_per_warp']}, timer step {s['timer_step_ns']} ns; "
             f"start {s['start']:.2f}, first copies issued {s['issued']:.2f}, warps folded {_fmt(s['folded'])}, "
             f"cluster met {_fmt(s['met'])}, end {_fmt(s['end'])} (p50 / p90 / max) us; "
             f"graph replay {s.get('replay_us', float('nan')):.2f} us"
             + (f"; the spin from {s['spin_us'][0]:.2f} to {s['spin_us'][1]:.2f} us" if "spin_us" in s else "")),
             (f"  {'block':>5} {'landed p50/p90':>16} {'summed p50/p90':>16} {'waited p50/p90':>16} "
             f"{'sums p50/p90':>16} {'issue->land p50':>16}")]
    for b in s["blocks"]:
        lines.append(f"  {b['block']:5d} {_fmt(b['landed']):>16} {_fmt(b['summed']):>16} {_fmt(b['waited']):>16} "
                     f"{_fmt(None if b['in_flight'] is None else (b['in_flight'],)):>16}")
    return "\n".join(lines)


def _case(a, lead, attn, kv: torch.Tensor, q: torch.Tensor, sinks: torch.Tensor, b: int, ctx: int,
          cfg: cda.ClusterConfig) -> dict:
    """One batch shape and launch shape, in each of MODES: name -> summary."""
    dev = q.device
    results = {}
    out, ref = torch.empty_like(q), torch.empty_like(q)
    trace = cda.trace_buffer(b, HKV, cfg, dev, attn._scratch.shape[2])

    def run(traced: bool = True) -> None:
        cda.decode_attention(q, kv, attn._block_tables, attn._seq_lens, sinks, SM_SCALE, -1, attn._scratch,
                             out=out if traced else ref, cfg=cfg, trace=trace if traced else None)

    run(), run(False)
    torch.cuda.synchronize()
    if not torch.equal(out, ref):  # the timing build must compute what the engine's computes
        raise SystemExit(f"batch {b} context {ctx}: the timing build's output differs from the engine build's")
    qkv = _qkv_projection(attn, kv, b, ctx)
    stamp = torch.zeros(2, dtype=torch.int64, device=dev)
    spin = lambda: launch_cuda(lead, (1, 1, 1), (32, 1, 1), 0, pdl=True,  # as the engine launches every kernel
                               args=[int(a.lead_us * 1e3), stamp, 1])
    before = dict(zip(MODES, (lambda: None, spin, qkv)))
    for mode in MODES:
        # as the engine runs it: one CUDA graph (the kernel before and the attention, PDL between them)
        replay = graphed(lambda mode=mode: (before[mode](), run()))
        recs, spans = [], []
        for _ in range(a.reps):
            trace.zero_()
            torch.cuda._sleep(QUEUE_SLEEP)  # the host queues the rep meanwhile: no launch gap in it
            flush_l2()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            replay()
            t1.record()
            torch.cuda.synchronize()
            recs.append(trace.reshape(-1, cda.TRACE_WORDS).cpu())
            spans.append(t0.elapsed_time(t1) * 1e3)
        s = summarize(recs, cfg.stages)
        s["replay_us"] = sorted(spans)[len(spans) // 2]  # the kernel before and the attention
        if mode == "behind a spin":  # the last rep's spin, from that rep's PDL pass
            r = recs[-1][recs[-1][:, T_START] > 0]
            pdl = int(r[:, T_PDL].min())
            s["spin_us"] = [(int(v) - pdl) / 1e3 for v in stamp.cpu()]
        name = f"{b} request(s) x {ctx} keys, cluster {cfg.cluster}, stages {cfg.stages}, {mode}"
        print(report(name, s), flush=True)
        results[name] = s
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--lead-us", type=float, default=20.0)
    ap.add_argument("--clusters", default=None, help="cluster sizes to run instead of the engine's shape")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    lead = overlap_kernels()["spin"]
    results = {}
    for b in (int(x) for x in a.batches.split(",")):
        for ctx in (int(x) for x in a.contexts.split(",")):
            batch, kv, q = _paged([ctx] * b, [1] * b, torch.Generator().manual_seed(ctx + b))
            sinks = torch.randn(q.shape[1], device=dev)
            attn = _ours(-1, decode_backend="triton", cuda_graph_batch_size=b, max_pages_per_request=-(-ctx // PAGE))
            attn.plan(batch)
            if not cda.applies(q, kv, -1):
                print(f"batch {b} context {ctx}: the cluster kernel does not apply", flush=True)
                continue
            for cfg in ([cda.config_for(-1, b)] if a.clusters is None else
                        [cda.ClusterConfig(int(c), 2, b) for c in a.clusters.split(",")]):
                results.update(_case(a, lead, attn, kv, q, sinks, b, ctx, cfg))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
