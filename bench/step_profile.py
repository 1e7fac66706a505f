"""Where one decode step's time goes: per-category GPU time of the replayed CUDA graph, kernels per
step, and the host time spent before each replay (bench/engine_gpu.py --profile). And where a
prefill's goes: per-category time of one prompt (every chunk) against its FLOP floor.

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

    def fp8(self, real):
        """engine.model's linear_fp8 (attention precision fp8), labelled the same way."""
        def linear_fp8(x, w, scale, b=None):
            with torch.profiler.record_function("L:" + self._names.get(w.shape[0], "linear")):
                return real(x, w, scale, b)
        return linear_fp8


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
    lin = _LinearLabels(torch.nn.functional, {(m.num_q_heads + 2 * m.num_kv_heads) * d: "qkv GEMM",
                                              m.cfg.hidden_size: "o_proj GEMM",
                                              m.w.unembedding.shape[0]: "vocab GEMM"})
    p.set(M, "F", lin)
    p.set(M, "linear_fp8", lin.fp8(M.linear_fp8))
    p.set(m, "_add_norm", _labelled("residual + RMSNorm", m._add_norm))
    p.set(m, "_route", _labelled("router", m._route))
    p.set(M, "experts_forward", _labelled("MoE experts", M.experts_forward))
    p.set(m, "rope", _LabelledRope(m.rope))
    p.set(runner.cache, "write", _labelled("RoPE + KV write", runner.cache.write))
    p.set(TR, "rope_qkv_write", _labelled("RoPE + KV write", TR.rope_qkv_write))
    p.set(TR, "qkv_rope_write", _labelled("QKV GEMV + RoPE + KV write", TR.qkv_rope_write))
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

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        import json

        return json.loads(path.read_text())["traceEvents"]


_GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")


def _kernels(events: list[dict], outermost: bool = False, cats: tuple[str, ...] = ("kernel",)) -> list[dict]:
    """GPU kernels (or the ops of `cats`) with the innermost (or outermost) `L:` label around the
    launch (or 'graph' for replays)."""
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
        if g.get("ph") != "X" or g.get("cat") not in cats:
            continue
        r = rt.get((g.get("args") or {}).get("correlation"))
        label = "other"
        if r is not None and "GraphLaunch" in r["name"]:
            label = "graph"
        elif r is not None:
            best = None
            for a in ann[max(0, bisect.bisect_right(starts, r["ts"]) - 64):bisect.bisect_right(starts, r["ts"])]:
                if a["ts"] <= r["ts"] <= a["ts"] + a["dur"] and (
                        best is None or (a["dur"] > best["dur"] if outermost else a["dur"] < best["dur"])):
                    best = a
            if best is not None:
                label = best["name"][2:]
        out.append(dict(name=g["name"], label=label, ts=g.get("ts", 0), dur=g.get("dur", 0)))
    return out


def critical_path(kernels: list[dict], gap_us: float = 200.0) -> collections.Counter:
    """Each kernel name's share of the critical path, summed: for a kernel (in start order), the time
    from the latest end of the kernels before it to its own end (0 if it ends before that). With PDL a
    kernel starts while the one before it runs and waits for it, so its duration overstates what it
    adds to the step; this share does not. A kernel that starts more than `gap_us` after that latest
    end begins a new stretch (the time between replays is nobody's): its share is its duration."""
    share = collections.Counter()
    last_end = None
    for k in sorted(kernels, key=lambda k: k["ts"]):
        end = k["ts"] + k["dur"]
        if last_end is None or k["ts"] - last_end > gap_us:
            share[k["name"]] += k["dur"]
            last_end = end
        else:
            share[k["name"]] += max(end - last_end, 0.0)
            last_end = max(last_end, end)
    return share


