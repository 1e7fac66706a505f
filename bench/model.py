"""Model benchmark: prefill and decode cost of the gpt-oss-20b and -120b shapes on every parallel
layout this machine's GPUs allow, priced at $3.00 per GPU-hour (the seed's cost model).

    python bench/model.py --device cuda --out DIR [--quick] [--models 20b,120b]
                          [--sections prefill,decode] [--layouts TP1,EP4TP4] [--doc docs/performance.md]
    python bench/model.py --device cpu --preset tiny --quick --out DIR      # logic check on CPU
    python bench/model.py --render-only --out DIR [--doc docs/performance.md]  # tables from DIR/results.json

Tables produced (the seed's):
- prefill, batch size 1, by TP degree (1, 2, 4, 8) and input length (1k, 4k, 8k, 32k tokens):
  latency and $ per million input tokens (= GPUs x price x latency / tokens);
- decode by layout (EPn TPn for n = 1, 2, 4, 8, and pure TPn without --quick) and batch size
  (1 .. 128) at contexts 8192 and 32768: tokens/s per request (1 / step time), tokens/s in total
  (batch / step time) and $ per million output tokens (= GPUs x price / total tokens/s).

How: a random checkpoint of the model's shape in the published layout (MXFP4 experts, written once
with engine.checkpoint_writer.make_random_checkpoint under --ckpt-dir; the 120b one is ~64 GB, and
is skipped with a message when the disk cannot hold it) is loaded by W spawned ranks (NCCL; gloo on
CPU), each with its ShardSpec, experts served as FP8 on CUDA. All ranks run the same engine steps
(`ModelRunner.prefill` / `decode`) in lockstep; rank 0 times them (CUDA-synchronised medians).
Decode requests start from a context whose KV pages are reserved and adopted as a decode worker does
after a KV transfer (their contents do not change the work). Not included: the worker's step-plan
broadcast between ranks, gRPC, the router.

Every (model, section, layout) runs in its own process group; results accumulate in
DIR/results.json across invocations (so a long sweep can be split over several commands), then
DIR/prefill.csv, DIR/decode.csv and, with matplotlib, DIR/model_decode.png and DIR/model_prefill.png
are rewritten, and the section between `<!-- model:begin -->` and `<!-- model:end -->` of --doc
(default docs/performance.md on CUDA, none on CPU) is replaced; the rest of that file is kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

PRICE_PER_GPU_HOUR = 3.00
BEGIN, END = "<!-- model:begin -->", "<!-- model:end -->"


# -- what to run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    world: int
    ep: int = 1

    @property
    def name(self) -> str:
        return f"TP{self.world}" if self.ep == 1 else f"EP{self.ep}TP{self.world}"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        t = text.upper().replace(" ", "")
        try:
            if t.startswith("EP"):
                ep, tp = t[2:].split("TP")
                return cls(int(tp), int(ep))
            if t.startswith("TP"):
                return cls(int(t[2:]))
        except ValueError:
            pass
        raise ValueError(f"layout {text!r} is not TPn or EPmTPn")


def prefill_layouts(max_ranks: int) -> list[Layout]:
    return [Layout(w) for w in (1, 2, 4, 8) if w <= max_ranks]


def decode_layouts(max_ranks: int, quick: bool) -> list[Layout]:
    out = []
    for w in (1, 2, 4, 8):
        if w <= max_ranks:
            out.append(Layout(w, w))
            if w > 1 and not quick:
                out.append(Layout(w, 1))
    return out


@dataclass(frozen=True)
class Grid:
    lengths: tuple[int, ...]  # prefill input tokens
    contexts: tuple[int, ...]  # decode context tokens
    batches: tuple[int, ...]
    prefill_reps: int
    decode_steps: int
    warmup_steps: int = 2


def make_grid(preset: str, quick: bool) -> Grid:
    if preset == "tiny":  # CPU logic check: the tiny model's context is 4096
        return Grid((64, 256), (128, 512), (1, 4) if quick else (1, 4, 16), 1 if quick else 2, 2 if quick else 4, 1)
    if quick:
        return Grid((1024, 4096, 8192, 32768), (8192, 32768), (1, 8, 32, 128), 2, 5)
    return Grid((1024, 4096, 8192, 32768), (8192, 32768), (1, 2, 4, 8, 16, 32, 64, 128), 3, 20)


# -- cost model ---------------------------------------------------------------------------------
def usd_per_m_input(gpus: int, latency_s: float, tokens: int) -> float:
    return gpus * PRICE_PER_GPU_HOUR / 3600 * latency_s / tokens * 1e6


def usd_per_m_output(gpus: int, tokens_per_s: float) -> float:
    return gpus * PRICE_PER_GPU_HOUR / 3600 / tokens_per_s * 1e6


# -- checkpoints --------------------------------------------------------------------------------
def checkpoint_bytes(cfg) -> int:
    """Size of a random MXFP4 checkpoint of `cfg` on disk (weights; metadata is negligible)."""
    H, I, E, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.head_dim
    attn = (cfg.num_attention_heads * D * H * 2 + 2 * cfg.num_key_value_heads * D * H
            + cfg.num_attention_heads + H) * 2
    experts = E * 3 * I * H * (0.5 + 1 / 32) + E * (2 * I + H) * 2 + E * (H + 1) * 2
    return int(2 * cfg.vocab_size * H * 2 + cfg.num_hidden_layers * (attn + experts + 4 * H))


def ensure_checkpoint(preset_name: str, root: Path) -> tuple[Path | None, str]:
    """(checkpoint dir, "") once written, or (None, why not)."""
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset

    path = root / f"{preset_name}-mxfp4-seed0"
    if (path / "config.json").is_file():
        return path, ""
    cfg = preset(preset_name)
    root.mkdir(parents=True, exist_ok=True)
    need, free = checkpoint_bytes(cfg), shutil.disk_usage(root).free
    if need * 1.05 > free:
        return None, (f"the random {preset_name} checkpoint needs {need / 1e9:.0f} GB on disk, "
                      f"{free / 1e9:.0f} GB free under {root} (use --ckpt-dir)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset_name}-", dir=root))
    t = time.perf_counter()
    print(f"[bench] writing a random {preset_name} checkpoint ({need / 1e9:.1f} GB) to {path}", flush=True)
    make_random_checkpoint(tmp / "ckpt", cfg, seed=0, experts="mxfp4", progress=sys.stderr.isatty(),
                           workers=min(16, os.cpu_count() or 1))
    os.replace(tmp / "ckpt", path)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[bench] checkpoint written in {time.perf_counter() - t:.0f} s", flush=True)
    return path, ""


# -- one process group ------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resize_cache(runner, blocks: int) -> None:
    import gc

    import torch

    from pdserve.engine.kv_cache import PagedKVCache

    runner.cache = None
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    runner.cache = PagedKVCache(runner.cfg, num_blocks=max(1, blocks), page_size=runner.model.page_size,
                                num_kv_heads=runner.model.num_kv_heads, device=runner.device)


def _block_capacity(runner, margin_bytes: int) -> int:
    """KV blocks that fit next to a working margin, on every rank."""
    import torch
    import torch.distributed as dist

    from pdserve.engine.kv_cache import PagedKVCache

    if runner.device.type != "cuda":
        return 1 << 17
    _resize_cache(runner, 1)
    free, _ = torch.cuda.mem_get_info(runner.device)
    per_block = PagedKVCache.bytes_per_block(runner.cfg, runner.model.page_size, runner.model.num_kv_heads)
    cap = torch.tensor([max(0, (free - margin_bytes) // per_block)], device=runner.device)
    if dist.is_initialized():
        dist.all_reduce(cap, op=dist.ReduceOp.MIN)
    return int(cap.item())


def _bench_prefill(runner, grid: Grid, device) -> list[dict]:
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    fits = [n for n in grid.lengths if n < runner.max_context]
    rows = [dict(input_tokens=n, skipped=f"longer than the model's context ({runner.max_context})")
            for n in grid.lengths if n not in fits]
    if not fits:
        return rows
    _resize_cache(runner, sum(runner.cache.blocks_needed(max(fits), max(fits))))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_new_tokens=1)
    for i, n in enumerate(fits):
        ids = [rng.randrange(runner.cfg.vocab_size) for _ in range(n)]
        times = []
        try:
            for rep in range(1 + grid.prefill_reps):  # the first run compiles and plans: not timed
                seq = Sequence(f"p{n}-{rep}", ids, params)
                seq.blocks = runner.cache.reserve(n, local_prompt_tokens=n)
                try:
                    _sync(device)
                    t = time.perf_counter()
                    int(runner.prefill(seq).argmax())
                    _sync(device)
                finally:
                    runner.cache.release(seq.blocks)
                if rep:
                    times.append(time.perf_counter() - t)
        except _oom_errors():  # the same on every rank (same shapes): longer prompts cannot run either
            rows += [dict(input_tokens=m, skipped="out of GPU memory") for m in fits[i:]]
            break
        rows.append(dict(input_tokens=n, latency_s=statistics.median(times)))
    return rows


def _oom_errors() -> tuple[type, ...]:
    import torch

    return (torch.cuda.OutOfMemoryError,)


def _bench_decode(runner, grid: Grid, device, multi_rank_graphs: bool = False) -> list[dict]:
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    page = runner.model.page_size
    steps = grid.warmup_steps + grid.decode_steps
    cfg = runner.cfg
    need = {(c, b): b * sum(runner.cache.blocks_needed(c + steps + 1)) for c in grid.contexts for b in grid.batches}
    margin = (8 << 30) if device.type == "cuda" else 0  # activations, logits, workspaces
    blocks = min(max(need.values()), _block_capacity(runner, margin))
    _resize_cache(runner, blocks + len(runner.cache.pools))  # + the CUDA graphs' pad block of each group
    if (device.type == "cuda" and (runner.shard.world_size == 1 or multi_rank_graphs)
            and type(runner.attention["full"]).__name__ == "FlashInferSinkAttention"):
        from pdserve.engine.cuda_graphs import DecodeGraphs

        # as a single-rank decode worker runs: steps replay CUDA graphs (captured in the first
        # warm-up step); multi-rank layouts decode eagerly unless --multi-rank-graphs, which
        # captures every size of the grid up front on all ranks (engine/cuda_graphs.py)
        graphs = DecodeGraphs(runner.model, runner.cache, max(grid.batches), max_context=runner.max_context)
        if runner.shard.world_size > 1:
            graphs.capture_all(sorted({graphs.size_for(b) for b in grid.batches}))
        runner.decode_graphs = graphs
    rows = []
    rng = random.Random(0)
    for ctx in grid.contexts:
        for b in grid.batches:
            row = dict(context=ctx, batch=b)
            if ctx + steps >= runner.max_context:
                rows.append({**row, "skipped": f"beyond the model's context ({runner.max_context})"})
                continue
            if need[(ctx, b)] > blocks:
                rows.append({**row, "skipped": f"KV of {b} x {ctx} tokens does not fit ({blocks} blocks of {page})"})
                continue
            seqs = []
            for i in range(b):
                s = Sequence(f"d{ctx}-{b}-{i}", [0] * ctx, SamplingParams(temperature=0, max_new_tokens=steps + 1))
                s.blocks = runner.cache.reserve(ctx + steps + 1)
                runner.cache.adopt_transferred(s.blocks, ctx)  # as after a KV transfer of ctx tokens
                s.num_cached = ctx
                s.output_ids = [rng.randrange(cfg.vocab_size)]
                seqs.append(s)
            times = []
            try:
                for i in range(steps):
                    _sync(device)
                    t = time.perf_counter()
                    tokens = runner.decode(seqs).argmax(-1).tolist()  # greedy sampling included
                    _sync(device)
                    if i >= grid.warmup_steps:
                        times.append(time.perf_counter() - t)
                    for s, tok in zip(seqs, tokens):
                        s.output_ids.append(tok)
            except _oom_errors():
                rows.append({**row, "skipped": "out of GPU memory"})
                continue
            finally:
                for s in seqs:
                    runner.cache.release(s.blocks)
            rows.append({**row, "step_s": statistics.median(times)})
    return rows


def _rank_main(rank: int, job: dict, out_dir: str) -> None:
    import torch

    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel import cpu_threads_per_rank, destroy_worker_group, init_worker_group

    lay = Layout(**job["layout"])
    if job["device"] == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(lay.world))
    group = init_worker_group(rank, lay.world, job["init"], ep_size=lay.ep, device=job["device"], timeout_s=600)
    try:
        t = time.perf_counter()
        runner = ModelRunner(job["model_dir"], device=group.device, precision=job["precision"], shard=group.shard,
                             num_kv_blocks=1)
        load_s = time.perf_counter() - t
        grid = Grid(**job["grid"])
        if job["section"] == "prefill":
            rows = _bench_prefill(runner, grid, group.device)
        else:
            rows = _bench_decode(runner, grid, group.device, job.get("multi_rank_graphs", False))
        if rank == 0:
            meta = dict(load_s=load_s, precision=runner.precision,
                        device_name=torch.cuda.get_device_name(group.device) if group.device.type == "cuda" else "CPU")
            Path(out_dir, "rows.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    finally:
        destroy_worker_group()


def run_job(model_dir: Path, layout: Layout, section: str, grid: Grid, device: str, precision: str | None,
            multi_rank_graphs: bool = False) -> dict:
    """Spawn the layout's ranks, run one section; returns {"meta", "rows"} from rank 0."""
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as d:
        job = dict(model_dir=str(model_dir), layout=asdict(layout), section=section, grid=asdict(grid),
                   device=device, precision=precision, init=f"file://{Path(d) / 'rendezvous'}",
                   multi_rank_graphs=multi_rank_graphs)
        tmp.spawn(_rank_main, args=(job, d), nprocs=layout.world, join=True)
        return json.loads(Path(d, "rows.json").read_text())


