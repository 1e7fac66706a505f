"""The replayed decode step as a timeline: per kernel of a layer, when it started against the end of
the kernel before it (launched early under PDL: how far ahead) and what it added to the step's span
(its end minus the latest end before it), medians over the middle layers.

The category table of bench/step_profile.py sums kernel durations; with programmatic dependent
launch the kernels overlap, so durations no longer add up to the step. This table does: the
"adds" column sums to the layer's span, which is what the step's critical path is made of.
Used by bench/launch_ab.py --timeline.
"""

from __future__ import annotations

import collections
import json
import statistics
import tempfile
from pathlib import Path

import torch


def kernel_events(replay, replays: int = 3) -> list[list[tuple[str, float, float]]]:
    """(name, start us, end us) of every kernel, per replay, in start order."""
    replay()  # warm, outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    per = len(kernels) // replays
    if per * replays != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernels over {replays} replays: not a whole number each")
    return [[(n, s, e) for s, e, n in kernels[i * per:(i + 1) * per]] for i in range(replays)]


def _short(name: str) -> str:
    name = name.split("(")[0].split("<")[0]
    return name[:40]


def layer_table(steps: list[list[tuple[str, float, float]]], marker: str = "route") -> list[dict]:
    """Per position in a layer window (from one kernel whose name contains `marker` to the next), the
    kernel's name and, as medians over the middle windows of every replay: its duration, how long before
    the previous kernel's end it started (lead), and what it added to the span (its end minus the
    latest end so far). Windows of the same sequence of names and the same parity go together (gpt-oss
    alternates windowed and full attention layers); the common ones are reported."""
    windows = collections.defaultdict(list)
    for step in steps:
        marks = [i for i, (n, _, _) in enumerate(step) if marker in n]
        for i, (a, b) in enumerate(zip(marks[1:-2], marks[2:-1])):  # skip the first and last windows
            w = step[a:b + 1]
            windows[(tuple(_short(n) for n, _, _ in w[1:]), i % 2)].append(w)
    if not windows:
        raise RuntimeError(f"no kernel named like {marker!r} in the step")
    most = max(len(v) for v in windows.values())
    rows = []
    kept = [(key, ws) for key, ws in windows.items() if 2 * len(ws) >= most]  # (one odd window count apart)
    for wi, ((names, _), ws) in enumerate(kept):
        for pos, name in enumerate(names, start=1):
            durs, leads, adds = [], [], []
            for w in ws:
                prev_end = max(e for _, _, e in w[:pos])
                _, s, e = w[pos]
                durs.append(e - s)
                leads.append(max(0.0, w[pos - 1][2] - s))
                adds.append(max(0.0, e - prev_end))
            rows.append({"window": wi, "kernel": name, "us": statistics.median(durs),
                         "lead_us": statistics.median(leads), "adds_us": statistics.median(adds), "windows": len(ws)})
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"timeline {title}: per kernel of a layer window, median over the windows of each kind", flush=True)
    for window in sorted({r["window"] for r in rows}):
        mine = [r for r in rows if r["window"] == window]
        print(f"  {'kernel':40s} {'us':>7s} {'lead':>7s} {'adds':>7s}")
        for r in mine:
            print(f"  {r['kernel']:40s} {r['us']:7.2f} {r['lead_us']:7.2f} {r['adds_us']:7.2f}")
        print(f"  {'layer span (' + str(mine[0]['windows']) + ' windows)':40s} {'':7s} {'':7s} "
              f"{sum(r['adds_us'] for r in mine):7.2f}", flush=True)
