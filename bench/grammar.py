"""Cost of structured-output token masks over gpt-oss's 201088-token vocabulary, on the CPU.

A batch of sequences walks a JSON schema (a random model: any token the mask allows, as random
weights sample), and every step fills each row's bitmask. Reports the time per token (one row's
mask) and per batch step, for llguidance (what pdserve runs: `engine.grammar.fill_masks`, its
budget checks included, and the mask alone) and, when installed, xgrammar (the candidate
it was chosen against; `pip install xgrammar` to compare).

    python -m pdserve.bench.grammar [--batch 64] [--steps 60] [--record docs/performance.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.bench.doc_section import replace_section
from pdserve.engine import grammar as G
from pdserve.engine.config import VOCAB_SIZE
from pdserve.engine.vocab import special_tokens, token_bytes

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
BEGIN, END = "<!-- bench-grammar:begin -->", "<!-- bench-grammar:end -->"


def _walk(batch: int, steps: int, make, fill_batch, consume, rng: random.Random) -> list[float]:
    """Seconds per row-mask of each step (a finished row restarts: the batch stays full)."""
    rows = [make() for _ in range(batch)]
    mask = np.full((batch, G.MASK_WORDS), -1, dtype=np.int32)
    per_token = []
    for _ in range(steps):
        t = time.perf_counter()
        fill_batch(rows, mask)
        per_token.append((time.perf_counter() - t) / batch)
        for i in range(batch):
            ids = G.allowed(mask[i])
            if not len(ids) or not consume(rows[i], int(ids[rng.randrange(len(ids))])):
                rows[i] = make()
    return per_token


def _llguidance(batch: int, steps: int, rng: random.Random, parallel: bool) -> list[float]:
    from llguidance.numpy import fill_next_token_bitmask

    grammar = "start: body\nbody: %json" + json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})

    def fill(rows, mask):
        if parallel:
            mask[:] = G.fill_masks(rows)  # the decode worker's call
        else:
            for i, m in enumerate(rows):
                fill_next_token_bitmask(m._m, mask, i)  # the mask alone

    def consume(m, token):
        if m.done():
            return False
        m.accept(token)
        return True

    G.tokenizer()  # built once per process, not timed
    return _walk(batch, steps, lambda: G.Matcher(grammar, 1 << 20), fill, consume, rng)


def _xgrammar(batch: int, steps: int, rng: random.Random) -> list[float] | None:
    try:
        import torch
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = [b""] * VOCAB_SIZE
    for text, i in token_bytes().items():
        vocab[i] = text
    for text, i in special_tokens(VOCAB_SIZE).items():
        vocab[i] = text.encode()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[200002])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)

    def fill(rows, mask):
        t = torch.from_numpy(mask)
        for i, m in enumerate(rows):
            m.fill_next_token_bitmask(t, i)

    def consume(m, token):
        return not m.is_terminated() and m.accept_token(token)

    return _walk(batch, steps, lambda: xgr.GrammarMatcher(compiled), fill, consume, rng)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", type=Path, help="write the table into this markdown file")
    a = p.parse_args(argv)
    # the machine may be shared: each engine runs twice, interleaved, and keeps its faster run
    runs = {"llguidance, pdserve's fill_masks (budget checks included)":
            lambda: _llguidance(a.batch, a.steps, random.Random(a.seed), True),
            "llguidance, mask alone, one row at a time":
            lambda: _llguidance(a.batch, a.steps, random.Random(a.seed), False),
            "xgrammar 0.1, mask alone, one row at a time": lambda: _xgrammar(a.batch, a.steps, random.Random(a.seed))}
    results: dict[str, list[float] | None] = {}
    for _ in range(2):
        for name, run in runs.items():
            per = run()
            if per is not None and (name not in results or statistics.median(per) < statistics.median(results[name])):
                results[name] = per
    lines = [BEGIN, f"### Structured outputs: token mask cost, vocabulary {VOCAB_SIZE}, batch {a.batch} (CPU)", "",
             f"{datetime.date.today()}, {_cpu()} ({os.cpu_count()} cores), "
             f"`python -m pdserve.bench.grammar --batch {a.batch} --steps {a.steps}`: a random walk "
             "through a JSON schema (nested object, enum array, required fields), every row's mask "
             "filled each step.", "",
             "| engine | us per token, median | mean | p99 | ms per batch step (mean) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, per in results.items():
        if per is None:
            continue
        us = np.array(per) * 1e6
        lines.append(f"| {name} | {statistics.median(us):.1f} | {us.mean():.1f} | {np.percentile(us, 99):.1f} "
                     f"| {us.mean() * a.batch / 1e3:.2f} |")
    lines.append(END)
    table = "\n".join(lines)
    print(table)
    if a.record:
        replace_section(a.record, BEGIN, END, table)


if __name__ == "__main__":
    main(sys.argv[1:])
