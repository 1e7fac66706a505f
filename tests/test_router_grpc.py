"""The public gRPC API: pdserve.v1.Generator/Generate (token ids in, streamed ids out) + health."""

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pbg
from router_harness import Cluster, codec, wait_for

MODEL = "gpt-oss-test"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(script=[1], max_context=2048)
    yield c
    c.close()


@pytest.fixture
def stub(cluster):
    channel = grpc.insecure_channel(cluster.router.grpc_address)
    yield pbg.GeneratorStub(channel)
    channel.close()


def new_script(cluster, length=40):
    stop = codec().stop_token_ids()[0]
    script = [random.randrange(0, 199_000) for _ in range(length)] + [stop]
    cluster.reset(script)
    return script


def sampling(**kw):
    return pb.SamplingParams(stop_token_ids=codec().stop_token_ids(), **kw)


def test_generate_streams_token_ids(cluster, stub):
    script = new_script(cluster)
    prompt = [random.randrange(0, 199_000) for _ in range(random.randrange(5, 50))]
    responses = list(stub.Generate(pb.GenerateRequest(
        request_id="my-request-1", model=MODEL, prompt_token_ids=prompt,
        sampling=sampling(temperature=0.5, max_new_tokens=500)), timeout=10))
    ids = [t for r in responses for t in r.token_ids]
    assert ids == script  # the stop token is included, as the contract says
    assert len(responses) > 2
    assert all(r.request_id == "my-request-1" for r in responses)
    assert [r.finish_reason for r in responses[:-1]] == [0] * (len(responses) - 1)
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    totals = [r.completion_tokens for r in responses]
    assert totals == sorted(totals) and totals[-1] == len(script)
    assert all(r.prompt_tokens == len(prompt) for r in responses)
    prefill = next(p for p in cluster.prefill if p.requests)
    assert list(prefill.requests[0].prompt_token_ids) == prompt
    assert prefill.requests[0].request_id == "my-request-1"


def test_generate_defaults_and_length(cluster, stub):
    script = new_script(cluster)
    responses = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                      sampling=sampling(max_new_tokens=7))))
    assert [t for r in responses for t in r.token_ids] == script[:7]
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[0].request_id.startswith("gen-")
    # max_new_tokens unset: as many as the context leaves, up to the default budget
    (last, *_) = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7])))
    (reserve,) = [r for d in cluster.decode for r in d.reserve_requests
                  if r.request_id == last.request_id]
    assert reserve.max_new_tokens == 2048 - 3


@pytest.mark.parametrize("request_kwargs,code", [
    ({"prompt_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1, -2]}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1], "model": "other"}, grpc.StatusCode.NOT_FOUND),
    ({"prompt_token_ids": [1], "sampling": pb.SamplingParams(max_new_tokens=-1)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1], "sampling": pb.SamplingParams(temperature=9)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": list(range(3000))}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1], "sampling": pb.SamplingParams(grammar="start: %json{\"type\": \"nope\"}")},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1], "request_id": "a|b#0:8"}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1], "request_id": "x" * 129}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"prompt_token_ids": [1], "request_id": "caf\u00e9"}, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_generate_rejects_bad_requests(cluster, stub, request_kwargs, code):
    new_script(cluster)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(**request_kwargs), timeout=10))
    assert info.value.code() == code
    assert info.value.details()


