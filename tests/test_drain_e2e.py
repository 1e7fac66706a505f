"""Rollout of a decode worker under load, through real processes: told to stop (SIGTERM) while it
streams 10 requests, it finishes every one of them to the last token before it exits, and the
router sends it nothing new meanwhile: later requests go to the other decode worker, and none is
refused by the draining one (a refusal would show as a retried Reserve)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest

from pdserve.launch.serve import ClusterSpec, LocalCluster
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from ports import server_ports

pytestmark = pytest.mark.slow
STREAM_TOKENS = 200


def generate(address: str, prompt: list[int], max_new_tokens: int, out: dict, key) -> None:
    tokens, reason = [], 0
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_new_tokens=max_new_tokens, ignore_eos=True))
        for chunk in pb_grpc.GeneratorStub(channel).Generate(request, timeout=300):
            tokens += chunk.token_ids
            reason = chunk.finish_reason or reason
    out[key] = (len(tokens), reason)


def metric_lines(cluster: LocalCluster, prefix: str) -> list[str]:
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_decode_worker_stopped_under_10_streams_finishes_them_and_gets_nothing_new(tiny_mxfp4, tmp_path, rng):
    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(), decode_workers=2,
                       max_batch_size=16, extra_worker_args=["--drain-timeout", "120"])
    cluster = LocalCluster(spec, tmp_path)
    try:
        # decode-0 has by far the most KV room, so the router places the first 10 streams there
        cluster.start_worker("prefill", 0)
        spec.kv_blocks = 2048
        cluster.start_worker("decode", 0)
        spec.kv_blocks = 160
        cluster.start_worker("decode", 1)
        cluster._wait_ready(["prefill-0", "decode-0", "decode-1"], 180)
        cluster.start_router()
        cluster.wait_healthy(180)
        router = f"127.0.0.1:{spec.grpc_port}"
        draining, other = cluster.addresses["decode-0"], cluster.addresses["decode-1"]

        results: dict = {}
        streams = [threading.Thread(target=generate, args=(
            router, [rng.randrange(1, 50_000) for _ in range(rng.randrange(4, 40))], STREAM_TOKENS, results, i))
            for i in range(10)]
        for t in streams:
            t.start()
        running = f'pdserve_worker_running_requests{{role="decode",worker="{draining}"}}'
        deadline = time.monotonic() + 60
        while not any(line.split()[-1] == "10.0" for line in metric_lines(cluster, running)):
            assert time.monotonic() < deadline, "the 10 streams never all ran on decode-0"
            time.sleep(0.1)
        decode = cluster.procs["decode-0"]
        decode.send_signal(signal.SIGTERM)  # what the kubelet does after the preStop pause
        healthy = f'pdserve_worker_healthy{{role="decode",worker="{draining}"}}'
        deadline = time.monotonic() + 10
        while not any(line.endswith(" 0.0") for line in metric_lines(cluster, healthy)):
            assert time.monotonic() < deadline, "the router never saw decode-0 draining"
            time.sleep(0.05)
        # still there for its streams (its gRPC server waits for them before the process ends)
        assert not any(t.is_alive() for t in streams) or decode.poll() is None

        later: dict = {}
        for i in range(5):
            generate(router, [rng.randrange(1, 50_000) for _ in range(8)], 8, later, i)
        assert later == {i: (8, pb.FINISH_REASON_LENGTH) for i in range(5)}
        for t in streams:
            t.join(300)
        assert results == {i: (STREAM_TOKENS, pb.FINISH_REASON_LENGTH) for i in range(10)}
        assert decode.wait(timeout=60) == 0
        # nothing new reached decode-0: no Reserve was refused and retried, decode-1 took the rest
        assert not metric_lines(cluster, 'pdserve_retries_total{stage="reserve"')
        assert cluster.procs["decode-1"].poll() is None and other != draining
    finally:
        cluster.stop()
