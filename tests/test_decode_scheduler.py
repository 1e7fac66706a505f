"""The decode scheduler on its own: a fake model runner (real paged KV bookkeeping, a fixed next
token), a hand-driven clock and loop (`run_once`), KV arrivals and push notes fed as the NIXL
notifications a prefill worker sends (kvtransfer.notify)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.decode_worker.request import DecodeRequest, InvalidTransition, State
from pdserve.decode_worker.scheduler import DecodeScheduler, ReservationError
from pdserve.engine.block_manager import SeqBlocks
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.kvtransfer.notify import (FAILED, OK, PUSH, KVArrivals, kv_notification, parse_kv_notification,
                                       parse_notification, push_notification)

NEXT_TOKEN = 7  # what the fake model always predicts (not an end-of-turn id)
WRITER = "prefill-a-r0"


class FakeRunner:
    """What the scheduler uses of a ModelRunner: the cache, the limits and `decode`."""

    def __init__(self, cfg, num_blocks: int = 512, page_size: int = 4, max_context: int = 256):
        self.cfg = cfg
        self.cache = PagedKVCache(cfg, num_blocks=num_blocks, page_size=page_size)
        self.max_context = max_context
        self.steps: list[list[str]] = []
        self.copies: list[dict] = []  # block copies each step was given (forked choices)

    def decode(self, seqs, block_copies=None):
        self.steps.append([s.request_id for s in seqs])
        self.copies.append(block_copies or {})
        for s in seqs:
            self.cache.prepare(s.blocks, s.num_cached, 1)
            s.num_cached += 1
        logits = torch.zeros(len(seqs), 16)
        logits[:, NEXT_TOKEN] = 1.0
        return logits


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A scheduler with a fake clock and a notification inbox per rank."""

    def __init__(self, cfg, *, max_batch_size: int = 2, num_blocks: int = 512, head_ranges=None):
        self.clock = Clock()
        self.runner = FakeRunner(cfg, num_blocks=num_blocks)
        self.s = DecodeScheduler(self.runner, max_batch_size=max_batch_size, head_ranges=head_ranges,
                                 transfer_timeout_s=30, clock=self.clock)
        self.inbox: list[tuple[int, bytes]] = []
        self.s.notification_source = self._take

    def _take(self):
        out, self.inbox[:] = list(self.inbox), []
        return out

    def note(self, raw: bytes, rank: int = 0) -> None:
        self.inbox.append((rank, raw))

    def kv(self, rid: str) -> None:
        self.note(push_notification(rid, PUSH, WRITER))
        self.note(kv_notification(rid, (0, self.runner.cfg.num_key_value_heads)))
        self.note(push_notification(rid, OK, WRITER))

    def state(self, rid: str):
        return self.s.state_of(rid)

    def blocks(self):
        c = self.runner.cache
        return c.num_free_blocks, c.num_used_blocks, c.num_fenced_blocks


@pytest.fixture
def h(tiny_cfg):
    return Harness(tiny_cfg)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def drain(r) -> list:
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait())
    return out


def start(h: Harness, rid: str, n: int, max_new: int = 1000):
    return h.s.start(rid, NEXT_TOKEN, n, greedy(max_new))


# -- the state machine itself ------------------------------------------------------------------------
def _req(rid="r", now=0.0, ttl=60.0) -> DecodeRequest:
    return DecodeRequest(rid, SeqBlocks(full=[1, 2]), 5, now, ttl)


def _seq(rid="r") -> Sequence:
    return Sequence(rid, [], greedy(10), num_prompt_tokens=5)


