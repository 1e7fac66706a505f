"""The router's small parts on their own: stop strings, detokenizer, breaker, backoff, policy,
config, and the registry following discovery and health."""

import asyncio
import random

import grpc
import pytest

from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.circuit_breaker import BreakerState, CircuitBreaker
from pdserve.router.config import ConfigError, RouterConfig
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.discovery import WorkerEndpoint
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import LoadAwarePolicy, kv_blocks_needed
from pdserve.router.registry import Worker, WorkerRegistry
from pdserve.router.retry import backoff_delay
from pdserve.router.stop_strings import StopStringMatcher
from router_harness import FakeDecode, FakePrefill, KVFabric, ListDiscovery, Script, codec, fast_config


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(0, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("trial", range(20))
def test_stop_strings_cut_at_the_first_match_however_text_is_split(trial, rng):
    alphabet = "abc "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(2, 80)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
             for _ in range(rng.randrange(1, 4))]
    matcher = StopStringMatcher(stops)
    out = "".join(matcher.feed(p) for p in random_pieces(text, rng)) + matcher.flush()
    # the match that completes first (then the one that begins first) ends the text
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if hits:
        assert matcher.stopped and out == text[:min(hits)[1]], (text, stops)
    else:
        assert not matcher.stopped and out == text


@pytest.mark.parametrize("pieces", [["caac b"], ["caa", "c b"], ["c", "a", "a", "c", " ", "b"]])
def test_the_stop_string_that_completes_first_ends_the_text_however_it_is_split(pieces):
    """"aac b" begins before "c" but completes after it: "c" at index 3 ends the text, in one piece
    or many (a stream cannot wait for a longer match that may never come)."""
    matcher = StopStringMatcher(["aac b", "c "])
    out = "".join(matcher.feed(p) for p in pieces) + matcher.flush()
    assert matcher.stopped and out == "caa"
    both = StopStringMatcher(["ab", "b"])  # both end at the same character: the earlier start wins
    assert both.feed("xab") == "x" and both.stopped


def test_stop_strings_hold_back_only_a_possible_prefix():
    matcher = StopStringMatcher(["STOP", "xyz"])
    assert matcher.feed("hello ST") == "hello "  # "ST" could begin STOP
    assert matcher.feed("ART x") == "START "  # "START" cannot; "x" could begin xyz
    assert matcher.feed("yz!") == "" and matcher.stopped
    assert matcher.flush() == ""
    assert StopStringMatcher([]).feed("anything") == "anything"


def test_incremental_detokenizer_matches_full_decode():
    """Streamed pieces never show U+FFFD for a character split across pushes, and join to the text.

    Seeded: the old window-based detokenizer gave up after 8 held ids and emitted U+FFFD when
    every push completed one character and began the next (seeds 902 and 1160 of these).
    """
    pool = ["Grüße", " 日本語", " émoji 🙂🚀", " plain", " ß", " Ω≈ç√", "\n", " 中文字符"]
    for seed in range(1500):
        rng = random.Random(seed)
        text = "".join(rng.choice(pool) for _ in range(30))
        ids = codec().encode(text)
        detok = IncrementalDetokenizer(codec().decode_bytes)
        out, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            piece = detok.push(ids[i:i + n])
            assert "\ufffd" not in piece, (seed, out, piece)
            out.append(piece)
            i += n
        out.append(detok.flush())
        assert "".join(out) == text, seed


def test_incremental_detokenizer_replaces_bytes_that_never_form_a_character_like_full_decode():
    rocket = codec().encode("🚀")  # two ids: three bytes of the character, then its last byte
    assert len(rocket) == 2
    ids = rocket[:1] + codec().encode(" plain") + rocket[:1]  # a cut character, and one at the end
    detok = IncrementalDetokenizer(codec().decode_bytes)
    streamed = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(streamed) == codec().decode(ids) == "\ufffd plain\ufffd"
    assert streamed[-1] == "\ufffd"  # the unfinished tail is held until the stream ends


def test_circuit_breaker():
    now = [100.0]
    breaker = CircuitBreaker(failure_threshold=3, reset_timeout=5, max_reset_timeout=12,
                             clock=lambda: now[0])
    breaker.record_failure("a")
    breaker.record_failure("b")
    assert breaker.closed
    breaker.record_success()  # resets the count
    breaker.record_failure("c")
    breaker.record_failure("d")
    assert breaker.closed
    breaker.record_failure("e")
    assert breaker.state is BreakerState.OPEN and not breaker.should_probe()
    now[0] += 5
    assert breaker.state is BreakerState.HALF_OPEN and breaker.should_probe()
    breaker.record_failure("probe")  # reopens, waiting twice as long
    now[0] += 9.9
    assert breaker.state is BreakerState.OPEN
    now[0] += 0.1
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_failure("probe")
    now[0] += 12  # capped at max_reset_timeout
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record_success()
    assert breaker.closed
    probe_started = breaker.epoch
    breaker.trip("stream died")  # one death is enough
    assert breaker.state is BreakerState.OPEN and breaker.last_reason == "stream died"
    breaker.record_success(probe_started)  # a probe from before the death cannot close it
    assert breaker.state is BreakerState.OPEN


