"""Cost of one batched sampling step (engine/sampling.py) over gpt-oss's 201088-token vocabulary:
median time of `sample()` per batch size and rule mix, on the device given, host synchronisation
included (it is part of every decode step).

    python bench/sampler.py [--device cuda] [--batches 1,16,64] [--vocab 201088] [--record docs/performance.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve.engine.sampling import SamplingParams, sample

# rule mixes a decode batch meets: what each row of the batch asks for
MIXES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "penalties + bias + logprobs 5": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5,
                                          logit_bias={42: 5.0}, logprobs=5),
}


def time_mix(batch: int, vocab: int, rules: dict, device: torch.device, generated: int, repeats: int) -> float:
    """Median seconds of one `sample()` call (results on the host)."""
    params = [SamplingParams(seed=random.getrandbits(63), max_new_tokens=generated + 1, **rules) for _ in range(batch)]
    outputs = [[random.randrange(vocab) for _ in range(generated)] for _ in range(batch)]
    logits = torch.randn(batch, vocab, device=device) * 3
    sample(logits, params, outputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample(logits, params, outputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (default 1,16,64)")
    ap.add_argument("--vocab", type=int, default=201088, help="vocabulary size (default 201088)")
    ap.add_argument("--generated", type=int, default=512, help="tokens each row generated so far (default 512)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per cell (default 5)")
    ap.add_argument("--record", help="markdown file whose sampler section gets the table")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    batches = [int(b) for b in a.batches.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = ["| rules (every row) | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "| --- |" + " --- |" * len(batches)]
    for mix, rules in MIXES.items():
        cells = [time_mix(b, a.vocab, rules, device, a.generated, a.repeats) * 1e3 for b in batches]
        lines.append(f"| {mix} | " + " | ".join(f"{c:.2f} ms" for c in cells) + " |")
    print(f"sample() over {a.vocab} tokens on {name}, {a.generated} tokens generated per row:")
    print("\n".join(lines))
    if a.record:
        from pdserve.bench.doc_section import replace_section

        body = "\n".join([
            "<!-- sampler:begin -->", "## Batched sampler (bench/sampler.py)", "",
            f"Median time of one `sample()` call over {a.vocab} tokens on {name} (results copied to the "
            f"host), each row having generated {a.generated} tokens: "
            f"`python bench/sampler.py --device {a.device} --batches {a.batches}`.", "", *lines,
            "<!-- sampler:end -->"])
        replace_section(Path(a.record), "<!-- sampler:begin -->", "<!-- sampler:end -->", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
