"""Worker deaths, client disconnects and timeouts: retries, error events, Cancel on both sides."""

import json
import signal
import subprocess
import threading
import sys
from pathlib import Path

import httpx
import openai
import pytest

from ports import free_ports
from router_harness import Cluster, harmony_ids, wait_for

MODEL = "gpt-oss-test"
USER = [{"role": "user", "content": "Tell me a story."}]
STORY = " ".join(f"word{i}" for i in range(150))
SCRIPT = f"<|channel|>final<|message|>{STORY}<|return|>"


def routable(cluster, worker) -> bool:
    """Whether the router would send new requests to this fake worker now."""
    role = "prefill" if worker in cluster.prefill else "decode"
    registry = cluster.router.router.registry
    return cluster.router.call(lambda: any(
        w.routable for w in registry.workers(role) if w.endpoint.address == worker.address))


def client_for(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=10)


@pytest.mark.parametrize("how", ["die", "unavailable"])
def test_prefill_worker_failure_is_retried_on_another(how):
    # prefill-0 reports the shorter queue, so it is tried first
    cluster = Cluster(script=harmony_ids(SCRIPT), prefill_queued=[0, 5000])
    try:
        first, second = cluster.prefill
        first.mode = how
        r = client_for(cluster).chat.completions.create(model=MODEL, messages=USER)
        assert r.choices[0].message.content == STORY
        assert len(first.requests) == 1 and len(second.requests) == 1
        a, b = first.requests[0], second.requests[0]
        assert a.request_id == b.request_id == r.id
        assert list(a.placements) == list(b.placements)  # same KV reservation, reused
        assert not routable(cluster, first) and routable(cluster, second)
        # the next request goes straight to the survivor
        client_for(cluster).chat.completions.create(model=MODEL, messages=USER)
        assert len(first.requests) == 1 and len(second.requests) == 2
        metrics = httpx.get(cluster.base_url + "/metrics").text
        assert 'pdserve_retries_total{code="UNAVAILABLE",stage="prefill"} 1.0' in metrics
    finally:
        cluster.close()


def test_decode_worker_dying_mid_stream_without_migration():
    # decode-0 has more free blocks, so it is picked first; probes are rare here, so only the
    # request path can tell the router that decode-0 died
    cluster = Cluster(script=harmony_ids(SCRIPT), decode_kv_blocks=[8192, 2048],
                      router_config={"probe_interval": 60.0, "max_migrations": 0})
    try:
        doomed, survivor = cluster.decode
        doomed.chunk_size, doomed.die_after_chunks = 4, 3
        stream = client_for(cluster).chat.completions.create(model=MODEL, messages=USER,
                                                             stream=True)
        content = []
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    content.append(chunk.choices[0].delta.content)
        assert "decode worker" in str(info.value).lower()
        assert content and STORY.startswith("".join(content)) and "".join(content) != STORY
        assert doomed.decode_requests and not survivor.decode_requests
        assert not routable(cluster, doomed)

        r = client_for(cluster).chat.completions.create(model=MODEL, messages=USER)
        assert r.choices[0].message.content == STORY
        assert len(survivor.decode_requests) == 1 and len(doomed.decode_requests) == 1
        metrics = httpx.get(cluster.base_url + "/metrics").text
        assert "pdserve_worker_failures_total" in metrics
        assert f'pdserve_worker_healthy{{role="decode",worker="{doomed.address}"}} 0.0' in metrics
    finally:
        cluster.close()


def test_kv_transfer_failure_moves_the_request_to_another_decode_worker():
    cluster = Cluster(script=harmony_ids(SCRIPT), decode_kv_blocks=[8192, 2048])
    try:
        unreachable, other = cluster.decode
        for p in cluster.prefill:
            p.unreachable_decode = unreachable.name
        r = client_for(cluster).chat.completions.create(model=MODEL, messages=USER)
        assert r.choices[0].message.content == STORY
        assert [q.request_id for q in unreachable.reserve_requests] == [r.id]
        assert [q.request_id for q in other.decode_requests] == [r.id]
        assert wait_for(lambda: r.id in unreachable.cancelled)  # its reservation is given back
        assert not routable(cluster, unreachable)
    finally:
        cluster.close()


