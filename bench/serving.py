"""Serving benchmark: a seeded open- or closed-loop load against the pdserve router, compared with
the same workload run in one process through `engine.llm_engine.LLMEngine`.

    python -m pdserve.bench.serving --spawn --prefill-workers 1 --decode-workers 1 --model tiny \\
        --num-requests 60 --rate 0.4 --input-len 288 --input-dist uniform --input-spread 0.7778 \\
        --output-len 48 --output-dist uniform --output-spread 0.3334 --doc docs/performance.md
    python -m pdserve.bench.serving --url http://127.0.0.1:8000 --model /ckpt/gpt-oss-20b --rate 4 ...

Requests arrive as a Poisson process at `--rate` req/s (`inf`: all at once), with at most
`--concurrency` in flight (a closed loop when the rate is `inf`). Each prompt is random ordinary
token ids sent to `/v1/completions` (streaming SSE, `stream_options.include_usage`) or to the gRPC
`pdserve.v1.Generator/Generate` token API (`--api grpc`). The router's completions API has no
`ignore_eos`, so an HTTP request may stop early on a sampled end-of-turn id: output lengths are what
the server reports, never what was asked. The gRPC API sets `ignore_eos` and gets exact lengths.

Measured per request from the client: TTFT (send -> first token), inter-token latency (gaps
between token-bearing stream messages; a message of k tokens counts k gaps of 1/k of its wait),
TPOT ((e2e - TTFT) / (output tokens - 1)) and end-to-end latency. `/metrics` is scraped before and
after the measured requests (warm-up excluded) for the server's own view: prefill queue and compute
time, KV transfer bytes and seconds. The single-process baseline replays the same arrival schedule,
prompts, seeds and stop ids into an in-process engine after the cluster has stopped.

`--workload chat` runs the multi-turn chat workload of bench/multiturn.py instead (conversations
sharing a system prompt; with `--spawn`, prefix caching off vs on). `--workload structured` (bench/
structured.py) measures what structured outputs cost per token: chat with and without a JSON
schema at decode batches 1 and 64.

`--doc` replaces this run's subsection (same label) in the "Serving (CPU)" section of a markdown
file, between `<!-- serving:begin -->` and `<!-- serving:end -->`; the rest of the file is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import numpy as np

# Ordinary (non-special) ids of gpt-oss's o200k_harmony encoding: special tokens start at 199998.
PROMPT_ID_RANGE = (0, 199_998)
DOC_TITLE = "# Performance"
SECTION_HEADING = "## Serving (CPU)"
DOC_BEGIN, DOC_END = "<!-- serving:begin -->", "<!-- serving:end -->"
DISTS = ("fixed", "uniform", "lognormal")
# Independent random streams, so that changing one knob (say the rate) leaves the rest unchanged.
_STREAM_ARRIVALS, _STREAM_INPUT, _STREAM_OUTPUT, _STREAM_PROMPTS, _STREAM_WARMUP = range(5)


class BenchError(Exception):
    """A user-facing failure (bad flags, unreachable router): printed as one line."""


# ---- workload ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts with the given mean, clipped to [1, maximum].

    fixed: always `mean`; uniform: integers in [mean*(1-spread), mean*(1+spread)]; lognormal:
    mean * exp(N(-spread^2/2, spread)), so `spread` is sigma of the log and the mean is kept.
    """

    mean: int
    dist: str = "fixed"
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise BenchError(f"a length must be >= 1, got {self.mean}")
        if self.dist not in DISTS:
            raise BenchError(f"unknown length distribution {self.dist!r} (choose {', '.join(DISTS)})")
        if self.dist == "uniform" and not 0 <= self.spread <= 1:
            raise BenchError(f"a uniform spread must be in [0, 1], got {self.spread}")
        if self.dist == "lognormal" and not 0 <= self.spread <= 3:
            raise BenchError(f"a lognormal spread (sigma) must be in [0, 3], got {self.spread}")

    @property
    def bounds(self) -> tuple[int, int]:
        if self.dist == "uniform":
            return max(1, round(self.mean * (1 - self.spread))), max(1, round(self.mean * (1 + self.spread)))
        return self.mean, self.mean  # fixed; lognormal has no bounds but the clip

    def sample(self, rng: np.random.Generator, n: int, maximum: int | None = None) -> np.ndarray:
        """int64 [n]."""
        if self.dist == "fixed":
            out = np.full(n, self.mean, dtype=np.int64)
        elif self.dist == "uniform":
            lo, hi = self.bounds
            out = rng.integers(lo, hi + 1, size=n, dtype=np.int64)
        else:
            s = self.spread
            out = np.rint(self.mean * np.exp(rng.normal(-s * s / 2, s, size=n))).astype(np.int64)
        return np.clip(out, 1, maximum if maximum is not None else None)

    def describe(self) -> str:
        if self.dist == "fixed":
            return f"fixed {self.mean}"
        if self.dist == "uniform":
            lo, hi = self.bounds
            return f"uniform {lo}-{hi}"
        return f"lognormal mean {self.mean}, sigma {self.spread:g}"


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int
    seed: int  # sampling seed: the same tokens wherever the request runs


