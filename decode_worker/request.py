"""One request's life on a decode worker, as an explicit state machine.

::

    reserve ─> AWAITING_KV ──kv_arrived──> KV_READY ──first_token──> QUEUED ──admit──> RUNNING
                    │                                                   ^                 │
                    └──first_token (Decode came first)──┐  kv_arrived ──┘                 finish
                                                        v                                 v
                                             AWAITING_KV (started)       FINISHED (also straight
                                                                         from Decode: 1st = last)
    any live state ──cancel──> CANCELLED        any live state ──fail──> FAILED

Live states hold the request's KV blocks; the three terminal ones give them back, at once when no
KV write into them can still land, else under a fence (`writes_settled`). Each transition is a
method that checks the state it leaves and raises `InvalidTransition` otherwise; notifications may
come late or twice, so `kv_arrived` and the push notes are idempotent and ignored once terminal.

Time limits (`overdue`), none of which runs while the request waits for a batch slot:
- a reservation that Decode has not followed up within its ttl, with no KV write under way (once
  the KV is here, Decode gets at least the transfer timeout, however late the KV came);
- a KV transfer that began (the prefill worker said "push") and has not completed within the
  transfer timeout;
- Decode came (so the prefill worker's push is over), no push is under way, and the KV is not
  complete within the transfer timeout of Decode (a lost notification).
A push the prefill worker reports failed fails the request at once.
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass, field

from pdserve.engine.block_manager import SeqBlocks
from pdserve.engine.sampling import TokenLogprob
from pdserve.engine.sequence import FinishReason, Sequence


class State(enum.Enum):
    AWAITING_KV = "awaiting_kv"  # blocks reserved; the prompt's KV is not all here yet
    KV_READY = "kv_ready"        # KV here; Decode (the first token) not yet
    QUEUED = "queued"            # KV and first token here; waiting for a batch slot
    RUNNING = "running"          # in the decode batch
    FINISHED = "finished"        # stop token or length
    FAILED = "failed"
    CANCELLED = "cancelled"


LIVE = (State.AWAITING_KV, State.KV_READY, State.QUEUED, State.RUNNING)


class InvalidTransition(RuntimeError):
    """A transition asked of a request in a state that does not allow it."""


@dataclass
class TokenEvent:
    tokens: list[int]
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for
    choice: int = 0  # n > 1: the choice these tokens continue; a finish reason ends only that one


@dataclass(eq=False)
class DecodeRequest:
    """A request's state on this worker (mutated by the scheduler's loop, under its lock)."""

    request_id: str
    blocks: SeqBlocks
    num_prompt_tokens: int
    reserved_at: float
    ttl_s: float  # Decode must follow Reserve within this (unless a KV write is under way)
    state: State = State.AWAITING_KV
    seq: Sequence | None = None  # set by first_token (choice 0)
    # n > 1: the blocks of choices 1.. (their own pages until `fork` shares the prompt's), and
    # every choice's sequence (choices[0] is seq) once started
    choice_blocks: list[SeqBlocks] = field(default_factory=list)
    choices: list[Sequence] = field(default_factory=list)
    started_at: float | None = None
    events: "queue.Queue[TokenEvent]" = field(default_factory=queue.Queue)
    error: str = ""
    # KV writers (prefill agents) that announced a push and have not ended it
    writers: set[str] = field(default_factory=set)
    ended_writers: set[str] = field(default_factory=set)
    push_started_at: float | None = None
    last_push_at: float | None = None  # the latest announced push's start
    push_ended: bool = False  # some writer reported its push over (ok or failed)
    kv_complete: bool = False  # every head of every rank arrived
    kv_slotted: bool = False  # some rank got writes narrower than its heads (put in place on command)
    kv_arrived_at: float | None = None
    no_writer: bool = False  # the caller said no prefill worker was ever asked to write

    # -- transitions ------------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def started(self) -> bool:
        return self.seq is not None

    def _require(self, *states: State, what: str) -> None:
        if self.state not in states:
            raise InvalidTransition(f"request {self.request_id}: cannot {what} in state {self.state.value}")

    def kv_arrived(self, now: float) -> bool:
        """Every head of the prompt's KV is here. False (nothing changes) when it was known already
        or the request has ended: duplicate and late notifications are harmless."""
        if self.kv_complete or not self.live:
            return False
        self.kv_complete, self.kv_arrived_at = True, now
        if self.state is State.AWAITING_KV:
            self.state = State.QUEUED if self.started else State.KV_READY
        return True

    def first_token(self, seq: Sequence, now: float) -> None:
        """Decode handed over the first token (the prefill worker has finished its push)."""
        self._require(State.AWAITING_KV, State.KV_READY, what="take the first token")
        if self.started:
            raise InvalidTransition(f"request {self.request_id} was already started")
        self.seq = seq
        self.started_at = now
        if self.state is State.KV_READY:
            self.state = State.QUEUED

    @property
    def live_choices(self) -> list[tuple[int, Sequence]]:
        """(index, sequence) of the choices still generating."""
        return [(i, c) for i, c in enumerate(self.choices) if c.finish_reason is None]

    def admit(self) -> None:
        """Into the decode batch."""
        self._require(State.QUEUED, what="join the batch")
        self.state = State.RUNNING

    def finish(self) -> None:
        """The last token was produced (seq.finish_reason says why); the first token handed over
        by Decode may already be the last, whatever the KV's state."""
        self._require(*LIVE, what="finish")
        if not self.started:
            raise InvalidTransition(f"request {self.request_id}: cannot finish before its first token")
        self.state = State.FINISHED

    def fail(self, error: str) -> None:
        self._require(*LIVE, what="fail")
        self.state, self.error = State.FAILED, error

    def cancel(self) -> None:
        self._require(*LIVE, what="be cancelled")
        self.state = State.CANCELLED

    # -- KV writers (notes, valid in any state: they decide when blocks may be reused) ------------
    def push_begun(self, writer: str, now: float) -> None:
        if writer in self.ended_writers:  # its end overtook its start: nothing is under way
            return
        self.writers.add(writer)
        self.last_push_at = now
        if self.push_started_at is None:
            self.push_started_at = now

    def push_over(self, writer: str, ok: bool) -> bool:
        """A writer's push ended (or will never begin); True when that means the request failed
        (it was waiting for that KV and the writer gave up)."""
        self.writers.discard(writer)
        self.ended_writers.add(writer)
        self.push_ended = True
        if not ok and self.state is State.AWAITING_KV and not self.writers:
            self.fail("the prefill worker reported that the KV transfer failed")
            return True
        return False

    def writes_settled(self) -> bool:
        """No KV write into this request's blocks can still land: every announced push ended and
        either the KV is complete, a writer said it is done, or no writer was ever asked."""
        return not self.writers and (self.kv_complete or self.push_ended or self.no_writer)

    # -- time limits ------------------------------------------------------------------------------
    def overdue(self, now: float, transfer_timeout_s: float) -> str | None:
        """Why the request must fail now, or None. A request whose KV is here and which waits for
        a batch slot (QUEUED) never expires."""
        if self.state is State.KV_READY:  # Decode follows the prefill's answer at once
            if now > max(self.reserved_at + self.ttl_s, self.kv_arrived_at + transfer_timeout_s):
                return "reservation expired: the KV arrived but Decode did not follow"
            return None
        if self.state is not State.AWAITING_KV:
            return None
        if self.writers:  # a push is under way: only the transfer timeout applies
            if now > self.push_started_at + transfer_timeout_s:
                return (f"KV transfer began {now - self.push_started_at:.1f} s ago and did not "
                        f"complete within {transfer_timeout_s:g} s")
            return None
        if self.started:
            if now > self.started_at + transfer_timeout_s:
                return f"KV transfer did not arrive within {transfer_timeout_s:g} s of Decode"
            return None
        if now > self.reserved_at + self.ttl_s:
            return f"reservation expired: Decode did not follow within {self.ttl_s:g} s"
        return None

    def fence_deadline(self, transfer_timeout_s: float, margin_s: float = 5.0) -> float:
        """Time after which no prefill worker can still be writing, should none say so: a push
        ends within the transfer timeout of its start, and (never announced) none begins after
        the request's deadline (the reservation's ttl). The ended request is not retried, so an
        announced push bounds it (a prefill worker that died mid-push holds blocks for seconds,
        not for the request's whole deadline)."""
        if self.last_push_at is not None:
            return self.last_push_at + transfer_timeout_s + margin_s
        return self.reserved_at + self.ttl_s + transfer_timeout_s + margin_s
