"""The worker lifecycle (proto/lifecycle.py) both roles run: a stop request drains (health
NOT_SERVING, new work refused, accepted work finishes up to --drain-timeout), a second one ends the
drain at once; and real workers of both roles drain that way on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto.lifecycle import WorkerLifecycle
from pdserve.proto.rpc import make_server


class FakeService:
    def __init__(self, in_flight: int):
        self.draining = False
        self.work = in_flight

    def in_flight(self) -> int:
        return self.work


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def serve_in_background(life: WorkerLifecycle, service: FakeService, tmp_path, events: list):
    """Run `life.serve` on this (main) thread while `drive(address)` runs on another."""
    ready = tmp_path / "ready"

    def run(drive):
        def driver():
            for _ in range(500):
                if ready.is_file():
                    break
                time.sleep(0.01)
            drive(json.loads(ready.read_text())["address"])

        t = threading.Thread(target=driver, daemon=True)
        t.start()
        code = life.serve(make_server(4), service, host="127.0.0.1", port=0, ready_file=str(ready),
                          worker_id="w0", start=lambda: events.append("start"),
                          teardown=lambda: events.append("teardown"),
                          on_fatal_exit=lambda: events.append("fatal"))
        t.join(5)
        return code
    return run


def test_stop_drains_accepted_work_then_tears_down(tmp_path):
    life = WorkerLifecycle("decode", ["pdserve.v1.DecodeWorker"], drain_timeout_s=60)
    service, events, seen = FakeService(in_flight=2), [], {}

    def drive(address):
        assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
        life.request_stop()  # SIGTERM
        time.sleep(0.3)
        seen["draining"], seen["health"] = service.draining, health_status(address)
        seen["teardown_early"] = "teardown" in events
        service.work = 0  # the streams finished

    code = serve_in_background(life, service, tmp_path, events)(drive)
    assert code == 0
    assert seen == {"draining": True, "health": health_pb2.HealthCheckResponse.NOT_SERVING,
                    "teardown_early": False}
    assert events == ["start", "teardown"]


def test_drain_ends_at_the_timeout_or_at_a_second_signal(tmp_path):
    for second_signal in (False, True):
        life = WorkerLifecycle("prefill", ["pdserve.v1.PrefillWorker"],
                               drain_timeout_s=60 if second_signal else 0.5)
        service, events = FakeService(in_flight=1), []  # never finishes

        def drive(address):
            life.request_stop()
            if second_signal:
                time.sleep(0.2)
                life.request_stop()

        t0 = time.monotonic()
        (tmp_path / str(second_signal)).mkdir()
        assert serve_in_background(life, service, tmp_path / str(second_signal), events)(drive) == 0
        assert time.monotonic() - t0 < 10
        assert events == ["start", "teardown"] and service.draining


def test_signal_handlers_are_restored_after_serving(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    life = WorkerLifecycle("decode", ["pdserve.v1.DecodeWorker"], drain_timeout_s=1)
    serve_in_background(life, FakeService(0), tmp_path, [])(lambda address: os.kill(os.getpid(), signal.SIGTERM))
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_caught_by_another_thread_still_stops_the_worker(tmp_path):
    """The kernel may hand a process's SIGTERM to any thread that does not block it (gRPC's, UCX's,
    the engine's): CPython then runs the handler only when the main thread next runs Python code, so
    a main thread asleep in an unbounded wait would never drain (a real decode worker once ignored a
    SIGTERM until the next signal came). Here the signal lands on the driver thread; if the worker
    has not stopped 5 s later, a second SIGTERM aimed at the main thread ends it, and the test fails."""
    life = WorkerLifecycle("decode", ["pdserve.v1.DecodeWorker"], drain_timeout_s=1)
    service, events, seen = FakeService(in_flight=0), [], {}

    def drive(address):
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # this (non-main) thread takes it
        t0 = time.monotonic()
        while "teardown" not in events and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        seen["stopped_in_time"] = "teardown" in events
        if not seen["stopped_in_time"]:
            os.kill(os.getpid(), signal.SIGTERM)  # unblock the main thread: the test has failed

    assert serve_in_background(life, service, tmp_path, events)(drive) == 0
    assert seen == {"stopped_in_time": True}


def test_drain_timeout_must_not_be_negative():
    with pytest.raises(ValueError, match="--drain-timeout"):
        WorkerLifecycle("decode", [], drain_timeout_s=-1)


@pytest.mark.slow
def test_sigterm_drains_a_real_decode_worker(tiny_mxfp4, tmp_path):
    """SIGTERM mid-stream: the decode worker says NOT_SERVING and draining, refuses a new
    reservation, finishes the stream it holds to the last token, then exits 0."""
    from pdserve.launch.serve import ClusterSpec, LocalCluster
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from ports import server_ports

    spec = ClusterSpec(model=str(tiny_mxfp4), **server_ports(), kv_blocks=512,
                       extra_worker_args=["--drain-timeout", "120"])
    with LocalCluster(spec, tmp_path) as cluster:
        decode = cluster.procs["decode-0"]
        with grpc.insecure_channel(f"127.0.0.1:{spec.grpc_port}") as ch:
            req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4, 5],
                                     sampling=pb.SamplingParams(max_new_tokens=300, ignore_eos=True))
            stream = pb_grpc.GeneratorStub(ch).Generate(req, timeout=300)
            tokens, reason = list(next(stream).token_ids), 0
            decode.send_signal(signal.SIGTERM)
            address = cluster.addresses["decode-0"]
            for _ in range(100):
                if health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.05)
            with grpc.insecure_channel(address) as wch:
                stub = pb_grpc.DecodeWorkerStub(wch)
                assert stub.Load(pb.LoadRequest(), timeout=5).draining
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Reserve(pb.ReserveRequest(request_id="new", num_prompt_tokens=4, max_new_tokens=4),
                                 timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert decode.poll() is None  # still streaming
            for msg in stream:
                tokens += msg.token_ids
                reason = msg.finish_reason or reason
        assert (len(tokens), reason) == (300, pb.FINISH_REASON_LENGTH)
        assert decode.wait(timeout=30) == 0


def test_fatal_refuses_everything_and_skips_the_drain(tmp_path):
    """A rank died: whichever role, the service refuses work and health says NOT_SERVING at once,
    accepted work is not waited for, and the other ranks are stopped before the process exits."""
    for role in ("decode", "prefill"):
        life = WorkerLifecycle(role, [f"pdserve.v1.{role.title()}Worker"], drain_timeout_s=60)
        service, seen = FakeService(in_flight=5), {}
        ready = tmp_path / f"{role}.ready"

        class Exited(Exception):
            pass

        def stop_ranks():  # the last step before os._exit(1)
            seen["draining"] = service.draining
            raise Exited

        def kill_a_rank():
            while not ready.is_file():
                time.sleep(0.01)
            address = json.loads(ready.read_text())["address"]
            with grpc.insecure_channel(address) as ch:  # a watcher, as a readiness probe
                watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""),
                                                             timeout=10)
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
                life.fatal("rank 1 (pid 42) exited with code -9")
                seen["health"] = next(watch).status

        t = threading.Thread(target=kill_a_rank, daemon=True)
        t.start()
        with pytest.raises(Exited):
            life.serve(make_server(4), service, host="127.0.0.1", port=0, ready_file=str(ready),
                       worker_id="w0", start=lambda: None, teardown=lambda: None, on_fatal_exit=stop_ranks)
        t.join(5)
        assert seen == {"draining": True, "health": health_pb2.HealthCheckResponse.NOT_SERVING}
        assert life.failed.startswith("rank 1")


def test_a_group_of_one_runs_commands_locally_and_survives_their_failure():
    from pdserve.engine.parallel import start_group

    leader = start_group(1, 1, "cpu", follower=None, args_for=None)
    assert leader.procs is None and leader.group.shard.world_size == 1
    assert leader.call("step", 3, lambda x: x * 2, want_reply=True) == [6]

    def broken(_):
        raise RuntimeError("one bad request")

    with pytest.raises(RuntimeError):
        leader.call("step", 0, broken, want_reply=False)
    assert leader.failed is None  # alone, a failed command is that command's failure
    assert leader.call("step", 1, lambda x: x, want_reply=False) == 1
    leader.shutdown()