@pytest.mark.parametrize("stream", [True, False])
def test_decode_worker_dying_mid_stream_migrates(stream):
    """The stream goes on from the survivor: prompt + streamed tokens re-prefilled, the same
    text with nothing repeated or skipped, one migration counted."""
    script = harmony_ids(SCRIPT)
    cluster = Cluster(script=script, decode_kv_blocks=[8192, 2048],
                      router_config={"probe_interval": 60.0})
    try:
        doomed, survivor = cluster.decode
        doomed.chunk_size, doomed.die_after_chunks = 4, 3
        client = client_for(cluster)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=USER, stream=True) if c.choices)
        else:
            r = client.chat.completions.create(model=MODEL, messages=USER)
            text = r.choices[0].message.content
            assert r.usage.completion_tokens == len(script)
        assert text == STORY
        [moved] = survivor.decode_requests
        streamed = 1 + 3 * 4  # prefill's token, then three chunks of four
        assert moved.num_generated == streamed
        assert list(moved.generated_token_ids) == script[:streamed]  # the prompt's tail, not the prompt
        resumed = [p for w in cluster.prefill for p in w.requests if p.num_generated]
        assert [p.num_generated for p in resumed] == [streamed]
        assert list(resumed[0].prompt_token_ids[-streamed:]) == script[:streamed]
        assert moved.num_prompt_tokens == len(resumed[0].prompt_token_ids)
        assert resumed[0].sampling.seed == moved.sampling.seed
        metrics = httpx.get(cluster.base_url + "/metrics").text
        assert 'pdserve_migrations_total{outcome="migrated"} 1.0' in metrics
    finally:
        cluster.close()


def test_migration_limit_ends_the_stream():
    cluster = Cluster(script=harmony_ids(SCRIPT), decode_kv_blocks=[8192, 2048],
                      router_config={"probe_interval": 60.0, "max_migrations": 1})
    try:
        for worker in cluster.decode:
            worker.chunk_size, worker.die_after_chunks = 4, 2
        stream = client_for(cluster).chat.completions.create(model=MODEL, messages=USER,
                                                             stream=True)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        metrics = httpx.get(cluster.base_url + "/metrics").text
        assert 'pdserve_migrations_total{outcome="migrated"} 1.0' in metrics
        assert 'pdserve_migrations_total{outcome="limit"} 1.0' in metrics
    finally:
        cluster.close()


def test_decode_worker_dying_non_streamed_is_502():
    cluster = Cluster(script=harmony_ids(SCRIPT), decode_kv_blocks=[8192, 2048],
                      router_config={"max_migrations": 0})
    try:
        for d in cluster.decode:  # whichever the router picks (it may not know the KV sizes yet)
            d.die_after_chunks = 1
        r = httpx.post(cluster.base_url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": USER}, timeout=10)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "decode_failed"
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(script=harmony_ids(SCRIPT))
    yield c
    c.close()


def test_client_disconnect_mid_stream_cancels_both_workers(cluster):
    cluster.reset()
    for d in cluster.decode:
        d.chunk_size, d.token_delay = 1, 0.02
    with httpx.stream("POST", cluster.base_url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": USER, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        events = (json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: "))
        received = [next(events) for _ in range(6)]  # role, then decode tokens
        rid = received[0]["id"]
        assert received[-1]["choices"][0]["finish_reason"] is None
    # the connection is closed here, mid-stream
    prefill = next(p for p in cluster.prefill if p.requests)
    decode = next(d for d in cluster.decode if d.decode_requests)
    assert decode.decode_requests[0].request_id == rid
    assert wait_for(lambda: rid in decode.cancelled and rid in prefill.cancelled)
    assert wait_for(lambda: not decode.reservations)


def test_client_disconnect_before_first_token_cancels_both_workers(cluster):
    cluster.reset()
    for p in cluster.prefill:
        p.mode = "hang"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": USER}, timeout=0.5)
    prefill = next(p for p in cluster.prefill if p.requests)
    rid = prefill.requests[0].request_id
    decode = next(d for d in cluster.decode if d.reserve_requests)
    assert wait_for(lambda: rid in prefill.cancelled and rid in decode.cancelled)
    assert not decode.decode_requests


