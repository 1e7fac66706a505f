"""Where one decode step's time goes: per-category GPU time of the replayed CUDA graph, kernels per
step, and the host time spent before each replay (bench/engine_gpu.py --profile).

Kernels inside a graph replay carry no Python context, so the categories come from an eager step
of the same batch profiled with a label around every model part (record_function): each kernel
name's time is split over the parts that launched it eagerly, then applied to the kernels of the
replay. Host phases are timed with wall clocks around the engine's calls in graph mode.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

_GEMM = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "matmul")


class _Patches:
    def __init__(self):
        self.items = []

    def set(self, obj, attr, new):
        had = attr in getattr(obj, "__dict__", {})
        self.items.append((obj, attr, getattr(obj, attr), had))
        setattr(obj, attr, new)

    def undo(self):
        for obj, attr, old, had in reversed(self.items):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        self.items = []


def _labelled(label, fn):
    def wrapped(*a, **k):
        with torch.profiler.record_function("L:" + label):
            return fn(*a, **k)
    return wrapped


class _LinearLabels:
    """Stands in for torch.nn.functional in engine.model: labels each linear by its weight."""

    def __init__(self, real, names):
        self._real, self._names = real, names

    def __getattr__(self, n):
        return getattr(self._real, n)

    def linear(self, x, w, b=None):
        with torch.profiler.record_function("L:" + self._names.get(w.shape[0], "linear")):
            return self._real.linear(x, w, b)


class _LabelledRope:
    """engine.model's RotaryEmbedding with a label around each call (tables passed through)."""

    def __init__(self, rope):
        self._rope, self.cos, self.sin = rope, rope.cos, rope.sin

    def __call__(self, *a, **k):
        with torch.profiler.record_function("L:RoPE + KV write"):
            return self._rope(*a, **k)


@contextlib.contextmanager
def labels(runner):
    """Label every model part of an eager step (one record_function per call)."""
    import pdserve.engine.llm_engine as LE
    import pdserve.engine.model as M
    import pdserve.kernels.triton_rope as TR

    m, p = runner.model, _Patches()
    d = m.cfg.head_dim
    p.set(M, "F", _LinearLabels(torch.nn.functional, {(m.num_q_heads + 2 * m.num_kv_heads) * d: "qkv GEMM",
                                                      m.cfg.hidden_size: "o_proj GEMM",
                                                      m.w.unembedding.shape[0]: "vocab GEMM"}))
    p.set(m, "_add_norm", _labelled("residual + RMSNorm", m._add_norm))
    p.set(m, "_route", _labelled("router", m._route))
    p.set(M, "experts_forward", _labelled("MoE experts", M.experts_forward))
    p.set(m, "rope", _LabelledRope(m.rope))
    p.set(runner.cache, "write", _labelled("RoPE + KV write", runner.cache.write))
    p.set(TR, "rope_qkv_write", _labelled("RoPE + KV write", TR.rope_qkv_write))
    p.set(m, "_embed", _labelled("embedding", m._embed))
    p.set(LE, "sample", _labelled("sampling", LE.sample))
    for att in list(runner.attention.values()):
        p.set(att, "run", _labelled("attention", att.run))
    try:
        yield
    finally:
        p.undo()


def _trace(fn, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        import json

        return json.loads(path.read_text())["traceEvents"]


def _kernels(events: list[dict]) -> list[dict]:
    """GPU kernels with the innermost `L:` label around the launch (or 'graph' for replays)."""
    rt = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                rt[c] = e
    ann = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                  and str(e.get("name", "")).startswith("L:")), key=lambda a: a["ts"])
    starts = [a["ts"] for a in ann]
    out = []
    for g in events:
        if g.get("ph") != "X" or g.get("cat") != "kernel":
            continue
        r = rt.get((g.get("args") or {}).get("correlation"))
        label = "other"
        if r is not None and "GraphLaunch" in r["name"]:
            label = "graph"
        elif r is not None:
            best = None
            for a in ann[max(0, bisect.bisect_right(starts, r["ts"]) - 64):bisect.bisect_right(starts, r["ts"])]:
                if a["ts"] <= r["ts"] <= a["ts"] + a["dur"] and (best is None or a["dur"] < best["dur"]):
                    best = a
            if best is not None:
                label = best["name"][2:]
        out.append(dict(name=g["name"], label=label, dur=g.get("dur", 0)))
    return out


