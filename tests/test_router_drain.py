"""A decode worker that leaves discovery (its pod is terminating) keeps streaming the requests
placed on it until they end, while the router places nothing new on it.

Kubernetes takes a terminating pod out of its Service's EndpointSlice at once, long before the
pod's grace period ends; the router must not cut the pod's streams then (it used to close the
connection after `graceful_shutdown_timeout`).
"""

from __future__ import annotations

import threading

import httpx

from router_harness import (FakeDecode, FakePrefill, KVFabric, ListDiscovery, RouterThread, Script,
                            harmony_ids, wait_for)
from pdserve.router.discovery import WorkerEndpoint

MODEL = "gpt-oss-test"


def stream_chat(base_url: str, out: dict, key: int) -> None:
    text, finish = [], None
    with httpx.stream("POST", base_url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Tell me."}]}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    out[key] = ("".join(text), finish)


def test_departed_decode_worker_finishes_its_streams_and_gets_nothing_new(rng):
    story = " ".join(f"w{rng.randrange(10**6)}" for _ in range(40))
    script = Script(harmony_ids(f"<|channel|>final<|message|>{story}<|return|>"))
    fabric = KVFabric()
    prefill = FakePrefill("p0", fabric, script)
    old, new = FakeDecode("d-old", fabric, script), FakeDecode("d-new", fabric, script)
    old.chunk_size, old.token_delay = 1, 0.05  # ~2 s per stream: longer than the router's grace
    ep = lambda role, w: WorkerEndpoint(role, w.address, w.name)  # noqa: E731
    discovery = ListDiscovery([ep("prefill", prefill), ep("decode", old)])
    router = RouterThread([], [], discovery=discovery, graceful_shutdown_timeout=0.5)
    try:
        router.wait_ready()
        results: dict[int, tuple[str, str]] = {}
        streams = [threading.Thread(target=stream_chat, args=(router.base_url, results, i)) for i in range(10)]
        for t in streams:
            t.start()
        assert wait_for(lambda: len(old.decode_requests) == 10, timeout=10)
        # the pod is terminating: its endpoint goes, a new worker's comes
        discovery.set([ep("prefill", prefill), ep("decode", new)])
        registry = router.router.registry
        assert wait_for(lambda: router.call(lambda: [w.name for w in registry.routable("decode")]) == ["d-new"])
        later: dict[int, tuple[str, str]] = {}
        for i in range(5):
            stream_chat(router.base_url, later, i)
        assert len(old.reserve_requests) == 10 and len(new.reserve_requests) == 5
        for t in streams:
            t.join(30)
        assert results == {i: (story, "stop") for i in range(10)}  # none cut short
        assert later == {i: (story, "stop") for i in range(5)}
        # the last stream ended: the departed worker is let go
        assert wait_for(lambda: router.call(registry.departing) == [])
        assert router.call(lambda: [w.requests for w in registry.workers("decode")]) == [0]
    finally:
        router.close()
        for w in (prefill, old, new):
            w.server.die()
