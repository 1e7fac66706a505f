"""Every HTTP response is counted in `pdserve_requests_total`, with the status the client saw."""

import asyncio

import httpx
import pytest

from router_harness import Cluster, harmony_ids, wait_for

MODEL = "gpt-oss-test"
STORY = " ".join(f"word{i}" for i in range(120))
SCRIPT = f"<|channel|>final<|message|>{STORY}<|return|>"
USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(script=harmony_ids(SCRIPT))
    yield c
    c.close()


def counts(cluster) -> dict[tuple[str, str], float]:
    """(endpoint, status) -> requests counted so far, read on the router's loop."""
    metric = cluster.router.router.metrics.requests

    def read():
        return {(s.labels["endpoint"], s.labels["status"]): s.value
                for family in metric.collect() for s in family.samples
                if s.name.endswith("_total")}
    return cluster.router.call(read)


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_responses_made_outside_the_handlers_are_counted(cluster):
    cluster.reset()
    before = counts(cluster)
    with httpx.Client(base_url=cluster.base_url, timeout=10) as h:
        assert h.get("/nowhere").status_code == 404
        assert h.get("/v1/models/nope").status_code == 404
        assert h.get("/v1/models").status_code == 200
        assert h.get("/v1/responses/resp_nope").status_code == 404
        assert h.get("/v1/chat/completions").status_code == 405
        assert h.post("/v1/chat/completions", content=b"{").status_code == 400
    assert delta(before, counts(cluster)) == {
        ("other", "404"): 1, ("models", "404"): 1, ("models", "200"): 1, ("responses", "404"): 1,
        ("chat_completions", "405"): 1, ("chat_completions", "400"): 1}


class NativePanic(BaseException):
    """What a panic in native code (the Rust tokenizer) raises: not an Exception."""


def test_a_native_panic_is_an_openai_500_and_counted(cluster, monkeypatch):
    cluster.reset()
    codec = cluster.router.router.frontend.codec

    def panic(*args, **kwargs):
        raise NativePanic("tokenizer panicked")
    monkeypatch.setattr(codec, "render_chat", panic)
    before = counts(cluster)
    r = httpx.post(cluster.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": USER}, timeout=10)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error"
    assert delta(before, counts(cluster)) == {("chat_completions", "500"): 1}
    gauge = cluster.router.router.metrics.in_flight.labels("chat_completions")
    assert cluster.router.call(lambda: gauge._value.get()) == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 100}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once", "stream": True, "max_tokens": 100}),
])
def test_streams_cut_off_by_the_client_are_499(cluster, path, body):
    """The client reads a few events and hangs up while tokens keep coming: 499 every time."""
    cluster.reset()
    for d in cluster.decode:
        d.chunk_size = 1
    endpoint = "chat_completions" if "chat" in path else "completions"
    before = counts(cluster)
    n = 24

    async def cut(h: httpx.AsyncClient, after: int) -> None:
        async with h.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen > after:
                    return  # closes the connection mid-stream

    async def main():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as h:
            await asyncio.gather(*(cut(h, i % 4) for i in range(n)))
    asyncio.run(main())
    gauge = cluster.router.router.metrics.in_flight.labels(endpoint)
    assert wait_for(lambda: cluster.router.call(lambda: gauge._value.get()) == 0)
    assert delta(before, counts(cluster)) == {(endpoint, "499"): n}
    assert wait_for(lambda: not any(d.reservations for d in cluster.decode))


def test_a_disconnect_the_server_saw_before_the_last_byte_is_499():
    """The server learns the client is gone while the rest of the body is ready to go out in one
    go (the app never waits again): the response did not reach the client, so it counts 499."""
    from pdserve.router.accounting import RequestAccounting
    from pdserve.router.metrics import RouterMetrics

    async def app(scope, receive, send):
        listener = asyncio.create_task(receive())  # as a streaming response listens
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        listener.cancel()

    async def run(disconnect_after: int | None) -> str:
        metrics = RouterMetrics()
        gone, sent = asyncio.Event(), 0

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):  # a server's send after the peer left returns at once
            nonlocal sent
            sent += 1
            if sent == disconnect_after:
                gone.set()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
        await RequestAccounting(app, metrics)(scope, receive, send)
        return [s.labels["status"] for f in metrics.requests.collect() for s in f.samples
                if s.name.endswith("_total") and s.value == 1][0]

    assert asyncio.run(run(None)) == "200"
    assert asyncio.run(run(2)) == "499"
    assert asyncio.run(run(3)) == "499"
