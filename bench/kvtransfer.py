"""KV transfer benchmark: one gpt-oss-20b request's KV moved between worker processes through the
workers' own code path, at several prompt lengths and prefill/decode TP pairs.

    python3 bench/kvtransfer.py --device cuda [--doc docs/performance.md] [--json FILE]
    python3 bench/kvtransfer.py --device cpu --quick          # logic check, UCX over TCP
    python3 bench/kvtransfer.py --render-only kvtransfer.json --doc docs/performance.md
    options: --lengths 1024,8192,32768  --cases tp1-tp1,tp1-tp1-shuffled,tp1-tp2,tp2-tp1,tp1-tp2-rows (or all)

What moves: the KV of a 20b prompt (24 layers; the 12 full-attention layers send every page, the
12 sliding-window layers only the pages a 128-key window still sees; 8 KV heads x 64 dims, bf16,
16-token pages: 32 KiB per page and layer at TP1). Every rank is its own process with its own
`PagedKVCache` (the worker's pools) and `KVTransferAgent`, as in a worker; ranks are placed
round-robin over the visible GPUs, sources first (2 GPUs: TP1->TP1 goes cuda:0 -> cuda:1).

How, per case: the decode ranks reserve the request (`PagedKVCache.reserve`, optionally after
churning their block allocator so the blocks are scattered as on a busy worker) and publish the
placement the decode worker's Reserve returns (`transfer_targets`); the prefill leader maps its
pages with `PrefillExecutor.plan_push` (its planning reads only the runner's KV cache); every
prefill rank runs `push_kv` (one WRITE per decode rank sharing its heads) and every decode rank
waits until notifications cover its heads (`KVArrivals`). Timed: first prefill rank starting to
post -> last decode rank complete (CLOCK_MONOTONIC is shared by the processes), median over the
repetitions, after a small warm-up request that opens the connections. Before each repetition
the sources change every KV byte; after the last one, the sha256 of each KV head's pages (in
logical order) on the decode side must equal the prefill side's: outside the timed region.

UCX transports: left to UCX on GPU hosts (cuda_ipc between GPUs); on a machine without CUDA
UCX_TLS defaults to tcp,self,sm as in the tests. `--doc` replaces the section between
`<!-- kvtransfer:begin -->` and `<!-- kvtransfer:end -->` (appended at the end if absent).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
# As a script the checkout goes before bench/ on the path; imported as pdserve.bench.* the path is left
# alone (the checkout's `kernels` folder would shadow the `kernels` distribution that transformers imports).
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

BEGIN, END = "<!-- kvtransfer:begin -->", "<!-- kvtransfer:end -->"
PAGE = 16
WARM_TOKENS = 16  # the warm-up request: one page per layer
MAX_NEW_TOKENS = 128  # what the decode side reserves beyond the prompt
LENGTHS = (1024, 8192, 32768)


class BenchError(RuntimeError):
    """A case could not run or its bytes did not arrive intact."""


@dataclass(frozen=True)
class Case:
    key: str
    src_tp: int
    dst_tp: int
    shuffled: bool = False  # decode blocks scattered by churn (else a fresh worker's runs)
    staged: bool = False  # sender packs re-sharded pages first (agent staging, as the workers)

    @property
    def label(self) -> str:
        extra = [w for w, on in (("shuffled blocks", self.shuffled), ("staged", self.staged)) if on]
        return f"TP{self.src_tp} -> TP{self.dst_tp}" + (f" ({', '.join(extra)})" if extra else "")

    @property
    def ranks(self) -> int:
        return self.src_tp + self.dst_tp


CASES = {c.key: c for c in (
    Case("tp1-tp1", 1, 1),
    Case("tp1-tp1-shuffled", 1, 1, shuffled=True),
    Case("tp1-tp2", 1, 2, staged=True),
    Case("tp2-tp1", 2, 1),
    Case("tp1-tp2-rows", 1, 2),
)}
DEFAULT_CASES = ("tp1-tp1", "tp1-tp1-shuffled", "tp1-tp2", "tp2-tp1")


def model_config():
    from pdserve.engine.config import preset

    return preset("20b")


def request_kv_bytes(cfg, n_tokens: int, page: int = PAGE) -> int:
    """Bytes of every KV head a decode worker receives for an n-token prompt (what the sources
    send in all: each head's pages exactly once)."""
    from pdserve.engine.kv_cache import cdiv, sliding_first_page

    page_bytes = 2 * page * cfg.num_key_value_heads * cfg.head_dim * 2
    n_sliding = sum(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)) if cfg.sliding_window else 0
    last = (n_tokens - 1) // page
    sliding_pages = last - sliding_first_page(n_tokens, cfg.sliding_window, page) + 1 if n_sliding else 0
    return page_bytes * ((cfg.num_hidden_layers - n_sliding) * cdiv(n_tokens, page) + n_sliding * sliding_pages)