@dataclass(frozen=True)
class Workload:
    num_requests: int
    rate: float  # req/s; inf = all at t=0
    input: LengthDist
    output: LengthDist
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise BenchError(f"--num-requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise BenchError(f"--rate must be > 0 (or inf), got {self.rate}")

    def _rng(self, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream])

    def requests(self) -> list[Request]:
        """The measured requests, in arrival order; a pure function of the fields."""
        n = self.num_requests
        arrivals = poisson_arrivals(self._rng(_STREAM_ARRIVALS), n, self.rate)
        return _make_requests(arrivals, self.input.sample(self._rng(_STREAM_INPUT), n),
                              self.output.sample(self._rng(_STREAM_OUTPUT), n),
                              self._rng(_STREAM_PROMPTS), seed_base=self.seed * 1_000_003)

    def warmup(self, n: int) -> list[Request]:
        """`n` requests of the same shapes from a separate stream, all arriving at t=0."""
        if n <= 0:
            return []
        rng = self._rng(_STREAM_WARMUP)
        return _make_requests(np.zeros(n), self.input.sample(rng, n), self.output.sample(rng, n), rng,
                              seed_base=self.seed * 1_000_003 + 500_000)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival offsets in seconds, float64 [n], non-decreasing, the first at 0: exponential gaps of
    mean 1/rate (a Poisson process); all zeros when the rate is infinite."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _make_requests(arrivals: np.ndarray, input_lens: np.ndarray, output_lens: np.ndarray,
                   rng: np.random.Generator, seed_base: int) -> list[Request]:
    lo, hi = PROMPT_ID_RANGE
    return [Request(i, float(arrivals[i]), rng.integers(lo, hi, size=int(input_lens[i])).tolist(),
                    int(output_lens[i]), seed_base + i)
            for i in range(len(arrivals))]


# ---- statistics ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Summary":
        values = list(values)
        mean = math.fsum(values) / len(values) if values else math.nan
        return cls(len(values), mean, percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass
class Outcome:
    """What the client saw of one request. Times are `time.perf_counter()` seconds."""

    index: int
    start: float
    prompt_tokens: int
    end: float = math.nan
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in it)
    output_tokens: int = 0
    finish_reason: str = ""
    status: str = "ok"  # "ok", an HTTP status code, a gRPC status name, or a transport failure
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft(self) -> float:
        return self.events[0][0] - self.start if self.events else math.nan

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan

    def inter_token_gaps(self) -> list[float]:
        gaps = []
        for (t0, _), (t1, k) in zip(self.events, self.events[1:]):
            gaps.extend([(t1 - t0) / k] * k)
        return gaps

    def fail(self, status: str, error: str, now: float) -> "Outcome":
        self.status, self.error, self.end = status, error[:500], now
        return self


@dataclass
class RunStats:
    sent: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    early_stops: int  # completed with fewer tokens than max_tokens
    output_len: Summary
    ttft: Summary
    itl: Summary
    tpot: Summary
    e2e: Summary

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration_s if self.duration_s > 0 else math.nan


def summarize(outcomes: Sequence[Outcome], requests: Sequence[Request]) -> RunStats:
    """Throughput counts completed requests over the wall time from the first send to the last end
    (failed ones included in the span); latencies are over completed requests only."""
    if not outcomes:
        raise BenchError("no requests were run")
    by_index = {r.index: r for r in requests}
    ok = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.status] = errors.get(o.status, 0) + 1
    ends = [o.end for o in outcomes if not math.isnan(o.end)]
    duration = (max(ends) - min(o.start for o in outcomes)) if ends else math.nan
    return RunStats(
        sent=len(outcomes), completed=len(ok), errors=dict(sorted(errors.items())), duration_s=duration,
        input_tokens=sum(o.prompt_tokens for o in ok), output_tokens=sum(o.output_tokens for o in ok),
        early_stops=sum(o.output_tokens < by_index[o.index].max_tokens for o in ok),
        output_len=Summary.of([o.output_tokens for o in ok]),
        ttft=Summary.of([o.ttft for o in ok if not math.isnan(o.ttft)]),
        itl=Summary.of([g for o in ok for g in o.inter_token_gaps()]),
        tpot=Summary.of([o.tpot for o in ok if not math.isnan(o.tpot)]),
        e2e=Summary.of([o.e2e for o in ok]))


# ---- CPU time ------------------------------------------------------------------------------------
def group_cpu_seconds(pgids: set[int]) -> float:
    """User + system CPU seconds of every live process whose process group is in `pgids` (spawned
    servers lead their own groups, so this includes their children); Linux /proc only."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 (state) of proc(5)
        if int(fields[2]) in pgids:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def self_cpu_seconds() -> float:
    """CPU seconds of this process, all threads."""
    return time.process_time()


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, all cores (/proc/stat: all but idle and
    iowait); NaN where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class CPUUse:
    """CPU seconds spent during a measured run: by the serving processes, by the load generator and
    by the whole machine (the rest is other work competing for the same cores)."""

    server_s: float = math.nan  # serving processes (the cluster's, or the baseline engine's)
    client_s: float = 0.0  # the load generator (none for the in-process baseline)
    machine_s: float = math.nan

    @property
    def other_s(self) -> float:
        """Clamped at 0: the two clocks tick separately, so an idle rest can read slightly negative."""
        rest = self.machine_s - self.server_s - self.client_s
        return rest if math.isnan(rest) else max(0.0, rest)


# ---- load generation -----------------------------------------------------------------------------
async def drive(requests: Sequence[Request], send: Callable[[Request], Awaitable[Outcome]],
                concurrency: int | None) -> list[Outcome]:
    """Send each request at its arrival offset, at most `concurrency` in flight (FIFO)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def one(r: Request) -> Outcome:
        delay = t0 + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            return await send(r)
        async with limit:
            return await send(r)

    return list(await asyncio.gather(*(one(r) for r in requests)))


