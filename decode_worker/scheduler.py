"""Continuous batching on a decode worker.

Requests arrive in three steps: `reserve` takes KV blocks (backpressure when there are none),
a prefill worker writes the prompt's KV into them over NIXL (a notification names the request),
then `start` hands over the first token and the request joins the batch at the next step. One
thread runs the loop: admit, one decode step for the batch, stream tokens, retire. Cancellation,
expiry and errors all end in the loop thread, which alone frees blocks, so no step ever runs on
blocks that were given away.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from pdserve.engine.kv_cache import KVCacheFull, SeqBlocks
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams, TokenLogprob, sample
from pdserve.engine.sequence import FinishReason, Sequence

log = logging.getLogger(__name__)


class ReservationError(RuntimeError):
    """Unknown or unusable request id (maps to NOT_FOUND / FAILED_PRECONDITION)."""


@dataclass
class TokenEvent:
    tokens: list[int]
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for


@dataclass(eq=False)
class Reservation:
    request_id: str
    blocks: SeqBlocks
    num_prompt_tokens: int
    expires_at: float
    kv_arrived: bool = False
    seq: Sequence | None = None  # set by start()
    events: "queue.Queue[TokenEvent]" = field(default_factory=queue.Queue)
    cancelled: bool = False


class DecodeScheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_size: int = 128,
        kv_quarantine_s: float = 2.0,
        idle_wait_s: float = 0.002,
        clock=time.monotonic,
    ):
        self.runner = runner
        self.cache = runner.cache
        self.max_batch_size = max_batch_size
        self.kv_quarantine_s = kv_quarantine_s
        self.idle_wait_s = idle_wait_s
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._reservations: dict[str, Reservation] = {}
        self._ready: list[str] = []  # started, KV arrived, waiting for a batch slot
        self._running: list[Reservation] = []
        self._quarantine: list[tuple[float, SeqBlocks]] = []
        self._notifications: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.notification_source = None  # callable -> list[bytes], set by the server
        self.steps = 0

    # -- API (any thread) -------------------------------------------------------------------------
    def start_loop(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int, ttl_s: float) -> Reservation:
        if num_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("num_prompt_tokens and max_new_tokens must be positive")
        max_tokens = min(num_prompt_tokens + max_new_tokens, self.runner.max_context)
        if num_prompt_tokens >= self.runner.max_context:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of {self.runner.max_context}")
        with self._lock:
            if request_id in self._reservations:
                raise ValueError(f"request {request_id} already holds a reservation")
            blocks = self.cache.reserve(max_tokens)  # KVCacheFull -> backpressure
            r = Reservation(request_id, blocks, num_prompt_tokens, self.clock() + ttl_s)
            self._reservations[request_id] = r
        return r

    def start(self, request_id: str, first_token: int, prompt_ids: list[int], params: SamplingParams,
              kv_wait_s: float = 30.0, num_generated: int = 0) -> Reservation:
        """Hand over the first token; the request joins the batch once its KV has arrived.
        num_generated: the last prompt ids are the request's own earlier samples (a migrated
        stream): they count as its output (max_new_tokens, penalties, the sampling index)."""
        if not 0 <= num_generated < len(prompt_ids):
            raise ValueError(f"num_generated {num_generated} is not within the {len(prompt_ids)}-token prompt")
        with self._lock:
            r = self._reservations.get(request_id)
            if r is None or r.cancelled:
                raise ReservationError(f"request {request_id} has no live reservation")
            if r.seq is not None:
                raise ReservationError(f"request {request_id} was already started")
            if len(prompt_ids) != r.num_prompt_tokens:
                raise ValueError(f"reservation was for {r.num_prompt_tokens} prompt tokens, got {len(prompt_ids)}")
            cut = len(prompt_ids) - num_generated
            seq = Sequence(request_id, list(prompt_ids[:cut]), params, output_ids=list(prompt_ids[cut:]),
                           blocks=r.blocks)
            seq.num_cached = len(prompt_ids)
            r.seq = seq
            r.expires_at = self.clock() + kv_wait_s  # now: deadline for the KV to arrive
            done = seq.append(first_token, self.runner.cfg.eos_token_ids, self.runner.max_context)
            if done:
                r.events.put(TokenEvent([], seq.finish_reason))
                self._retire(r)
                return r
            self._ready.append(request_id)
        self._wake.set()
        return r

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            r = self._reservations.get(request_id)
            if r is None:
                return False
            r.cancelled = True
        self._wake.set()
        return True

    def load(self) -> dict:
        with self._lock:
            return {
                "running": len(self._running),
                "queued": len(self._ready),
                "reserved": len(self._reservations),
                "blocks_total": self.cache.num_total_blocks,
                "blocks_free": self.cache.num_free_blocks,
                "blocks_used": self.cache.allocators["full"].num_used,
            }

    # -- loop thread ------------------------------------------------------------------------------
    def _retire(self, r: Reservation) -> None:
        """Give back a request's blocks (lock held). Blocks a remote prefill may still be writing
        (KV not yet arrived) wait out a quarantine before they can be reused."""
        self._reservations.pop(r.request_id, None)
        if r.request_id in self._ready:
            self._ready.remove(r.request_id)
        self._notifications.discard(r.request_id)
        if r.kv_arrived or self.kv_quarantine_s <= 0:
            self.cache.release(r.blocks)
        else:
            self._quarantine.append((self.clock() + self.kv_quarantine_s, r.blocks))

    def _poll_notifications(self) -> None:
        if self.notification_source is None:
            return
        for n in self.notification_source():
            self._notifications.add(n.decode() if isinstance(n, bytes) else n)

    def _housekeeping(self) -> None:
        now = self.clock()
        self._poll_notifications()
        with self._lock:
            for rid in list(self._notifications):
                r = self._reservations.get(rid)
                if r is not None:
                    r.kv_arrived = True
            keep = []
            for until, blocks in self._quarantine:
                if until <= now:
                    self.cache.release(blocks)
                else:
                    keep.append((until, blocks))
            self._quarantine = keep
            for r in list(self._reservations.values()):
                if r in self._running:
                    if r.cancelled:
                        self._running.remove(r)
                        r.events.put(TokenEvent([], FinishReason.CANCELLED))
                        self._retire(r)
                    continue
                if r.cancelled:
                    r.events.put(TokenEvent([], FinishReason.CANCELLED))
                    self._retire(r)
                elif now > r.expires_at and not (r.seq is not None and r.kv_arrived):
                    # a started request whose KV is here waits for a batch slot as long as it takes
                    what = "KV transfer did not arrive" if r.seq else "reservation expired before decode started"
                    r.events.put(TokenEvent([], FinishReason.ERROR, what))
                    log.warning("request %s: %s", r.request_id, what)
                    self._retire(r)
            while self._ready and len(self._running) < self.max_batch_size:
                ready = [rid for rid in self._ready if self._reservations[rid].kv_arrived]
                if not ready:
                    break
                rid = ready[0]
                self._ready.remove(rid)
                r = self._reservations[rid]
                self.cache.adopt_transferred(r.blocks, r.num_prompt_tokens)
                self._running.append(r)

    def run_once(self) -> bool:
        """One loop iteration: housekeeping, then one decode step if anything runs (True)."""
        self._housekeeping()
        batch = list(self._running)
        if not batch:
            return False
        self._step(batch)
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.run_once():
                    self._wake.wait(self.idle_wait_s if self._reservations else 0.05)
                    self._wake.clear()
            except Exception as e:  # one bad step must not kill the worker: fail the batch
                log.exception("decode step failed")
                with self._lock:
                    for r in list(self._running):
                        self._running.remove(r)
                        r.events.put(TokenEvent([], FinishReason.ERROR, f"decode step failed: {e}"))
                        self._retire(r)

    def _step(self, batch: list[Reservation]) -> None:
        seqs = [r.seq for r in batch]
        logits = self.runner.decode(seqs)
        cfg = self.runner.cfg
        out = sample(logits, [s.params for s in seqs], [s.output_ids for s in seqs], stop_ids=cfg.eos_token_ids)
        self.steps += 1
        with self._lock:
            for r, seq, tok, lp in zip(batch, seqs, out.tokens, out.logprobs):
                done = seq.append(tok, cfg.eos_token_ids, self.runner.max_context, lp)
                r.events.put(TokenEvent([tok], seq.finish_reason if done else None,
                                        logprobs=[lp] if lp is not None else []))
                if done:
                    self._running.remove(r)
                    self._retire(r)


__all__ = ["DecodeScheduler", "KVCacheFull", "Reservation", "ReservationError", "TokenEvent"]
