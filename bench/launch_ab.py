"""The decode step's CUDA graph under different launch settings, timed interleaved in one process.

Each setting (environment variables read when kernels are launched, so at capture) gets its own
DecodeGraphs of the same runner and the same running batch; rounds replay each setting's graph
back to back in turn, so clock and thermal drift fall on every setting alike. Reports the median
replay per setting and its ratio to the first. Settings: programmatic dependent launch
(kernels/pdl.py) off, then on; then also one token's QKV GEMV + RoPE + KV write in one launch
(`GptOssModel.fuse_qkv_rope`), the engine's default.

    python bench/launch_ab.py --ckpt DIR [--precision mxfp4] [--batches 1,16,64] [--context 1024]
        [--rounds 15] [--replays 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.kernels import time_it  # noqa: E402
from pdserve.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.sampling import SamplingParams  # noqa: E402

# name -> (environment, GptOssModel attributes) at capture
SETTINGS = {
    "pdl off": ({"PDSERVE_PDL": "0"}, {"fuse_qkv_rope": False}),
    "pdl on": ({"PDSERVE_PDL": "1"}, {"fuse_qkv_rope": False}),
    "pdl on, qkv+rope": ({"PDSERVE_PDL": "1"}, {"fuse_qkv_rope": True}),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--precision", default="mxfp4", choices=["fp8", "mxfp4", "bf16"])
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    runner = ModelRunner(a.ckpt, device="cuda", precision=a.precision, num_kv_blocks=8192)
    g = torch.Generator().manual_seed(1)
    results = {}
    for batch in a.batches:
        eng = LLMEngine(runner, max_batch_size=batch)
        params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(torch.randint(0, runner.cfg.vocab_size, (a.context,), generator=g).tolist(), params)
        while eng.waiting:
            eng.step()
        graphs, steps = {}, {}
        for name, (env, attrs) in SETTINGS.items():
            os.environ.update(env)
            for k, v in attrs.items():
                setattr(runner.model, k, v)
            graphs[name] = DecodeGraphs(runner.model, runner.cache, batch, max_context=runner.max_context)
            size = graphs[name].size_for(batch)
            graphs[name].capture_all([size])
            runner.decode_graphs = graphs[name]
            eng.step()  # one real step through this setting's graph (its inputs staged)
            steps[name] = graphs[name]._steps[size]
        runner.decode_graphs = None
        times = {name: [] for name in SETTINGS}
        for _ in range(a.rounds):
            for name, step in steps.items():  # one timed run of `replays` back-to-back replays
                run = lambda: [step.graph.replay() for _ in range(a.replays)]  # noqa: E731
                times[name].append(time_it(run, reps=1, warmup=1, flush=False) * 1e6 / a.replays)
        base = statistics.median(times[next(iter(SETTINGS))])
        results[batch] = {}
        for name, ts in times.items():
            med = statistics.median(ts)
            results[batch][name] = {"replay_us": med, "min_us": min(ts), "ratio": med / base}
            print(f"batch {batch:3d} {a.precision:5s} {name:24s} replay {med:8.1f} us (min {min(ts):8.1f}) "
                  f"x{med / base:.3f}", flush=True)
        while eng.busy:
            eng.step()
        del graphs, steps
    if a.out:
        Path(a.out).write_text(json.dumps({"precision": a.precision, "context": a.context, "results": results,
                                           "command": "python " + " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