class HTTPCompletions:
    """Streams `/v1/completions` with token-id prompts; one SSE message with text = one event."""

    def __init__(self, url: str, model: str, temperature: float, timeout_s: float):
        import httpx

        self.url = url.rstrip("/") + "/v1/completions"
        self.model, self.temperature = model, temperature
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def close(self) -> None:
        await self.client.aclose()

    async def __call__(self, r: Request) -> Outcome:
        import httpx

        body = {"model": self.model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.temperature, "seed": r.seed}
        o = Outcome(r.index, time.perf_counter(), len(r.prompt_ids))
        try:
            async with self.client.stream("POST", self.url, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    return o.fail(str(resp.status_code), text, time.perf_counter())
                done = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now, data = time.perf_counter(), line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        msg = json.loads(data)
                    except json.JSONDecodeError:
                        return o.fail("bad_stream", f"not JSON: {data[:200]!r}", now)
                    if "error" in msg:
                        return o.fail("stream_error", json.dumps(msg["error"]), now)
                    for choice in msg.get("choices") or ():
                        if choice.get("text"):
                            o.events.append((now, 1))
                        o.finish_reason = choice.get("finish_reason") or o.finish_reason
                    if msg.get("usage"):
                        o.output_tokens = msg["usage"]["completion_tokens"]
                o.end = time.perf_counter()
                if not done:
                    return o.fail("incomplete_stream", "the stream ended without [DONE]", o.end)
                o.output_tokens = o.output_tokens or len(o.events)
                return o
        except httpx.TimeoutException as e:
            return o.fail("timeout", repr(e), time.perf_counter())
        except httpx.TransportError as e:
            return o.fail("connection_error", repr(e), time.perf_counter())


class GRPCGenerate:
    """Streams `pdserve.v1.Generator/Generate` with `ignore_eos`: exact output lengths, token ids."""

    def __init__(self, target: str, model: str, temperature: float, timeout_s: float):
        import grpc

        from pdserve.proto import pdserve_pb2_grpc

        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pdserve_pb2_grpc.GeneratorStub(self.channel)
        self.model, self.temperature, self.timeout_s = model, temperature, timeout_s

    async def close(self) -> None:
        await self.channel.close()

    async def __call__(self, r: Request) -> Outcome:
        import grpc

        from pdserve.proto import pdserve_pb2 as pb

        request = pb.GenerateRequest(model=self.model, prompt_token_ids=r.prompt_ids, sampling=pb.SamplingParams(
            temperature=self.temperature, seed=r.seed, max_new_tokens=r.max_tokens, ignore_eos=True))
        o = Outcome(r.index, time.perf_counter(), len(r.prompt_ids))
        try:
            async for msg in self.stub.Generate(request, timeout=self.timeout_s):
                now = time.perf_counter()
                if msg.token_ids:
                    o.events.append((now, len(msg.token_ids)))
                o.output_tokens = msg.completion_tokens
                if msg.finish_reason == pb.FINISH_REASON_ERROR:
                    return o.fail("stream_error", msg.error, now)
                if msg.finish_reason:
                    o.finish_reason = pb.FinishReason.Name(msg.finish_reason)
        except grpc.aio.AioRpcError as e:
            return o.fail(e.code().name, e.details() or "", time.perf_counter())
        o.end = time.perf_counter()
        if not o.finish_reason:
            return o.fail("incomplete_stream", "the stream ended without a finish reason", o.end)
        return o


async def run_against_router(make_client: Callable[[], HTTPCompletions | GRPCGenerate], requests: Sequence[Request], warmup: Sequence[Request],
                             concurrency: int | None, metrics_url: str, server_pgids: set[int] | None
                             ) -> tuple[list[Outcome], dict[str, float], dict[str, float], CPUUse]:
    """Warm up (all at once, so every worker gets some), then the measured run between two scrapes
    of /metrics and of CPU time (server processes when we spawned them, and our own). The client
    is made here: gRPC's aio channel belongs to the running event loop."""
    client = make_client()
    try:
        if warmup:
            bad = [o for o in await drive(warmup, client, None) if not o.ok]
            if bad:
                raise BenchError(f"{len(bad)}/{len(warmup)} warm-up requests failed; first: "
                                 f"{bad[0].status} {bad[0].error}")
        before = await asyncio.to_thread(scrape_metrics, metrics_url)
        server0 = group_cpu_seconds(server_pgids) if server_pgids else math.nan
        client0, machine0 = self_cpu_seconds(), machine_cpu_seconds()
        outcomes = await drive(requests, client, concurrency)
        cpu = CPUUse(client_s=self_cpu_seconds() - client0, machine_s=machine_cpu_seconds() - machine0,
                     server_s=group_cpu_seconds(server_pgids) - server0 if server_pgids else math.nan)
        after = await asyncio.to_thread(scrape_metrics, metrics_url)
    finally:
        await client.close()
    return outcomes, before, after, cpu


# ---- the single-process baseline -----------------------------------------------------------------
def baseline_engine(model_dir: str, *, max_batch_size: int, torch_threads: int | None = None,
                    device: str = "cpu"):
    """The single-process engine the cluster is compared with, configured as a user would run it:
    on CUDA its decode steps replay CUDA graphs up to the batch limit, as a one-rank decode
    worker's do (same precision default, KV room sized from free memory)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_runner import ModelRunner

    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    graphs = max_batch_size if device == "cuda" else 0
    return LLMEngine(ModelRunner(model_dir, device=device, cuda_graph_max_batch=graphs), max_batch_size=max_batch_size)


def run_engine(model_dir: str, requests: Sequence[Request], warmup: Sequence[Request], *,
               concurrency: int | None, temperature: float, ignore_eos: bool, stop_token_ids: list[int],
               max_batch_size: int, torch_threads: int | None = None, device: str = "cpu", engine=None
               ) -> tuple[list[Outcome], CPUUse]:
    """Replay the schedule into an in-process `LLMEngine` (`engine`, else one made by
    baseline_engine): a request that arrives during a step joins at the next one (its latency
    counts from the arrival); with `concurrency`, request k starts when request k-concurrency's
    slot frees, as the client's semaphore does."""
    from pdserve.engine.model_runner import InvalidRequest
    from pdserve.engine.sampling import SamplingParams

    if engine is None:
        engine = baseline_engine(model_dir, max_batch_size=max_batch_size, torch_threads=torch_threads, device=device)

    def params(r: Request) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=r.seed, max_new_tokens=r.max_tokens,
                              stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)

    if warmup:
        engine.generate([r.prompt_ids for r in warmup], [params(r) for r in warmup])
    live: dict[str, Outcome] = {}
    outcomes: list[Outcome] = []
    freed: list[float] = []  # slot release times, in order

    def on_token(seq, tokens: list[int]) -> None:
        o = live[seq.request_id]
        now = time.perf_counter()
        if tokens:
            o.events.append((now, len(tokens)))
            return
        o.end, o.output_tokens = now, len(seq.output_ids)
        o.finish_reason = seq.finish_reason.value if seq.finish_reason else ""
        freed.append(now)
        del live[seq.request_id]

    pending = deque(requests)
    cpu0, machine0 = self_cpu_seconds(), machine_cpu_seconds()
    t0 = time.perf_counter()
    while pending or live:
        now = time.perf_counter()
        while pending and t0 + pending[0].arrival_s <= now and (not concurrency or len(live) < concurrency):
            r = pending.popleft()
            k = len(outcomes)
            start = t0 + r.arrival_s
            if concurrency and k >= concurrency:
                start = max(start, freed[k - concurrency])
            o = Outcome(r.index, start, len(r.prompt_ids))
            outcomes.append(o)
            try:
                engine.add_request(r.prompt_ids, params(r), request_id=f"bench-{r.index}")
            except InvalidRequest as e:
                o.fail("invalid_request", str(e), time.perf_counter())
                freed.append(o.end)
                continue
            live[f"bench-{r.index}"] = o
        if engine.waiting or engine.running:
            engine.step(on_token)
        elif pending:
            time.sleep(max(0.0, t0 + pending[0].arrival_s - time.perf_counter()))
    return outcomes, CPUUse(server_s=self_cpu_seconds() - cpu0, machine_s=machine_cpu_seconds() - machine0)