def test_every_transition_and_every_refusal():
    # KV first, then Decode
    r = _req()
    assert r.state is State.AWAITING_KV and r.live
    assert r.kv_arrived(1.0) and r.state is State.KV_READY
    assert not r.kv_arrived(1.0) and r.state is State.KV_READY  # duplicate notification: no change
    with pytest.raises(InvalidTransition):
        r.admit()  # no first token yet
    r.first_token(_seq(), 1.0)
    assert r.state is State.QUEUED
    with pytest.raises(InvalidTransition):
        r.first_token(_seq(), 1.0)  # Decode twice
    r.admit()
    assert r.state is State.RUNNING
    with pytest.raises(InvalidTransition):
        r.admit()
    assert not r.kv_arrived(1.0)  # late duplicate while running
    r.finish()
    assert r.state is State.FINISHED and not r.live
    assert not r.kv_arrived(2.0)  # late notification after the end: ignored
    for verb in (r.cancel, r.finish, r.admit, lambda: r.fail("x"), lambda: r.first_token(_seq(), 2.0)):
        with pytest.raises(InvalidTransition):
            verb()
    # Decode first, then KV
    r = _req()
    r.first_token(_seq(), 1.0)
    assert r.state is State.AWAITING_KV and r.started
    assert r.kv_arrived(1.0) and r.state is State.QUEUED
    # the first token can be the last one, KV here or not
    r = _req()
    with pytest.raises(InvalidTransition):
        r.finish()  # nothing produced yet
    r.first_token(_seq(), 1.0)
    r.finish()
    assert r.state is State.FINISHED
    # cancel and fail from every live state
    for make in (lambda x: None, lambda x: x.kv_arrived(1.0),
                 lambda x: (x.kv_arrived(1.0), x.first_token(_seq(), 1.0)),
                 lambda x: (x.kv_arrived(1.0), x.first_token(_seq(), 1.0), x.admit())):
        for end, final in ((lambda x: x.cancel(), State.CANCELLED), (lambda x: x.fail("boom"), State.FAILED)):
            r = _req()
            make(r)
            end(r)
            assert r.state is final and not r.live
            with pytest.raises(InvalidTransition):
                r.cancel()


def test_time_limits_of_each_state():
    t = 30.0
    r = _req(now=0.0, ttl=60.0)  # waiting for a prefill worker: the reservation's ttl
    assert r.overdue(59.0, t) is None and "reservation expired" in r.overdue(61.0, t)
    r = _req(now=0.0, ttl=60.0)
    r.push_begun(WRITER, 50.0)  # KV in flight: only the transfer timeout, from the push's start
    assert r.overdue(79.0, t) is None
    assert "did not complete within 30 s" in r.overdue(81.0, t)
    r = _req(now=0.0, ttl=60.0)
    r.push_begun(WRITER, 50.0)
    r.push_over(WRITER, ok=True)
    r.first_token(_seq(), 55.0)  # Decode came, the KV-written notes are still on their way
    assert r.overdue(84.0, t) is None and "of Decode" in r.overdue(86.0, t)
    r = _req(now=0.0, ttl=60.0)
    r.kv_arrived(50.0)  # KV here, Decode never came
    assert r.overdue(79.0, t) is None and "Decode did not follow" in r.overdue(81.0, t)
    r.first_token(_seq(), 59.0)
    assert r.state is State.QUEUED and r.overdue(1e9, t) is None  # waits for a slot forever
    r.admit()
    assert r.overdue(1e9, t) is None


def test_push_notes_decide_failure_and_fence():
    r = _req()
    assert not r.writes_settled()  # a prefill worker may still begin a push
    r.push_begun(WRITER, 1.0)
    assert not r.writes_settled()
    assert r.push_over(WRITER, ok=False) and r.state is State.FAILED and "failed" in r.error
    assert r.writes_settled()
    r = _req()
    r.push_begun(WRITER, 1.0)
    r.kv_arrived(1.0)
    assert not r.writes_settled()  # every byte landed, but the writer has not said it is done
    assert not r.push_over(WRITER, ok=False)  # the KV is here: a late failure changes nothing
    assert r.state is State.KV_READY and r.writes_settled()
    r = _req()
    r.push_begun("a", 1.0)
    r.push_begun("b", 2.0)
    r.push_over("a", ok=True)
    assert not r.writes_settled()  # b may still write
    r.push_over("b", ok=True)
    assert r.writes_settled()
    r = _req()
    r.push_over("a", ok=False)  # the end overtook the start (notes may be reordered)
    r.push_begun("a", 3.0)
    assert r.writes_settled() and r.state is State.FAILED
    r = _req()
    r.no_writer = True
    assert r.writes_settled()
    r = _req(now=10.0, ttl=60.0)
    assert r.fence_deadline(30.0, margin_s=5.0) == 10.0 + 60.0 + 30.0 + 5.0  # a push may yet begin
    r.push_begun("a", 12.0)
    r.push_begun("b", 15.0)
    assert r.fence_deadline(30.0, margin_s=5.0) == 15.0 + 30.0 + 5.0  # the announced pushes' end


