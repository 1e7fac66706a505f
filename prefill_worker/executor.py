"""Batch-size-1 prefill: a bounded FIFO of prompts, one executor thread, KV pushed over NIXL.

Each job: pin the longest cached prefix of the prompt and take local KV blocks for the rest, run
the rest, sample the first token, write every page the decode worker needs straight into the
blocks it reserved (full-attention pages; the sliding-window pages still inside the window), wait
for the transfer, then hand the prompt's complete pages to the prefix cache and the rest back.

The push is planned once (`KVPush`: which local block goes to which block of every decode rank)
and executed by every rank of the prefill worker (`push_kv`): each rank writes the KV heads it
holds into each decode rank whose heads overlap them, so any prefill TP feeds any decode TP. Each
write's notification names the request and the heads it carried (kvtransfer.notify): a decode
rank has the request's KV once the heads it holds are all covered.

Around the push the leader tells the decode worker's rank 0 that it begins ("push") and that
every write has ended ("ok" / "failed", kvtransfer.notify): the decode worker times the transfer
from its start and reuses a cancelled request's blocks only once the writes into them ended. A
cancelled request never pushes afterwards: Cancel drops a queued prompt, aborts a push under way
(waiting until NIXL let go of every write), and remembers the id so a Prefill that arrives after
its Cancel is refused; each of these reports "failed" to the decode worker. No push begins after
the request's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.grammar import fill_masks, matcher_for
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.model_runner import ModelRunner, PrefillStopped
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.sampling import SamplingParams, TokenLogprob, sample
from pdserve.engine.sequence import Sequence
from pdserve.kvtransfer import KVTransferError, heads_overlap
from pdserve.kvtransfer.notify import FAILED, OK, PUSH, kv_notification, push_notification

log = logging.getLogger(__name__)


def prefill_kv_blocks(cfg: ModelConfig, page_size: int, prefix_cache_tokens: int) -> int:
    """KV blocks of a prefill worker: the longest prompt, plus room for cached prefixes, in each
    layer group (a local prefill holds the whole prompt in sliding pages too; so does the cache)."""
    return PagedKVCache.prompt_blocks(cfg, cfg.max_context + max(0, prefix_cache_tokens), page_size)


class QueueFull(RuntimeError):
    """The prefill queue is at its bound (maps to RESOURCE_EXHAUSTED: try another worker)."""


class PlacementError(ValueError):
    """The decode worker's KV placement does not cover the prompt."""


@dataclass
class PrefillResult:
    first_token: int
    kv_bytes: int
    transfer_s: float
    queue_s: float
    compute_s: float
    cached_tokens: int = 0  # prompt positions whose KV came from the prefix cache
    first_logprob: TokenLogprob | None = None  # when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.prompt_logprobs is set
    choice_tokens: list[int] = field(default_factory=list)  # params.n > 1: every choice's first token
    choice_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # ... and its logprob


@dataclass(eq=False)
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    placements: list  # proto KVPlacement, one per decode rank
    sample_index: int = 0  # the prompt's last tokens that the request sampled before (migrated)
    future: Future = field(default_factory=Future)
    enqueued_at: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic; no push begins after it
    peers: dict[str, bytes] = field(default_factory=dict)  # decode agent name -> peer info
    cancelled: bool = False
    abort: threading.Event = field(default_factory=threading.Event)  # stops a push under way
    decode_told: bool = False  # the decode worker heard how the push ended (or must not: unsettled)


@dataclass
class KVPush:
    """One request's KV write as every prefill rank runs it (picklable: broadcast to the ranks).

    targets : per decode rank, (its agent's peer-info blob, pool -> [(local block, remote block)]).
    push_id : the same on every rank of this push, new for each push: a decode rank assembling
        slotted writes (kvtransfer.reshard) never mixes them with an earlier, failed push's.
    """

    request_id: str
    targets: list[tuple[bytes, dict[str, list[tuple[int, int]]]]]
    push_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


