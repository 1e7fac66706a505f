"""The decode scheduler on its own: a fake model runner (real paged KV bookkeeping, a fixed next
token), a hand-driven clock and loop (`run_once`), KV arrivals fed as notifications."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.decode_worker.scheduler import DecodeScheduler
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason

NEXT_TOKEN = 7  # what the fake model always predicts (not an end-of-turn id)


class FakeRunner:
    """What the scheduler uses of a ModelRunner: the cache, the limits and `decode`."""

    def __init__(self, cfg, num_blocks: int = 512, page_size: int = 4, max_context: int = 256):
        self.cfg = cfg
        self.cache = PagedKVCache(cfg, num_blocks=num_blocks, page_size=page_size)
        self.max_context = max_context
        self.steps: list[list[str]] = []

    def decode(self, seqs):
        self.steps.append([s.request_id for s in seqs])
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


@pytest.fixture
def sched(tiny_cfg):
    clock = Clock()
    s = DecodeScheduler(FakeRunner(tiny_cfg), max_batch_size=2, clock=clock)
    s.clock_ = clock
    inbox: list[str] = []
    s.notification_source = lambda: [inbox.pop() for _ in range(len(inbox))]
    s.inbox = inbox
    return s


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def drain(r) -> list:
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait())
    return out


def test_started_requests_wait_for_a_batch_slot_past_the_kv_deadline(sched):
    """Issue 13: with a full batch, a request whose KV is in waits for a slot however long the
    others run; it used to fail with "KV transfer did not arrive" 30 s after Decode."""
    rng = random.Random()
    reqs = []
    for i in range(3):
        n = rng.randint(3, 20)
        r = sched.reserve(f"r{i}", n, 1000, ttl_s=60)
        sched.inbox.append(f"r{i}")
        sched.run_once()
        sched.start(f"r{i}", NEXT_TOKEN, [1] * n, greedy(1000), kv_wait_s=30)
        reqs.append(r)
    for _ in range(5):
        sched.run_once()
        sched.clock_.now += 20  # 100 s: past the KV deadline and the reservation's ttl
    assert [e.finish_reason for e in drain(reqs[2])] == []  # still queued, not failed
    assert sched.load()["queued"] == 1 and sched.load()["running"] == 2
    sched.cancel("r0")
    sched.run_once()
    assert sched.load()["running"] == 2  # r2 took r0's slot
    assert sched.runner.steps[-1] == ["r1", "r2"]
    assert all(e.finish_reason is None for e in drain(reqs[2]))