def test_notification_wire_format():
    assert parse_kv_notification(kv_notification("id#with#hashes", (1, 3))) == ("id#with#hashes", (1, 3))
    n = parse_notification(push_notification("a#b", PUSH, "agent-1"))
    assert (n.request_id, n.kind, n.writer) == ("a#b", PUSH, "agent-1")
    assert parse_notification(push_notification("x", FAILED, "w")).kind == FAILED
    assert parse_notification(b"legacy") == parse_notification("legacy")
    with pytest.raises(ValueError):
        push_notification("x", "maybe", "w")


def test_kv_arrives_when_every_head_of_every_rank_has():
    """A decode worker's ranks hold heads [0, 2) and [2, 4); the KV of a request has arrived once
    the notifications of the writes cover both, whatever the prefill worker's TP."""
    clock = Clock()
    a = KVArrivals([(0, 2), (2, 4)], clock=clock)
    # prefill TP4 -> decode TP2: two writes per decode rank
    assert a.feed(0, [kv_notification("r1", (0, 1))]) == []
    assert a.feed(1, [kv_notification("r1", (2, 3)), kv_notification("r1", (3, 4))]) == []
    assert a.feed(0, [kv_notification("r1", (1, 2))]) == ["r1"]
    # prefill TP1 -> decode TP2: one write per decode rank; a duplicate (retried prefill) is harmless
    assert a.feed(1, [kv_notification("r2", (2, 4))]) == []
    assert a.feed(0, [kv_notification("r2", (0, 2)), kv_notification("r2", (0, 2))]) == ["r2"]
    # one rank's heads twice do not stand in for the other rank's
    assert a.feed(0, [kv_notification("r3", (0, 2)), kv_notification("r3", (0, 2))]) == []
    # prefill TP2 -> decode TP1 (one rank, all four heads): both halves needed
    b = KVArrivals([(0, 4)])
    assert b.feed(0, [kv_notification("r4", (2, 4))]) == []
    assert b.feed(0, [kv_notification("r4", (0, 2))]) == ["r4"]
    assert b.feed(0, [b"legacy"]) == ["legacy"]  # a bare request id covers the rank's heads
    assert b.feed(0, [push_notification("r5", PUSH, "w")]) == []  # push notes are not writes
    # partial arrivals of abandoned requests are dropped: forgotten, or after the ttl
    stale = KVArrivals([(0, 2), (2, 4)], ttl_s=5.0, clock=clock)
    stale.feed(0, [kv_notification("gone", (0, 2)), kv_notification("cancelled", (0, 2))])
    stale.forget("cancelled")
    assert len(stale) == 1
    clock.now += 6
    stale.feed(0, [])
    assert len(stale) == 0
    assert stale.feed(1, [kv_notification("gone", (2, 4))]) == []


# -- the scheduler driving it ------------------------------------------------------------------------
def test_started_requests_wait_for_a_batch_slot_past_the_kv_deadline(h, rng):
    """Issue 13: with a full batch, a request whose KV is in waits for a slot however long the
    others run; it used to fail with "KV transfer did not arrive" 30 s after Decode."""
    reqs = []
    for i in range(3):
        n = rng.randint(3, 20)
        r = h.s.reserve(f"r{i}", n, 1000, ttl_s=60)
        h.kv(f"r{i}")
        h.s.run_once()
        start(h, f"r{i}", n)
        reqs.append(r)
    for _ in range(5):
        h.s.run_once()
        h.clock.now += 20  # 100 s: past the transfer timeout and the reservation's ttl
    assert [e.finish_reason for e in drain(reqs[2])] == []  # still queued, not failed
    assert h.s.load()["queued"] == 1 and h.s.load()["running"] == 2
    h.s.cancel("r0")
    h.s.run_once()
    assert h.s.load()["running"] == 2  # r2 took r0's slot
    assert h.runner.steps[-1] == ["r1", "r2"]
    assert all(e.finish_reason is None for e in drain(reqs[2]))