# ---- server metrics ------------------------------------------------------------------------------
SERVER_METRICS = (
    "pdserve_kv_transfer_bytes_sum", "pdserve_kv_transfer_bytes_count", "pdserve_kv_transfer_seconds_sum",
    "pdserve_prefill_queue_seconds_sum", "pdserve_prefill_compute_seconds_sum",
    "pdserve_prefill_compute_seconds_count", "pdserve_time_to_first_token_seconds_sum",
    "pdserve_time_to_first_token_seconds_count", "pdserve_generation_tokens_total",
    "pdserve_prompt_tokens_total", "pdserve_retries_total",
)


def parse_metrics(text: str, names: tuple[str, ...] = SERVER_METRICS) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}, for `names`."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def scrape_metrics(url: str, names: tuple[str, ...] = SERVER_METRICS) -> dict[str, float]:
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise BenchError(f"cannot read {url}/metrics: {e}") from None
    return parse_metrics(resp.text, names)


@dataclass(frozen=True)
class ServerView:
    """Per-request means from the router's histograms over the measured run (seconds, bytes)."""

    prefills: int
    kv_bytes: float
    kv_seconds: float
    prefill_queue_s: float
    prefill_compute_s: float
    router_ttft_s: float
    retries: int

    @classmethod
    def delta(cls, before: dict[str, float], after: dict[str, float]) -> "ServerView":
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SERVER_METRICS}
        n = d["pdserve_prefill_compute_seconds_count"]
        per = (lambda v: v / n) if n else (lambda v: math.nan)
        ttft_n = d["pdserve_time_to_first_token_seconds_count"]
        return cls(prefills=int(n), kv_bytes=d["pdserve_kv_transfer_bytes_sum"],
                   kv_seconds=d["pdserve_kv_transfer_seconds_sum"],
                   prefill_queue_s=per(d["pdserve_prefill_queue_seconds_sum"]),
                   prefill_compute_s=per(d["pdserve_prefill_compute_seconds_sum"]),
                   router_ttft_s=d["pdserve_time_to_first_token_seconds_sum"] / ttft_n if ttft_n else math.nan,
                   retries=int(d["pdserve_retries_total"]))

    @property
    def kv_bandwidth(self) -> float:
        """Bytes per second while transferring (sum of bytes / sum of transfer time)."""
        return self.kv_bytes / self.kv_seconds if self.kv_seconds > 0 else math.nan


