"""Where the FP8 attention projections spend their time inside the replayed decode step, CTA by CTA.

The step timeline (bench/step_timeline.py) says what each kernel adds to a layer; it cannot say why a
120b layer's FP8 QKV + RoPE + KV-write launch adds about 7 us after the norm before it for 14.7 MB of
weights that its CTAs request ahead of their PDL wait (3.4 us at the copy bandwidth), even when those
weights were requested into L2 during the MoE. This table does: the timing build of
kernels/cuda_gemv_fp8.cu (GF_TRACE) stamps, per CTA, its start (when it was placed on an SM), its
weight copies requested, its PDL wait passed, warp 0's token rows staged, warp 0's copies landed, the
CTA's sums done and its end (%globaltimer), inside the captured step, for the QKV launch and the O
projection (`gemv_fp8`) of every layer.

Times are in us from the moment the launch's first CTA passed its wait (about when the kernel before
it ended). Per launch kind (QKV, O) and layer kind (windowed, full), over the middle layers and the
replays: the median of each launch's 10th / 50th / 90th percentile and maximum over its CTAs. Also
how many CTAs were placed only after that moment, and how many found warp 0's copies still in flight
after staging their token rows (landed more than 0.25 us after staged).

Used by `python -m pdserve.bench.launch_ab ... --fp8 --trace` (one token, FP8 attention projections).
"""

from __future__ import annotations

import statistics

import torch

from pdserve.kernels import cuda_gemv_fp8 as gf

# word offsets of a CTA's record (the .cu file's `GfTrace`)
STAMPS = ("start", "issued", "pdl", "staged", "landed", "summed", "end")
SM = 7
ENTRIES = {"gemv_fp8_rope": "QKV + RoPE", "gemv_fp8": "O"}
QUANTILES = (0.1, 0.5, 0.9, 1.0)
LATE_LANDING_US = 0.25


def most_ctas(cfg) -> int:
    """CTAs of the larger of a layer's two traced launches (QKV: its rows, O: the hidden size, 8 rows a CTA)."""
    return max((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size) // gf.ROWS


def new_trace(launches: int, ctas: int, device: torch.device) -> gf.Trace:
    """A Trace with room for `launches` launches of up to `ctas` CTAs."""
    return gf.Trace(buffer=torch.zeros(launches * ctas * gf.TRACE_WORDS, dtype=torch.int64, device=device),
                    scratch=torch.zeros(ctas * gf.TRACE_WORDS, dtype=torch.int64, device=device))


def launch_times(rec: torch.Tensor) -> dict:
    """rec [CTAs, TRACE_WORDS] int64 of one launch -> per stamp, us from the first CTA's wait passed
    ([CTAs] float64), and the SMs."""
    t0 = rec[:, STAMPS.index("pdl")].min()
    out = {name: (rec[:, i] - t0).double() / 1e3 for i, name in enumerate(STAMPS)}
    out["sm"] = rec[:, SM]
    return out


def timer_step_ns(rec: torch.Tensor) -> int:
    """The smallest nonzero difference between two stamps of a launch: the timer's resolution, at best."""
    v = torch.unique(rec[:, : len(STAMPS)].flatten())
    d = v[1:] - v[:-1]
    d = d[d > 0]
    return int(d.min()) if d.numel() else 0


def summarize(replays: list[torch.Tensor], trace: gf.Trace, kinds: list[str]) -> list[dict]:
    """replays: a copy of trace.buffer after each replay; kinds: each layer's kind ("windowed" / "full").
    One row per (entry, layer kind) over the middle layers (the first and last of each are left out)."""
    layer_of: dict[str, int] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    steps = []
    for entry, start, ctas in trace.launches:
        layer = layer_of.get(entry, 0)
        layer_of[entry] = layer + 1
        if layer >= len(kinds):
            raise ValueError(f"{entry} launched {layer + 1} times for {len(kinds)} layers")
        same = [i for i, k in enumerate(kinds) if k == kinds[layer]]
        if layer in (same[0], same[-1]) and len(same) > 2:
            continue
        for buf in replays:
            rec = buf[start:start + ctas * gf.TRACE_WORDS].view(ctas, gf.TRACE_WORDS)
            groups.setdefault((entry, kinds[layer]), []).append(launch_times(rec))
            steps.append(timer_step_ns(rec))
    rows = []
    for (entry, kind), launches in groups.items():
        row = {"launch": ENTRIES.get(entry, entry), "layers": kind, "launches": len(launches),
               "ctas": int(launches[0]["start"].numel())}
        for name in STAMPS:
            row[name] = {q: statistics.median(float(torch.quantile(t[name], q)) for t in launches) for q in QUANTILES}
        row["placed_after_wait"] = statistics.median(int((t["start"] > 0).sum()) for t in launches)
        row["late_landing"] = statistics.median(int((t["landed"] - t["staged"] > LATE_LANDING_US).sum())
                                                for t in launches)
        row["ctas_per_sm_max"] = statistics.median(int(torch.bincount(t["sm"]).max()) for t in launches)
        row["timer_step_ns"] = min(steps) if steps else 0
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"projection trace {title}: us from the launch's first wait passed; each stamp p10 / p50 / p90 / max "
          f"over a launch's CTAs, medians over launches", flush=True)
    for r in rows:
        print(f"  {r['launch']:10s} {r['layers']:8s} {r['launches']:3d} launches x {r['ctas']} CTAs; placed after the "
              f"wait {r['placed_after_wait']:.0f}; copies landing > {LATE_LANDING_US} us after staging "
              f"{r['late_landing']:.0f}; most CTAs on one SM {r['ctas_per_sm_max']:.0f}; timer step "
              f"{r['timer_step_ns']} ns", flush=True)
        for name in STAMPS:
            print(f"    {name:7s} " + " ".join(f"{r[name][q]:7.2f}" for q in QUANTILES), flush=True)