def test_kv_in_flight_outlives_the_reservation_ttl_and_fails_only_on_the_transfer_timeout(h):
    h.s.reserve("slow", 9, 5, ttl_s=10)
    h.clock.now += 8
    h.note(push_notification("slow", PUSH, WRITER))  # the prefill worker starts pushing at t=8
    h.s.run_once()
    h.clock.now += 25  # t=33: ttl long gone, the push is 25 s old
    h.s.run_once()
    assert h.state("slow") is State.AWAITING_KV
    h.note(kv_notification("slow", (0, 4)))
    h.s.run_once()
    assert h.state("slow") is State.KV_READY
    h.s.reserve("stuck", 9, 5, ttl_s=10)
    h.note(push_notification("stuck", PUSH, WRITER))
    h.s.run_once()
    h.clock.now += 31
    h.s.run_once()
    assert h.state("stuck") is None  # failed: the transfer began 31 s ago


def test_prefill_reported_failure_fails_the_waiting_request_with_a_clear_error(h):
    r = h.s.reserve("x", 9, 5, ttl_s=60)
    h.note(push_notification("x", PUSH, WRITER))
    h.note(push_notification("x", FAILED, WRITER))
    h.s.run_once()
    (ev,) = drain(r)
    assert ev.finish_reason is FinishReason.ERROR and "reported that the KV transfer failed" in ev.error
    assert h.blocks() == (512, 0, 0)  # the writer is done: blocks free at once
    with pytest.raises(ReservationError):
        start(h, "x", 9)


def test_late_and_duplicate_notifications_are_dropped_not_kept(h):
    """The old scheduler kept notifications of requests it no longer knew in a set scanned every
    step, forever."""
    h.s.reserve("a", 5, 3, ttl_s=60)
    h.kv("a")
    h.kv("a")  # duplicates
    h.s.run_once()
    start(h, "a", 5, max_new=3)
    for _ in range(3):
        h.s.run_once()
    assert h.state("a") is None and h.blocks() == (512, 0, 0)
    before = h.s.dropped_notifications
    for rid in ("a", "never-reserved", "a"):
        h.kv(rid)
        h.note(kv_notification(rid, (0, 2)))  # a partial arrival too
    h.s.run_once()
    assert h.s.dropped_notifications == before + 12
    assert len(h.s._arrivals) == 0 and not h.s._fenced and not h.s._requests


def test_first_token_can_end_the_request_before_its_kv_note(h):
    r = h.s.reserve("one", 5, 1, ttl_s=60)
    h.note(push_notification("one", PUSH, WRITER))
    h.s.run_once()
    start(h, "one", 5, max_new=1)  # max_new_tokens=1: the first token is the last
    (ev,) = drain(r)
    assert ev.finish_reason is FinishReason.LENGTH
    assert h.blocks()[2] > 0  # fenced: the writer has not said it is done
    h.kv("one")  # the write's note and the push's end come after
    h.s.run_once()
    assert h.blocks() == (512, 0, 0)


def test_kv_split_over_ranks_and_prefill_tp(tiny_cfg):
    h = Harness(tiny_cfg, head_ranges=[(0, 2), (2, 4)])
    h.s.reserve("tp", 5, 3, ttl_s=60)
    for rank, heads in ((0, (0, 1)), (1, (2, 4)), (0, (1, 2))):
        assert h.state("tp") is State.AWAITING_KV
        h.note(kv_notification("tp", heads), rank=rank)
        h.s.run_once()
    assert h.state("tp") is State.KV_READY


# -- safe block reuse (issue 11): a fence, not a timer ------------------------------------------------
class DelayedWriter:
    """A prefill push that is slow to end: it announces itself, writes when told, and only then
    says it is over. `land()` marks the blocks it writes, so reuse before the end shows."""

    def __init__(self, h: Harness, rid: str, placement: list[int]):
        self.h, self.rid, self.blocks = h, rid, list(placement)
        h.note(push_notification(rid, PUSH, WRITER))

    def land(self) -> None:
        pool = self.h.runner.cache.pools["full"]
        pool[:, self.blocks] = 1.0

    def end(self, ok: bool) -> None:
        self.h.note(push_notification(self.rid, OK if ok else FAILED, WRITER))