def _category(label: str, name: str) -> str:
    if label == "router":
        gemm = any(s in name.lower() for s in _GEMM)
        return "router GEMM" if gemm else "router top-k/softmax/casts" if "_router_kernel" not in name else "router (fused)"
    return label


def profile_decode(eng, runner, graphs, steps: int = 20) -> dict:
    """Profile the engine's decode steps at its current batch (graph mode is what is timed).
    Leaves runner.decode_graphs as it found it."""
    import pdserve.engine.llm_engine as LE

    saved = runner.decode_graphs
    res = {}
    # host phases in graph mode, one engine step at a time (GPU idle at each start)
    runner.decode_graphs = graphs
    for _ in range(3):
        eng.step()
    timers = collections.defaultdict(list)
    p = _Patches()

    def timed(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name].append(time.perf_counter() - t0)
        return wrapped

    p.set(runner, "decode_plan", timed("step plan (block bookkeeping, tables)", runner.decode_plan))
    p.set(graphs, "_pad_plan", timed("inputs + attention plans + copy", graphs._pad_plan))
    p.set(LE, "sample", timed("sampling (waits for the replay)", LE.sample))
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            timers["engine step"].append(time.perf_counter() - t0)
    finally:
        p.undo()
    res["host_us"] = {k: statistics.median(v) * 1e6 for k, v in timers.items()}
    res["host_before_replay_us"] = (res["host_us"]["step plan (block bookkeeping, tables)"]
                                    + res["host_us"]["inputs + attention plans + copy"])
    # replay alone, back to back
    step = graphs._steps[graphs.size_for(len(eng.running))]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step.graph.replay()
    e0.record()
    for _ in range(steps):
        step.graph.replay()
    e1.record()
    torch.cuda.synchronize()
    res["replay_us"] = e0.elapsed_time(e1) / steps * 1e3
    # eager labelled steps -> name map; replayed steps -> categories
    runner.decode_graphs = None
    eng.step()
    with labels(runner):
        eager = _kernels(_trace(eng.step, 2))
    name_map = collections.defaultdict(collections.Counter)
    for k in eager:
        name_map[k["name"]][_category(k["label"], k["name"])] += k["dur"]
    runner.decode_graphs = graphs
    eng.step()
    n = 5
    replayed = [k for k in _kernels(_trace(eng.step, n)) if k["label"] == "graph"]
    cats = collections.Counter()
    count = collections.Counter()
    for k in replayed:
        m = name_map.get(k["name"])
        if not m:
            cats["(not seen eagerly)"] += k["dur"]
            count["(not seen eagerly)"] += 1
            continue
        tot = sum(m.values())
        for c, v in m.items():
            cats[c] += k["dur"] * v / tot
            count[c] += v / tot
    res["categories"] = {c: {"us": cats[c] / n, "kernels": count[c] / n} for c, _ in cats.most_common()}
    res["kernels_per_step"] = len(replayed) / n
    res["kernel_us_per_step"] = sum(k["dur"] for k in replayed) / n
    runner.decode_graphs = saved
    return res


def table(profiles: dict[str, dict]) -> list[str]:
    """Markdown: one column pair (us, kernels) per profiled variant."""
    names = list(profiles)
    cats = []
    for p in profiles.values():
        cats += [c for c in p["categories"] if c not in cats]
    head = "| per decode step | " + " | ".join(f"{n}: us | {n}: kernels" for n in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(names)]
    for c in cats:
        cells = []
        for p in profiles.values():
            v = p["categories"].get(c)
            cells += [f"{v['us']:.0f}", f"{v['kernels']:.0f}"] if v else ["-", "-"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for label, key, fmt in (("all kernels (sum of durations)", "kernel_us_per_step", "{:.0f}"),
                            ("graph replay alone (back to back)", "replay_us", "{:.0f}"),
                            ("host before the replay (plan + inputs)", "host_before_replay_us", "{:.0f}")):
        cells = []
        for p in profiles.values():
            cells += [fmt.format(p[key]), f"{p['kernels_per_step']:.0f}" if key == "kernel_us_per_step" else ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for h in next(iter(profiles.values()))["host_us"]:
        cells = []
        for p in profiles.values():
            cells += [f"{p['host_us'].get(h, 0):.0f}", ""]
        lines.append(f"| host: {h} | " + " | ".join(cells) + " |")
    return lines