class KVWritesUnsettled(KVTransferError):
    """A push was aborted but NIXL has not let go of every write yet: bytes may still land."""


def push_kv(agent, push: KVPush, timeout_s: float, abort: threading.Event | None = None) -> int:
    """This rank's share of a push: write the KV heads it holds into every decode rank that holds
    some of them, wait until all landed; bytes written. Raises KVTransferError on failure, timeout
    or `abort`, after aborting the writes in flight and waiting (up to `timeout_s`) until NIXL
    let go of them; KVWritesUnsettled if it did not."""
    mine = agent.head_range
    handles = []
    try:
        for blob, pairs in push.targets:
            peer = agent.add_peer(blob)
            theirs = next(iter(agent.peer_pools(peer).values())).heads
            heads = heads_overlap(mine, theirs)
            if heads is None:
                continue
            handles.append(agent.write_pages(peer, pairs, kv_notification(push.request_id, heads),
                                             push_id=push.push_id))
        deadline = time.monotonic() + timeout_s
        pending, delay = list(handles), 20e-6
        while pending:
            if abort is not None and abort.is_set():
                raise KVTransferError(f"KV push of {push.request_id} aborted: the request was cancelled")
            pending = [h for h in pending if not h.done()]
            if pending and time.monotonic() > deadline:
                raise KVTransferError(f"KV push of {push.request_id} timed out after {timeout_s:g} s")
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
    except BaseException as e:
        for h in handles:
            h.abort("aborted: the push failed or was cancelled")
        end = time.monotonic() + timeout_s
        while not all(h.settled for h in handles):
            if time.monotonic() > end:
                raise KVWritesUnsettled(f"{e}; NIXL still holds some of its writes: their bytes "
                                        "may still land") from e
            time.sleep(1e-3)
        raise
    return sum(h.nbytes for h in handles)