def test_backoff_is_jittered_and_capped(rng):
    for attempt in range(6):
        delays = [backoff_delay(attempt, 0.1, 1.0, rng) for _ in range(200)]
        bound = min(1.0, 0.1 * 2 ** attempt)
        assert all(0 <= d <= bound for d in delays)
        assert max(delays) > 0.7 * bound and len(set(delays)) > 150
    with pytest.raises(ValueError):
        backoff_delay(-1, 0.1, 1.0)


def test_kv_blocks_needed():
    assert kv_blocks_needed(1, 16) == 1
    assert kv_blocks_needed(16, 16) == 1
    assert kv_blocks_needed(17, 16) == 2
    assert kv_blocks_needed(100, 0) == 0


def _worker(role, name, **load) -> Worker:
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    breaker = CircuitBreaker(3, 5, 60)
    worker = Worker(WorkerEndpoint(role, f"127.0.0.1:{name}", str(name)), channel, breaker)
    worker.load = pb.LoadReport(role=role, **load)
    worker.serving = True
    return worker


def test_policy_ranks_decode_by_free_blocks_among_those_that_fit():
    async def run():
        policy = LoadAwarePolicy()
        common = dict(page_size=16, max_context=4096)
        big = _worker("decode", 1, kv_blocks_free=500, **common)
        small = _worker("decode", 2, kv_blocks_free=100, **common)
        tiny = _worker("decode", 3, kv_blocks_free=10, **common)
        draining = _worker("decode", 4, kv_blocks_free=900, draining=True, **common)
        short = _worker("decode", 5, kv_blocks_free=900, page_size=16, max_context=1024)
        workers = [tiny, small, big, draining, short]
        # 1000 + 600 tokens = 100 blocks of 16: tiny cannot hold it, short's context cannot
        assert policy.rank_decode(workers, 1000, 600) == [big, small]
        big.pending_kv.add(450)  # reserved by this router since big's last report
        assert policy.rank_decode(workers, 1000, 600) == [small]
        assert big.free_kv_blocks == 50

        p1 = _worker("prefill", 11, queued_prompt_tokens=9000)
        p2 = _worker("prefill", 12, queued_prompt_tokens=100)
        p3 = _worker("prefill", 13, queued_prompt_tokens=0, draining=True)
        assert policy.rank_prefill([p1, p2, p3], 50) == [p2, p1]
        p2.pending_prompt.add(10_000)
        assert policy.select_pair([p1, p2], [small, big], 1000, 600) == (p1, small)
        assert policy.select_pair([p3], [small], 10, 10) is None
        for w in workers + [p1, p2, p3]:
            await w.channel.close()
    asyncio.run(run())


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="request_timeout"):
        RouterConfig(request_timeout=0)
    with pytest.raises(ConfigError, match="default_max_tokens"):
        RouterConfig(default_max_tokens=0)
    with pytest.raises(ConfigError, match="port"):
        RouterConfig(port=70000)
    with pytest.raises(ConfigError, match="served_model_name"):
        RouterConfig(served_model_name="")


def test_registry_follows_discovery_and_health():
    fabric, script = KVFabric(), Script([1])
    p0 = FakePrefill("p0", fabric, script)
    d0, d1 = FakeDecode("d0", fabric, script), FakeDecode("d1", fabric, script)
    ep = lambda role, w: WorkerEndpoint(role, w.address, w.name)  # noqa: E731

    async def until(predicate, timeout=5.0):
        for _ in range(int(timeout / 0.01)):
            if predicate():
                return True
            await asyncio.sleep(0.01)
        return predicate()

    async def run():
        metrics = RouterMetrics()
        registry = WorkerRegistry(fast_config(breaker_reset_timeout=0.2, breaker_max_reset_timeout=0.5),
                                  metrics)
        changes = []
        registry.add_listener(lambda: changes.append(registry.ready()))
        discovery = ListDiscovery([ep("prefill", p0), ep("decode", d0)])
        await registry.start(discovery)
        assert await until(registry.ready)
        assert [w.name for w in registry.routable("decode")] == ["d0"]
        assert registry.max_context() == d0.max_context

        discovery.set([ep("prefill", p0), ep("decode", d1)])  # d0 left, d1 joined
        assert await until(lambda: [w.name for w in registry.routable("decode")] == ["d1"])
        assert 'worker="d0"' not in metrics.render().decode()

        d1.server.set_serving(False)  # health says NOT_SERVING: alive but not routable
        assert await until(lambda: not registry.ready())
        d1.server.set_serving(True)
        assert await until(registry.ready)

        p0_load = 'pdserve_worker_queued_prompt_tokens{role="prefill",worker="p0"}'
        assert p0_load in metrics.render().decode()
        p0.server.die()  # probes fail: after the breaker's threshold it is out
        assert await until(lambda: not registry.routable("prefill"))
        text = metrics.render().decode()
        assert 'pdserve_worker_healthy{role="prefill",worker="p0"} 0.0' in text
        assert p0_load not in text  # no frozen load figures of a dead worker
        assert True in changes and False in changes
        p0.server.revive()  # restarted on its address: probed back into rotation
        assert await until(registry.ready)
        assert p0_load in metrics.render().decode()
        await registry.stop()
        assert discovery.stopped and not registry.workers("decode")
    try:
        asyncio.run(run())
    finally:
        for w in (p0, d0, d1):
            w.server.die()


