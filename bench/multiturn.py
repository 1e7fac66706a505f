"""Multi-turn chat workload for `bench/serving.py --workload chat`: what prefix caching is for.

Several conversations share one long system prompt; each turn sends the whole conversation so far
(system prompt, earlier user turns and the replies the server gave) plus a new user turn, through
the gRPC token API (`ignore_eos`: replies have exactly `--output-len` tokens, and their ids extend
the conversation). Conversations start `1 / --rate` seconds apart (all at once with `inf`) and run
their turns one after another. With `--spawn` the same workload runs twice, on a cluster without
prefix caching (`--prefix-cache-tokens 0`, load-only routing) and on one with it (the defaults),
and the table compares: prompt tokens sent, prefill tokens computed (sent - cached, from the
router's `pdserve_prefill_*_tokens_total`), hit rate, TTFT (client-side, all turns and turns after
the first) and end-to-end time.

"Conversation share" is the part of all prompt tokens that repeats the same conversation's previous
prompt, the least a prefix cache should save; "ideal share" adds the system prompt of every
conversation after the first (what a cache that had seen it saves, at token granularity). Caches
work in whole pages (16 tokens by default), so the measured saving can fall short of the ideal.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

PROMPT_ID_RANGE = (0, 199_998)  # ordinary ids of o200k_harmony (bench/serving.py)
TOKEN_METRICS = ("pdserve_prefill_prompt_tokens_total", "pdserve_prefill_cached_tokens_total")


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int
    turns: int
    system_len: int
    user_len: int
    output_len: int
    rate: float  # conversations started per second (inf: all at once)
    seed: int

    def _ids(self, n: int, *key: int) -> list[int]:
        rng = np.random.default_rng([self.seed, *key])
        return rng.integers(*PROMPT_ID_RANGE, size=n).tolist()

    def system_prompt(self) -> list[int]:
        return self._ids(self.system_len, 0)

    def user_turn(self, conversation: int, turn: int) -> list[int]:
        return self._ids(self.user_len, 1, conversation, turn)

    def stand_in_reply(self, conversation: int, turn: int) -> list[int]:
        """Reply ids for runs without a model (bench/prefix_pressure.py); served runs use the server's."""
        return self._ids(self.output_len, 2, conversation, turn)

    def prompt_len(self, turn: int) -> int:
        """Tokens of a conversation's prompt at `turn` (0-based): everything said before, plus the new user turn."""
        return self.system_len + self.user_len + turn * (self.output_len + self.user_len)

    def describe(self) -> str:
        start = "all at once" if math.isinf(self.rate) else f"{1 / self.rate:g} s apart"
        return (f"{self.conversations} conversations x {self.turns} turns, started {start}; shared system "
                f"prompt {self.system_len} tokens, user turns {self.user_len}, replies {self.output_len} "
                f"tokens; seed {self.seed}")


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    start: float
    first: float = math.nan
    end: float = math.nan
    output_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.start


async def _send(stub, prompt: list[int], max_tokens: int, seed: int, temperature: float,
                timeout_s: float, turn: Turn) -> Turn:
    import grpc

    from pdserve.proto import pdserve_pb2 as pb

    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        temperature=temperature, seed=seed, max_new_tokens=max_tokens, ignore_eos=True))
    try:
        async for msg in stub.Generate(request, timeout=timeout_s):
            if msg.token_ids and math.isnan(turn.first):
                turn.first = time.perf_counter()
            turn.output_ids.extend(msg.token_ids)
            if msg.finish_reason == pb.FINISH_REASON_ERROR:
                turn.error = msg.error or "stream error"
    except grpc.aio.AioRpcError as e:
        turn.error = f"{e.code().name}: {e.details()}"
    turn.end = time.perf_counter()
    return turn


async def run_chat(target: str, w: ChatWorkload, temperature: float, timeout_s: float) -> list[Turn]:
    """Every conversation's turns, in order; a failed turn ends its conversation."""
    import grpc

    from pdserve.proto import pdserve_pb2_grpc

    system = w.system_prompt()
    turns: list[Turn] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pdserve_pb2_grpc.GeneratorStub(channel)

        async def conversation(c: int) -> None:
            if not math.isinf(w.rate):
                await asyncio.sleep(c / w.rate)
            history = system + w.user_turn(c, 0)
            for t in range(w.turns):
                turn = Turn(c, t, len(history), time.perf_counter())
                turns.append(turn)
                await _send(stub, history, w.output_len, w.seed * 1000 + c * w.turns + t,
                            temperature, timeout_s, turn)
                if turn.error:
                    return
                history = history + turn.output_ids + w.user_turn(c, t + 1)

        await asyncio.gather(*(conversation(c) for c in range(w.conversations)))
    return turns


def shares(w: ChatWorkload) -> tuple[int, float, float]:
    """(prompt tokens of the whole workload, conversation share, ideal share)."""
    total = w.conversations * sum(w.prompt_len(t) for t in range(w.turns))
    repeated = w.conversations * sum(w.prompt_len(t - 1) for t in range(1, w.turns))
    ideal = repeated + (w.conversations - 1) * w.system_len
    return total, repeated / total, ideal / total