def test_request_timeout_is_504_and_frees_the_workers(cluster):
    cluster.reset()
    config = cluster.router.router.config
    cluster.router.call(lambda: setattr(config, "request_timeout", 0.5))
    try:
        for p in cluster.prefill:
            p.mode = "hang"
        r = httpx.post(cluster.base_url + "/v1/completions",
                       json={"model": MODEL, "prompt": "Once upon a time"}, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        prefill = next(p for p in cluster.prefill if p.requests)
        decode = next(d for d in cluster.decode if d.reserve_requests)
        rid = prefill.requests[0].request_id
        assert wait_for(lambda: rid in prefill.cancelled and rid in decode.cancelled)
    finally:
        cluster.router.call(lambda: setattr(config, "request_timeout", 600.0))


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_cli_serves_and_shuts_down_on_sigterm(cluster):
    cluster.reset()
    repo = Path(__file__).resolve().parents[1]
    for _ in range(3):  # on fresh ports if another process took one between choosing and binding
        port, grpc_port = free_ports(2)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.router.main", "--port", str(port), "--grpc-port", str(grpc_port),
             "--served-model-name", MODEL, "--discovery", "static",
             "--prefill", ",".join(p.address for p in cluster.prefill),
             "--decode", cluster.decode[0].address, "--decode", cluster.decode[1].address],
            cwd=repo,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: proc.poll() is not None or _healthy(port), timeout=30)
        if proc.poll() is None:
            break
        output = proc.stdout.read()
        assert "address already in use" in output, output
    try:
        assert _healthy(port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"model": MODEL, "messages": USER}, timeout=10)
        assert r.json()["choices"][0]["message"]["content"] == STORY
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_graceful_shutdown_lets_streams_finish():
    cluster = Cluster(script=harmony_ids(SCRIPT), router_config={"graceful_shutdown_timeout": 10})
    try:
        for d in cluster.decode:
            d.chunk_size, d.token_delay = 1, 0.005
        stream = client_for(cluster).chat.completions.create(model=MODEL, messages=USER,
                                                             stream=True)
        chunks = iter(stream)
        content = [next(chunks).choices[0].delta.content for _ in range(3)]
        closer = threading.Thread(target=cluster.router.close)
        closer.start()  # SIGTERM-like: stop accepting, finish what is in flight
        assert wait_for(lambda: _refuses_connections(cluster.base_url), timeout=5)
        content += [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(content) == STORY
        closer.join(15)
        assert not closer.is_alive()
    finally:
        cluster.close()


def _refuses_connections(base_url: str) -> bool:
    try:
        httpx.get(base_url + "/health", timeout=1)
        return False
    except httpx.TransportError:
        return True


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once", "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": "Once", "stream": True}),
])
def test_disconnect_before_the_stream_starts_leaves_nothing_behind(cluster, path, body):
    """The client is gone when the streamed body would start: the ASGI server never iterates the
    body, yet the workers get Cancel, the in-flight gauge returns to zero and the request is
    counted (499) once."""
    import asyncio

    cluster.reset()
    for d in cluster.decode:
        d.chunk_size, d.token_delay = 1, 0.02
    router = cluster.router.router
    endpoint = path.removeprefix("/v1/").replace("chat/", "chat_")
    gauge = router.metrics.in_flight.labels(endpoint)
    closed = router.metrics.requests.labels(endpoint, "499")
    before = cluster.router.call(lambda: (gauge._value.get(), closed._value.get()))
    raw = json.dumps(body).encode()

    async def call_app():
        sent, receives, gone = [], 0, asyncio.Event()

        async def receive():
            # 1: the body; 2: the router's disconnect watcher (waits); 3: the streaming response
            # listening for a disconnect, which it gets at once, before the first chunk
            nonlocal receives
            receives += 1
            if receives == 1:
                return {"type": "http.request", "body": raw, "more_body": False}
            if receives == 2:
                await gone.wait()
            gone.set()
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0)  # a real server's send yields to the loop (and sees the cancel)
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await router.app(scope, receive, send)
        return sent

    sent = asyncio.run_coroutine_threadsafe(call_app(), cluster.router._loop).result(10)
    assert not any(m["type"] == "http.response.body" and m.get("body") for m in sent)
    prefill = next(p for p in cluster.prefill if p.requests)
    rid = prefill.requests[-1].request_id
    decode = next(d for d in cluster.decode if d.reserve_requests)
    assert wait_for(lambda: rid in decode.cancelled)
    assert wait_for(lambda: not decode.reservations)
    assert wait_for(lambda: cluster.router.call(lambda: gauge._value.get()) == before[0])
    assert cluster.router.call(lambda: closed._value.get()) == before[1] + 1