@pytest.mark.slow
def test_worker_back_on_its_address_after_a_long_absence_is_readmitted_promptly():
    """A worker restarted after 20 s away is routable about a second after it answers: neither
    the breaker nor the channel's reconnect backoff (which grows while it is away) holds it out."""
    fabric, script = KVFabric(), Script([1])
    p0, d0 = FakePrefill("p0", fabric, script), FakeDecode("d0", fabric, script)

    async def run():
        registry = WorkerRegistry(fast_config(breaker_reset_timeout=0.2, breaker_max_reset_timeout=0.5),
                                  RouterMetrics())
        await registry.start(ListDiscovery([WorkerEndpoint("prefill", p0.address, "p0"),
                                            WorkerEndpoint("decode", d0.address, "d0")]))
        assert await _until(registry.ready, 5.0)
        d0.server.die()
        assert await _until(lambda: not registry.ready(), 5.0)
        await asyncio.sleep(20.0)
        d0.server.revive()
        assert await _until(registry.ready, 2.5)
        await registry.stop()
    try:
        asyncio.run(run())
    finally:
        p0.server.die()
        d0.server.die()


async def _until(predicate, timeout: float) -> bool:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def test_a_woken_waiter_keeps_its_place_while_it_tries():
    """Woken for its turn, a waiter still counts against the queue's bound while it tries
    Reserve: an arrival meanwhile is refused (it took the slot before, so a full queue let one
    more wait and refused one fewer); finding no room, the waiter waits again at the front."""
    from pdserve.router.admission import AdmissionQueue
    from pdserve.router.errors import OverloadedError

    async def run():
        queue = AdmissionQueue(2, 1, RouterMetrics())
        first, second = queue.enter(), queue.enter()
        queue.wake()
        assert first.turn.done() and not second.turn.done() and queue.waiting == 2
        with pytest.raises(OverloadedError):
            queue.enter()
        queue.wait_again(first)  # still no room
        queue.wake()
        assert first.turn.done() and not second.turn.done()  # the front is still the first's
        queue.leave(first)  # placed: the second's turn
        assert second.turn.done() and queue.waiting == 1
        queue.wait_again(second)
        queue.leave(second)  # gave up after waiting again: no turn to hand on
        assert queue.waiting == 0

    asyncio.run(run())


def test_a_waiter_woken_and_then_cancelled_hands_its_turn_to_the_next():
    """Cancelling a request cannot take back a wake it already got: it must pass the turn on,
    or the next waiter sleeps although room came back (until some later load report)."""
    from pdserve.router.orchestrator import Orchestrator

    async def run():
        metrics = RouterMetrics()
        config = RouterConfig(max_queue_wait=60)
        orch = Orchestrator(config, WorkerRegistry(config, metrics), LoadAwarePolicy(), metrics)
        first, second = (orch.generate(f"r{i}", [1, 2, 3], pb.SamplingParams(max_new_tokens=4))
                         for i in range(2))
        loop = asyncio.get_running_loop()

        async def wait(g):  # the queue part of Generation._reserve
            place = orch.admission.enter()
            try:
                return await g._wait_for_room(place, loop.time())
            finally:
                orch.admission.leave(place)

        waits = [asyncio.create_task(wait(g)) for g in (first, second)]
        await asyncio.sleep(0)
        assert orch.admission.waiting == 2
        orch.admission.wake()   # room for one: the first's turn...
        first.cancel("client disconnected")  # ...but its client left before it could take it
        assert await asyncio.wait_for(waits[0], 5) is False
        assert await asyncio.wait_for(waits[1], 5) is True  # the second got the turn
        assert orch.admission.waiting == 0

    asyncio.run(run())