# ---- reporting -----------------------------------------------------------------------------------
def _num(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "n/a" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    aligns = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(aligns) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _errors(s: RunStats) -> str:
    return ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "none"


def render_tables(cluster: RunStats, base: RunStats | None, server: ServerView | None, name: str,
                  cpu: CPUUse, base_cpu: CPUUse | None) -> str:
    """Markdown: throughput and CPU, latency (ms) and, with server metrics, where TTFT goes."""
    cols = [name] + (["single process", "ratio"] if base else [])
    base_cpu = base_cpu or CPUUse()

    def row(label: str, a: float, b: float | None, digits: int = 2, ratio: bool = True) -> list[str]:
        return [label, _num(a, digits)] + ([_num(b, digits), _ratio(a, b) if ratio else ""] if base else [])

    b = base or cluster  # placeholder values when there is no baseline; not shown
    out = [_table(["metric"] + cols, [
        ["completed / sent", f"{cluster.completed} / {cluster.sent}"]
        + ([f"{base.completed} / {base.sent}", ""] if base else []),
        ["errors", _errors(cluster)] + ([_errors(base), ""] if base else []),
        row("duration (s)", cluster.duration_s, b.duration_s, 1),
        row("requests/s", cluster.request_throughput, b.request_throughput),
        row("output tokens/s", cluster.output_throughput, b.output_throughput, 1),
        row("total tokens/s", cluster.total_throughput, b.total_throughput, 1),
        row("output tokens per request (mean)", cluster.output_len.mean, b.output_len.mean, 1),
        ["stopped before max_tokens", str(cluster.early_stops)] + ([str(base.early_stops), ""] if base else []),
        row("server CPU per completed request (ms)", 1e3 * cpu.server_s / max(1, cluster.completed),
            1e3 * base_cpu.server_s / max(1, b.completed), 1),
        row("server CPU busy (cores, of the run's wall time)", cpu.server_s / cluster.duration_s,
            base_cpu.server_s / b.duration_s),
        row("load generator CPU per request (ms)", 1e3 * cpu.client_s / cluster.sent, math.nan, 1, ratio=False),
        row("other work on the machine (cores busy)", cpu.other_s / cluster.duration_s,
            base_cpu.other_s / b.duration_s, ratio=False),
    ])]
    rows = []
    for label, attr in (("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2E", "e2e")):
        a: Summary = getattr(cluster, attr)
        rows.append([label, name] + [_num(1e3 * getattr(a, q), 1) for q in ("mean", "p50", "p90", "p99")])
        if base:
            c: Summary = getattr(base, attr)
            rows.append(["", "single process"] + [_num(1e3 * getattr(c, q), 1) for q in ("mean", "p50", "p90", "p99")])
            rows.append(["", "ratio"] + [_ratio(getattr(a, q), getattr(c, q)) for q in ("mean", "p50", "p90", "p99")])
    out.append(_table(["latency (ms)", "system", "mean", "p50", "p90", "p99"], rows))
    if server is not None and server.prefills:
        kv_s = server.kv_seconds / server.prefills
        rest = server.router_ttft_s - server.prefill_queue_s - server.prefill_compute_s - kv_s
        out.append(_table(["TTFT, mean per request (ms)", name], [
            ["client: send -> first token", _num(1e3 * cluster.ttft.mean, 1)],
            ["router: arrival -> first token (pdserve_time_to_first_token_seconds)", _num(1e3 * server.router_ttft_s, 1)],
            ["  prefill queue (pdserve_prefill_queue_seconds)", _num(1e3 * server.prefill_queue_s, 1)],
            ["  prefill compute (pdserve_prefill_compute_seconds)", _num(1e3 * server.prefill_compute_s, 1)],
            ["  KV transfer (pdserve_kv_transfer_seconds)", _num(1e3 * kv_s, 1)],
            ["  rest: routing, Reserve/Prefill RPCs, first-token hand-off", _num(1e3 * rest, 1)],
            ["client - router: HTTP/SSE or gRPC stream, detokenization, client", _num(1e3 * (cluster.ttft.mean - server.router_ttft_s), 1)],
        ]))
        out.append(f"KV transfer over the run: {server.kv_bytes / 2**20:,.1f} MiB in {server.prefills} prefills "
                   f"({server.kv_bytes / server.prefills / 2**10:,.1f} KiB each), {server.kv_seconds:.2f} s "
                   f"moving it: {_num(server.kv_bandwidth / 2**20, 1)} MiB/s while transferring. "
                   f"Retries: {server.retries}.")
    return "\n\n".join(out) + "\n"


def describe_device() -> str:
    model = platform.processor() or platform.machine()
    mem = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
                break
    except OSError:
        pass
    try:
        import torch

        version = f", torch {torch.__version__}"
        if torch.cuda.is_available():
            version += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        version = ""
    return f"{model}, {os.cpu_count()} cores{mem}{version}"


def _default_torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


DOC_INTRO = """\
Written by `python -m pdserve.bench.serving` (one subsection per configuration; a rerun replaces its own).
Each run sends one seeded workload (Poisson arrivals or a closed loop, random token-id prompts,
per-request sampling seeds) to the disaggregated cluster through the router, then replays the
identical schedule in one process through `engine.llm_engine.LLMEngine` (no network, no
disaggregation, same model, batch limit and stop ids) after the cluster has stopped. Ratios are
cluster / single process: above 1 is more throughput, or more latency.

What CPU figures mean: the model is the built-in tiny random gpt-oss (4 layers, hidden 160, full
201k vocabulary), so compute per token is tiny and fixed costs (Python, gRPC, HTTP, NIXL/UCX over
TCP) weigh much more than on a GPU; and every process (router, each worker, the load generator)
shares the same few cores, so adding workers adds contention, not capacity. By default each process
runs torch with one intra-op thread per core (`--torch-threads` changes it), so the cores are
oversubscribed. These numbers measure the serving stack's overhead on CPU, not what pdserve does
on H200s; the router's `pdserve_*` metrics split the time to first token into its parts.

Other work on the machine (the "other work" row: cores busy outside the benchmark) makes the
comparison unfair to the single process: Linux's scheduler autogroups give each session an equal
share and `LocalCluster` starts every worker in its own session, so the cluster gets several
shares against the baseline's one; and once the in-process engine falls behind, its prefill-first
step stalls decoding for every prompt that queued meanwhile. Trust runs whose other work is near 0;
CPU time per request is the steadier figure. Outputs of random models stop early now and then (a
sampled end-of-turn id; the completions API has no `ignore_eos`): output lengths are as served.
Over HTTP, ITL is the gap between SSE messages carrying text; TPOT is per token.
"""


def _split_runs(inner: str) -> tuple[str, list[tuple[str, str]]]:
    """Section body -> (intro, [(run title, run text)]) split on `### ` headings."""
    intro, runs = [], []
    for line in inner.splitlines(keepends=True):
        if line.startswith("### "):
            runs.append([line[4:].strip(), line])
        elif runs:
            runs[-1][1] += line
        else:
            intro.append(line)
    return "".join(intro), [(t, x) for t, x in runs]


def update_doc(path: str | Path, title: str, body: str) -> None:
    """Put `### title` + body into the serving section of `path`, replacing a run of the same title;
    everything outside the markers is left as it is (the file is created if missing)."""
    path = Path(path)
    text = path.read_text() if path.exists() else DOC_TITLE + "\n"
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if (begin < 0) != (end < 0) or end < begin:
        raise BenchError(f"{path} has a broken serving section: expected {DOC_BEGIN} ... {DOC_END}")
    inner = text[begin + len(DOC_BEGIN):end] if begin >= 0 else "\n" + DOC_INTRO
    intro, runs = _split_runs(inner)
    run = f"### {title}\n\n{body.strip()}\n\n"
    for i, (t, _) in enumerate(runs):
        if t == title:
            runs[i] = (t, run)
            break
    else:
        runs.append((title, run))
    intro = intro.rstrip("\n") + "\n\n"
    new_inner = intro + "".join(x.rstrip("\n") + "\n\n" for _, x in runs)
    if begin >= 0:
        text = text[:begin + len(DOC_BEGIN)] + new_inner + text[end:]
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION_HEADING}\n{DOC_BEGIN}{new_inner}{DOC_END}\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- command line --------------------------------------------------------------------------------
def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()] or [_rate(text)]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.serving", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running router, e.g. http://127.0.0.1:8000")
    target.add_argument("--spawn", action="store_true", help="start a local CPU cluster for the run")
    p.add_argument("--model", default="tiny", help="checkpoint dir or `tiny`: what --spawn serves and "
                   "what the single-process baseline loads")
    p.add_argument("--served-model-name", default="gpt-oss")
    p.add_argument("--prefill-workers", type=_positive, default=1)
    p.add_argument("--decode-workers", type=_positive, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where spawned workers and the single-process baseline run")
    p.add_argument("--max-batch-size", type=_positive, default=64,
                   help="decode batch limit of spawned decode workers and of the baseline engine")
    p.add_argument("--api", choices=["completions", "grpc"], default="completions",
                   help="HTTP /v1/completions (SSE) or the gRPC Generate token API (ignore_eos)")
    p.add_argument("--grpc-target", default=None, help="host:port of the router's gRPC API (with --url)")
    p.add_argument("--workload", dest="scenario", choices=["random", "chat", "structured"], default="random",
                   help="random prompts, or multi-turn chat sharing a system prompt (bench/multiturn.py: "
                        "with --spawn, prefix cache off vs on; gRPC API)")
    p.add_argument("--conversations", type=_positive, default=8, help="chat: conversations")
    p.add_argument("--turns", type=_positive, default=4, help="chat: turns per conversation")
    p.add_argument("--system-len", type=_positive, default=512, help="chat: shared system prompt tokens")
    p.add_argument("--user-len", type=_positive, default=64, help="chat: tokens of each user turn")
    p.add_argument("--num-requests", type=_positive, default=100)
    p.add_argument("--rate", type=_rate, default=math.inf, help="Poisson arrival rate, req/s (inf: all at once)")
    p.add_argument("--rates", type=_rates, default=None,
                   help="comma-separated rates (req/s): the same workload at each in turn against the same "
                        "servers (warm-up before the first only), the baseline engine loaded once, and a "
                        "summary table; replaces --rate")
    p.add_argument("--concurrency", type=_positive, default=None, help="at most this many in flight")
    for kind, default in (("input", 128), ("output", 32)):
        p.add_argument(f"--{kind}-len", type=_positive, default=default, help=f"mean {kind} tokens")
        p.add_argument(f"--{kind}-dist", choices=DISTS, default="fixed")
        p.add_argument(f"--{kind}-spread", type=float, default=0.5,
                       help="uniform: +-fraction of the mean; lognormal: sigma of the log")
    p.add_argument("--torch-threads", type=_positive, default=None,
                   help="intra-op threads of every spawned worker (OMP_NUM_THREADS) and of the baseline "
                   "(default: torch's, one per core)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="requests sent (all at once) before measuring")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-process LLMEngine run")
    p.add_argument("--doc", default=None, help="markdown file whose serving section gets this run")
    p.add_argument("--label", default=None, help="subsection title in --doc (default: from the config)")
    p.add_argument("--json", default=None, help="write every figure and per-request outcome here")
    p.add_argument("--log-dir", default=None, help="process logs of --spawn (default: a temp dir)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.api == "grpc" and a.url and not a.grpc_target:
        p.error("--api grpc with --url needs --grpc-target host:port")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.rates and a.scenario != "random":
        p.error("--rates sweeps the random workload only")
    if not 0 <= a.temperature <= 2:
        p.error("--temperature must be in [0, 2]")
    try:
        a.workload = Workload(a.num_requests, a.rate, LengthDist(a.input_len, a.input_dist, a.input_spread),
                              LengthDist(a.output_len, a.output_dist, a.output_spread), a.seed)
    except BenchError as e:
        p.error(str(e))
    return a


def _max_context(url: str, model: str) -> int | None:
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the router at {url}: {e}") from None
    served = {m["id"]: m for m in resp.json().get("data", [])}
    if model not in served:
        raise BenchError(f"the router serves {sorted(served)}, not {model!r} (--served-model-name)")
    return served[model].get("max_model_len")


def _check_fits(requests: Sequence[Request], max_context: int | None) -> None:
    if not max_context:
        return
    worst = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    if worst > max_context:
        raise BenchError(f"a request needs {worst} tokens of context; the model has {max_context}: "
                         "lower --input-len/--output-len or their spread")


def _load(rate: float) -> str:
    return f"Poisson {rate:g} req/s" if not math.isinf(rate) else "all at once"


def _label(a: argparse.Namespace, rate: float | None = None) -> str:
    """The doc subsection's title: model, layout, API, requests, load (a sweep: its rates)."""
    model = a.model if a.model == "tiny" else Path(a.model).name
    where = f"{a.prefill_workers}P+{a.decode_workers}D" if a.spawn else "external router"
    if rate is None and a.rates:
        load = "rates " + ", ".join(f"{r:g}" for r in a.rates) + " req/s"
    else:
        load = _load(a.rate if rate is None else rate)
    if a.concurrency:
        load += f", concurrency {a.concurrency}"
    threads = f", {a.torch_threads} torch thread{'s' * (a.torch_threads > 1)}" if a.torch_threads else ""
    return f"{model}, {where}, {a.api}, {a.num_requests} requests, {load}{threads}"


def run(a: argparse.Namespace, argv: list[str]) -> dict:
    """The whole benchmark; returns what --json writes: one run's figures, or with --rates one
    entry per rate under "runs" and the sweep's summary table."""
    rates = a.rates or [a.workload.rate]
    workloads = [replace(a.workload, rate=r) for r in rates]
    warmup = a.workload.warmup(a.warmup)  # before the first rate only: the servers stay warm
    cluster = None
    if a.spawn:
        from pdserve.launch.ports import server_ports
        from pdserve.launch.serve import ClusterSpec, LocalCluster

        spec = ClusterSpec(model=a.model, served_model_name=a.served_model_name, **server_ports(),
                           prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                           max_batch_size=a.max_batch_size, device=a.device)
        if a.torch_threads:
            os.environ["OMP_NUM_THREADS"] = str(a.torch_threads)  # inherited by the workers
        cluster = LocalCluster(spec, a.log_dir)
        print(f"bench: starting {a.prefill_workers} prefill + {a.decode_workers} decode workers; logs in "
              f"{cluster.log_dir}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        cluster.start()
        print(f"bench: cluster up in {time.perf_counter() - t:.1f}s at {cluster.url}", file=sys.stderr, flush=True)
        url, grpc_target, model_dir = cluster.url, f"127.0.0.1:{spec.grpc_port}", cluster.model
    else:
        url, grpc_target = a.url, a.grpc_target
        model_dir = None
        if not a.no_baseline:
            if a.model == "tiny":
                from pdserve.launch.serve import builtin_tiny_model

                model_dir = str(builtin_tiny_model())
            else:
                model_dir = a.model
    measured = []  # per rate: (outcomes, metrics before, after, CPU)
    try:
        _check_fits([r for w in workloads for r in w.requests()] + warmup, _max_context(url, a.served_model_name))

        def make_client() -> HTTPCompletions | GRPCGenerate:
            if a.api == "completions":
                return HTTPCompletions(url, a.served_model_name, a.temperature, a.request_timeout)
            return GRPCGenerate(grpc_target, a.served_model_name, a.temperature, a.request_timeout)

        pgids = {p.pid for p in cluster.procs.values()} if cluster is not None else None
        for k, w in enumerate(workloads):
            print(f"bench: {len(warmup) if k == 0 else 0} warm-up + {w.num_requests} measured requests"
                  + (f" at {w.rate:g} req/s" if a.rates else ""), file=sys.stderr, flush=True)
            measured.append(asyncio.run(run_against_router(make_client, w.requests(), warmup if k == 0 else [],
                                                           a.concurrency, url, pgids)))
    finally:
        if cluster is not None:
            cluster.stop()
    baseline: list[tuple[list[Outcome], CPUUse] | None] = [None] * len(workloads)
    if not a.no_baseline:
        from pdserve.router.harmony import HarmonyCodec

        print("bench: single-process baseline (LLMEngine)", file=sys.stderr, flush=True)
        engine = baseline_engine(model_dir, max_batch_size=a.max_batch_size, torch_threads=a.torch_threads,
                                 device=a.device)
        for k, w in enumerate(workloads):
            baseline[k] = run_engine(model_dir, w.requests(), warmup if k == 0 else [], concurrency=a.concurrency,
                                     temperature=a.temperature, ignore_eos=a.api == "grpc",
                                     stop_token_ids=HarmonyCodec().stop_token_ids(),
                                     max_batch_size=a.max_batch_size, engine=engine)
    reports = [_report(a, argv, w, warmup, *m, *(b or (None, None)))
               for w, m, b in zip(workloads, measured, baseline)]
    results = [r for r, _, _ in reports]
    if not a.rates:
        result = results[0]
    else:
        name = f"cluster {a.prefill_workers}P+{a.decode_workers}D" if a.spawn else "router"
        sweep = render_sweep(rates, [c for _, c, _ in reports], [b for _, _, b in reports], name)
        print("\n" + sweep, flush=True)
        result = {"title": a.label or _label(a), "rates": rates, "sweep": sweep, "runs": results}
        if a.doc:
            update_doc(a.doc, result["title"], f"Command: `{results[0]['command']}`\n\n{sweep}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


def render_sweep(rates: list[float], cluster: list[RunStats], base: list[RunStats | None],
                 name: str = "cluster") -> str:
    """One row per rate and system: throughput and mean/p90 TTFT and TPOT (ms)."""
    rows = []
    for rate, c, b in zip(rates, cluster, base):
        for system, s in ((name, c), ("single process", b)):
            if s is None:
                continue
            rows.append([f"{rate:g}", system, f"{s.completed} / {s.sent}", _num(s.request_throughput),
                         _num(s.output_throughput, 1), _num(1e3 * s.ttft.mean, 1), _num(1e3 * s.ttft.p90, 1),
                         _num(1e3 * s.tpot.mean, 2), _num(1e3 * s.tpot.p90, 2)])
    return _table(["rate (req/s)", "system", "completed / sent", "requests/s", "output tokens/s",
                   "TTFT mean (ms)", "TTFT p90 (ms)", "TPOT mean (ms)", "TPOT p90 (ms)"], rows) + "\n"


def _report(a: argparse.Namespace, argv: list[str], w: Workload, warmup: list[Request], outcomes: list[Outcome],
            before: dict[str, float], after: dict[str, float], cpu: CPUUse,
            base_outcomes: list[Outcome] | None, base_cpu: CPUUse | None
            ) -> tuple[dict, RunStats, RunStats | None]:
    """Print (and record in --doc) one rate's tables: (the figures --json writes for it, the
    cluster's and the baseline's statistics)."""
    requests = w.requests()
    stats = summarize(outcomes, requests)
    server = ServerView.delta(before, after)
    base = summarize(base_outcomes, requests) if base_outcomes is not None else None
    name = f"cluster {a.prefill_workers}P+{a.decode_workers}D" if a.spawn else "router"
    tables = render_tables(stats, base, server, name, cpu, base_cpu)
    command = "python -m pdserve.bench.serving " + shlex.join(argv)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device, commit = describe_device(), git_commit()
    in_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.max_tokens for r in requests]
    threads = a.torch_threads or _default_torch_threads()
    header = (f"Measured {date} on {device}, {threads} torch intra-op threads per process; "
              f"commit {commit[:12] if commit else 'unknown'}.\n"
              f"Command: `{command}`\n\n"
              f"Workload: {w.num_requests} requests, "
              + (f"Poisson arrivals at {w.rate:g} req/s" if not math.isinf(w.rate) else "all sent at once")
              + (f", at most {a.concurrency} in flight" if a.concurrency else "")
              + f"; input {w.input.describe()} (drawn {min(in_lens)}-{max(in_lens)}, mean {np.mean(in_lens):.0f}); "
              f"max_tokens {w.output.describe()} (drawn {min(out_lens)}-{max(out_lens)}, mean {np.mean(out_lens):.0f}); "
              f"temperature {a.temperature:g}, seed {w.seed}; {len(warmup)} warm-up requests excluded; "
              + ("HTTP `/v1/completions`, streamed." if a.api == "completions" else "gRPC `Generate`, ignore_eos.")
              + "\n")
    print("\n" + header + "\n" + tables, flush=True)
    if a.rates:
        title = f"{a.label}, {_load(w.rate)}" if a.label else _label(a, w.rate)
    else:
        title = a.label or _label(a)
    if a.doc:
        update_doc(a.doc, title, header + "\n" + tables)
        print(f"bench: wrote '{title}' to {a.doc}", file=sys.stderr, flush=True)
    return {"title": title, "date": date, "device": device, "commit": commit, "command": command,
            "config": {k: v for k, v in vars(a).items() if k != "workload"},
            "cluster": asdict(stats), "baseline": asdict(base) if base else None, "server": asdict(server),
            "cpu": asdict(cpu), "baseline_cpu": asdict(base_cpu) if base_cpu else None,
            "outcomes": [asdict(o) for o in outcomes],
            "baseline_outcomes": [asdict(o) for o in base_outcomes] if base_outcomes else None}, stats, base


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    try:
        if a.scenario == "chat":
            from pdserve.bench.multiturn import run_chat_bench

            run_chat_bench(a, argv)
        elif a.scenario == "structured":
            from pdserve.bench.structured import run_structured_bench

            run_structured_bench(a, argv)
        else:
            run(a, argv)
    except (BenchError, TimeoutError, RuntimeError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
