"""`bench/serving.py --workload structured`: what structured outputs cost per generated token.

The same chat requests (random token-id text as the user turn, a fixed `max_tokens`) run with and
without `response_format: json_schema`, at `--concurrency` 1 and 64 streams (decode batches of
1 and 64), each streamed. Per request: time per output token after the first (TPOT, from the
stream) and end to end. The cost of structured outputs per token is the TPOT difference; every
structured answer is also checked against its schema (a failure is counted, never hidden).

    python -m pdserve.bench.serving --spawn --workload structured --output-len 64 --doc docs/performance.md
"""

from __future__ import annotations

import asyncio
import datetime
import json
import shlex
import sys
import time
from dataclasses import dataclass, field

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
BATCHES = (1, 64)


@dataclass
class Run:
    label: str
    batch: int
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0
    invalid: int = 0
    errors: int = 0
    wall_s: float = 0.0


async def _one(client, url: str, body: dict, run: Run, structured: bool) -> None:
    t0 = time.perf_counter()
    first, content, tokens = None, [], 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            run.errors += 1
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            for choice in msg.get("choices") or ():
                delta = choice.get("delta") or {}
                if first is None and (delta.get("content") or delta.get("reasoning_content")):
                    first = time.perf_counter()
                content.append(delta.get("content") or "")
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
    end = time.perf_counter()
    if structured:
        import jsonschema

        try:
            jsonschema.validate(json.loads("".join(content)), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            run.invalid += 1
    run.tokens += tokens
    run.e2e_s.append(end - t0)
    if first is not None and tokens > 1:
        run.tpot_s.append((end - first) / (tokens - 1))


async def measure(url: str, model: str, batch: int, requests: int, max_tokens: int, structured: bool,
                  seed: int, timeout_s: float) -> Run:
    import httpx

    rng = np.random.default_rng(seed)
    run = Run("json_schema" if structured else "free", batch)
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    limit = asyncio.Semaphore(batch)

    def body(i: int) -> dict:
        text = " ".join(str(x) for x in rng.integers(0, 10_000, 24))
        b = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
             "stream": True, "stream_options": {"include_usage": True}, "seed": seed + i}
        if structured:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
        return b

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def go(i: int) -> None:
            async with limit:
                await _one(client, endpoint, body(i), run, structured)

        await asyncio.gather(*(go(i) for i in range(min(batch, 4))))  # warm-up (first grammar: vocabulary index)
        run.tpot_s.clear(), run.e2e_s.clear()
        run.tokens = run.invalid = run.errors = 0
        t = time.perf_counter()
        await asyncio.gather(*(go(i) for i in range(requests)))
        run.wall_s = time.perf_counter() - t
    return run


def render(runs: list[Run]) -> str:
    rows = ["| batch | output | requests ok | TPOT ms (median) | TPOT ms (mean) | tokens/s | invalid JSON | errors |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        rows.append(f"| {r.batch} | {r.label} | {len(r.e2e_s)} | {np.median(r.tpot_s) * 1e3:.2f} | "
                    f"{np.mean(r.tpot_s) * 1e3:.2f} | {r.tokens / r.wall_s:.1f} | {r.invalid} | {r.errors} |")
    cost = []
    for b in sorted({r.batch for r in runs}):
        free, js = ([r for r in runs if r.batch == b and r.label == k] for k in ("free", "json_schema"))
        if free and js:
            d = (np.mean(js[0].tpot_s) - np.mean(free[0].tpot_s)) * 1e3
            cost.append(f"batch {b}: {d:+.2f} ms per token ({d / (np.mean(free[0].tpot_s) * 1e3) * 100:+.0f}%)")
    return "\n".join(rows) + "\n\nCost of structured outputs (mean TPOT, json_schema - free): " + "; ".join(cost) + ".\n"


def run_structured_bench(a, argv: list[str]) -> dict:
    """Free vs json_schema at each batch size, against --url or a --spawn'ed cluster."""
    from pdserve.bench.serving import describe_device, git_commit, update_doc

    max_tokens = a.workload.output.mean
    requests = lambda batch: max(8, 2 * batch)  # noqa: E731 - two rounds of the batch, at least 8

    def all_runs(url: str) -> list[Run]:
        runs = []
        for batch in BATCHES:
            for structured in (False, True):
                print(f"bench: batch {batch}, {'json_schema' if structured else 'free'}", file=sys.stderr, flush=True)
                runs.append(asyncio.run(measure(url, a.served_model_name, batch, requests(batch), int(max_tokens),
                                                structured, a.seed, a.request_timeout)))
        return runs

    if a.spawn:
        from pdserve.launch.ports import server_ports
        from pdserve.launch.serve import ClusterSpec, LocalCluster

        spec = ClusterSpec(model=a.model, served_model_name=a.served_model_name, **server_ports(),
                           prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                           max_batch_size=max(BATCHES), device=a.device)
        with LocalCluster(spec, a.log_dir) as cluster:
            runs = all_runs(cluster.url)
    else:
        runs = all_runs(a.url)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit()
    header = (f"Measured {date} on {describe_device()}; commit {commit[:12] if commit else 'unknown'}.\n"
              f"Command: `python -m pdserve.bench.serving {shlex.join(argv)}`\n\n"
              f"Chat requests streamed, max_tokens {int(max_tokens)}, {a.prefill_workers}P+{a.decode_workers}D; "
              "the schema: an object with a string, an integer, an enum array and a nested object, all required. "
              "On CPU the tiny model's step is short, so the mask's share is larger than on a GPU; the machine is shared, "
              "so a difference of a few ms (either sign) is noise.\n")
    table = render(runs)
    print("\n" + header + "\n" + table, flush=True)
    title = a.label or f"structured outputs, {a.prefill_workers}P+{a.decode_workers}D, batch 1 and 64"
    if a.doc:
        update_doc(a.doc, title, header + "\n" + table)
    return {"title": title, "runs": [r.__dict__ for r in runs]}