# -- results ------------------------------------------------------------------------------------
def enrich(model: str, section: str, layout: Layout, result: dict, graphs: bool = False) -> list[dict]:
    """Add the layout (" graphs": multi-rank decode from CUDA graphs), the GPU count and the cost
    columns to rank 0's raw rows."""
    out = []
    name = layout.name + (" graphs" if graphs else "")
    for r in result["rows"]:
        row = dict(model=model, section=section, layout=name, gpus=layout.world, **r)
        if "skipped" not in r:
            if section == "prefill":
                row["usd_per_m_input"] = usd_per_m_input(layout.world, r["latency_s"], r["input_tokens"])
            else:
                row["tok_s_per_request"] = 1.0 / r["step_s"]
                row["tok_s_total"] = r["batch"] / r["step_s"]
                row["usd_per_m_output"] = usd_per_m_output(layout.world, row["tok_s_total"])
        out.append(row)
    return out


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """New rows replace old rows of the same (model, section, layout)."""
    keys = {(r["model"], r["section"], r["layout"]) for r in new}
    return [r for r in old if (r["model"], r["section"], r["layout"]) not in keys] + new


def _layout_key(name: str) -> tuple[int, int, str]:
    lay = Layout.parse(name.split()[0])  # "EP2TP2 graphs": the layout, decoded from CUDA graphs
    return lay.world, -lay.ep, name