class PrefillExecutor:
    def __init__(self, runner: ModelRunner, agent, *, max_queue: int = 64, max_queued_tokens: int = 1 << 20,
                 transfer_timeout_s: float = 30.0, prefix_cache: bool = True):
        """prefix_cache: keep the KV pages of earlier prompts in the runner's free blocks and
        compute only the part of a prompt that is not cached (engine.prefix_cache)."""
        self.runner = runner
        self.prefix_cache = PrefixCache(runner.cache, enabled=prefix_cache)
        self.agent = agent
        self.max_queue = max_queue
        self.max_queued_tokens = max_queued_tokens
        self.transfer_timeout_s = transfer_timeout_s
        # runs a KVPush on every rank of the worker; a multi-rank worker's leader replaces it
        self.push = lambda p: push_kv(self.agent, p, self.transfer_timeout_s, self.current_abort())
        self._queue: deque[PrefillJob] = deque()
        self._jobs: dict[str, PrefillJob] = {}
        self._running: PrefillJob | None = None
        self._cancelled_ids: OrderedDict[str, None] = OrderedDict()  # Cancel came before Prefill
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._stop = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    # -- API ----------------------------------------------------------------------------------
    def submit(self, job: PrefillJob) -> Future:
        self.runner.validate_prompt(job.prompt_ids)  # InvalidRequest -> INVALID_ARGUMENT
        job.params.check_vocab(self.runner.cfg.vocab_size)  # SamplingError -> INVALID_ARGUMENT
        with self._cv:
            late = self._cancelled_ids.pop(job.request_id, 0) is None
        if late:  # its Cancel overtook it: never push, and say so
            self._notify_decode(job, FAILED)
            raise InterruptedError(f"request {job.request_id} was cancelled before it arrived")
        with self._cv:
            if self._stop:
                raise QueueFull("prefill worker is shutting down")
            queued = sum(len(j.prompt_ids) for j in self._queue)
            if len(self._queue) >= self.max_queue or queued + len(job.prompt_ids) > self.max_queued_tokens:
                raise QueueFull(f"prefill queue full ({len(self._queue)} prompts, {queued} tokens)")
            if job.request_id in self._jobs:
                raise ValueError(f"request {job.request_id} is already queued")
            self._queue.append(job)
            self._jobs[job.request_id] = job
            self._cv.notify()
        return job.future

    def cancel(self, request_id: str, *, remember: bool = True) -> bool:
        """Drop a queued prompt; a running one finishes its forward but pushes nothing (a push
        under way is aborted). With `remember` (a Cancel from the router, which may overtake its
        Prefill) an unknown id is remembered: its Prefill is refused if it comes."""
        with self._cv:
            job = self._jobs.get(request_id)
            if job is None:
                if not remember:
                    return False
                self._cancelled_ids[request_id] = None
                while len(self._cancelled_ids) > 4 * self.max_queue + 1024:
                    self._cancelled_ids.popitem(last=False)
                return False
            job.cancelled = True
            job.abort.set()
            dropped = job in self._queue
            if dropped:
                self._queue.remove(job)
                self._jobs.pop(request_id, None)
                job.future.cancel()
        if dropped:
            self._notify_decode(job, FAILED)
        return True

    def current_abort(self) -> threading.Event | None:
        """The running job's abort event (set by Cancel): what stops its push under way."""
        job = self._running
        return job.abort if job is not None else None

    def load(self) -> dict:
        with self._lock:
            return {"queued": len(self._queue) + int(self._busy),
                    "queued_tokens": sum(len(j.prompt_ids) for j in self._queue)}

    # -- executor thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop and not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
                self._running = job
            try:
                result = self._run(job)
                if not job.future.cancelled():
                    job.future.set_result(result)
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                if not job.decode_told:  # e.g. the forward failed: no push will come
                    self._notify_decode(job, FAILED)
                if not job.future.cancelled():
                    job.future.set_exception(e)
            finally:
                with self._cv:
                    self._busy = False
                    self._running = None
                    self._jobs.pop(job.request_id, None)

    def _run(self, job: PrefillJob) -> PrefillResult:
        started = time.monotonic()
        n = len(job.prompt_ids)
        # cached prefix pinned, blocks for the rest; prompt logprobs need every position computed
        lease = self.prefix_cache.acquire(job.prompt_ids, reuse=job.params.prompt_logprobs is None)
        seq = Sequence(job.request_id, job.prompt_ids, job.params, blocks=lease.blocks,
                       num_cached=lease.num_cached)
        computed_ok = stopped = False

        def stop() -> bool:  # checked between chunks of a long prompt
            return job.cancelled or job.deadline is not None and time.monotonic() > job.deadline

        try:
            k = job.params.prompt_logprobs
            try:
                if k is None:
                    last, prompt_lps = self.runner.prefill(seq, finish=False, stop=stop), []
                else:
                    last, prompt_lps = self.runner.prefill_scored(seq, k, finish=False, stop=stop)
                computed_ok = True
            except PrefillStopped:
                stopped = True
            if not stopped:
                last = last[None]
                before = job.prompt_ids[n - job.sample_index:] if job.sample_index else []
                # n > 1: every choice draws its first token from the one prefill's logits
                choices = [job.params.for_choice(i) for i in range(job.params.n)] if job.params.n > 1 else [job.params]
                bitmask = fill_masks([matcher_for(c, before) for c in choices])  # structured outputs
                out = sample(last.expand(len(choices), -1), choices, [before] * len(choices),
                             stop_ids=self.runner.cfg.eos_token_ids,
                             token_bitmask=None if bitmask is None else torch.from_numpy(bitmask))
            computed = time.monotonic()
            if stopped or job.cancelled or job.deadline is not None and computed > job.deadline:
                self._notify_decode(job, FAILED)  # no push for this request, ever
                if job.cancelled:
                    raise InterruptedError(f"request {job.request_id} was cancelled")
                raise TimeoutError(f"request {job.request_id} passed its deadline before its KV push")
            nbytes = self._push_kv(job, seq.blocks, n)
            done = time.monotonic()
        finally:
            self.prefix_cache.release(lease, computed=computed_ok)
        return PrefillResult(out.tokens[0], nbytes, done - computed, started - job.enqueued_at, computed - started,
                             cached_tokens=lease.num_cached, first_logprob=out.logprobs[0],
                             prompt_logprobs=prompt_lps,
                             choice_tokens=out.tokens if len(choices) > 1 else [],
                             choice_logprobs=out.logprobs if len(choices) > 1 else [])

    def _push_kv(self, job: PrefillJob, blocks, n: int) -> int:
        plan = self.plan_push(job, blocks, n)
        self._notify_decode(job, PUSH)
        try:
            nbytes = self.push(plan)
        except BaseException as e:
            if KVWritesUnsettled.__name__ not in str(e) and not isinstance(e, KVWritesUnsettled):
                self._notify_decode(job, FAILED)
            job.decode_told = True  # unsettled: the decode worker waits out its fence
            raise
        self._notify_decode(job, OK)
        return nbytes

    def _notify_decode(self, job: PrefillJob, kind: str) -> None:
        """Tell the decode worker's rank 0 (whose bookkeeping it is) that this worker's push of the
        request begins or ended; best effort: without it the decode side waits out its fence."""
        job.decode_told = job.decode_told or kind != PUSH
        p = next((p for p in job.placements if p.tp_rank == 0), None)
        if p is None or p.kv_agent_name not in job.peers:
            return
        try:
            peer = self.agent.add_peer(job.peers[p.kv_agent_name])
            self.agent.send_notification(peer, push_notification(job.request_id, kind, self.agent.name))
        except KVTransferError as e:
            log.warning("request %s: cannot tell decode rank 0 %r: %s", job.request_id, kind, e)

    def plan_push(self, job: PrefillJob, blocks, n: int) -> KVPush:
        """Map the prompt's pages onto every decode rank's reserved blocks (PlacementError when
        the placements do not cover the pages or every decode rank)."""
        cache = self.runner.cache
        local = cache.transfer_pages(blocks, n)
        sizes = {max(1, p.tp_size) for p in job.placements}
        ranks = sorted(p.tp_rank for p in job.placements)
        if len(sizes) != 1 or ranks != list(range(sizes.pop())):
            raise PlacementError(f"placements name decode ranks {ranks} of TP sizes "
                                 f"{sorted({p.tp_size for p in job.placements})}: need one per rank")
        targets = []
        for p in job.placements:
            if p.page_size != cache.page_size:
                raise PlacementError(f"decode page size {p.page_size} != prefill page size {cache.page_size}")
            pairs = {"full": _map(local["full"], list(p.full_block_ids), 0, "full")}
            if "sliding" in local:
                if local["sliding"] and local["sliding"][0][0] != p.sliding_first_page:
                    raise PlacementError(
                        f"decode expects sliding pages from {p.sliding_first_page}, prefill has "
                        f"{local['sliding'][0][0]}")
                pairs["sliding"] = _map(local["sliding"], list(p.sliding_block_ids), p.sliding_first_page, "sliding")
            if p.kv_agent_name not in job.peers:
                raise PlacementError(f"no peer info for decode KV agent {p.kv_agent_name!r}")
            targets.append((job.peers[p.kv_agent_name], pairs))
        return KVPush(job.request_id, targets)


def _map(local: list[tuple[int, int]], remote: list[int], first_page: int, pool: str) -> list[tuple[int, int]]:
    """(logical page, local block) -> (local block, remote block) via the decode's table."""
    out = []
    for page, blk in local:
        i = page - first_page
        if not 0 <= i < len(remote):
            raise PlacementError(f"decode placement has no {pool} block for page {page}")
        out.append((blk, remote[i]))
    return out
