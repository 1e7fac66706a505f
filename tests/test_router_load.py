"""Load at the router: placements counted the moment a worker is picked (bursts spread)."""

import asyncio

import httpx
import pytest

from router_harness import Cluster, harmony_ids
from pdserve.router.registry import PendingLoad

MODEL = "gpt-oss-test"
SCRIPT = "<|channel|>final<|message|>Fine, thanks.<|return|>"


def test_pending_load_counts_from_pick_until_a_later_report_or_withdrawal():
    pending = PendingLoad()
    a, b, c = pending.add(5), pending.add(7), pending.add(11)
    assert pending.total == 23
    pending.withdraw(b)  # refused
    pending.withdraw(b)  # idempotent
    assert pending.total == 16
    pending.confirm(a)
    pending.reported(float("-inf"))  # a report asked for before `a` was confirmed: still pending
    assert pending.total == 16
    pending.reported(float("inf"))   # a later report shows `a`; `c` is still in flight
    assert pending.total == 11
    pending.confirm(pending.add(-4))  # released
    assert pending.total == 7
    pending.reported(float("inf"))
    assert pending.total == 11
    pending.withdraw(c)
    assert pending.total == 0


async def _burst(base_url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> int:
            r = await client.post(base_url + "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 16, "seed": i,
                "messages": [{"role": "user", "content": "How are you?"}]})
            return r.status_code
        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("n", [20, 8])
def test_a_burst_spreads_over_decode_and_prefill_workers(n):
    """Reserve and Prefill take a while, so the whole burst is placed before any answer comes
    back: each placement must already count when the next request is placed."""
    cluster = Cluster(script=harmony_ids(SCRIPT))
    try:
        for d in cluster.decode:
            d.reserve_delay = 0.3
        for p in cluster.prefill:
            p.delay = 0.3
        assert asyncio.run(_burst(cluster.base_url, n)) == [200] * n
        for workers, calls in ((cluster.decode, lambda d: d.reserve_requests),
                               (cluster.prefill, lambda p: p.requests)):
            shares = [len(calls(w)) / n for w in workers]
            assert sum(shares) == 1 and all(0.4 <= s <= 0.6 for s in shares), shares
    finally:
        cluster.close()