@pytest.mark.parametrize("how", ["cancel", "expire"])
def test_no_block_is_reused_before_the_delayed_write_into_it_ended(tiny_cfg, how, rng):
    pages = rng.randint(8, 16)
    page = 4
    blocks = pages + -(-tiny_cfg.sliding_window // page) + 1  # + the sliding layers' window
    h = Harness(tiny_cfg, num_blocks=blocks)
    r = h.s.reserve("victim", page * pages - 3, 3, ttl_s=5)  # the whole pool
    writer = DelayedWriter(h, "victim", r.blocks.full)
    h.s.run_once()
    if how == "cancel":
        h.s.cancel("victim")
        h.s.run_once()
    else:
        h.clock.now += 31  # the push began and never completed: transfer timeout
        h.s.run_once()
    assert h.state("victim") is None and [e.finish_reason for e in drain(r)] in (
        [FinishReason.CANCELLED], [FinishReason.ERROR])
    for _ in range(rng.randint(1, 5)):  # however long the writer takes (short of its deadline)
        assert h.blocks() == (0, 0, blocks)
        with pytest.raises(Exception, match="fenced"):
            h.s.reserve("next", 1, 1, ttl_s=60)
        h.clock.now += 0.5
        h.s.run_once()
    writer.land()  # the late write lands in the fenced blocks: nobody else's KV
    writer.end(ok=False)
    h.s.run_once()
    assert h.blocks() == (blocks, 0, 0)
    nxt = h.s.reserve("next", 1, 1, ttl_s=60)
    h.runner.cache.pools["full"][:, nxt.blocks.full] = 0.0  # the new owner's KV is never overwritten


def test_cancel_without_a_writer_frees_at_once_and_silent_writers_at_the_deadline(h):
    h.s.reserve("never-sent", 9, 5, ttl_s=60)
    h.s.cancel("never-sent", no_writer=True)  # the router never asked a prefill worker
    h.s.run_once()
    assert h.blocks() == (512, 0, 0)
    r = h.s.reserve("silent", 9, 5, ttl_s=60)
    n = len(r.blocks.full) + len(r.blocks.owned_sliding())
    h.s.cancel("silent")  # a prefill worker may have it queued: fenced
    h.s.run_once()
    assert h.blocks() == (512 - n, 0, n)
    h.clock.now += 60 + 30  # the request's deadline, then the longest push: still a margin
    h.s.run_once()
    assert h.blocks()[2] == n
    h.clock.now += 6
    h.s.run_once()
    assert h.blocks() == (512, 0, 0)


def test_cancel_of_a_queued_prefill_releases_when_the_prefill_side_says_so(h):
    h.s.reserve("q", 9, 5, ttl_s=600)
    h.s.cancel("q")
    h.s.run_once()
    assert h.blocks()[2] > 0
    h.note(push_notification("q", FAILED, WRITER))  # prefill dropped the queued job: no push
    h.s.run_once()
    assert h.blocks() == (512, 0, 0)


# -- the same through real NIXL agents (UCX over TCP) and the prefill executor ------------------------
class GatedHandle:
    """A write that stays in flight until its gate opens; aborting it lets the write land first
    (the worst case: bytes arrive while the push is being torn down)."""

    def __init__(self, real_agent, args, gate, log):
        self.real_agent, self.args, self.gate, self.log = real_agent, args, gate, log
        self.nbytes, self._ended = 0, False

    def _land(self) -> None:
        if not self._ended:
            h = self.real_agent.write_pages(*self.args)
            h.wait(30)
            self.nbytes, self._ended = h.nbytes, True
            self.log.append("landed")

    def done(self) -> bool:
        if self.gate.is_set():
            self._land()
        return self._ended

    def abort(self, reason: str = "") -> None:
        self._land()

    @property
    def settled(self) -> bool:
        return self._ended


class SlowAgent:
    def __init__(self, agent, gate, log):
        self._agent, self.gate, self.log = agent, gate, log

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def write_pages(self, *args, push_id=""):
        return GatedHandle(self._agent, (*args, push_id), self.gate, self.log)


class FakePrefillRunner:
    def __init__(self, cfg):
        self.cfg = cfg
        self.cache = PagedKVCache(cfg, num_blocks=128, page_size=4)
        for pool in self.cache.pools.values():
            pool.normal_()
        self.max_context = 256

    def validate_prompt(self, ids):
        pass

    def prefill(self, seq, all_logits=False, *, finish=True, stop=None):  # one chunk: never stops
        start, n = seq.num_cached, len(seq.prompt_ids)
        self.cache.prepare(seq.blocks, start, n - start)
        seq.num_cached = n
        if finish:
            self.cache.finish_prefill(seq.blocks, n)
        logits = torch.zeros(n - start, 16)
        logits[:, NEXT_TOKEN] = 1.0
        return logits if all_logits else logits[-1]


@pytest.fixture(params=["executor", "rank-group"])
def nixl_pair(tiny_cfg, request):
    """A decode scheduler and a prefill executor with real NIXL agents; the push either the
    executor's own or as a worker's rank group runs it (prefill_worker/main.py: every rank's
    share through push_report, the leader's abortable)."""
    import threading
    import uuid

    from pdserve.decode_worker.server import DecodeService
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.prefill_worker.executor import PrefillExecutor

    h = Harness(tiny_cfg, num_blocks=24 + -(-tiny_cfg.sliding_window // 4) + 1)  # 24 pages + a window
    tag = uuid.uuid4().hex[:6]
    dec = KVTransferAgent(f"dec-{tag}", h.runner.cache.pools, head_range=(0, 4))
    h.s.notification_source = lambda: [(0, n) for n in dec.take_notifications()]
    pre_runner = FakePrefillRunner(tiny_cfg)
    pre = KVTransferAgent(f"pre-{tag}", pre_runner.cache.pools, head_range=(0, 4))
    gate, log = threading.Event(), []
    slow = SlowAgent(pre, gate, log)
    ex = PrefillExecutor(pre_runner, slow, transfer_timeout_s=30)
    if request.param == "rank-group":
        from pdserve.kvtransfer import KVTransferError
        from pdserve.prefill_worker.parallel import push_report

        def push_on_one_rank(p):
            status, out = push_report(slow, p, 30, ex.current_abort())
            if status != "ok":
                raise KVTransferError(out)
            return out

        ex.push = push_on_one_rank
    ex.start()
    h.service = DecodeService(h.s, dec, worker_id="dec")
    h.executor, h.gate, h.log = ex, gate, log
    yield h
    gate.set()
    ex.stop()
    pre.close()
    dec.close()


def _submit(h, rid: str, n: int):
    from pdserve.prefill_worker.executor import PrefillJob
    from pdserve.proto import pdserve_pb2 as pb

    placements = h.service.Reserve(pb.ReserveRequest(request_id=rid, num_prompt_tokens=n, max_new_tokens=8),
                                   None).placements
    job = PrefillJob(rid, [1] * n, greedy(8), list(placements))
    job.peers = dict(h.service.rank_agents)  # what the prefill worker learns once (KVMetadata)
    return job, h.executor.submit(job)


def _pump(h, until, what: str):
    import time

    end = time.monotonic() + 60
    while not until():
        assert time.monotonic() < end, what
        h.s.run_once()
        time.sleep(0.002)


def test_cancelled_push_over_nixl_keeps_blocks_fenced_until_the_prefill_side_let_go(nixl_pair):
    h = nixl_pair
    n = random.randint(5, 40)
    job, fut = _submit(h, "victim", n)
    victim = h.s._requests["victim"]
    _pump(h, lambda: victim.writers or fut.done(), "the push never began")
    assert not fut.done(), fut.exception()
    h.s.cancel("victim")  # the client left; the router cancels both sides
    h.s.run_once()
    assert h.state("victim") is None and h.blocks()[2] > 0 and h.log == []
    with pytest.raises(Exception, match="fenced"):
        h.s.reserve("greedy", 24 * 4 - 4, 4, ttl_s=60)  # needs every block, the fenced ones too
    assert h.executor.cancel("victim")  # aborts the push: its write lands while it is torn down
    with pytest.raises(Exception):
        fut.result(timeout=60)
    assert h.log == ["landed"]
    _pump(h, lambda: h.blocks()[2] == 0, "the prefill side never said its push ended")
    assert h.blocks() == (h.runner.cache.num_total_blocks, 0, 0)
    nxt = h.s.reserve("greedy", 24 * 4 - 4, 4, ttl_s=60)
    for pool in h.runner.cache.pools.values():
        pool.zero_()
    h.gate.set()
    h.s.run_once()
    assert all(float(p.abs().sum()) == 0 for p in h.runner.cache.pools.values())  # nothing landed late
    assert nxt.state is State.AWAITING_KV


def test_push_over_nixl_notes_and_a_prefill_that_comes_after_its_cancel(nixl_pair):
    h = nixl_pair
    h.gate.set()
    n = random.randint(5, 40)
    job, fut = _submit(h, "ok", n)
    fut.result(timeout=60)
    _pump(h, lambda: h.state("ok") is State.KV_READY and not h.s._requests["ok"].writers, "no KV")
    assert h.s._requests["ok"].writes_settled()
    h.s.cancel("ok")
    h.s.run_once()
    assert h.blocks() == (h.runner.cache.num_total_blocks, 0, 0)  # every write ended: no fence
    assert not h.executor.cancel("ok", remember=False)  # its RPC ended: that is no Cancel
    job, fut = _submit(h, "ok", n)  # so a retry of the request (the router's, after a failed
    fut.result(timeout=60)          # decode worker) is served
    h.s.cancel("ok")
    _pump(h, lambda: h.blocks() == (h.runner.cache.num_total_blocks, 0, 0), "the retried request did not end")
    # the router's Cancel reaches the prefill worker before its Prefill
    assert not h.executor.cancel("late")
    with pytest.raises(InterruptedError):
        _submit(h, "late", n)
    h.s.cancel("late")
    _pump(h, lambda: h.blocks() == (h.runner.cache.num_total_blocks, 0, 0), "the refused prefill did not release the fence")


def test_decode_gets_the_prompt_length_and_a_migrated_streams_samples_only(h):
    """Decode has the prompt's KV; it is given the prompt's length (was: the whole prompt, of
    which it read the length), and for a migrated stream the samples it had already streamed."""
    n, earlier = random.randint(8, 30), [random.randrange(100, 200) for _ in range(3)]
    r = h.s.reserve("m", n, 5, ttl_s=60)
    h.kv("m")
    h.s.run_once()
    with pytest.raises(ValueError, match="prompt tokens"):
        h.s.start("m", NEXT_TOKEN, n + 1, greedy(5))
    with pytest.raises(ValueError, match="not within"):
        h.s.start("m", NEXT_TOKEN, 3, greedy(5), generated=earlier)
    h.s.start("m", NEXT_TOKEN, n, greedy(5), generated=earlier)
    seq = r.seq
    assert seq.prompt_ids == [] and seq.num_prompt_tokens == n - 3 and seq.num_cached == n
    assert seq.output_ids == earlier + [NEXT_TOKEN] and seq.num_tokens == n + 1
    h.s.run_once()  # the 5th sample: max_new_tokens counts the earlier ones
    assert [e.finish_reason for e in drain(r)][-1] is FinishReason.LENGTH and seq.output_ids[-1] == NEXT_TOKEN


def test_a_prefill_that_fails_before_pushing_tells_the_decode_side(nixl_pair):
    h = nixl_pair

    def broken(seq, *a, **kw):
        raise RuntimeError("the forward failed")

    h.executor.runner.prefill = broken
    job, fut = _submit(h, "doomed", random.randint(5, 40))
    with pytest.raises(RuntimeError):
        fut.result(timeout=60)
    h.s.cancel("doomed")  # the router gives up on the request
    _pump(h, lambda: h.blocks() == (h.runner.cache.num_total_blocks, 0, 0), "the decode side was not told: blocks fenced")


# -- re-sharded KV (prefill TP4 -> decode TP2) into reused blocks, with a rank that polls late --------
@pytest.mark.parametrize("how", ["cancel", "expire"])
def test_a_rank_polling_late_never_touches_the_reused_blocks_of_an_ended_request(tiny_cfg, how, rng):
    """Each decode rank gets its heads as two slotted writes to put in place (kvtransfer.reshard).
    The victim ends and its blocks are freed on the prefill side's "ok" to rank 0, while rank 1
    has not yet polled the victim's slots; the next request gets the very same blocks and its KV
    lands in them; only then does rank 1 poll, seeing the victim's slots complete beside the next
    request's. No rank may put the victim's slots in place any more (that would permute the new
    owner's KV): the next request's KV must be bit-exact on both ranks."""
    import time
    import uuid

    from types import SimpleNamespace

    from pdserve.decode_worker.parallel import rank_commands, unpack_on_every_rank
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.prefill_worker.executor import KVPush, push_kv

    pages = rng.randint(2, 6)
    nb = pages + min(-(-tiny_cfg.sliding_window // 4) + 1, pages)  # the whole cache (a victim's full
    h = Harness(tiny_cfg, num_blocks=nb, head_ranges=[(0, 2), (2, 4)])  # + sliding pages): the next
    # request must take the victim's blocks
    shape = h.runner.cache.pools["full"].shape  # (layers, blocks, 2, page, heads, dim)
    tag = uuid.uuid4().hex[:6]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    truth = torch.randint(-2**15, 2**15, (shape[0], 2 * nb, *shape[2:]), generator=gen,
                          dtype=torch.int16).view(torch.bfloat16)  # prefill blocks: victim's, next's
    dec = [KVTransferAgent(f"dec{r}-{tag}", {"full": torch.zeros(*shape[:4], 2, shape[5], dtype=torch.bfloat16)},
                           head_range=(2 * r, 2 * r + 2), unpack_on_arrival=False) for r in (0, 1)]
    pre = [KVTransferAgent(f"pre{i}-{tag}", {"full": truth[..., i:i + 1, :].contiguous()}, head_range=(i, i + 1))
           for i in range(4)]
    unpacked = []

    class TwoRanks:
        """LeaderGroup.call over rank 0 (here) and rank 1 (its command table, as it follows)."""

        follower = rank_commands(SimpleNamespace(execute=None), dec[1])

        def call(self, name, payload, local, want_reply):
            unpacked.append([rid for rid, _ in payload])
            out = [local(payload), self.follower[name](payload)]
            return out if want_reply else out[0]

    h.s.kv_unpack = unpack_on_every_rank(TwoRanks(), dec[0])
    polled = {0: [], 1: []}

    def poll(rank: int, *want: bytes) -> None:
        """Poll decode rank `rank` until `want` arrived; hand what it saw to the scheduler."""
        end = time.monotonic() + 60
        while not all(w in polled[rank] for w in want):
            assert time.monotonic() < end, f"rank {rank} never got {want}"
            got = dec[rank].take_notifications()
            polled[rank] += got
            h.inbox += [(rank, n) for n in got]
            time.sleep(0.001)

    def push(rid: str, src: int, kind: str) -> None:
        blocks = h.s._requests[rid].blocks.full if kind == PUSH else None
        peer = pre[0].add_peer(dec[0].peer_info())
        pre[0].send_notification(peer, push_notification(rid, kind, pre[0].name))
        if kind == PUSH:  # every prefill rank writes its head into a slot on the decode rank
            targets = [(d.peer_info(), {"full": [(src + i, b) for i, b in enumerate(blocks)]}) for d in dec]
            p = KVPush(rid, targets)
            for a in pre:
                push_kv(a, p, timeout_s=30)

    try:
        victim = list(h.s.reserve("victim", 4 * pages - 1, 1, ttl_s=60).blocks.full)
        push("victim", 0, PUSH)
        slots = [kv_notification("victim", (i, i + 1)) for i in range(4)]
        poll(0, push_notification("victim", PUSH, pre[0].name), *slots[:2])  # rank 1: not yet
        h.s.run_once()
        assert h.state("victim") is State.AWAITING_KV
        if how == "cancel":
            h.s.cancel("victim")
        else:
            h.clock.now += 31  # the push began and is not complete (rank 1): transfer timeout
        h.s.run_once()
        assert h.state("victim") is None and h.blocks() == (0, 0, nb)  # fenced: the push is not over
        push("victim", 0, OK)
        poll(0, push_notification("victim", OK, pre[0].name))
        h.s.run_once()
        assert h.blocks() == (nb, 0, 0)  # every write landed: the blocks may be handed out

        nxt = h.s.reserve("next", 4 * pages - 1, 1, ttl_s=60)
        assert sorted(nxt.blocks.full) == sorted(victim)
        push("next", nb, PUSH)
        push("next", nb, OK)
        # rank 1 polls at last: the victim's slots, all there, and the next request's
        poll(1, *slots[2:], *[kv_notification("next", (i, i + 1)) for i in (2, 3)])
        poll(0, *[kv_notification("next", (i, i + 1)) for i in (0, 1)], push_notification("next", OK, pre[0].name))
        h.s.run_once()
        assert h.state("next") is State.KV_READY and unpacked == [["next"]]
        for r, a in enumerate(dec):
            got = a._pools["full"][:, nxt.blocks.full].view(torch.int16)
            want = truth[:, nb:nb + pages, ..., 2 * r:2 * r + 2, :].view(torch.int16)
            assert torch.equal(got, want), f"rank {r}: the next request's KV is not what its prefill wrote"
    finally:
        for a in pre + dec:
            a.close()