# -- one rank (runs in its own process) ----------------------------------------------------------
class _Rank:
    """A prefill or decode rank's KV state: the worker's paged cache, its agent, its requests."""

    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        if self.device.type == "cuda":  # one GPU per rank process, as a worker's ranks
            torch.cuda.set_device(self.device)
        self.cache = self.agent = None
        self.seqs: dict[str, object] = {}
        self.arrivals = None
        self.staged = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def setup(self, role: str, tp: int, rank: int, lengths: dict[str, int], seed: int, shuffled: bool,
              staging_bytes: int) -> dict:
        """Build the pools, reserve each request in `lengths` (name -> prompt tokens) as the worker
        of `role` does, start the agent."""
        from pdserve.kvtransfer.notify import KVArrivals
        from pdserve.engine.kv_cache import KVBlockManager, PagedKVCache
        from pdserve.kvtransfer import KVTransferAgent, head_range

        cfg = model_config()
        heads = head_range(cfg.num_key_value_heads, tp, rank)
        if role == "src":  # a prefill worker: sliding pages for the whole prompt while it runs
            blocks = sum(PagedKVCache.prompt_blocks(cfg, n, PAGE) for n in lengths.values())
            self.cache = PagedKVCache(cfg, num_blocks=blocks, page_size=PAGE, num_kv_heads=heads[1] - heads[0],
                                      device=self.device)
            for name, n in lengths.items():
                seq = self.cache.reserve(n, local_prompt_tokens=n)
                self.cache.prepare(seq, 0, n)  # what ModelRunner.prefill does around the forward
                self.cache.finish_prefill(seq, n)
                self.seqs[name] = seq
            gen = self.torch.Generator(device=self.device).manual_seed(seed * 100 + rank)
            for pool in self.cache.pools.values():  # the KV the prompt computed: random bits
                pool.view(self.torch.int16).random_(-2**15, 2**15, generator=gen)
        else:  # a decode worker: prompt + new tokens reserved at admission
            blocks = KVBlockManager(page_size=PAGE, num_blocks=1, window=cfg.sliding_window)  # the arithmetic
            need = sum(sum(blocks.blocks_needed(n + MAX_NEW_TOKENS)) for n in lengths.values())
            self.cache = PagedKVCache(cfg, num_blocks=2 * need, page_size=PAGE, num_kv_heads=heads[1] - heads[0],
                                      device=self.device)
            order = list(lengths.items())
            for i, (name, n) in enumerate(order):
                if shuffled and i == len(order) - 1:
                    self._churn()
                self.seqs[name] = self.cache.reserve(n + MAX_NEW_TOKENS)
            self.arrivals = KVArrivals([heads])
        self._sync()
        self.staged = staging_bytes > 0
        self.agent = KVTransferAgent(f"bench-{role}{rank}-{uuid.uuid4().hex[:8]}", self.cache.pools,
                                     head_range=heads, staging_bytes=staging_bytes)
        return {"name": self.agent.name, "peer_info": self.agent.peer_info(), "heads": heads,
                "device": str(self.device)}

    def _churn(self) -> None:
        """Fill the free blocks with one-page requests and free every other one (the same on every
        rank: block ids agree across a worker's ranks): the worst a busy worker's allocator can
        do, the next reservation gets no two consecutive blocks."""
        fillers = [self.cache.allocator.allocate(1) for _ in range(self.cache.num_free_blocks)]
        for blocks in fillers[::2]:
            self.cache.allocator.free(blocks)

    def placement(self, name: str, n: int) -> dict:
        """The decode side of a KVPlacement (what DecodeService.Reserve hands out)."""
        seq = self.seqs[name]
        first, sliding = self.cache.transfer_targets(seq, n)
        return {"full_block_ids": list(seq.full), "sliding_block_ids": list(sliding),
                "sliding_first_page": first, "page_size": self.cache.page_size}

    def plan(self, request_id: str, name: str, n: int, placements: list[dict]):
        """The prefill leader's KVPush for request `name` (n tokens) onto the decode placements."""
        from pdserve.engine.sampling import SamplingParams
        from pdserve.prefill_worker.executor import PrefillExecutor, PrefillJob

        executor = PrefillExecutor(SimpleNamespace(cache=self.cache), self.agent)
        job = PrefillJob(request_id, [], SamplingParams(), [SimpleNamespace(**p) for p in placements])
        job.peers = {p["kv_agent_name"]: p["peer_info"] for p in placements}  # the handshake
        return executor.plan_push(job, self.seqs[name], n)

    def descriptors(self, push) -> int:
        """NIXL descriptors this rank's share of `push` posts (the agent's own planning)."""
        from pdserve.kvtransfer import heads_overlap
        from pdserve.kvtransfer.plan import merge_contiguous, plan_copy, plan_staging_nbytes

        total = 0
        for blob, pairs in push.targets:
            peer = self.agent.add_peer(blob)
            theirs = self.agent.peer_pools(peer)
            if heads_overlap(self.agent.head_range, next(iter(theirs.values())).heads) is None:
                continue
            staged = self.staged and plan_staging_nbytes(self.agent.layouts, theirs, pairs) > 0
            copies = plan_copy(self.agent.layouts, theirs, pairs, 0 if staged else None, slotted=True)
            total += sum(merge_contiguous(c).num_descs for c in copies)
        return total

    def bump(self) -> None:
        """Change every KV byte, so a repetition that moved nothing cannot pass the check."""
        for pool in self.cache.pools.values():
            pool.view(self.torch.int16).add_(1)
        self._sync()

    def push(self, push, timeout_s: float) -> tuple[float, float, int]:
        from pdserve.prefill_worker.executor import push_kv

        t0 = time.monotonic()
        nbytes = push_kv(self.agent, push, timeout_s)
        return t0, time.monotonic(), nbytes

    def await_kv(self, request_id: str, timeout_s: float) -> float:
        """Monotonic time at which notifications covered this rank's heads for the request."""
        deadline = time.monotonic() + timeout_s
        while True:
            if request_id in self.arrivals.feed(0, self.agent.take_notifications()):
                return time.monotonic()
            if time.monotonic() > deadline:
                raise BenchError(f"KV of {request_id} did not arrive in {timeout_s:g} s")
            time.sleep(20e-6)

    def digest(self, name: str, n: int, role: str) -> dict[int, str]:
        """sha256 of each global KV head's pages of request `name`, pools and pages in logical order."""
        seq = self.seqs[name]
        if role == "src":
            pages = self.cache.transfer_pages(seq, n)
        else:
            first, sliding = self.cache.transfer_targets(seq, n)
            pages = {"full": [(p, seq.full[p]) for p in range((n - 1) // PAGE + 1)]}
            if self.cache.has_sliding:
                pages["sliding"] = [(first + i, b) for i, b in enumerate(sliding)]
        lo, hi = self.agent.head_range
        hashes = {h: hashlib.sha256() for h in range(lo, hi)}
        for pool_name in sorted(pages):
            idx = self.torch.tensor([b for _, b in pages[pool_name]], dtype=self.torch.long, device=self.device)
            got = self.cache.pools[pool_name].index_select(1, idx)  # [L, P, 2, page, heads, D]
            for i, h in enumerate(range(lo, hi)):
                hashes[h].update(got[..., i, :].contiguous().view(self.torch.int16).cpu().numpy().tobytes())
        return {h: d.hexdigest() for h, d in hashes.items()}

    def teardown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.cache = self.agent = self.arrivals = None
        self.seqs.clear()
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()


def _rank_main(conn, device: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    rank = _Rank(device)
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            return
        try:
            conn.send(("ok", getattr(rank, cmd)(*args)))
        except Exception as e:  # report to the driver, keep serving (teardown follows)
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankProcess:
    """A spawned process hosting one rank at a time; `send` then `recv`, or `call`. Replies come
    in order; `drain` collects those still owed after a failure, so the next case starts clean."""

    def __init__(self, index: int, device: str, threads: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.device = device
        self.pending = 0
        self.proc = ctx.Process(target=_rank_main, args=(child, device, threads), name=f"kv-rank{index}",
                                daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, *args) -> None:
        try:
            self.conn.send((cmd, args))
        except OSError:
            raise BenchError(f"{self.proc.name} ({self.device}) is gone (exit code {self.proc.exitcode})") from None
        self.pending += 1

    def recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise BenchError(f"{self.proc.name} ({self.device}) did not answer in {timeout_s:g} s")
        try:
            status, out = self.conn.recv()
        except (EOFError, OSError):
            raise BenchError(f"{self.proc.name} ({self.device}) died (exit code {self.proc.exitcode})") from None
        self.pending -= 1
        if status != "ok":
            raise BenchError(f"{self.proc.name} ({self.device}): {out}")
        return out

    def call(self, cmd: str, *args, timeout_s: float = 300.0):
        self.send(cmd, *args)
        return self.recv(timeout_s)

    def drain(self, timeout_s: float) -> None:
        """Collect owed replies (errors included); a rank that does not answer is terminated."""
        while self.pending > 0 and self.proc.is_alive():
            if not self.conn.poll(timeout_s):
                print(f"[kvtransfer] {self.proc.name} owes {self.pending} replies after {timeout_s:g} s; "
                      "terminating it", file=sys.stderr, flush=True)
                self.proc.terminate()
                self.proc.join(5)
                return
            try:
                self.recv(0)
            except BenchError:
                pass

    def stop(self) -> None:
        try:
            self.conn.send(("exit", ()))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# -- one case -------------------------------------------------------------------------------------
def run_case(case: Case, n: int, ranks: list[RankProcess], *, max_reps: int, min_time_s: float,
             timeout_s: float, seed: int) -> dict:
    """Measure one (case, prompt length) on ranks[:src_tp] (prefill) and the next dst_tp (decode)."""
    cfg = model_config()
    srcs, dsts = ranks[:case.src_tp], ranks[case.src_tp:case.ranks]
    lengths = {"warm": WARM_TOKENS, "main": n}
    staging = request_kv_bytes(cfg, n) + (1 << 20) if case.staged else 0
    try:
        for r, p in enumerate(srcs):
            p.send("setup", "src", case.src_tp, r, lengths, seed, False, staging)
        for r, p in enumerate(dsts):
            p.send("setup", "dst", case.dst_tp, r, lengths, seed, case.shuffled, 0)
        infos = [p.recv(120) for p in srcs + dsts]
        dst_infos = infos[case.src_tp:]

        def placements(name: str) -> list[dict]:
            got = [p.call("placement", name, lengths[name]) for p in dsts]
            if any(g != got[0] for g in got):
                raise BenchError("decode ranks reserved different block ids")
            return [dict(got[0], kv_agent_name=info["name"], peer_info=info["peer_info"], tp_rank=r,
                         tp_size=case.dst_tp)
                    for r, info in enumerate(dst_infos)]

        tag = f"{case.key}-{n}-{uuid.uuid4().hex[:6]}"
        warm = srcs[0].call("plan", f"{tag}-warm", "warm", WARM_TOKENS, placements("warm"))
        main = srcs[0].call("plan", f"{tag}-0", "main", n, placements("main"))
        descs = sum(p.call("descriptors", main) for p in srcs)

        def transfer(push) -> tuple[float, int]:
            for p in dsts:
                p.send("await_kv", push.request_id, timeout_s)
            for p in srcs:
                p.send("push", push, timeout_s)
            sent = [p.recv(timeout_s + 60) for p in srcs]
            done = [p.recv(timeout_s + 60) for p in dsts]
            return max(done) - min(t0 for t0, _, _ in sent), sum(b for _, _, b in sent)

        transfer(warm)
        times, nbytes = [], 0
        while len(times) < max_reps and (not times or sum(times) < min_time_s):
            for p in srcs:
                p.send("bump")
            for p in srcs:
                p.recv(120)
            t, nbytes = transfer(dataclasses.replace(main, request_id=f"{tag}-{len(times) + 1}"))
            times.append(t)
        want = request_kv_bytes(cfg, n)
        if nbytes != want:
            raise BenchError(f"sent {nbytes} bytes, the request's KV is {want}")
        sent = {}
        for p in srcs:
            sent.update(p.call("digest", "main", n, "src"))
        got = {}
        for p in dsts:
            got.update(p.call("digest", "main", n, "dst"))
        if sorted(sent) != list(range(cfg.num_key_value_heads)) or got != sent:
            bad = sorted(h for h in sent if got.get(h) != sent[h])
            raise BenchError(f"KV heads {bad} differ between prefill and decode after the last repetition")
        t = statistics.median(times)
        return {"case": case.key, "label": case.label, "tokens": n, "bytes": nbytes, "descriptors": descs,
                "time_s": t, "gb_s": nbytes / t / 1e9, "reps": len(times), "times_s": times,
                "placement": _placement(infos, case)}
    finally:  # after a failure some ranks may still owe replies (a push waiting out its timeout)
        for p in srcs + dsts:
            p.drain(timeout_s + 60)
            try:
                if p.proc.is_alive():
                    p.call("teardown", timeout_s=60)
            except BenchError as e:
                print(f"[kvtransfer] teardown: {e}", file=sys.stderr, flush=True)


def _placement(infos: list[dict], case: Case) -> str:
    def dev(d: str) -> str:
        return d.split(":")[1] if d.startswith("cuda:") else d

    src = ",".join(dev(i["device"]) for i in infos[:case.src_tp])
    dst = ",".join(dev(i["device"]) for i in infos[case.src_tp:])
    return f"{src} -> {dst}"


# -- report ---------------------------------------------------------------------------------------
def render_table(rows: list[dict]) -> str:
    lines = ["| case | prompt tokens | devices (src -> dst) | KV moved | descriptors | time | GB/s | reps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['tokens']} | {r['placement']} | {r['bytes'] / 2**20:.1f} MiB | "
                     f"{r['descriptors']:,} | {_ms(r['time_s'])} | {r['gb_s']:.2f} | {r['reps']} |")
    return "\n".join(lines)


def reshard_ratios(rows: list[dict]) -> list[str]:
    """Each re-sharded row's bandwidth against same-TP consecutive blocks at its length (same run)."""
    base = {r["tokens"]: r["gb_s"] for r in rows if r["case"] == "tp1-tp1"}
    return [f"{r['label']}, {r['tokens']} tokens: {r['gb_s'] / base[r['tokens']]:.0%} of TP1 -> TP1's bandwidth"
            for r in rows if r["case"] not in ("tp1-tp1", "tp1-tp1-shuffled") and r["tokens"] in base]


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def render_section(rows: list[dict], meta: dict, notes: list[str]) -> str:
    lines = [BEGIN, "## KV transfer between worker processes", "",
             f"Measured {meta['date']} on {meta['device']} (nixl {meta['nixl']}, UCX_TLS={meta['ucx_tls']}), "
             f"command: `{meta['command']}`.", "",
             "One gpt-oss-20b request's KV (24 layers: the 12 full-attention layers send every page, the 12 "
             "sliding-window layers only the pages a 128-key window still sees; 8 KV heads x 64, bf16, 16-token "
             "pages) from the prefill rank(s) to the decode rank(s), each rank its own process with its own "
             "paged cache and NIXL agent, through the workers' code: the decode ranks' reservation, "
             "`PrefillExecutor.plan_push`, `push_kv` on every prefill rank (one WRITE per decode rank sharing "
             "its heads), `KVArrivals` on the decode ranks. Time: first prefill rank posting -> last decode "
             "rank holding all its heads (descriptor planning, NIXL's synchronous posting and the agents' "
             "completion polling included, as in the workers), median of the repetitions after a warm-up "
             "request; every KV head's "
             "bytes checked (sha256) after the last one. Ranks sit round-robin on the GPUs, sources first "
             "(the devices column). Decode blocks are a fresh worker's consecutive runs unless shuffled (a busy "
             "worker's allocator: one descriptor per page and layer). Re-sharded writes: to a decode rank with "
             "fewer heads (TP1 -> TP2) the sender packs that rank's heads into its staging buffer first "
             "(`staged`, as the workers do for prompts up to `--kv-staging-tokens`); to a rank with more heads "
             "(TP2 -> TP1) each sender writes whole pages into slots of the decode pages and the decode rank "
             "puts the heads in place before it reports the KV (kvtransfer/reshard.py), inside the timed "
             "region; `rows` is the per-token-row fallback (one descriptor per layer, page, K/V and token).", "",
             render_table(rows), ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def update_doc(doc: Path, section: str) -> None:
    """Replace the text between the kvtransfer markers (inclusive), or append the section."""
    from pdserve.bench.doc_section import replace_section

    replace_section(doc, BEGIN, END, section)


def describe(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    from pdserve.bench.serving import describe_device

    return describe_device()


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="1k tokens only, at most 2 repetitions")
    ap.add_argument("--lengths", default=None, help=f"prompt lengths (default {','.join(map(str, LENGTHS))})")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma list of {', '.join(CASES)}, or all")
    ap.add_argument("--reps", type=int, default=5, help="at most this many timed repetitions per row")
    ap.add_argument("--min-time", type=float, default=2.0, help="stop repeating once this many seconds are timed")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds one transfer may take")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--doc", default=None, help="markdown file whose kvtransfer section is replaced")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--render-only", default=None, metavar="JSON",
                    help="measure nothing: write --doc's section from a --json file (e.g. one a device run "
                         "brought back)")
    a = ap.parse_args(argv)
    if a.render_only:
        if not a.doc:
            print("bench/kvtransfer.py: --render-only needs --doc", file=sys.stderr)
            return 2
        saved = json.loads(Path(a.render_only).read_text())
        update_doc(Path(a.doc), render_section(saved["rows"], saved["meta"], saved["notes"]))
        print(f"[kvtransfer] wrote the kvtransfer section of {a.doc} from {a.render_only}", flush=True)
        return 0

    import torch

    keys = list(CASES) if a.cases == "all" else [k for k in a.cases.split(",") if k]
    unknown = [k for k in keys if k not in CASES]
    if unknown or not keys:
        print(f"bench/kvtransfer.py: unknown case(s) {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    try:
        lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else ([1024] if a.quick else list(LENGTHS))
    except ValueError:
        print(f"bench/kvtransfer.py: --lengths takes integers, got {a.lengths!r}", file=sys.stderr)
        return 2
    if any(n < 1 for n in lengths) or a.reps < 1:
        print("bench/kvtransfer.py: lengths and --reps must be >= 1", file=sys.stderr)
        return 2
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/kvtransfer.py: --device cuda but no GPU is visible", file=sys.stderr)
            return 1
        gpus = torch.cuda.device_count()
    elif not torch.cuda.is_available():
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")  # as tests/conftest.py; NIXL needs cuda on GPU hosts
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # one INFO line per agent otherwise
    max_reps = min(a.reps, 2) if a.quick else a.reps
    seed = a.seed if a.seed is not None else random.randrange(1 << 20)
    cases = [CASES[k] for k in keys]
    n_ranks = max(c.ranks for c in cases)
    devices = [f"cuda:{i % gpus}" for i in range(n_ranks)] if a.device == "cuda" else ["cpu"] * n_ranks
    threads = max(1, (os.cpu_count() or 1) // n_ranks)
    command = os.environ.get("PDSERVE_BENCH_COMMAND") or "python3 bench/kvtransfer.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    meta = {"date": datetime.date.today().isoformat(), "device": describe(a.device), "nixl": _nixl_version(),
            "ucx_tls": os.environ.get("UCX_TLS", "<UCX default>"), "command": command, "seed": seed}
    print(f"[kvtransfer] {meta['device']}, nixl {meta['nixl']}, UCX_TLS={meta['ucx_tls']}, seed {seed}, "
          f"ranks on {devices}", flush=True)

    rows, notes = [], []
    ranks = [RankProcess(i, d, threads) for i, d in enumerate(devices)]
    try:
        for n in lengths:
            for case in cases:
                t = time.perf_counter()
                try:
                    row = run_case(case, n, ranks, max_reps=max_reps, min_time_s=a.min_time,
                                   timeout_s=a.timeout, seed=seed)
                except BenchError as e:
                    notes.append(f"{case.label}, {n} tokens: FAILED: {str(e).splitlines()[0][:300]}")
                    print(f"[kvtransfer] {case.label} {n} tokens FAILED:\n{e}", file=sys.stderr, flush=True)
                    if any(not p.proc.is_alive() for p in ranks):
                        notes.append("a rank process died; the remaining rows were not measured")
                        raise
                    continue
                rows.append(row)
                print(f"[kvtransfer] {case.label:32s} {n:6d} tokens  {row['bytes'] / 2**20:8.1f} MiB  "
                      f"{row['descriptors']:>9,} descs  {_ms(row['time_s']):>10s}  {row['gb_s']:7.2f} GB/s  "
                      f"x{row['reps']} ({time.perf_counter() - t:.1f} s with setup and check)", flush=True)
    except BenchError:
        pass
    finally:
        for p in ranks:
            p.stop()
    notes += reshard_ratios(rows)
    if a.device == "cuda" and gpus == 1:
        notes.append("one GPU: every rank shares cuda:0 (transfers stay on the device)")
    print("\n" + render_table(rows), flush=True)
    for note in notes:
        print(f"- {note}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows, "notes": notes}, indent=1))
    if a.doc:
        update_doc(Path(a.doc), render_section(rows, meta, notes))
        print(f"[kvtransfer] wrote the kvtransfer section of {a.doc}", flush=True)
    return 1 if any("FAILED" in n for n in notes) or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