@dataclass
class ChatRun:
    label: str
    turns: list[Turn]
    prompt_tokens: float  # router-side, over the run
    cached_tokens: float
    wall_s: float

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if not t.error]

    def row(self) -> list[str]:
        ok = self.ok
        ttft = [t.ttft for t in ok]
        later = [t.ttft for t in ok if t.turn > 0]
        e2e = [t.end - t.start for t in ok]
        computed = self.prompt_tokens - self.cached_tokens
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan
        ms = lambda v: f"{1000 * v:.0f}" if not math.isnan(v) else "-"  # noqa: E731
        mean = lambda v: float(np.mean(v)) if v else math.nan  # noqa: E731
        pct = lambda v, q: float(np.percentile(v, q)) if v else math.nan  # noqa: E731
        return [self.label, f"{len(ok)}/{len(self.turns)}", f"{self.prompt_tokens:.0f}", f"{computed:.0f}",
                f"{hit:.1%}", ms(mean(ttft)), ms(pct(ttft, 50)), ms(pct(ttft, 90)), ms(mean(later)),
                ms(mean(e2e)), f"{self.wall_s:.1f}"]


HEADER = ["prefix cache", "turns ok", "prompt tokens", "prefill tokens computed", "hit rate",
          "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms", "TTFT turns 2+ ms", "e2e mean ms", "wall s"]


def measure(url: str, target: str, w: ChatWorkload, label: str, temperature: float,
            timeout_s: float) -> ChatRun:
    from pdserve.bench.serving import BenchError, scrape_metrics

    warm = ChatWorkload(1, 1, 8, 8, 2, math.inf, w.seed + 7919)  # first-call costs out of the run
    asyncio.run(run_chat(target, warm, temperature, timeout_s))
    before = scrape_metrics(url, TOKEN_METRICS)
    t0 = time.perf_counter()
    turns = asyncio.run(run_chat(target, w, temperature, timeout_s))
    wall = time.perf_counter() - t0
    after = scrape_metrics(url, TOKEN_METRICS)
    failed = [t for t in turns if t.error]
    if len(failed) == len(turns):
        raise BenchError(f"every turn failed; first: {failed[0].error}")
    d = {k: after[k] - before[k] for k in TOKEN_METRICS}
    return ChatRun(label, turns, d[TOKEN_METRICS[0]], d[TOKEN_METRICS[1]], wall)


def render(w: ChatWorkload, runs: list[ChatRun]) -> str:
    total, conv, ideal = shares(w)
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.row()) + " |" for r in runs]
    text = "\n".join(lines) + "\n"
    text += (f"\nWorkload prompt tokens {total}; conversation share {conv:.1%}, ideal share "
             f"{ideal:.1%} (see bench/multiturn.py).")
    off = next((r for r in runs if r.label == "off"), None)
    on = next((r for r in runs if r.label == "on"), None)
    if off and on and off.prompt_tokens:
        drop = 1 - (on.prompt_tokens - on.cached_tokens) / (off.prompt_tokens - off.cached_tokens)
        text += f" Prefill tokens computed drop by {drop:.1%} with the cache."
    return text + "\n"


def run_chat_bench(a, argv: list[str]) -> dict:
    """`bench/serving.py --workload chat`: off and on with --spawn, else once against --url."""
    import datetime
    import shlex

    from pdserve.bench.serving import describe_device, git_commit, update_doc

    w = ChatWorkload(a.conversations, a.turns, a.system_len, a.user_len, a.output_len, a.rate, a.seed)
    runs = []
    if a.spawn:
        from pdserve.launch.ports import server_ports
        from pdserve.launch.serve import ClusterSpec, LocalCluster

        for label, prefill_args, router_args in (
                ("off", ["--prefix-cache-tokens", "0"], ["--routing-policy", "load"]), ("on", [], [])):
            spec = ClusterSpec(model=a.model, **server_ports(),
                               prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                               max_batch_size=a.max_batch_size, device=a.device,
                               extra_prefill_args=prefill_args, extra_router_args=router_args)
            print(f"bench: chat workload, prefix cache {label}", file=sys.stderr, flush=True)
            with LocalCluster(spec, a.log_dir) as cluster:
                runs.append(measure(cluster.url, f"127.0.0.1:{spec.grpc_port}", w, label,
                                    a.temperature, a.request_timeout))
    else:
        if not a.grpc_target:
            from pdserve.bench.serving import BenchError

            raise BenchError("--workload chat with --url needs --grpc-target host:port")
        runs.append(measure(a.url, a.grpc_target, w, "as served", a.temperature, a.request_timeout))
    table = render(w, runs)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit()
    where = f"{a.prefill_workers}P+{a.decode_workers}D" if a.spawn else "external router"
    header = (f"Measured {date} on {describe_device()}; commit {commit[:12] if commit else 'unknown'}.\n"
              f"Command: `python -m pdserve.bench.serving {shlex.join(argv)}`\n\n"
              f"Workload: {w.describe()}; gRPC `Generate`, temperature {a.temperature:g}.\n")
    print("\n" + header + "\n" + table, flush=True)
    model = a.model if a.model == "tiny" else a.model.rstrip("/").split("/")[-1]
    title = a.label or f"{model}, {where}, multi-turn chat, prefix cache off vs on"
    if a.doc:
        update_doc(a.doc, title, header + "\n" + table)
    return {"title": title, "runs": [{"label": r.label, "prompt_tokens": r.prompt_tokens,
                                      "cached_tokens": r.cached_tokens, "wall_s": r.wall_s,
                                      "ttft_s": [t.ttft for t in r.ok]} for r in runs]}
