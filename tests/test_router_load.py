"""Load at the router: placements counted the moment a worker is picked (bursts spread)."""

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from router_harness import Cluster, harmony_ids, wait_for
from test_router_errors import assert_error
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


# ---- admission: requests without KV room wait in a bounded queue --------------------------
def _admission_cluster(**config) -> tuple[Cluster, int]:
    """2 decode workers with room for exactly 2 requests each; returns (cluster, blocks/request)."""
    cluster = Cluster(script=harmony_ids(SCRIPT), router_config=config)
    r = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=10, json=_BODY)
    assert r.status_code == 200
    reserve = next(d for d in cluster.decode if d.reserve_requests).reserve_requests[0]
    blocks = -(-(reserve.num_prompt_tokens + reserve.max_new_tokens) // 16)
    for d in cluster.decode:
        d.kv_blocks_total = 2 * blocks
        d.chunk_size, d.token_delay = 1, 0.04
    cluster.reset()
    return cluster, blocks


_BODY = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "How are you?"}]}


async def _streams(base_url: str, n: int) -> list[tuple[int, str]]:
    """n concurrent streamed chats: (status, content or error code) each."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        async def one(i: int) -> tuple[int, str]:
            async with client.stream("POST", "/v1/chat/completions",
                                     json={**_BODY, "stream": True, "seed": i}) as r:
                if r.status_code != 200:
                    await r.aread()
                    assert r.headers.get("retry-after")
                    return r.status_code, r.json()["error"]["code"]
                text = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return 200, event["error"]["code"]
                        text += "".join(c["delta"].get("content") or "" for c in event["choices"])
                return 200, text
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_requests_without_kv_room_wait_and_all_finish():
    """12 streams, room for 4 at a time: the rest wait at the router, none is refused or cut,
    and no decode worker is ever asked for more than it has."""
    cluster, blocks = _admission_cluster(max_queued_requests=64, max_queue_wait=20)
    try:
        results = asyncio.run(_streams(cluster.base_url, 12))
        assert results == [(200, "Fine, thanks.")] * 12
        assert all(d.peak_kv_blocks == 2 * blocks for d in cluster.decode)
        metrics = cluster.router.router.metrics
        waited = cluster.router.call(lambda: metrics.admission_wait._sum.get())
        assert waited > 0
        assert wait_for(lambda: cluster.router.call(lambda: metrics.admission_waiting._value.get()) == 0)
        assert wait_for(lambda: not any(d.reservations for d in cluster.decode))
    finally:
        cluster.close()


def test_no_more_requests_than_batch_slots_are_placed_on_a_decode_worker():
    """Plenty of KV, 2 batch slots per worker: at most 3 (2 + 25%) requests of this router sit on
    a worker at once; the rest wait at the router (before their response starts) and all finish."""
    cluster = Cluster(script=harmony_ids(SCRIPT), router_config={"max_queued_requests": 64,
                                                                 "max_queue_wait": 20})
    try:
        for d in cluster.decode:
            d.max_batch_size, d.chunk_size, d.token_delay = 2, 1, 0.03
        registry = cluster.router.router.registry
        assert wait_for(lambda: cluster.router.call(lambda: all(
            w.load and w.load.max_batch_size == 2 for w in registry.workers("decode"))))
        assert asyncio.run(_streams(cluster.base_url, 14)) == [(200, "Fine, thanks.")] * 14
        assert [d.peak_requests for d in cluster.decode] == [3, 3]
        assert cluster.router.call(lambda: [w.active_requests for w in registry.workers("decode")]) == [0, 0]
    finally:
        cluster.close()


def test_a_full_queue_refuses_at_once_with_429():
    """Room for 4, 2 may wait: of 10 at once, 4 run, 2 wait and run, 4 get 429 up front."""
    cluster, _ = _admission_cluster(max_queued_requests=2, max_queue_wait=20)
    metrics = cluster.router.router.metrics

    def refused() -> float:
        return sum(s.value for m in metrics.requests.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("status") == "429")
    try:
        # the 4 placed keep their room until all 10 are placed, queued or refused (on a fast host
        # the first ones could otherwise finish before the last arrive, and more would get in)
        for d in cluster.decode:
            d.hold.clear()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(asyncio.run, _streams(cluster.base_url, 10))
            try:
                assert wait_for(lambda: cluster.router.call(refused) == 4 and cluster.router.call(
                    lambda: metrics.admission_waiting._value.get()) == 2)
            finally:
                for d in cluster.decode:
                    d.hold.set()
            results = running.result(timeout=60)
        assert sorted(results).count((200, "Fine, thanks.")) == 6, results
        assert sorted(results).count((429, "kv_cache_full")) == 4, results
    finally:
        cluster.close()


def test_a_wait_past_max_queue_wait_is_429_and_clients_may_give_up_while_waiting():
    cluster, _ = _admission_cluster(max_queued_requests=64, max_queue_wait=0.5)
    try:
        for d in cluster.decode:
            d.token_delay = 0.2  # the first 4 hold their room for ~2 s
        results = asyncio.run(_streams(cluster.base_url, 12))
        assert sorted(results).count((200, "Fine, thanks.")) == 4, results
        assert sorted(results).count((429, "kv_cache_full")) == 8, results
        # clients that give up while waiting leave the queue; nothing is reserved for them
        cluster.reset()
        for d in cluster.decode:
            d.chunk_size = 1
            d.hold.clear()  # the placed 4 keep their room until the waiters are gone
        metrics = cluster.router.router.metrics

        def waiting() -> int:
            return cluster.router.call(lambda: metrics.admission_waiting._value.get())

        async def placed_and_quitters() -> list[tuple[int, str]]:
            placed = asyncio.ensure_future(_streams(cluster.base_url, 4))
            assert await asyncio.to_thread(
                wait_for, lambda: sum(len(d.reservations) for d in cluster.decode) == 4)
            quitters = asyncio.ensure_future(_streams(cluster.base_url, 4))
            assert await asyncio.to_thread(wait_for, lambda: waiting() == 4)
            quitters.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await quitters
            assert await asyncio.to_thread(wait_for, lambda: waiting() == 0)
            for d in cluster.decode:
                d.hold.set()
            return await placed

        assert asyncio.run(placed_and_quitters()) == [(200, "Fine, thanks.")] * 4
        # the 4 placed requests were reserved and decoded; a Reserve beyond them can only have been
        # refused (the room was held): a waiter woken by a load report tries again, a placement that
        # picked a worker another concurrent placement had just filled moves on. Nothing of the
        # quitters is left reserved (below).
        reserved = {r.request_id for d in cluster.decode for r in d.reserve_requests}
        decoded = {r.request_id for d in cluster.decode for r in d.decode_requests}
        assert len(decoded) == 4 and decoded <= reserved, (reserved, decoded)
        assert wait_for(lambda: not any(d.reservations for d in cluster.decode), timeout=10)
    finally:
        cluster.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_batch_of_more_prompts_than_batch_slots_finishes(stream):
    """8 prompts in one request, 3 batch slots (2 + 25%) on each of 2 decode workers: the prompts
    placed first run to their end and make room for the others, instead of holding their slots
    until every prompt of the request has started (which then waited on its own siblings until
    the admission queue gave up with a 429)."""
    cluster = Cluster(script=harmony_ids(SCRIPT), router_config={"max_queued_requests": 64,
                                                                 "max_queue_wait": 5})
    try:
        for d in cluster.decode:
            d.max_batch_size = 2
        registry = cluster.router.router.registry
        assert wait_for(lambda: cluster.router.call(lambda: all(
            w.load and w.load.max_batch_size == 2 for w in registry.workers("decode"))))
        r = httpx.post(cluster.base_url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": [[1, 2, 3]] * 8, "max_tokens": 4, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            assert r.text.rstrip().endswith("data: [DONE]") and finishes == ["length"] * 8, r.text
        else:
            assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 8
        assert max(d.peak_requests for d in cluster.decode) <= 3
        assert wait_for(lambda: cluster.router.call(
            lambda: [w.active_requests for w in registry.workers("decode")]) == [0, 0])
    finally:
        cluster.close()


# ---- requests no decode worker's KV pool can ever hold: 400 at admission -----------------
POOLS = [120, 200]  # KV blocks of 16 tokens on the two decode workers
WINDOW_PAGES = 128 // 16 + 1  # gpt-oss' sliding-window layers: 128 keys span up to 9 pages


@pytest.fixture(scope="module")
def small_pools():
    cluster = Cluster(script=harmony_ids(SCRIPT), decode_kv_blocks=POOLS, sliding_window=128,
                      router_config={"max_queued_requests": 64, "max_queue_wait": 2})
    r = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=10, json=_BODY)
    assert r.status_code == 200, r.text
    yield cluster, r.json()["usage"]["prompt_tokens"]
    cluster.close()


def _blocks(prompt: int, max_tokens: int, n: int, page: int = 16) -> int:
    """Blocks n choices take (engine/block_manager.py): each its full-attention pages of prompt +
    max_tokens, less the prompt's complete pages the n - 1 later ones share, and its own
    sliding-window pages."""
    pages = -(-(prompt + max_tokens) // page)
    return n * pages - (n - 1) * (prompt // page) + n * min(WINDOW_PAGES, pages)


def _largest_max_tokens(prompt: int, n: int, blocks: int) -> int:
    """Largest max_tokens whose n choices fit `blocks` (0: none), by search."""
    m = 0
    while _blocks(prompt, m + 1, n) <= blocks:
        m += 1
    return m


@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_request_no_decode_pool_can_hold_is_400_at_once_and_one_that_fits_runs(small_pools, n):
    cluster, prompt = small_pools
    cluster.reset()
    fits = _largest_max_tokens(prompt, n, max(POOLS))
    assert fits > _largest_max_tokens(prompt, n, min(POOLS))  # only the larger pool holds it
    body = {**_BODY, "n": n, "max_tokens": fits}
    r = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=30, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == n
    started = time.monotonic()
    r = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=30,
                   json={**body, "max_tokens": fits + 1})
    assert time.monotonic() - started < 1.5  # not after a wait for room that cannot come
    # n = 1 would fit: n is what to reduce; else max_tokens
    assert_error(r, 400, param="n" if n > 1 else "max_tokens")
    assert f"holds {max(POOLS)} blocks of 16 tokens" in r.json()["error"]["message"]
    assert f"up to {WINDOW_PAGES} for its sliding-window layers" in r.json()["error"]["message"]


def test_the_default_max_tokens_is_what_fits_the_largest_pool(small_pools):
    cluster, prompt = small_pools
    cluster.reset()
    body = {k: v for k, v in _BODY.items() if k != "max_tokens"}
    r = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=30, json={**body, "n": 8})
    assert r.status_code == 200, r.text
    [reserve] = [r for d in cluster.decode for r in d.reserve_requests]
    assert reserve.max_new_tokens == _largest_max_tokens(prompt, 8, max(POOLS))


def test_a_prompt_that_leaves_no_room_in_any_pool_is_400_naming_n_or_the_prompt(small_pools):
    cluster, _ = small_pools
    cluster.reset()
    ids = list(range(1000, 1000 + (max(POOLS) - WINDOW_PAGES) * 16 - 8))  # one choice fits, 2 cannot
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": ids, "n": 2})
    assert_error(r, 400, param="n")
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": ids + list(range(8)), "max_tokens": 1})
    assert_error(r, 400, param="max_tokens")
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": ids + list(range(8))})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert not any(d.reserve_requests for d in cluster.decode)


def test_the_routers_kv_need_is_what_the_block_manager_takes(rng):
    """The router's count of a request's blocks against engine/block_manager.py's reservation
    (full-attention pages: the first choice every page, each later one the pages past the prompt's
    complete ones; sliding-window pages: each choice its window's), at random shapes, on both sides
    of the pool size; and the longest completion the router lets into a pool is the longest that
    fits it."""
    from pdserve.engine.block_manager import KVBlockManager, KVCacheFull
    from pdserve.router.policy import kv_blocks_for_choices, max_new_tokens_within

    def fits(manager, prompt, max_new, n):
        held = []
        try:
            held.append(manager.reserve(prompt + max_new))
            for _ in range(n - 1):
                held.append(manager.reserve_choice(prompt, prompt + max_new))
            return True
        except KVCacheFull:
            return False
        finally:
            for seq in held:
                manager.release(seq)

    for _ in range(300):
        page, n, window = rng.choice([1, 4, 16, 64]), rng.randint(1, 64), rng.choice([0, 16, 128])
        prompt, max_new = rng.randint(1, 600), rng.randint(1, 600)
        probe = KVBlockManager(page_size=page, num_blocks=1, window=window)
        need = kv_blocks_for_choices(prompt, max_new, n, page, probe.sliding_window_pages)
        for blocks in (need - 1, need):
            if blocks < 1:
                continue
            manager = KVBlockManager(page_size=page, num_blocks=blocks, window=window)
            assert fits(manager, prompt, max_new, n) == (blocks == need), (page, n, window, prompt, max_new, blocks)
            longest = max_new_tokens_within(prompt, n, blocks, page, manager.sliding_window_pages)
            assert longest < 1 or fits(manager, prompt, longest, n), (page, n, window, prompt, blocks, longest)
            assert not fits(manager, prompt, max(1, longest + 1), n), (page, n, window, prompt, blocks, longest)


def test_grpc_generate_counts_its_choices_against_the_pools(small_pools):
    import grpc

    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pbg

    cluster, _ = small_pools
    cluster.reset()
    ids = list(range(1000, 1100))
    fits = _largest_max_tokens(len(ids), 4, max(POOLS))
    with grpc.insecure_channel(cluster.router.grpc_address) as channel:
        stub = pbg.GeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
                max_new_tokens=fits + 1, n=4)), timeout=30))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "Reduce n" in info.value.details()
        assert not any(d.reserve_requests for d in cluster.decode)
        responses = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
            max_new_tokens=fits, n=4)), timeout=30))
        assert sorted(r.choice for r in responses if r.finish_reason) == [0, 1, 2, 3]