def test_generate_refuses_a_request_id_in_flight_and_the_first_finishes(cluster, stub):
    """A caller's id names the request on every worker (reservation, KV, Cancel): a second Generate
    with an id in flight gets ALREADY_EXISTS and the first streams to its end, untouched; once it
    has ended, the id can be used again."""
    script = new_script(cluster, length=60)
    for d in cluster.decode:
        d.chunk_size, d.token_delay = 1, 0.01
    first = stub.Generate(pb.GenerateRequest(request_id="shared-id", prompt_token_ids=[1, 2],
                                             sampling=sampling(max_new_tokens=500)), timeout=10)
    received = [next(first)]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(request_id="shared-id", prompt_token_ids=[3]), timeout=10))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS and "shared-id" in info.value.details()
    received += list(first)
    assert [t for r in received for t in r.token_ids] == script
    assert received[-1].finish_reason == pb.FINISH_REASON_STOP
    assert not any("shared-id" in d.cancelled for d in cluster.decode)
    again = list(stub.Generate(pb.GenerateRequest(request_id="shared-id", prompt_token_ids=[1, 2],
                                                  sampling=sampling(max_new_tokens=5)), timeout=10))
    assert again[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_generate_backpressure_has_retry_after(cluster, stub):
    new_script(cluster)
    for d in cluster.decode:
        d.refuse_reserve = True
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3]), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(info.value.trailing_metadata())["retry-after"]) >= 1


def test_generate_cancel_reaches_both_workers(cluster, stub):
    new_script(cluster, length=200)
    for d in cluster.decode:
        d.chunk_size, d.token_delay = 1, 0.02
    call = stub.Generate(pb.GenerateRequest(request_id="to-cancel", prompt_token_ids=[1, 2]),
                         timeout=10)
    received = [next(call) for _ in range(3)]
    assert all(r.finish_reason == 0 for r in received)
    call.cancel()
    decode = next(d for d in cluster.decode if d.decode_requests)
    prefill = next(p for p in cluster.prefill if p.requests)
    assert wait_for(lambda: "to-cancel" in decode.cancelled and "to-cancel" in prefill.cancelled)


def test_generate_cancel_is_immediate_without_garbage_collection(cluster, stub):
    """A cancelled Generate closes its event stream itself (aclosing), so Cancel reaches the
    workers even when no garbage collection ever runs."""
    import gc

    new_script(cluster, length=2000)
    for d in cluster.decode:
        d.chunk_size, d.token_delay = 1, 0.0  # the router is mostly busy writing tokens
    gc.collect()
    gc.disable()
    try:
        for i in range(10):
            rid = f"no-gc-{i}"
            call = stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2]),
                                 timeout=10)
            next(call), next(call)  # the second one comes from decode
            call.cancel()
            decode = next(d for d in cluster.decode if any(r.request_id == rid for r in d.decode_requests))
            assert wait_for(lambda: rid in decode.cancelled, timeout=3), rid
    finally:
        gc.enable()


def test_generate_decode_death_ends_with_error_message():
    stop = codec().stop_token_ids()[0]
    cluster = Cluster(script=list(range(100, 160)) + [stop], decode_kv_blocks=[8192, 1024],
                      router_config={"max_migrations": 0})
    try:
        cluster.decode[0].die_after_chunks = 2
        channel = grpc.insecure_channel(cluster.router.grpc_address)
        responses = list(pbg.GeneratorStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling()), timeout=10))
        channel.close()
        assert [t for r in responses[:-1] for t in r.token_ids] == list(range(100, 105))
        assert responses[-1].finish_reason == pb.FINISH_REASON_ERROR
        assert "failed mid-stream" in responses[-1].error
    finally:
        cluster.close()


def test_generate_decode_death_migrates_the_stream():
    """With migration the token stream goes on from the other decode worker, each token once."""
    stop = codec().stop_token_ids()[0]
    script = list(range(100, 160)) + [stop]
    cluster = Cluster(script=script, decode_kv_blocks=[8192, 1024])
    try:
        cluster.decode[0].die_after_chunks = 2
        channel = grpc.insecure_channel(cluster.router.grpc_address)
        responses = list(pbg.GeneratorStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling()), timeout=10))
        channel.close()
        assert [t for r in responses for t in r.token_ids] == script
        assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
        assert responses[-1].completion_tokens == len(script)
    finally:
        cluster.close()


def test_router_grpc_health(cluster):
    channel = grpc.insecure_channel(cluster.router.grpc_address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Generator"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
