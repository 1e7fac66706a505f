"""Cache-aware routing: the router's prefix index and the policy that follows it."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.discovery import WorkerEndpoint
from pdserve.router.policy import CacheAwarePolicy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Worker


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(201088) for _ in range(n)]


def test_index_matches_longest_recorded_prefix_per_worker(rng):
    index = PrefixIndex(chunk_tokens=4, capacity_tokens=1 << 20)
    system = _ids(rng.randrange(8, 40), rng)
    a = system + _ids(rng.randrange(8, 40), rng)
    b = system + _ids(rng.randrange(8, 40), rng)
    index.record("w1", a)
    index.record("w2", b)
    turn = a + _ids(5, rng)
    got = index.match(turn, ["w1", "w2", "w3"])
    assert got["w1"] == len(a) // 4 * 4
    assert got["w2"] == len(system) // 4 * 4
    assert got["w3"] == 0
    assert index.match(_ids(30, rng), ["w1"]) == {"w1": 0}
    index.forget("w1")
    assert index.match(turn, ["w1"]) == {"w1": 0}


def test_index_forgets_least_recently_sent_beyond_capacity(rng):
    index = PrefixIndex(chunk_tokens=4, capacity_tokens=40)  # 10 chunks per worker
    old, new = _ids(24, rng), _ids(24, rng)
    index.record("w", old)
    index.record("w", new)
    assert index.match(new, ["w"])["w"] == 24
    # 12 chunks sent, 10 kept: the old prompt lost its deepest chunks first, its root survives
    assert index.match(old, ["w"])["w"] == 16
    index.record("w", _ids(40, rng))
    assert index.match(old, ["w"])["w"] == 0 and index.match(new, ["w"])["w"] == 0


def _prefill_worker(name: str, queued: int) -> Worker:
    worker = Worker(WorkerEndpoint("prefill", f"127.0.0.1:{name}", name),
                    grpc.aio.insecure_channel("127.0.0.1:9"), CircuitBreaker(3, 5, 60))
    worker.load = pb.LoadReport(role="prefill", queued_prompt_tokens=queued)
    worker.serving = True
    return worker


@pytest.mark.parametrize("gap,expect_holder", [(0, True), (100, True), (5000, False)])
def test_policy_prefers_the_holder_unless_it_is_loaded_past_the_threshold(gap, expect_holder, rng):
    async def run():
        policy = CacheAwarePolicy(PrefixIndex(chunk_tokens=4), imbalance_tokens=1000)
        idle, holder = _prefill_worker("idle", 0), _prefill_worker("holder", gap)
        conversation = _ids(50, rng)
        policy.prefilled(holder, conversation)
        ranked = policy.rank_prefill([idle, holder], 60, conversation + _ids(10, rng))
        assert set(ranked) == {idle, holder}
        assert ranked[0] is (holder if expect_holder else idle)
        # an unrelated prompt goes by load
        by_load = sorted([idle, holder], key=lambda w: (w.queued_prompt_tokens, w.name))
        assert policy.rank_prefill([holder, idle], 20, _ids(20, rng)) == by_load

    asyncio.run(run())