def write_csvs(rows: list[dict], out: Path) -> None:
    import csv

    common = ["model", "layout", "gpus"]
    for section, cols in (("prefill", common + ["input_tokens", "latency_s", "usd_per_m_input", "skipped"]),
                          ("decode", common + ["context", "batch", "step_s", "tok_s_per_request", "tok_s_total",
                                               "usd_per_m_output", "skipped"])):
        with open(out / f"{section}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(r for r in rows if r["section"] == section)


def plot(rows: list[dict], out: Path) -> list[str]:
    """Decode speed per request against $ per M output tokens (the seed's curves) and prefill
    latency against input length; returns the PNG file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    dec = [r for r in rows if r["section"] == "decode" and "skipped" not in r]
    panels = sorted({(r["model"], r["context"]) for r in dec})
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (model, ctx) in zip(axes[0], panels):
            for lay in sorted({r["layout"] for r in dec if r["model"] == model}, key=_layout_key):
                pts = sorted((r for r in dec if (r["model"], r["context"], r["layout"]) == (model, ctx, lay)),
                             key=lambda r: r["batch"])
                if not pts:
                    continue
                ax.plot([p["usd_per_m_output"] for p in pts], [p["tok_s_per_request"] for p in pts], "o-", label=lay)
                for p in pts:
                    ax.annotate(str(p["batch"]), (p["usd_per_m_output"], p["tok_s_per_request"]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
            ax.set_xscale("log")
            ax.set_xlabel(r"\$ per million output tokens (\$3 per GPU-hour)")
            ax.set_ylabel("decode tokens/s per request")
            ax.set_title(f"{model}, context {ctx} (labels: batch size)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "model_decode.png", dpi=120)
        plt.close(fig)
        made.append("model_decode.png")
    pre = [r for r in rows if r["section"] == "prefill" and "skipped" not in r]
    models = sorted({r["model"] for r in pre})
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
        for ax, model in zip(axes[0], models):
            for lay in sorted({r["layout"] for r in pre if r["model"] == model}, key=_layout_key):
                pts = sorted((r for r in pre if (r["model"], r["layout"]) == (model, lay)),
                             key=lambda r: r["input_tokens"])
                ax.plot([p["input_tokens"] for p in pts], [p["latency_s"] * 1e3 for p in pts], "o-", label=lay)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("input tokens")
            ax.set_ylabel("prefill latency (ms), batch 1")
            ax.set_title(model)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "model_prefill.png", dpi=120)
        plt.close(fig)
        made.append("model_prefill.png")
    return made


def _money(x: float) -> str:
    return f"${x:.3f}" if x < 10 else f"${x:.1f}"


def render_section(rows: list[dict], meta: dict, plots: list[str], out: Path, doc: Path | None) -> str:
    lines = [BEGIN, "## Model: prefill and decode by parallel layout", ""]
    lines.append(
        f"Measured {meta['date']} on {meta['device']} ({meta['gpus']} available, torch {meta['torch']}), command: "
        f"`{meta['command']}`. Random weights of each model's shape in the published layout (MXFP4 experts, "
        f"served as {meta['precision']}), full depth; engine steps timed on rank 0 of the layout's ranks "
        "(medians after warm-up; the workers' step-plan broadcast, gRPC and the router are not included). "
        f"Cost: ${PRICE_PER_GPU_HOUR:.2f} per GPU-hour times the layout's GPUs.")
    lines.append("")
    for model in sorted({r["model"] for r in rows}):
        pre = [r for r in rows if r["model"] == model and r["section"] == "prefill"]
        if pre:
            lengths = sorted({r["input_tokens"] for r in pre})
            lines += [f"### {model}: prefill, batch size 1", "",
                      "Cells: latency / $ per million input tokens.", "",
                      "| layout | GPUs | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
                      "| --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
            for lay in sorted({r["layout"] for r in pre}, key=_layout_key):
                cells = []
                for n in lengths:
                    r = next((r for r in pre if r["layout"] == lay and r["input_tokens"] == n), None)
                    if r is None or "skipped" in r:
                        cells.append("n/a" if r is None else f"- ({r['skipped']})")
                    else:
                        cells.append(f"{r['latency_s'] * 1e3:.1f} ms / {_money(r['usd_per_m_input'])}")
                lines.append(f"| {lay} | {Layout.parse(lay).world} | " + " | ".join(cells) + " |")
            lines.append("")
        dec = [r for r in rows if r["model"] == model and r["section"] == "decode"]
        for ctx in sorted({r["context"] for r in dec}):
            at = [r for r in dec if r["context"] == ctx]
            lays = sorted({r["layout"] for r in at}, key=_layout_key)
            lines += [f"### {model}: decode at context {ctx}", "",
                      "Cells: tokens/s per request / tokens/s in total / $ per million output tokens.", "",
                      "| batch | " + " | ".join(f"{lay} ({Layout.parse(lay.split()[0]).world} GPU)" for lay in lays) + " |",
                      "| --- | " + " | ".join("---" for _ in lays) + " |"]
            for b in sorted({r["batch"] for r in at}):
                cells = []
                for lay in lays:
                    r = next((r for r in at if r["layout"] == lay and r["batch"] == b), None)
                    if r is None or "skipped" in r:
                        cells.append("n/a" if r is None else "- (KV does not fit)" if "KV" in r["skipped"] else "-")
                    else:
                        cells.append(f"{r['tok_s_per_request']:.1f} / {r['tok_s_total']:.0f} / "
                                     f"{_money(r['usd_per_m_output'])}")
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
            lines.append("")
    for note in meta.get("notes", []):
        lines += [f"- {note}"]
    if meta.get("notes"):
        lines.append("")
    if plots and doc is not None and out.resolve().is_relative_to(doc.resolve().parent.parent):
        where = Path(os.path.relpath(out.resolve(), doc.resolve().parent))
        lines += [f"![{p}]({where / p})" for p in plots] + [""]
    elif plots:
        lines += [f"Plots: {', '.join(plots)} next to results.json (copy them beside this file to show them here).", ""]
    else:
        lines += [f"(No plot: matplotlib is not installed; the numbers are in {out}/prefill.csv and decode.csv.)", ""]
    lines.append(END)
    return "\n".join(lines)


def update_doc(doc: Path, section: str) -> None:
    """Replace the text between the model markers (inclusive), or append the section."""
    from pdserve.bench.doc_section import replace_section

    replace_section(doc, BEGIN, END, section)


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", required=True, help="results directory (results.json accumulates across runs)")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes, repetitions and layouts")
    ap.add_argument("--models", default=None, help="comma list of 20b,120b (default: both; tiny with --preset)")
    ap.add_argument("--preset", default=None, choices=["tiny", "20b", "120b"], help="one model shape (tiny: CPU check)")
    ap.add_argument("--sections", default="prefill,decode")
    ap.add_argument("--layouts", default=None, help="comma list such as TP1,TP2,EP4TP4 (default: all that fit)")
    ap.add_argument("--max-ranks", type=int, default=None,
                    help="GPUs to use (default: all visible); on CPU the gloo ranks (default 2)")
    ap.add_argument("--multi-rank-graphs", action="store_true",
                    help="multi-rank decode layouts replay CUDA graphs (rows named '<layout> graphs'; "
                         "default: they decode eagerly, as multi-rank decode workers do by default)")
    ap.add_argument("--precision", default=None, choices=["bf16", "fp8"], help="default: fp8 on CUDA, bf16 on CPU")
    ap.add_argument("--ckpt-dir", default=None, help="where random checkpoints are written (default: $TMPDIR)")
    ap.add_argument("--doc", default=None, help="markdown file whose model section is replaced "
                                                 "(default: docs/performance.md on CUDA, none on CPU)")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: rewrite the CSVs, plots and --doc section from OUT/results.json "
                         "(e.g. here, after a device run brought OUT back)")
    a = ap.parse_args(argv)

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/model.py: --device cuda but no GPU is visible", file=sys.stderr)
        return 1
    models = [a.preset] if a.preset else (a.models.split(",") if a.models else ["20b", "120b"])
    sections = [s for s in a.sections.split(",") if s]
    if not set(sections) <= {"prefill", "decode"} or not set(models) <= {"tiny", "20b", "120b"}:
        print("bench/model.py: --sections takes prefill,decode; --models 20b,120b", file=sys.stderr)
        return 2
    if a.device == "cuda":
        max_ranks = min(a.max_ranks or torch.cuda.device_count(), torch.cuda.device_count())
    else:
        max_ranks = a.max_ranks or min(2, os.cpu_count() or 1)
    only = {Layout.parse(x).name for x in a.layouts.split(",")} if a.layouts else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = Path(a.ckpt_dir) if a.ckpt_dir else Path(tempfile.gettempdir()) / "pdserve-bench-ckpt"
    doc = Path(a.doc) if a.doc else (REPO / "docs" / "performance.md" if a.device == "cuda" else None)

    results_file = out / "results.json"
    saved = json.loads(results_file.read_text()) if results_file.is_file() else {"rows": [], "notes": {}}
    rows, notes = saved["rows"], saved.get("notes", {})
    precision = a.precision
    if a.render_only:
        if a.doc is None:
            doc = REPO / "docs" / "performance.md"
        models = []
    else:
        command = "python bench/model.py " + " ".join(argv if argv is not None else sys.argv[1:])
        saved.update(gpus=max_ranks, command=command, date=datetime.date.today().isoformat(), torch=torch.__version__)
    for model in models:
        model_dir, why = ensure_checkpoint(model, ckpt_root)
        if model_dir is None:
            print(f"[bench] skipping {model}: {why}", flush=True)
            notes[model] = f"{model}: not measured ({why})."
            continue
        notes.pop(model, None)
        grid = make_grid(model, a.quick)
        for section in sections:
            layouts = prefill_layouts(max_ranks) if section == "prefill" else decode_layouts(max_ranks, a.quick)
            for lay in layouts:
                if only is not None and lay.name not in only:
                    continue
                t = time.perf_counter()
                print(f"[bench] {model} {section} {lay.name} ...", flush=True)
                try:
                    graphs = a.multi_rank_graphs and section == "decode" and lay.world > 1
                    result = run_job(model_dir, lay, section, grid, a.device, precision, graphs)
                except Exception as e:  # one layout failing (OOM, kernel) must not lose the others
                    traceback.print_exc()
                    notes[f"{model}/{section}/{lay.name}"] = (f"{model} {section} {lay.name} failed: "
                                                              f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                notes.pop(f"{model}/{section}/{lay.name}", None)
                new = enrich(model, section, lay, result, graphs)
                rows = merge_rows(rows, new)
                saved.update(rows=rows, notes=notes, device_name=result["meta"]["device_name"],
                             precision=result["meta"]["precision"])
                results_file.write_text(json.dumps(saved, indent=1))
                print(f"[bench] {model} {section} {lay.name}: loaded in {result['meta']['load_s']:.0f} s, "
                      f"done in {time.perf_counter() - t:.0f} s", flush=True)
                for r in new:
                    print("   ", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                                  if k not in ("model", "section", "layout")}, flush=True)
    saved.update(rows=rows, notes=notes)
    results_file.write_text(json.dumps(saved, indent=1))
    write_csvs(rows, out)
    plots = plot(rows, out)
    if not plots:
        print("[bench] matplotlib is not installed: no plot, see the CSV files", flush=True)
    meta = dict(date=saved.get("date", "?"), device=saved.get("device_name", a.device), gpus=saved.get("gpus", "?"),
                torch=saved.get("torch", "?"), precision=saved.get("precision", precision or "default"),
                command=saved.get("command", "?"), notes=list(notes.values()))
    section_md = render_section(rows, meta, plots, out, doc)
    (out / "model_section.md").write_text(section_md + "\n")
    if doc is not None:
        update_doc(doc, section_md)
        print(f"[bench] wrote the model section of {doc}", flush=True)
    print(f"[bench] results in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