def gpu_timeline(ops: list[dict], steps: int) -> dict:
    """The GPU's side of `steps` engine steps traced back to back (`_kernels(..., cats=_GPU_OPS)`),
    per step: busy (the union of the ops' intervals), idle (the rest of the span from the first op's
    start to the last op's end) and the work outside the graph replays (the copies and kernels the
    engine issues around them), with the names of that work and of the ops around the longest gaps."""
    ops = sorted(ops, key=lambda k: k["ts"])
    if not ops or steps < 1:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "outside_graph_us": 0.0, "outside_graph_ops": 0.0,
                "outside_graph": {}, "gaps": []}
    busy, gaps = 0.0, []
    start, end = ops[0]["ts"], ops[0]["ts"] + ops[0]["dur"]
    prev = ops[0]
    for k in ops[1:]:
        if k["ts"] > end:
            busy += end - start
            gaps.append((k["ts"] - end, prev["name"], k["name"]))
            start = k["ts"]
        if k["ts"] + k["dur"] >= end:
            end, prev = k["ts"] + k["dur"], k
    busy += end - start
    span = end - ops[0]["ts"]
    outside = collections.Counter()
    counts = collections.Counter()
    for k in ops:
        if k["label"] != "graph":
            outside[k["name"]] += k["dur"]
            counts[k["name"]] += 1
    gaps.sort(reverse=True)
    return {"span_us": span / steps, "busy_us": busy / steps, "idle_us": (span - busy) / steps,
            "outside_graph_us": sum(outside.values()) / steps, "outside_graph_ops": sum(counts.values()) / steps,
            "outside_graph": {n: {"us": v / steps, "ops": counts[n] / steps} for n, v in outside.most_common()},
            "gaps": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:5]]}


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
    # each kernel name's split over categories, from the eager step (once a name)
    split = {}
    for name in {k["name"] for k in replayed}:
        m = name_map.get(name) or {"(not seen eagerly)": 1}
        tot = sum(m.values())
        split[name] = {c: v / tot for c, v in m.items()}
    cats = collections.Counter()
    count = collections.Counter()
    crit = collections.Counter()
    for name, share in critical_path(replayed).items():
        for c, f in split[name].items():
            crit[c] += share * f
    for k in replayed:
        for c, f in split[k["name"]].items():
            cats[c] += k["dur"] * f
            count[c] += f
    res["categories"] = {c: {"us": cats[c] / n, "critical_us": crit[c] / n, "kernels": count[c] / n}
                         for c, _ in cats.most_common()}
    res["kernels_per_step"] = len(replayed) / n
    res["kernel_us_per_step"] = sum(k["dur"] for k in replayed) / n
    # the pipelined engine in its steady state: wall time a step, and what the GPU does around the
    # replays (inputs staged, the next ids fed, the argmax, the copy of the ids to the host)
    left = min(s.params.max_new_tokens - len(s.output_ids) for s in eng.running) - 4
    m = max(min(steps, left // 3), 1)
    for _ in range(m):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(m):
        eng.step()
    torch.cuda.synchronize()
    res["pipelined_step_us"] = (time.perf_counter() - t0) / m * 1e6
    res["pipeline"] = gpu_timeline(_kernels(_trace(eng.step, m), cats=_GPU_OPS), m)
    from pdserve.kernels.pdl import enabled

    res["pdl"] = enabled(runner.device)  # then a kernel's duration includes its wait for the one before
    runner.decode_graphs = saved
    return res


def table(profiles: dict[str, dict]) -> list[str]:
    """Markdown: one column triple (us of kernel durations, us on the critical path, kernels) per
    profiled variant."""
    names = list(profiles)
    cats = []
    for p in profiles.values():
        cats += [c for c in p["categories"] if c not in cats]
    head = "| per decode step | " + " | ".join(f"{n}: us | {n}: critical us | {n}: kernels" for n in names) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(names)]
    for c in cats:
        cells = []
        for p in profiles.values():
            v = p["categories"].get(c)
            cells += [f"{v['us']:.0f}", f"{v.get('critical_us', 0):.0f}", f"{v['kernels']:.0f}"] if v else ["-"] * 3
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for label, key, fmt in (("all kernels (sum of durations)", "kernel_us_per_step", "{:.0f}"),
                            ("graph replay alone (back to back)", "replay_us", "{:.0f}"),
                            ("host before the replay (plan + inputs)", "host_before_replay_us", "{:.0f}")):
        cells = []
        for p in profiles.values():
            cells += [fmt.format(p[key]), "", f"{p['kernels_per_step']:.0f}" if key == "kernel_us_per_step" else ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, key in (("pipelined engine step (wall, steady state)", "pipelined_step_us"),
                       ("GPU busy a pipelined step", "busy_us"), ("GPU idle a pipelined step", "idle_us"),
                       ("GPU work outside the graph a pipelined step", "outside_graph_us")):
        cells = []
        for p in profiles.values():
            v = p.get(key, p.get("pipeline", {}).get(key))
            cells += [f"{v:.0f}" if v is not None else "-", "",
                      f"{p['pipeline']['outside_graph_ops']:.0f}" if key == "outside_graph_us" and "pipeline" in p else ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for h in next(iter(profiles.values()))["host_us"]:
        cells = []
        for p in profiles.values():
            cells += [f"{p['host_us'].get(h, 0):.0f}", "", ""]
        lines.append(f"| host: {h} | " + " | ".join(cells) + " |")
    if any(p.get("pdl") for p in profiles.values()):
        lines.append("\nKernels launched with programmatic dependent launch (kernels/pdl.py): a kernel's duration "
                     "includes the time its CTAs wait for the kernel before it, so the durations add up to more "
                     "than the replay; the critical-path column (`critical_path`) counts only what each adds.")
    return lines


# -- prefill ------------------------------------------------------------------------------------
PREFILL_CATEGORIES = {"MoE experts": "MoE", "attention": "attention", "qkv GEMM": "dense GEMMs",
                      "o_proj GEMM": "dense GEMMs", "vocab GEMM": "dense GEMMs", "linear": "dense GEMMs",
                      "residual + RMSNorm": "norms/RoPE", "RoPE + KV write": "norms/RoPE", "router": "router",
                      "embedding": "embedding", "other": "other"}


def prefill_flops(cfg, n: int, chunk: int, num_q_heads: int, num_kv_heads: int) -> dict[str, float]:
    """Useful FLOPs of a prefill of n tokens on one rank, per category (norms, RoPE and the
    embedding have none worth a floor: they are memory-bound and small)."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    chunks = -(-n // chunk)
    pairs = {"full": n * (n + 1) / 2,  # causal (query, key) pairs; sliding: at most window keys each
             "sliding": sum(min(i + 1, cfg.sliding_window) for i in range(min(n, cfg.sliding_window)))
             + max(0, n - cfg.sliding_window) * cfg.sliding_window}
    att = sum(4 * num_q_heads * d * pairs["sliding" if cfg.is_sliding(i) and cfg.sliding_window > 0 else "full"]
              for i in range(layers))
    return {
        "MoE": n * layers * cfg.experts_per_token * 6 * h * cfg.intermediate_size,
        "attention": att,
        "dense GEMMs": n * layers * (2 * h * (num_q_heads + 2 * num_kv_heads) * d + 2 * num_q_heads * d * h)
        + chunks * 2 * h * cfg.vocab_size,
        "router": n * layers * 2 * h * cfg.num_local_experts,
    }


def fp8_flops_rate(m: int = 8192, reps: int = 10) -> float | None:
    """FP8 `torch._scaled_mm` m^3 FLOP/s on this GPU (None without CUDA): the prefill floor's rate."""
    if not torch.cuda.is_available():
        return None
    x = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    y = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def mm():
        return torch._scaled_mm(x, y.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    mm()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        mm()
    e1.record()
    torch.cuda.synchronize()
    return 2 * m**3 * reps / (e0.elapsed_time(e1) / 1e3)


def _outer_annotations(events: list[dict]) -> list[dict]:
    """`L:` annotations that no other `L:` annotation encloses (host time on CPU)."""
    ann = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                  and str(e.get("name", "")).startswith("L:")), key=lambda a: (a["ts"], -a["dur"]))
    out, end = [], float("-inf")
    for a in ann:
        if a["ts"] >= end:
            out.append(a)
            end = a["ts"] + a["dur"]
    return out


def profile_prefill(runner, ids: list[int], fp8_rate: float | None = None) -> dict:
    """One labelled prefill of `ids` (in the runner's chunks): ms per category (GPU kernel time on
    CUDA, host time of each model part on CPU) and each category's floor, FLOPs / `fp8_rate`."""
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    cuda = runner.device.type == "cuda"

    def prefill():
        seq = Sequence("profile", list(ids), SamplingParams(max_new_tokens=1, temperature=0))
        seq.blocks = runner.cache.reserve(len(ids), local_prompt_tokens=len(ids))
        try:
            runner.prefill(seq)
        finally:
            runner.cache.release(seq.blocks)

    prefill()  # warm-up at this length (JIT, plans)
    with labels(runner):
        events = _trace(prefill, 1)
    ms = collections.Counter()
    if cuda:
        for k in _kernels(events, outermost=True):
            ms[PREFILL_CATEGORIES.get(k["label"], k["label"])] += k["dur"] / 1e3
    else:
        for a in _outer_annotations(events):
            ms[PREFILL_CATEGORIES.get(a["name"][2:], a["name"][2:])] += a["dur"] / 1e3
    m = runner.model
    flops = prefill_flops(m.cfg, len(ids), runner.prefill_chunk_tokens, m.num_q_heads, m.num_kv_heads)
    cats = {c: {"ms": ms.get(c, 0.0),
                "floor_ms": flops[c] / fp8_rate * 1e3 if fp8_rate and c in flops else None}
            for c in ["MoE", "attention", "dense GEMMs", "norms/RoPE", "router", "embedding"]
            + sorted(set(ms) - {"MoE", "attention", "dense GEMMs", "norms/RoPE", "router", "embedding"})}
    return {"tokens": len(ids), "chunk": runner.prefill_chunk_tokens, "time": "GPU kernels" if cuda else "host",
            "categories": cats, "fp8_tflops": fp8_rate / 1e12 if fp8_rate else None,
            "total_ms": sum(ms.values()),
            "floor_ms": sum(flops.values()) / fp8_rate * 1e3 if fp8_rate else None}


def prefill_table(prof: dict) -> list[str]:
    """Markdown: ms, floor and floor / time per category of one profiled prefill."""
    def cell(v):
        return "-" if v is None else f"{v:.1f}"

    lines = [f"| prefill {prof['tokens']} tokens (chunks of {prof['chunk']}), {prof['time']} | ms | floor ms "
             "| floor / time |", "|---|---|---|---|"]
    for c, v in list(prof["categories"].items()) + [("all", {"ms": prof["total_ms"], "floor_ms": prof["floor_ms"]})]:
        ratio = f"{v['floor_ms'] / v['ms']:.0%}" if v["floor_ms"] is not None and v["ms"] > 0 else "-"
        lines.append(f"| {c} | {cell(v['ms'])} | {cell(v['floor_ms'])} | {ratio} |")
    return lines
