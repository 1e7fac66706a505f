"""Kernel benchmarks on one GPU: sink attention and the FP8 MoE layer against peers and floors.

    python -m pdserve.bench.kernels [--quick] [--sections ceilings,attention,moe,moe_prefill,routing,gemm,sweep]
                            [--doc docs/performance.md] [--json results.json]

Prints one table per section and replaces the "## Kernels" section of `--doc` (date, device,
command, tables). Floors use ceilings measured in the same run: a device-to-device copy (bytes
read + written) and `torch._scaled_mm` FP8 (per-tensor scales, 8192^3, random data). Every timing
is the median over repetitions with the L2 cache flushed before each one; small launches are
replayed from CUDA graphs (as the engine runs decode), so host overhead is not counted.

`--warm-jit` only builds the FlashInfer modules the attention section needs (run it in the
background at the start of a device session). `--deepgemm-child` is the DeepGEMM part, run in a
separate process (DeepGEMM's extension can abort the process on a failed host assertion).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

HQ, HKV, HEAD_DIM, PAGE = 64, 8, 64, 16
SM_SCALE = 1 / math.sqrt(HEAD_DIM)
HIDDEN, INTER, TOP_K = 2880, 3072, 4  # INTER: 2880 padded for FP8 (kernels.fp8.pad_intermediate)
MODELS = {"20b": 32, "120b": 128}
DEV = "cuda"

_flush_buf: torch.Tensor | None = None


# ------------------------------------------------------------------------------------ timing
def flush_l2() -> None:
    """Evict L2 by *reading* 256 MB. (Writing it, as triton's do_bench does, leaves ~50 MB of
    dirty lines whose write-back the next kernel pays for: +50 % traffic for a batch-1 MoE layer.)"""
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.ones(32 << 20, dtype=torch.int64, device=DEV)
    _flush_buf.max()


def time_it(fn, reps: int = 25, warmup: int = 2, flush: bool = True) -> float:
    """Median seconds of fn() on the GPU (events around each call, L2 flushed before it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _timed(flush_l2 if flush else lambda: None, fn, reps, sleep=False) * 1e-6


def graphed(fn, warmup: int = 2):
    """Capture fn into a CUDA graph (after eager warm-up: compilation, JIT loading)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def time_graph(fn, reps: int = 25) -> float:
    return time_it(graphed(fn), reps=reps, warmup=1)


QUEUE_SLEEP = 2_000_000  # GPU cycles (about 1 ms) spent before each rep: the host enqueues it meanwhile


def _median_us(pairs) -> float:
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3


def _timed(before, what, reps: int, sleep: bool) -> float:
    """Median us of what() alone (events around it), each rep after before() untimed; with `sleep`
    the GPU first waits while the host enqueues the rep, so no launch gap is timed."""
    pairs = []
    for _ in range(reps):
        if sleep:
            torch.cuda._sleep(QUEUE_SLEEP)
        before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        what()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return _median_us(pairs)


def time_after(before, what, reps: int) -> float:
    """Median us of what() alone, each rep: the GPU sleeps (so no launch gap is timed), the L2 is
    flushed, then before() runs untimed."""
    return _timed(lambda: (flush_l2(), before()), what, reps, sleep=True)


def time_beside(main, side, then, reps: int, stream: torch.cuda.Stream) -> tuple[float, float]:
    """(us of main(), us of then() after it): each rep the L2 flushed, main() with side() launched beside
    it on `stream` (None: nothing beside it), then() once both are done; medians."""
    main_t, then_t = [], []
    for _ in range(reps):
        torch.cuda._sleep(QUEUE_SLEEP)
        flush_l2()
        e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        e0.record()
        if side is not None:
            stream.wait_event(e0)
            with torch.cuda.stream(stream):
                side()
        main()
        e1.record()
        if side is not None:
            torch.cuda.current_stream().wait_stream(stream)
        e2.record()
        then()
        e3.record()
        main_t.append((e0, e1))
        then_t.append((e2, e3))
    torch.cuda.synchronize()
    return _median_us(main_t), _median_us(then_t)


def fmt_us(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e6:.1f}"


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    return text


def guarded(name: str, fn, *a, **kw):
    """Run one measurement; a failing peer is reported, not fatal."""
    try:
        return fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - a benchmark reports whatever broke
        print(f"[{name}] failed: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=3)
        return None


# ------------------------------------------------------------------------------------ ceilings
def fastest_per_shape(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """(shape, M) -> the fastest timed row that has a config (candidate sweeps' best-config tables)."""
    best: dict = {}
    for r in rows:
        if r["config"] is not None and ((r["shape"], r["m"]) not in best or r["us"] < best[(r["shape"], r["m"])]["us"]):
            best[(r["shape"], r["m"])] = r
    return best


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy of nbytes / 2: bytes read + written per second (median of 10): the
    bandwidth floor every benchmark here divides by."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    t = time_it(lambda: b.copy_(a), reps=10, flush=False)
    del a, b
    return nbytes / t


def measure_ceilings() -> dict:
    copy_bw = copy_bandwidth()
    m = 8192
    x = torch.randn(m, m, device=DEV).to(torch.float8_e4m3fn)
    y = torch.randn(m, m, device=DEV).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    t_fp8 = time_it(lambda: torch._scaled_mm(x, y.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    reps=10, flush=False)
    xb, yb = torch.randn(m, m, device=DEV, dtype=torch.bfloat16), torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    t_bf16 = time_it(lambda: xb @ yb, reps=10, flush=False)
    c = dict(copy_bw=copy_bw, fp8_flops=2 * m**3 / t_fp8, bf16_flops=2 * m**3 / t_bf16)
    props = torch.cuda.get_device_properties(0)
    c["device"] = f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}"
    table("Ceilings (measured in this run)", ["quantity", "value"], [
        ["device-to-device copy (read + write)", f"{c['copy_bw'] / 1e12:.2f} TB/s"],
        ["FP8 `torch._scaled_mm` 8192^3, per-tensor scale", f"{c['fp8_flops'] / 1e12:.0f} TFLOP/s"],
        ["bf16 matmul 8192^3", f"{c['bf16_flops'] / 1e12:.0f} TFLOP/s"],
    ])
    return c


# ------------------------------------------------------------------------------------ attention
def scattered_batch(qo_lens: list[int], kv_lens: list[int], page_size: int, gen: torch.Generator,
                    spare_pages: int = 0):
    """(PagedBatch, pages in the pool): each request's pages drawn at random from a pool of all
    the batch needs plus `spare_pages`, page 0 left free (the CUDA graphs' padding page)."""
    from pdserve.kernels.paged_batch import PagedBatch

    pages = [-(-k // page_size) for k in kv_lens]
    total = sum(pages) + spare_pages + 1
    perm = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for p in pages:
        tables.append(perm[at : at + p])
        at += p
    return PagedBatch.from_tables(qo_lens, kv_lens, tables, page_size), total


def _paged(batch_lens: list[int], qo_lens: list[int], gen: torch.Generator):
    batch, total = scattered_batch(qo_lens, batch_lens, PAGE, gen)
    kv = torch.randn(total, 2, PAGE, HKV, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(sum(qo_lens), HQ, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    return batch, kv, q


def _ours(window_left: int, **kw):
    from pdserve.kernels.flashinfer_attention import FlashInferSinkAttention

    return FlashInferSinkAttention(torch.device(DEV), window_left=window_left, sm_scale=SM_SCALE,
                                   num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                                   page_size=PAGE, **kw)


def _fi_workspace():
    from pdserve.kernels.flashinfer_attention import _workspace

    return _workspace("fa", torch.device(DEV))


WARM_TARGETS = ("xqa-full", "xqa-window", "plain-fa2", "plain-fa3")


def warm_jit(target: str) -> None:
    """Build (or load) one FlashInfer module the attention tests/benchmark use (one per process,
    so a device session can build them in parallel)."""
    import flashinfer

    gen = torch.Generator().manual_seed(0)
    batch, kv, q = _paged([40, 300], [1, 1], gen)
    sinks = torch.zeros(HQ, device=DEV)
    t0 = time.time()
    if target.startswith("xqa"):
        a = _ours(-1 if target == "xqa-full" else 127, decode_backend="xqa")
        a.plan(batch)
        a.run(q, kv, sinks)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_fi_workspace(), "NHD", backend=target[-3:])
        w.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV,
               HEAD_DIM, PAGE, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               sm_scale=SM_SCALE)
        w.run(q, kv)
    torch.cuda.synchronize()
    print(f"warm-jit: {target} ready in {time.time() - t0:.0f}s", flush=True)


def _kv_bytes(kv_lens: list[int], window_left: int) -> int:
    per_token = HKV * HEAD_DIM * 2 * 2  # K and V, bf16
    if window_left >= 0:
        return sum(min(k, window_left + 1) for k in kv_lens) * per_token
    return sum(kv_lens) * per_token


def bench_attention_decode(ceil: dict, quick: bool) -> str:
    import flashinfer
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    cases = [(1, 1024), (1, 32768), (8, 4096), (32, 8192), (128, 1024), (128, 4096)]
    if not quick:
        cases += [(64, 16384), (128, 32768)]
    rows = []
    gen = torch.Generator().manual_seed(1)
    for b, ctx in cases:
        lens = [ctx] * b
        batch, kv, q = _paged(lens, [1] * b, gen)
        sinks = torch.randn(HQ, device=DEV)
        max_pages = -(-ctx // PAGE)
        res = {}
        # the engine's sliding pool keeps only the pages a 128-key window can reach
        win_lens = [min(ctx, 128 + ctx % PAGE + PAGE) for _ in range(b)]
        win_batch, win_kv, _ = _paged(win_lens, [1] * b, gen)
        for label, wl, backend in (("ours xqa", -1, "xqa"), ("ours fa2", -1, "fa2"),
                                   ("ours xqa win", 127, "xqa"), ("ours fa2 win", 127, "fa2")):
            def run_ours(wl=wl, backend=backend):
                bt, kv_, mp = (batch, kv, max_pages) if wl < 0 else (win_batch, win_kv, -(-max(win_lens) // PAGE))
                a = _ours(wl, decode_backend=backend, cuda_graph_batch_size=b, max_pages_per_request=mp)
                a.plan(bt)
                out = torch.empty_like(q)
                return time_graph(lambda: a.run(q, kv_, sinks, out=out))
            res[label] = guarded(label, run_ours)
        auto = _ours(-1, cuda_graph_batch_size=b, max_pages_per_request=max_pages).decode_backend
        res["ours auto"] = res["ours " + auto]

        def run_plain_decode():
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_fi_workspace(), "NHD", use_tensor_cores=True)
            w.plan(batch.kv_indptr.to(DEV), batch.kv_indices.to(DEV), batch.kv_last_page_len.to(DEV),
                   HQ, HKV, HEAD_DIM, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                   sm_scale=SM_SCALE)
            out = torch.empty_like(q)
            return time_graph(lambda: w.run(q, kv, out=out))
        res["fi plain"] = guarded("fi plain decode", run_plain_decode)

        def run_xqa_nosink():
            from pdserve.kernels.flashinfer_attention import FlashInferSinkAttention, _workspace

            table_ = FlashInferSinkAttention._page_table(batch, max_pages).to(DEV)
            seq = batch.kv_lens.to(torch.int32).to(DEV)
            ws = _workspace("xqa", torch.device(DEV))
            out = torch.empty_like(q)
            return time_graph(lambda: xqa_batch_decode_with_kv_cache(
                q, kv, ws, table_, seq, max_pages * PAGE, bmm1_scale=SM_SCALE, bmm2_scale=1.0,
                window_left=-1, out=out, sinks=None, kv_layout="NHD"))
        res["xqa nosink"] = guarded("xqa no sinks", run_xqa_nosink)

        def run_sdpa():
            k = torch.randn(b, HKV, ctx, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            qq = q.view(b, HQ, 1, HEAD_DIM)
            return time_graph(lambda: torch.nn.functional.scaled_dot_product_attention(
                qq, k, v, scale=SM_SCALE, enable_gqa=True))
        res["sdpa"] = guarded("sdpa", run_sdpa)
        del kv, win_kv
        floor = _kv_bytes(lens, -1) / ceil["copy_bw"]
        floor_w = _kv_bytes(lens, 127) / ceil["copy_bw"]
        plain = [t for t in (res["fi plain"], res["xqa nosink"]) if t]
        best_plain = min(plain) if plain else None
        ours = res["ours auto"]
        rows.append([
            b, ctx, fmt_us(res["ours xqa"]), fmt_us(res["ours fa2"]), f"{auto} {fmt_us(ours)}",
            fmt_us(res["xqa nosink"]), fmt_us(res["fi plain"]), fmt_us(res["sdpa"]), fmt_us(floor),
            f"{_kv_bytes(lens, -1) / ours / 1e12:.2f}" if ours else "-",
            f"{(ours / best_plain - 1) * 100:+.1f}%" if ours and best_plain else "-",
            fmt_us(res["ours xqa win"]), fmt_us(res["ours fa2 win"]), fmt_us(floor_w),
        ])
    return table(
        "Sink attention, decode (64 q / 8 kv heads, d 64, page 16, bf16; us; CUDA graphs)",
        ["batch", "context", "ours XQA+sinks", "ours FA2+sinks", "ours (graph pick)", "FI XQA no sinks",
         "FI FA2 decode no sinks", "torch SDPA no sinks (dense KV)", "KV floor (copy BW)",
         "ours KV TB/s", "ours vs best FI no-sink", "window: XQA", "window: FA2", "window floor"],
        rows,
    )


def _causal_flops(lens: list[int], window_left: int) -> float:
    per = 4 * HQ * HEAD_DIM  # QK^T and PV, 2 flops each
    tot = 0
    for n in lens:
        if window_left < 0:
            tot += n * (n + 1) // 2
        else:
            w = window_left + 1
            tot += sum(min(i + 1, w) for i in range(n)) if n <= w else w * (w + 1) // 2 + (n - w) * w
    return per * tot


def bench_attention_prefill(ceil: dict, quick: bool) -> str:
    import flashinfer

    lengths = [1024, 4096, 16384] + ([] if quick else [32768])
    rows = []
    gen = torch.Generator().manual_seed(2)
    for n in lengths:
        batch, kv, q = _paged([n], [n], gen)
        sinks = torch.randn(HQ, device=DEV)
        res = {}
        for label, wl, backend in (("fa3", -1, "fa3"), ("fa2", -1, "fa2"), ("w fa2", 127, "fa2"), ("w fa3", 127, "fa3")):
            def run_ours(wl=wl, backend=backend):
                a = _ours(wl, prefill_backend=backend)
                a.plan(batch)
                out = torch.empty_like(q)
                return time_graph(lambda: a.run(q, kv, sinks, out=out), reps=10)
            res[label] = guarded(f"ours {label}", run_ours)
        for backend in ("fa3", "fa2"):
            def run_plain(backend=backend):
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_fi_workspace(), "NHD", backend=backend)
                w.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV,
                       HEAD_DIM, PAGE, causal=True, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16, sm_scale=SM_SCALE)
                out = torch.empty_like(q)
                return time_graph(lambda: w.run(q, kv, out=out), reps=10)
            res[f"plain {backend}"] = guarded(f"plain prefill {backend}", run_plain)

        def run_sdpa():
            qq = q.view(1, n, HQ, HEAD_DIM).transpose(1, 2)
            k = torch.randn(1, HKV, n, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            return time_graph(lambda: torch.nn.functional.scaled_dot_product_attention(
                qq, k, v, is_causal=True, scale=SM_SCALE, enable_gqa=True), reps=10)
        res["sdpa"] = guarded("sdpa prefill", run_sdpa)
        del kv
        fl, flw = _causal_flops([n], -1), _causal_flops([n], 127)
        ours = res["fa3"]
        plain = res["plain fa3"]
        tf = lambda t, f: f"{f / t / 1e12:.0f}" if t else "-"  # noqa: E731
        rows.append([
            n, fmt_us(ours), tf(ours, fl), fmt_us(res["fa2"]), fmt_us(plain), fmt_us(res["plain fa2"]),
            fmt_us(res["sdpa"]), f"{(ours / plain - 1) * 100:+.0f}%" if ours and plain else "-",
            fmt_us(res["w fa2"]), fmt_us(res["w fa3"]), tf(res["w fa2"], flw),
        ])
    return table(
        "Sink attention, prefill (one causal request, 64 q / 8 kv heads; us)",
        ["tokens", "ours FA3+sinks", "TFLOP/s", "ours alt FA2+sinks", "FI FA3 no sinks",
         "FI FA2 no sinks", "torch SDPA no sinks", "ours vs FA3 no sinks", "ours window FA2",
         "alt window FA3", "window TFLOP/s"],
        rows,
    )


# ------------------------------------------------------------------------------------ MoE
def bench_weights(num_experts: int):
    """Random FP8 experts (random codes and scales: the kernels' speed must not see zeros)."""
    from pdserve.kernels.experts import ExpertWeights

    def fp8(*shape):
        return (torch.randn(*shape, device=DEV) * 64).to(torch.float8_e4m3fn)

    gu = fp8(num_experts, 2 * INTER, HIDDEN)
    dn = fp8(num_experts, HIDDEN, INTER)
    gs = torch.rand(num_experts, 2 * INTER // 128, -(-HIDDEN // 128), device=DEV) * 1e-4 + 1e-4
    ds = torch.rand(num_experts, -(-HIDDEN // 128), INTER // 128, device=DEV) * 1e-4 + 1e-4
    return ExpertWeights(gu, torch.randn(num_experts, 2 * INTER, device=DEV) * 0.1, dn,
                         torch.randn(num_experts, HIDDEN, device=DEV) * 0.1, gs, ds, 0)


def bench_inputs(t: int, num_experts: int, seed: int):
    from pdserve.kernels.experts import route

    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, HIDDEN, device=DEV, generator=g).to(torch.bfloat16)
    rw = (torch.randn(num_experts, HIDDEN, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    rb = torch.zeros(num_experts, device=DEV, dtype=torch.bfloat16)
    weights, ids = route(x, rw, rb, TOP_K)
    return x, weights, ids, rw, rb


def expert_bytes() -> int:
    w = 3 * INTER * HIDDEN  # fp8 gate_up + down
    scales = (2 * INTER // 128 * 23 + 23 * INTER // 128) * 4
    return w + scales + (2 * INTER + HIDDEN) * 4


def moe_floor(ids: torch.Tensor, t: int, ceil: dict) -> tuple[float, float, float]:
    active = int(torch.unique(ids).numel())
    nbytes = active * expert_bytes() + t * HIDDEN * 2 * 2
    flops = 2 * ids.numel() * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    return max(nbytes / ceil["copy_bw"], flops / ceil["fp8_flops"]), nbytes, flops


def torch_bf16_moe(w_bf16, bias_gu, bias_dn, x_sorted, offs, counts):
    """bf16 grouped GEMMs on rows already sorted by expert (no routing cost): the torch peer."""
    from pdserve.kernels.swiglu import swiglu

    if hasattr(torch, "_grouped_mm"):
        h = torch._grouped_mm(x_sorted, w_bf16[0].transpose(1, 2), offs=offs)
        h = h + bias_gu
        a = swiglu(h)
        return torch._grouped_mm(a, w_bf16[1].transpose(1, 2), offs=offs) + bias_dn
    outs, at = [], 0
    for e, c in enumerate(counts):
        if c:
            h = x_sorted[at : at + c] @ w_bf16[0][e].T + bias_gu[at : at + c]
            outs.append(swiglu(h) @ w_bf16[1][e].T)
        at += c
    return torch.cat(outs)


def bench_moe(ceil: dict, quick: bool) -> str:
    from pdserve.kernels import triton_moe as tm
    from pdserve.kernels.experts import route

    rows = []
    for model, num_e in MODELS.items():
        w = bench_weights(num_e)
        w_bf16 = None
        decode = [1, 2, 4, 8, 32, 64, 128]
        prefill = [1024, 8192] + ([] if quick else [32768])
        for t in decode + prefill:
            x, weights, ids, rw, rb = bench_inputs(t, num_e, seed=t)
            ours = guarded("ours moe", lambda: time_graph(lambda: tm.experts_forward(x, weights, ids, w),
                                                           reps=25 if t <= 128 else 8))
            router = guarded("router", lambda: time_graph(lambda: route(x, rw, rb, TOP_K)))
            floor, nbytes, flops = moe_floor(ids, t, ceil)

            def run_torch():
                nonlocal w_bf16
                if w_bf16 is None:
                    w_bf16 = (w.gate_up.to(torch.bfloat16), w.down.to(torch.bfloat16))
                flat = ids.flatten()
                order = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=num_e)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                xs = x[order // TOP_K]
                bg, bd = w.gate_up_bias[flat[order]].to(torch.bfloat16), w.down_bias[flat[order]].to(torch.bfloat16)
                cl = counts.tolist()
                return time_graph(lambda: torch_bf16_moe(w_bf16, bg, bd, xs, offs, cl),
                                  reps=25 if t <= 128 else 8)
            tor = guarded("torch bf16", run_torch)
            regime = "decode" if t <= 128 else "prefill"
            pct = lambda tt: f"{floor / tt * 100:.0f}%" if tt else "-"  # noqa: E731
            rows.append([
                model, regime, t, fmt_us(ours), fmt_us(router), fmt_us(tor), fmt_us(floor),
                "bytes" if nbytes / ceil["copy_bw"] >= flops / ceil["fp8_flops"] else "FLOPs",
                pct(ours), f"{flops / ours / 1e12:.0f}" if ours else "-",
            ])
        del w, w_bf16
        torch.cuda.empty_cache()
    return table(
        "MoE layer, FP8 experts (H 2880, I 3072 padded, top-4; us; CUDA graph; ours = routing layout + "
        "quant + 2 grouped GEMMs + combine)",
        ["model", "regime", "tokens", "ours", "router (torch bf16)", "torch bf16 grouped GEMMs",
         "floor", "floor bound by", "ours % of floor", "ours TFLOP/s"],
        rows,
    )


def bench_routing(ceil: dict, quick: bool, tokens: list[int] | None = None) -> str:
    """The routing layout (kernels.triton_moe.align_routing, DeepGEMM's 128-row alignment) at
    prompt sizes: one program that counts and places every pair against the two launches of one
    program per ROUTING_CHUNK pairs (each forced by moving ROUTING_PARALLEL_FROM); us, L2 flushed."""
    from pdserve.kernels import triton_moe as tm

    default_from = tm.ROUTING_PARALLEL_FROM
    rows = []
    try:
        for model, num_e in MODELS.items():
            for t in tokens or [1024, 4096, 8192] + ([] if quick else [32768]):
                _, _, ids, _, _ = bench_inputs(t, num_e, seed=t)
                times = []
                for parallel_from in (1 << 62, 0):
                    tm.ROUTING_PARALLEL_FROM = parallel_from
                    times.append(time_it(lambda: tm.align_routing(ids, 0, num_e, 128), reps=20))
                rows.append([model, t, t * TOP_K, fmt_us(times[0]), fmt_us(times[1]), f"{times[0] / times[1]:.1f}x",
                             "two launches" if t * TOP_K > default_from else "one program"])
                print(f"[routing] {rows[-1]}", flush=True)
    finally:
        tm.ROUTING_PARALLEL_FROM = default_from
    return table(
        "Routing layout at prefill sizes (align_routing, 128-row segments): one program vs two "
        f"launches of one program per {tm.ROUTING_CHUNK} pairs; us, L2 flushed",
        ["model", "tokens", "pairs", "one program us", "two launches us", "speed-up", "default"], rows)


def bench_moe_prefill(ceil: dict, quick: bool, tokens: list[int] | None = None) -> str:
    """The MoE layer at prefill sizes: our Triton grouped path against the DeepGEMM path
    (kernels.deepgemm_moe: DeepGEMM's grouped GEMMs with our routing, SwiGLU and combine kernels
    around them), and DeepGEMM's two GEMMs alone and with a separate bias add (the peers); TFLOP/s
    on useful FLOPs. Needs `deep_gemm` importable (bench/build_deepgemm.sh, then PYTHONPATH=$DG_SITE)."""
    from pdserve.kernels import deepgemm_moe as dm
    from pdserve.kernels import triton_moe as tm

    if not dm.available():
        return "### MoE layer at prefill, DeepGEMM path: not run (deep_gemm not importable on this GPU)\n"
    rows = []
    for model, num_e in MODELS.items():
        w = bench_weights(num_e)
        for t in tokens or [256, 512, 1024, 8192] + ([] if quick else [32768]):
            x, weights, ids, _, _ = bench_inputs(t, num_e, seed=t)
            cfg = tm.select_config(t * TOP_K, num_e)
            reps = 10 if t <= 8192 else 5
            tri_out = tm.experts_forward(x, weights, ids, w, config=cfg)
            dg_out = dm.experts_forward(x, weights, ids, w)  # (first call JIT-compiles DeepGEMM)
            torch.cuda.synchronize()
            err = ((dg_out.float() - tri_out.float()).norm() / tri_out.float().norm()).item()
            t_tri = time_it(lambda: tm.experts_forward(x, weights, ids, w, config=cfg), reps=reps)
            t_dg = time_it(lambda: dm.experts_forward(x, weights, ids, w), reps=reps)
            # the peers: DeepGEMM's two GEMMs on the same routed rows, alone and + a bias add each
            r = tm.align_routing(ids, 0, num_e, dm._m_alignment())
            m_idx = torch.where(r.sorted_slot >= 0, r.block_expert.repeat_interleave(r.route_m), -1)
            a, a_s = tm.quantize_act(x)
            a = a[(r.sorted_slot.clamp(min=0) // TOP_K).long()]
            a_st = a_s[(r.sorted_slot.clamp(min=0) // TOP_K).long()].t().contiguous()
            act = a.new_zeros(r.max_rows, INTER)
            act_st = torch.ones(INTER // 128, r.max_rows, device=DEV)
            bias_gu = w.gate_up_bias.to(torch.bfloat16)[m_idx.clamp(min=0).long()]
            bias_dn = w.down_bias.to(torch.bfloat16)[m_idx.clamp(min=0).long()]

            def gemms(bias: bool):
                h = dm._grouped_gemm(a, a_st, w.gate_up, w.gate_up_scale, m_idx)
                y = dm._grouped_gemm(act, act_st, w.down, w.down_scale, m_idx)
                if bias:
                    h.add_(bias_gu)
                    y.add_(bias_dn)

            t_g = time_it(lambda: gemms(False), reps=reps)
            t_gb = time_it(lambda: gemms(True), reps=reps)
            flops = 2 * t * TOP_K * (HIDDEN * 2 * INTER + INTER * HIDDEN)
            tf = lambda s: f"{flops / s / 1e12:.0f}"  # noqa: E731
            rows.append([model, t, fmt_us(t_tri), tf(t_tri), fmt_us(t_dg), tf(t_dg),
                         f"{t_tri / t_dg:.2f}x", tf(t_g), tf(t_gb), f"{t_gb / t_dg:.2f}x",
                         f"{err:.1e}"])
            print(f"[moe_prefill] {rows[-1]}", flush=True)
            del a, act, bias_gu, bias_dn
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    return table(
        "MoE layer at prefill: Triton grouped path vs DeepGEMM path (kernels/deepgemm_moe.py: "
        "routing + gather/quant + DeepGEMM gate_up + bias/SwiGLU/quant + DeepGEMM down + "
        "bias x weight combine); peers = DeepGEMM's two GEMMs alone / + a separate bias add; "
        "us and TFLOP/s on useful FLOPs; L2 flushed",
        ["model", "tokens", "Triton path us", "Triton TFLOP/s", "DeepGEMM path us",
         "DeepGEMM path TFLOP/s", "speed-up", "DeepGEMM GEMMs alone TFLOP/s",
         "DeepGEMM GEMMs + bias add TFLOP/s", "path vs GEMMs + bias add", "rel L2 vs Triton path"],
        rows,
    )


def _gemm_parts(t: int, num_e: int, w, cfg):
    from pdserve.kernels import triton_moe as tm

    x, weights, ids, _, _ = bench_inputs(t, num_e, seed=t)
    r = tm.align_routing(ids, 0, num_e, cfg.route_m)
    xq, xs = tm.quantize_act(x)
    act, act_s = tm.gate_up_swiglu(xq, xs, r, w, 7.0, 1.702, cfg.gate_up)
    return x, weights, ids, r, xq, xs, act, act_s


def bench_gemm(ceil: dict, quick: bool, dg: dict | None) -> str:
    """Prefill grouped GEMMs alone: ours (bias, SwiGLU/quant or routing weight fused) vs DeepGEMM."""
    from pdserve.kernels import triton_moe as tm

    rows = []
    for model, num_e in MODELS.items():
        w = bench_weights(num_e)
        for t in [1024, 8192] + ([] if quick else [32768]):
            cfg = tm.select_config(t * TOP_K, num_e)
            x, weights, ids, r, xq, xs, act, act_s = _gemm_parts(t, num_e, w, cfg)
            t_gu = time_graph(lambda: tm.gate_up_swiglu(xq, xs, r, w, 7.0, 1.702, cfg.gate_up), reps=10)
            t_dn = time_graph(lambda: tm.down_weighted(act, act_s, r, w, weights, True, cfg.down), reps=10)
            pairs = t * TOP_K
            f_gu, f_dn = 2 * pairs * 2 * INTER * HIDDEN, 2 * pairs * HIDDEN * INTER
            d = (dg or {}).get(f"{model}/{t}", {})
            dg_gu, dg_dn = d.get("gate_up"), d.get("down")
            dg_gu_b, dg_dn_b = d.get("gate_up_bias"), d.get("down_bias")
            tf = lambda f, s: f"{f / s / 1e12:.0f}" if s else "-"  # noqa: E731
            rows.append([
                model, t, tf(f_gu, t_gu), tf(f_gu, dg_gu), tf(f_gu, dg_gu_b),
                tf(f_dn, t_dn), tf(f_dn, dg_dn), tf(f_dn, dg_dn_b),
                f"{ceil['fp8_flops'] / 1e12:.0f}",
            ])
        del w
        torch.cuda.empty_cache()
    note = (dg or {}).get("status", "DeepGEMM not run")
    return table(
        f"Prefill grouped GEMMs, TFLOP/s on useful FLOPs (DeepGEMM: {note})",
        ["model", "tokens", "ours gate_up (+bias+SwiGLU+quant)", "DeepGEMM gate_up",
         "DeepGEMM gate_up + bias add", "ours down (+bias, x weight)", "DeepGEMM down",
         "DeepGEMM down + bias add", "FP8 ceiling"],
        rows,
    )


DG_TOL = 1e-2  # relative L2 error; a correct FP8 GEMM with bf16 output gives ~3e-3


def _rand_fp8(shape: tuple[int, ...], k_tensor: int) -> torch.Tensor:
    """Random FP8 E4M3 codes (|x| < 448) of `shape`, zero-padded along the last dim to k_tensor;
    made a slice at a time (no fp32 copy of a whole 128-expert weight)."""
    *lead, k = shape
    out = torch.zeros(*lead, k_tensor, device=DEV, dtype=torch.float8_e4m3fn)
    flat = out.view(-1, k_tensor)
    step = max(1, (1 << 26) // k)
    for i in range(0, flat.shape[0], step):
        rows = min(step, flat.shape[0] - i)
        x = (torch.randn(rows, k, device=DEV) * 64).clamp_(-448, 448)
        flat[i : i + rows, :k] = x.to(torch.float8_e4m3fn)
    return out


def _dequant(x: torch.Tensor, s: torch.Tensor, g: int, k: int) -> torch.Tensor:
    """fp32 [r, k] of FP8 codes x [r, >= k] with scales s [ceil(r / g), ceil(k / 128)] of g x 128
    blocks (g = 1: per-row activation scales, g = 128: weight blocks)."""
    full = s.repeat_interleave(g, 0)[: x.shape[0]].repeat_interleave(128, 1)[:, :k]
    return x[:, :k].float() * full


def _dg_routing(num_e: int, t: int, align: int) -> torch.Tensor:
    """m_idx (int32 [m]) of DeepGEMM's m-grouped contiguous layout for t tokens x TOP_K random
    experts: rows sorted by expert, each expert's rows padded to `align` (its block M) with -1."""
    g = torch.Generator(device=DEV).manual_seed(t)
    ids = torch.randint(0, num_e, (t * TOP_K,), device=DEV, generator=g)
    counts = torch.bincount(ids, minlength=num_e).tolist()
    return torch.cat([torch.cat([torch.full((c,), e, dtype=torch.int32),
                                 torch.full((-(-c // align) * align - c,), -1, dtype=torch.int32)])
                      for e, c in enumerate(counts)]).to(DEV)


def _dg_grouped_gemm(deep_gemm, m_idx: torch.Tensor, num_e: int, n: int, k: int, k_tensor: int) -> dict:
    """One m-grouped FP8 GEMM d[m, n] (bf16) = a[m, k] @ w[expert of row, n, k]^T with 1x128
    activation and 128x128 weight scales (float32), K of a and w zero-padded to k_tensor. Checks
    the first and last expert's rows against a dequantised reference; only if right, times the
    GEMM alone and followed by an unfused per-expert bias add. Keys: k, rel_err, time, time_bias."""
    m, sk = m_idx.numel(), -(-k_tensor // 128)
    a = _rand_fp8((m, k), k_tensor)
    w = _rand_fp8((num_e, n, k), k_tensor)
    # activation scales already MN-major and TMA-aligned (m is a multiple of 4), as DeepGEMM's SM90
    # kernel reads them; given row-major [m, sk], it would transpose them on every call
    sa = (torch.rand(sk, m, device=DEV) + 0.5).t()
    sw = torch.rand(num_e, -(-n // 128), sk, device=DEV) + 0.5
    d = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    bias_rows = (torch.randn(num_e, n, device=DEV) * 0.1).to(torch.bfloat16)[m_idx.clamp(min=0).long()]

    def gemm():
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (w, sw), d, m_idx)

    def gemm_bias():
        gemm()
        d.add_(bias_rows)

    gemm()  # first call JIT-compiles the kernel
    torch.cuda.synchronize()
    err = 0.0
    for e in (int(m_idx[0]), int(m_idx[m_idx >= 0][-1])):
        rows = (m_idx == e).nonzero().flatten()[:64]
        ref = _dequant(a[rows], sa[rows], 1, k) @ _dequant(w[e], sw[e], 128, k).T
        err = max(err, ((d[rows].float() - ref).norm() / ref.norm()).item())
    out = {"k": k_tensor, "rel_err": err}
    if err <= DG_TOL:
        out["time"] = time_graph(gemm, reps=10)
        out["time_bias"] = time_graph(gemm_bias, reps=10)
    return out


def deepgemm_child(quick: bool) -> None:
    """DeepGEMM m-grouped contiguous FP8 GEMMs at the prefill shapes. Prints a cumulative
    `DEEPGEMM_JSON` line after each case, so a parent that times out keeps what finished."""
    import deep_gemm
    import tvm_ffi

    out: dict = {"version": getattr(deep_gemm, "__version__", "?"),
                 "module": os.path.dirname(deep_gemm.__file__), "tvm_ffi": tvm_ffi.__version__}
    align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    # smoke test on the plain GEMM first: 2-D K-major FP8, float32 1x128 / 128x128 scales
    a, b = _rand_fp8((256, 512), 512), _rand_fp8((256, 512), 512)
    sa, sb = torch.rand(256, 4, device=DEV) + 0.5, torch.rand(2, 4, device=DEV) + 0.5
    d = torch.empty(256, 256, device=DEV, dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt((a, sa), (b, sb), d)
    torch.cuda.synchronize()
    ref = _dequant(a, sa, 1, 512) @ _dequant(b, sb, 128, 512).T
    out["smoke_rel_err"] = ((d.float() - ref).norm() / ref.norm()).item()
    print("DEEPGEMM_JSON " + json.dumps(out), flush=True)
    for model, num_e in MODELS.items():
        for t in [1024, 8192] + ([] if quick else [32768]):
            m_idx = _dg_routing(num_e, t, align)
            res: dict = {}
            for name, n, k in (("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)):
                r = _dg_grouped_gemm(deep_gemm, m_idx, num_e, n, k, k)
                if "time" not in r and k % 128:  # K tail wrong: zero-pad K to whole 128 blocks
                    r = _dg_grouped_gemm(deep_gemm, m_idx, num_e, n, k, -(-k // 128) * 128)
                res[name], res[name + "_bias"] = r.get("time"), r.get("time_bias")
                res[name + "_rel_err"], res[name + "_k"] = r["rel_err"], r["k"]
                torch.cuda.empty_cache()
            out[f"{model}/{t}"] = res
            print(f"[deepgemm] {model}/{t}: {res}", file=sys.stderr, flush=True)
            print("DEEPGEMM_JSON " + json.dumps(out), flush=True)


def _dg_status(res: dict, label: str, rc) -> str:
    """One line for the table title: version, where it came from, K handling, anything odd."""
    cases = [v for v in res.values() if isinstance(v, dict)]
    padded = any(c.get("gate_up_k", HIDDEN) != HIDDEN for c in cases)
    notes = [f"sgl-deep-gemm {res.get('version')}, {label}",
             f"K {HIDDEN} zero-padded to {-(-HIDDEN // 128) * 128}" if padded else f"K {HIDDEN} unpadded"]
    bad = [f"{key} {c[key]:.1e}" for c in cases for key in ("gate_up_rel_err", "down_rel_err")
           if c.get(key, 0) > DG_TOL]
    if res.get("smoke_rel_err", 0) > DG_TOL or bad:
        notes.append(f"WRONG RESULTS: smoke rel err {res.get('smoke_rel_err', 0):.1e} {' '.join(bad)}")
    if rc != 0:
        notes.append(f"partial: {rc}")
    return "; ".join(notes)


def run_deepgemm(quick: bool) -> dict:
    """Run the DeepGEMM child in a fresh process (a failed host assertion can abort it), trying in
    order: the source build of bench/build_deepgemm.sh ($DG_SITE), the installed wheel, and the
    wheel with the tvm-ffi release it declares (0.1.11, unpacked into $DG_TVM_FFI_SITE). The child
    JIT-compiles each kernel on first use (nvcc; cached in ~/.deep_gemm), hence a long timeout:
    $DG_CHILD_TIMEOUT seconds (default 540)."""
    def with_path(site: str) -> dict:
        env = os.environ.copy()
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
        return env

    envs = []
    site = os.environ.get("DG_SITE")
    if site and os.path.isdir(site):
        envs.append((f"built from source in {site}", with_path(site)))
    envs.append(("installed tvm-ffi", os.environ.copy()))
    alt = os.environ.get("DG_TVM_FFI_SITE")
    if alt and os.path.isdir(alt):
        envs.append(("tvm-ffi 0.1.11", with_path(alt)))
    timeout = float(os.environ.get("DG_CHILD_TIMEOUT", "540"))
    cmd = [sys.executable, "-m", "pdserve.bench.kernels", "--deepgemm-child"] + (["--quick"] if quick else [])
    attempts = []
    for label, env in envs:
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            stdout, stderr, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:  # output so far comes as bytes whatever text= says
            decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            stdout, stderr, rc = decode(e.stdout), decode(e.stderr), f"timeout after {timeout:.0f} s"
        res = None
        for line in stdout.splitlines():
            if line.startswith("DEEPGEMM_JSON "):
                res = json.loads(line[len("DEEPGEMM_JSON "):])
        if res is not None and any(isinstance(v, dict) for v in res.values()):
            res["status"] = _dg_status(res, label, rc)
            res["attempts"] = attempts
            return res
        err = (stderr or stdout).strip().splitlines()
        attempts.append(f"{label}: rc={rc} {' / '.join(err[-3:])[:400]}")
        print(f"[deepgemm] {label} failed (rc={rc}, {time.time() - t0:.0f} s):\n{(stderr or '')[-3000:]}",
              flush=True)
    short = "host assertion `dim == 2 or dim == 3` (utils/layout.hpp:16)" if attempts and all(
        "dim == 2 or dim == 3" in a for a in attempts) else "error"
    hint = "" if site else " (build it: bash bench/build_deepgemm.sh, then set DG_SITE)"
    return {"status": f"did not run: {short}{hint}; see docs/kernels.md", "attempts": attempts}


# ------------------------------------------------------------------------------------ sweep
def _g(bm, bn, warps, stages, split=1, prefetch=True):
    from pdserve.kernels.triton_moe import GemmConfig

    return GemmConfig(bm, bn, warps, stages, split_k=split, prefetch_scales=prefetch)


SWEEP = {
    # label: (tokens, experts, route_m, gate_up candidates, down candidates); A is quantised by
    # the routing launch unless a candidate is marked "fused" (quantised inside the gate/up GEMM)
    "decode b1 20b": (1, 32, 16, [_g(16, 256, 8, 4), _g(16, 256, 8, 4, 2), _g(16, 256, 8, 4, 4),
                                  _g(16, 256, 8, 4, 8), ("fused", _g(16, 256, 8, 4))],
                      [_g(16, 64, 4, 6), _g(16, 64, 4, 6, 2), _g(16, 64, 4, 6, 4), _g(16, 64, 4, 6, 8)]),
    "decode b8 20b": (8, 32, 16, [_g(16, 256, 8, 4), _g(16, 256, 8, 4, 2)],
                      [_g(16, 64, 4, 6), _g(16, 64, 4, 6, 2)]),
    "decode b128 20b": (128, 32, 32, [_g(32, 256, 4, 4), _g(32, 256, 8, 4)],
                        [_g(32, 64, 4, 5), _g(32, 64, 4, 5, prefetch=False)]),
    "prefill 1k 20b": (1024, 32, 128, [_g(64, 256, 8, 4, prefetch=False), _g(64, 256, 8, 4)],
                       [_g(64, 128, 4, 4, prefetch=False), _g(128, 128, 8, 3, prefetch=False),
                        _g(64, 128, 4, 4)]),
    "prefill 8k 120b": (8192, 128, 128, [_g(64, 256, 8, 3, prefetch=False)],
                        [_g(128, 128, 8, 3, prefetch=False), _g(64, 128, 4, 4, prefetch=False)]),
}


def _tile(cfg) -> str:
    return (f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            + (f" splitK{cfg.split_k}" if cfg.split_k > 1 else "")
            + ("" if cfg.prefetch_scales else " no-prefetch"))


def bench_sweep(ceil: dict, quick: bool) -> str:
    from pdserve.kernels import triton_moe as tm

    rows = []
    cached: tuple[int, object] | None = None
    for label, (t, num_e, route_m, gus, dns) in SWEEP.items():
        if cached is None or cached[0] != num_e:
            cached = None
            torch.cuda.empty_cache()
            cached = (num_e, bench_weights(num_e))
        w = cached[1]
        x, weights, ids, _, _ = bench_inputs(t, num_e, seed=t)
        r, xq, xs = tm.align_routing(ids, 0, num_e, route_m, x)
        nbytes_gu = int(torch.unique(ids).numel()) * 2 * INTER * HIDDEN
        act, act_s = tm.gate_up_swiglu(xq, xs, r, w, 7.0, 1.702, tm.select_config(t * TOP_K, num_e).gate_up)
        for cand in gus:
            fused = isinstance(cand, tuple)
            cfg = cand[1] if fused else cand
            a, a_s = (x, None) if fused else (xq, xs)
            tt = guarded(f"sweep {label} gu {cfg}", lambda: time_graph(
                lambda: tm.gate_up_swiglu(a, a_s, r, w, 7.0, 1.702, cfg), reps=15))
            rows.append([label, "gate_up" + (" (A quantised in GEMM)" if fused else ""), _tile(cfg),
                         fmt_us(tt), f"{nbytes_gu / tt / 1e12:.2f} TB/s" if tt else "-"])
        for cfg in dns:
            tt = guarded(f"sweep {label} dn {cfg}", lambda: time_graph(
                lambda: tm.down_weighted(act, act_s, r, w, weights, True, cfg), reps=15))
            rows.append([label, "down", _tile(cfg), fmt_us(tt),
                         f"{nbytes_gu / 2 / tt / 1e12:.2f} TB/s" if tt else "-"])
        t_align = time_graph(lambda: tm.align_routing(ids, 0, num_e, route_m), reps=15)
        t_alq = time_graph(lambda: tm.align_routing(ids, 0, num_e, route_m, x), reps=15)
        pair = torch.randn(t * TOP_K, HIDDEN, device=DEV)
        t_comb = time_graph(lambda: tm.combine(pair, ids, 0, num_e, torch.bfloat16), reps=15)
        rows.append([label, "align / align+quant / combine", "",
                     f"{fmt_us(t_align)} / {fmt_us(t_alq)} / {fmt_us(t_comb)}", ""])
        tt = time_graph(lambda: tm.experts_forward(x, weights, ids, w), reps=15)
        rows.append([label, "whole layer, table config", "", fmt_us(tt), ""])
    return table("MoE tile sweep (us per launch, CUDA graph, L2 flushed; TB/s = weight bytes / time)",
                 ["regime", "kernel", "tile", "time", "weights"], rows)


# ------------------------------------------------------------------------------------ report
def write_doc(path: str, sections: list[str], ceil: dict, command: str, date: str | None = None) -> None:
    """Replace (or append) the '## Kernels' section of the markdown file at `path`. Also used on
    the workstation to merge a device run's --json output: write_doc(path, j['tables'],
    j['ceilings'], j['command'], j['date'])."""
    head = (
        "## Kernels\n\n"
        f"Measured {date or datetime.date.today().isoformat()} on {ceil.get('device', '?')}, "
        f"command: `{command}`. Times are medians with the L2 flushed (256 MB read) before each "
        "repetition; decode-sized work is replayed from CUDA graphs. Floors: bytes / measured copy bandwidth "
        "and FLOPs / measured FP8 `_scaled_mm` rate, whichever is larger. Design and history: "
        "docs/kernels.md.\n\n"
    )
    ceilings = (
        "| ceiling (this run) | value |\n|---|---|\n"
        f"| device-to-device copy, read + write | {ceil['copy_bw'] / 1e12:.2f} TB/s |\n"
        f"| FP8 `torch._scaled_mm` 8192^3 | {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s |\n"
        f"| bf16 matmul 8192^3 | {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s |\n\n"
    )
    body = head + ceilings + "\n".join(sections)
    text = open(path).read() if os.path.exists(path) else "# Performance\n\n"
    start = text.find("## Kernels")
    if start >= 0:
        # the section ends at the next heading or at the next section marker (<!-- x:begin -->)
        ends = [i for i in (text.find("\n## ", start + 3), text.find("\n<!-- ", start + 3)) if i >= 0]
        nxt = min(ends) if ends else -1
        text = text[:start] + body + (text[nxt + 1 :] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    ap.add_argument("--sections", default="moe,gemm,attention", help="run in this order")
    ap.add_argument("--doc", default=None, help="markdown file whose '## Kernels' section is replaced")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", default=None, help="comma-separated prompt sizes of the moe_prefill and routing sections")
    ap.add_argument("--warm-jit", choices=WARM_TARGETS, default=None)
    ap.add_argument("--deepgemm-child", action="store_true")
    args = ap.parse_args(argv)
    if args.warm_jit:
        return warm_jit(args.warm_jit)
    if args.deepgemm_child:
        return deepgemm_child(args.quick)
    ceil = measure_ceilings()
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else None
    out = []
    t0 = time.time()
    for section in args.sections.split(","):  # in the order given
        if section == "sweep":
            out.append(bench_sweep(ceil, args.quick))
        elif section == "moe":
            out.append(bench_moe(ceil, args.quick))
        elif section == "moe_prefill":
            out.append(bench_moe_prefill(ceil, args.quick, tokens))
        elif section == "routing":
            out.append(bench_routing(ceil, args.quick, tokens))
        elif section == "gemm":
            dg = run_deepgemm(args.quick)
            print("[deepgemm]", json.dumps(dg)[:2000], flush=True)
            out.append(bench_gemm(ceil, args.quick, dg))
        elif section == "attention":
            out.append(bench_attention_decode(ceil, args.quick))
            out.append(bench_attention_prefill(ceil, args.quick))
        elif section != "ceilings":
            raise SystemExit(f"unknown section {section!r}")
    print(f"bench: {time.time() - t0:.0f}s", flush=True)
    command = os.environ.get("PDSERVE_BENCH_COMMAND") or (
        "python -m pdserve.bench.kernels " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.doc:
        write_doc(args.doc, out, ceil, command)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceil, "tables": out, "command": command,
                   "date": datetime.date.today().isoformat()}, f, indent=1)


if __name__ == "__main__":
    main()
