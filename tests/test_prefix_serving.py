"""Prefix caching and stream migration through the whole CPU cluster (router, 2 prefill + 2 decode
worker processes, NIXL over TCP): conversations go back to the prefill worker that caches them and
report cached tokens; kill -9 of a decode worker under 20 streams loses no stream and no token."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import httpx
import pytest

from pdserve.launch.serve import ClusterSpec, LocalCluster
from ports import server_ports
from test_serving_e2e import wait_kv_drained, worker_loads

pytestmark = pytest.mark.slow
PAGE = 16  # the workers' default page size: only complete pages are cached
MAX_NEW = 32


@pytest.fixture(scope="module")
def cluster(tiny_mxfp4, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(),
                       prefill_workers=2, decode_workers=2, max_batch_size=64, kv_blocks=2048)
    with LocalCluster(spec, tmp_path_factory.mktemp("logs")) as c:
        yield c


def _metric(cluster: LocalCluster, name: str) -> float:
    text = httpx.get(cluster.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(cluster: LocalCluster, prompt: list[int], stream: bool = False) -> dict:
    body = {"model": "gpt-oss", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if not stream:
        r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body.update(stream=True, stream_options={"include_usage": True})
    usage = None
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


def test_conversations_return_to_the_worker_that_caches_them(cluster, rng):
    """Four conversations with their own long system prompt, interleaved turn by turn: every
    turn after the first finds the whole previous prompt (its complete pages) cached, which only
    the worker that ran it has."""
    conversations = [[rng.randrange(201088) for _ in range(rng.randrange(40, 90))] for _ in range(4)]
    cached_before = _metric(cluster, "pdserve_prefill_cached_tokens_total")
    expected, previous = 0, []
    for turn in range(3):
        for i, prompt in enumerate(conversations):
            usage = _complete(cluster, prompt, stream=(turn == 2 and i % 2 == 0))
            want = 0 if turn == 0 else previous[i] // PAGE * PAGE
            assert usage["prompt_tokens_details"]["cached_tokens"] == want, (turn, i)
            expected += want
        previous = [len(p) for p in conversations]
        conversations = [p + [rng.randrange(201088) for _ in range(rng.randrange(5, 30))]
                         for p in conversations]
    assert _metric(cluster, "pdserve_prefill_cached_tokens_total") - cached_before == expected
    assert 0 < _metric(cluster, "pdserve_prefix_cache_hit_rate") < 1
    wait_kv_drained(cluster)  # cached pages are not "used": the prefill workers report them free


def _generate(cluster: LocalCluster, prompt: list[int], seed: int, out: list[int], ended: list[float]) -> None:
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{cluster.spec.grpc_port}") as ch:
        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            temperature=0.9, top_p=0.95, seed=seed, max_new_tokens=MAX_NEW, ignore_eos=True))
        for msg in pb_grpc.GeneratorStub(ch).Generate(req, timeout=300):
            assert not msg.error, msg.error
            out.extend(msg.token_ids)
    ended.append(time.monotonic())


def test_kill_9_of_a_decode_worker_migrates_every_stream(cluster, rng):
    """20 seeded streams; decode-0 is killed once every stream is under way. Every stream still
    ends with all its tokens, continuing its own seeded sequence (compared with an uninterrupted
    run of the same requests), and each moved stream counts as one migration: those decode-0
    ran when it was counted, less any that ended between the count and the kill."""
    prompts = [[rng.randrange(201088) for _ in range(rng.randrange(5, 60))] for _ in range(20)]
    seeds = [rng.randrange(1 << 31) for _ in prompts]

    def run_all(kill: bool) -> tuple[list[list[int]], list[int], int, int]:
        outs, ended = [[] for _ in prompts], [[] for _ in prompts]
        threads = [threading.Thread(target=_generate, args=(cluster, p, s, o, e))
                   for p, s, o, e in zip(prompts, seeds, outs, ended)]
        for t in threads:
            t.start()
        at_kill, moved, ended_meanwhile = [], 0, 0
        if kill:
            assert _wait(lambda: all(len(o) >= 4 for o in outs))
            counted = time.monotonic()
            load = worker_loads(cluster, ("decode-0",))["decode-0"]
            moved = load.running_requests + load.queued_requests
            at_kill = [len(o) for o in outs]
            cluster.kill("decode-0")
            killed = time.monotonic()
        for t in threads:
            t.join(300)
        if kill:  # a stream counted on decode-0 may still finish there before the kill lands
            ended_meanwhile = sum(1 for e in ended if e and counted <= e[0] <= killed + 1.0)
        return outs, at_kill, moved, ended_meanwhile

    migrated_before = _metric(cluster, 'pdserve_migrations_total{outcome="migrated"}')
    reference, *_ = run_all(kill=False)
    assert all(len(o) == MAX_NEW for o in reference)
    # a stream that moved in the uninterrupted run would not be a reference
    assert _metric(cluster, 'pdserve_migrations_total{outcome="migrated"}') == migrated_before
    outs, at_kill, moved, ended_meanwhile = run_all(kill=True)
    assert all(len(o) == MAX_NEW for o in outs), [len(o) for o in outs]
    same = 0
    migrated = _metric(cluster, 'pdserve_migrations_total{outcome="migrated"}') - migrated_before
    for p, o, r, k, seed in zip(prompts, outs, reference, at_kill, seeds):
        # nothing before the kill changed (a stream that moved earlier would show in the log)
        assert o[:k] == r[:k], dict(seed=seed, prompt_tokens=len(p), at_kill=k, first_difference=next(
            j for j in range(k) if o[j] != r[j]), stream=o, reference=r, moved=moved, migrated=migrated,
            router_log=[line for line in cluster.tail("router", 400).splitlines() if "migrat" in line])
        if o == r:
            same += 1
            continue
        # the re-prefilled KV equals the decoded one within bf16 noise, so a sampled token may
        # rarely flip (measured: 1 of 10 moved streams) and the stream goes on from it; a repeated
        # or skipped token would show as the reference shifted by one at the first difference
        i = next(j for j in range(MAX_NEW) if o[j] != r[j])
        assert o[i:i + 3] != r[i - 1:i + 2] and o[i:i + 3] != r[i + 1:i + 4], (i, o, r)
    assert same >= 10, f"only {same} of 20 streams equal the uninterrupted run"
    assert moved >= 1
    assert moved - ended_meanwhile <= migrated <= moved, (migrated, moved, ended_meanwhile)
    assert migrated >= 1
    assert _metric(cluster, 'pdserve_migrations_total{outcome="limit"}') == 0


def _wait(predicate, timeout: float = 120.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False
