"""Continuous batching on a decode worker.

Requests arrive in three steps: `reserve` takes KV blocks (backpressure when there are none),
a prefill worker writes the prompt's KV into them over NIXL (notifications name the request, see
kvtransfer.notify), then `start` hands over the first token and the request joins the batch at the
next step. Each request is a `request.DecodeRequest` state machine; this module only drives it.

One thread runs the loop (`run_once`): read notifications, apply cancellations and time limits,
release fenced blocks whose writes ended, admit queued requests into free batch slots, one decode
step for the batch, stream tokens, retire. Cancellation, expiry and errors of running requests all
end in the loop thread, so no step ever runs on blocks that were given away.

Blocks of an ended request whose KV writes may still land (a push under way, or a prefill worker
that may yet begin one) are released under a fence, lifted when the prefill side reports the push
over, or at the latest when no push can still be running (`DecodeRequest.fence_deadline`).

Re-sharded KV (prefill TP > decode TP, kvtransfer.reshard) lands in slots that each rank must
permute into place. The ranks do that only when this loop says so (`kv_unpack`), once the request's
KV is on every rank, and under the lock that also guards every release of blocks: the blocks are
the request's until every rank has finished, and a rank that sees an ended request's slots late
(its notifications polled after the push's "ok" reached rank 0) never touches their next owner's
KV. So the fence above needs no word from the other ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable

import torch

from pdserve.engine.block_manager import KVCacheFull
from pdserve.engine.decode_pipeline import InFlight, launch, next_rows, pipelinable
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams, sample
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.kvtransfer.notify import FAILED, OK, PUSH, KVArrivals, parse_notification

from .grammar import MaskPipeline, matcher_for
from .request import DecodeRequest, InvalidTransition, State, TokenEvent

log = logging.getLogger(__name__)


class ReservationError(RuntimeError):
    """Unknown or unusable request id (maps to NOT_FOUND / FAILED_PRECONDITION)."""


Notifications = Callable[[], Iterable[tuple[int, bytes]]]


class DecodeScheduler:
    """runner : the model runner (its `cache` is the block manager and KV pools).
    head_ranges : global KV heads [lo, hi) of each rank of the worker (default: one rank, all).
    transfer_timeout_s : how long a KV transfer may run once the prefill worker began it.
    notification_source : set by the server: returns (rank, notification) pairs since last call.
    kv_unpack : set by the server when its ranks' agents leave slotted writes to their owner
        (``unpack_on_arrival=False``): puts the given requests' slotted KV in place on every rank,
        [(request id, pool -> blocks it holds)], and returns once every rank has.
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_size: int = 128,
        head_ranges: list[tuple[int, int]] | None = None,
        transfer_timeout_s: float = 30.0,
        idle_wait_s: float = 0.002,
        clock=time.monotonic,
        pipeline: bool = True,
    ):
        self.runner = runner
        self.cache = runner.cache
        self.max_batch_size = max_batch_size
        self.transfer_timeout_s = transfer_timeout_s
        self.idle_wait_s = idle_wait_s
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._requests: dict[str, DecodeRequest] = {}  # live
        self._queued: deque[DecodeRequest] = deque()  # QUEUED, oldest first
        self._running: list[DecodeRequest] = []
        self._cancel: dict[str, bool] = {}  # request id -> no_writer, applied by the loop
        self._fenced: dict[str, list[DecodeRequest]] = {}  # ended, blocks fenced
        self._arrivals = KVArrivals(head_ranges or [(0, runner.cfg.num_key_value_heads)], clock=clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.notification_source: Notifications | None = None
        self.kv_unpack: Callable[[list[tuple[str, dict[str, list[int]]]]], object] | None = None
        self.masks = MaskPipeline()
        self.steps = 0
        self._block_copies: dict[str, list[tuple[int, int]]] = {}  # forks admitted, run with the next step
        self._inflight: InFlight | None = None  # a launched step whose tokens are not read yet
        self.pipeline = pipeline
        self.dropped_notifications = 0  # for requests this worker does not know (any more)

    # -- API (any thread) -------------------------------------------------------------------------
    def start_loop(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.masks.close()

    def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int, ttl_s: float,
                n: int = 1) -> DecodeRequest:
        """Blocks for the prompt and max_new_tokens, and for n > 1 choices the pages each adds
        (they will share the prompt's complete pages)."""
        if num_prompt_tokens < 1 or max_new_tokens < 1 or n < 1:
            raise ValueError("num_prompt_tokens, max_new_tokens and n must be positive")
        if n > self.max_batch_size:
            raise ValueError(f"n={n} choices exceed the decode batch of {self.max_batch_size}")
        max_tokens = min(num_prompt_tokens + max_new_tokens, self.runner.max_context)
        if num_prompt_tokens >= self.runner.max_context:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of {self.runner.max_context}")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id} already holds a reservation")
            blocks = self.cache.reserve(max_tokens)  # KVCacheFull -> backpressure
            forks: list = []
            try:
                for _ in range(n - 1):
                    forks.append(self.cache.reserve_choice(num_prompt_tokens, max_tokens))
            except KVCacheFull:
                for b in [blocks, *forks]:
                    self.cache.release(b)
                raise
            r = DecodeRequest(request_id, blocks, num_prompt_tokens, self.clock(), ttl_s, choice_blocks=forks)
            self._requests[request_id] = r
        return r

    def start(self, request_id: str, first_token: int | list[int], num_prompt_tokens: int,
              params: SamplingParams, generated: list[int] = ()) -> DecodeRequest:
        """Hand over the first token (n > 1: every choice's, from the one prefill); the request
        joins the batch once its KV has arrived. The prompt itself stays with the prefill worker:
        its KV is here. `generated`: the prompt's last ids when they are the request's own earlier
        samples (a migrated stream): they count as its output (max_new_tokens, penalties, the
        sampling index)."""
        generated = list(generated)
        if not 0 <= len(generated) < num_prompt_tokens:
            raise ValueError(f"{len(generated)} earlier samples are not within the {num_prompt_tokens}-token prompt")
        firsts = [first_token] if isinstance(first_token, int) else list(first_token)
        # structured outputs: each choice's own matcher (outside the lock: the grammar compiles)
        matchers = [matcher_for(params, generated + [t]) for t in firsts]
        with self._lock:
            r = self._requests.get(request_id)
            if r is None or request_id in self._cancel:
                raise ReservationError(f"request {request_id} has no live reservation")
            if num_prompt_tokens != r.num_prompt_tokens:
                raise ValueError(f"reservation was for {r.num_prompt_tokens} prompt tokens, got {num_prompt_tokens}")
            n = 1 + len(r.choice_blocks)
            if params.n != n or len(firsts) != n:
                raise ValueError(f"reservation was for {n} choice(s); got n={params.n} with {len(firsts)} first tokens")
            choices = [Sequence(request_id, [], params if n == 1 else params.for_choice(i),
                                output_ids=list(generated), blocks=b, num_cached=num_prompt_tokens,
                                num_prompt_tokens=num_prompt_tokens - len(generated), matcher=matchers[i])
                       for i, b in enumerate([r.blocks, *r.choice_blocks])]
            try:
                r.first_token(choices[0], self.clock())
            except InvalidTransition as e:
                raise ReservationError(str(e)) from None
            r.choices = choices
            last = None
            for i, (seq, token) in enumerate(zip(choices, firsts)):
                if seq.append(token, self.runner.cfg.eos_token_ids, self.runner.max_context):
                    last = TokenEvent([], seq.finish_reason, choice=i)
                    if r.live_choices:
                        r.events.put(last)
            if not r.live_choices:
                r.finish()
                self._end(r, last)
                return r
            if r.state is State.QUEUED:
                self._queued.append(r)
        self._wake.set()
        return r

    def cancel(self, request_id: str, no_writer: bool = False) -> bool:
        """Cancel a live request (the loop ends it). `no_writer`: the caller never asked a prefill
        worker to write its KV, so its blocks need no fence."""
        with self._lock:
            if request_id not in self._requests:
                return False
            self._cancel[request_id] = self._cancel.get(request_id, False) or no_writer
        self._wake.set()
        return True

    def load(self) -> dict:
        with self._lock:
            return {
                "running": len(self._running),
                "queued": len(self._queued),
                "reserved": len(self._requests),
                "blocks_total": self.cache.num_total_blocks,
                "blocks_free": self.cache.num_free_blocks,
                "blocks_used": self.cache.num_used_blocks,
                "blocks_fenced": self.cache.num_fenced_blocks,
            }

    def state_of(self, request_id: str) -> State | None:
        with self._lock:
            r = self._requests.get(request_id)
            return r.state if r is not None else None

    # -- loop thread ------------------------------------------------------------------------------
    def _end(self, r: DecodeRequest, event: TokenEvent) -> None:
        """After a terminal transition (lock held): last event, forget, give the blocks back, under
        a fence while a KV write into them may still land."""
        self._requests.pop(r.request_id, None)
        self._cancel.pop(r.request_id, None)
        self._arrivals.forget(r.request_id)
        if r in self._queued:
            self._queued.remove(r)
        if r in self._running:
            self._running.remove(r)
        r.events.put(event)
        inflight = self._inflight  # read once: `start` ends requests from an API thread
        if inflight is not None and {id(c) for c in r.choices} & {id(c) for c in inflight.seqs}:
            inflight.wait()  # a launched step still writes this request's KV
        for blocks in r.choice_blocks:  # never written remotely; shared pages only lose a holder
            self.cache.release(blocks)
        if r.writes_settled():
            self.cache.release(r.blocks)
        else:
            self.cache.release(r.blocks, fence=r)
            self._fenced.setdefault(r.request_id, []).append(r)

    def _fail(self, r: DecodeRequest, error: str) -> None:
        r.fail(error)
        log.warning("request %s: %s", r.request_id, error)
        self._end(r, TokenEvent([], FinishReason.ERROR, error))

    def _on_notification(self, rank: int, raw: bytes, now: float) -> None:
        n = parse_notification(raw)
        r = self._requests.get(n.request_id)
        fenced = self._fenced.get(n.request_id, [])
        if r is None and not fenced:
            self.dropped_notifications += 1
            return
        if n.kind == PUSH:
            for x in ([r] if r else []) + fenced:
                x.push_begun(n.writer, now)
        elif n.kind in (OK, FAILED):
            for x in fenced:
                x.push_over(n.writer, ok=n.kind == OK)
            if r is not None and r.push_over(n.writer, ok=n.kind == OK):
                log.warning("request %s: %s", r.request_id, r.error)
                self._end(r, TokenEvent([], FinishReason.ERROR, r.error))
        elif r is not None:
            if n.heads is not None and n.heads != tuple(self._arrivals.head_ranges[rank]):
                r.kv_slotted = True
            if self._arrivals.add(rank, n.request_id, n.heads):
                if r.kv_slotted and self.kv_unpack is not None:
                    # every rank puts the pages in place while the request holds them (under the
                    # lock: no block changes hands before all ranks are done; module docstring)
                    self.kv_unpack([(r.request_id, self._holds(r))])
                r.kv_arrived(now)
                if r.state is State.QUEUED:
                    self._queued.append(r)

    def _holds(self, r: DecodeRequest) -> dict[str, list[int]]:
        holds = {"full": list(r.blocks.full)}
        if self.cache.has_sliding:
            holds["sliding"] = r.blocks.owned_sliding()
        return holds

    def _housekeeping(self) -> None:
        notes = list(self.notification_source()) if self.notification_source is not None else []
        now = self.clock()
        with self._lock:
            for rank, raw in notes:
                self._on_notification(rank, raw, now)
            self._arrivals.expire()
            for rid, no_writer in list(self._cancel.items()):
                r = self._requests[rid]
                r.no_writer = r.no_writer or no_writer
                r.cancel()
                self._end(r, TokenEvent([], FinishReason.CANCELLED))
            for r in list(self._requests.values()):
                why = r.overdue(now, self.transfer_timeout_s)
                if why:
                    self._fail(r, why)
            self._lift_fences(now)
            rows = sum(len(r.live_choices) for r in self._running)
            while self._queued and rows + len(self._queued[0].live_choices) <= self.max_batch_size:
                r = self._queued.popleft()
                self.cache.adopt_transferred(r.blocks, r.num_prompt_tokens)
                for i, blocks in enumerate(r.choice_blocks, start=1):  # n > 1: share the prompt
                    for pool, pairs in self.cache.fork(r.blocks, blocks, r.num_prompt_tokens).items():
                        self._block_copies.setdefault(pool, []).extend(pairs)
                r.admit()
                self._running.append(r)
                rows += len(r.live_choices)

    def _lift_fences(self, now: float) -> None:
        for rid, ended in list(self._fenced.items()):
            keep = []
            for r in ended:
                if r.writes_settled():
                    self.cache.lift_fence(r)
                elif now > r.fence_deadline(self.transfer_timeout_s):
                    log.warning("request %s: no word that its KV writes ended; releasing its "
                                "blocks after the longest a push can run", rid)
                    self.cache.lift_fence(r)
                else:
                    keep.append(r)
            if keep:
                self._fenced[rid] = keep
            else:
                del self._fenced[rid]

    def run_once(self) -> bool:
        """One loop iteration: housekeeping, then one decode step if anything runs (True)."""
        self._housekeeping()
        batch = list(self._running)
        if self._inflight is not None or (batch and self._pipelinable(batch)):
            self._pipelined_step(batch)
            return True
        if not batch:
            return False
        self._step(batch)
        return True

    def _drop_inflight(self) -> None:
        if self._inflight is not None:
            try:
                self._inflight.wait()
            finally:
                self._inflight = None

    def _pipelinable(self, batch: list[DecodeRequest]) -> bool:
        return self.pipeline and pipelinable(self.runner, [seq for r in batch for _, seq in r.live_choices])

    def _pipelined_step(self, batch: list[DecodeRequest]) -> None:
        """engine.decode_pipeline: launch the next step on the in-flight step's device-side tokens,
        then read and stream those tokens (one step late; a row that stopped computes one discarded
        token). Once a row needs the host's sampler, nothing is launched and `_step` takes over."""
        prev, self._inflight = self._inflight, None
        owner = {id(seq): (r, i) for r in batch for i, seq in r.live_choices}
        seqs = next_rows([seq for r in batch for _, seq in r.live_choices], prev, self.runner.max_context)
        if seqs and self.pipeline and pipelinable(self.runner, seqs):
            copies, self._block_copies = self._block_copies, {}
            self._inflight = launch(self.runner, seqs, prev, block_copies=copies)
            self.steps += 1
        if prev is None:
            return
        tokens = prev.read()
        cfg = self.runner.cfg
        with self._lock:
            for seq, tok in zip(prev.seqs, tokens):
                r, i = owner.get(id(seq), (None, None))
                if r is None or not r.live or seq.finish_reason is not None:
                    continue  # ended meanwhile (cancel, failure, an earlier stop): its token is dropped
                done = seq.append(tok, cfg.eos_token_ids, self.runner.max_context)
                event = TokenEvent([tok], seq.finish_reason if done else None, choice=i)
                if done and not r.live_choices:
                    r.finish()
                    self._end(r, event)
                else:
                    r.events.put(event)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.run_once():
                    self._wake.wait(self.idle_wait_s if self._requests or self._fenced else 0.05)
                    self._wake.clear()
            except Exception as e:  # one bad step must not kill the worker: fail the batch
                log.exception("decode step failed")
                with self._lock:
                    self._drop_inflight()
                    for r in list(self._running):
                        self._fail(r, f"decode step failed: {e}")

    def _step(self, batch: list[DecodeRequest]) -> None:
        """One token for every live choice of every running request (n > 1: one row each)."""
        rows = [(r, i, seq) for r in batch for i, seq in r.live_choices]
        seqs = [seq for _, _, seq in rows]
        copies, self._block_copies = self._block_copies, {}
        masks = self.masks.submit(seqs)  # structured outputs: filled while the step runs
        logits = self.runner.decode(seqs, block_copies=copies)
        bitmask = MaskPipeline.result(masks)
        cfg = self.runner.cfg
        out = sample(logits, [s.params for s in seqs], [s.output_ids for s in seqs], stop_ids=cfg.eos_token_ids,
                     token_bitmask=None if bitmask is None else torch.from_numpy(bitmask))
        self.steps += 1
        with self._lock:
            for (r, i, seq), tok, lp in zip(rows, out.tokens, out.logprobs):
                if seq.matcher is not None:
                    try:
                        seq.matcher.accept(tok)
                    except ValueError as e:
                        if r.live:
                            self._fail(r, f"structured output: {e}")
                        continue
                done = seq.append(tok, cfg.eos_token_ids, self.runner.max_context, lp)
                event = TokenEvent([tok], seq.finish_reason if done else None,
                                   logprobs=[lp] if lp is not None else [], choice=i)
                if done and not r.live_choices:
                    r.finish()
                    self._end(r, event)
                else:
                    r.events.put(event)


__all__ = ["DecodeRequest", "DecodeScheduler", "KVCacheFull", "ReservationError", "State", "TokenEvent"]
