"""Run a prefill worker (gRPC): batch-size-1 prompts, KV pushed to decode workers over NIXL.

One code path for any number of ranks (a TP group of --tp ranks): rank 0, the leader, is the
prefill worker everyone talks to (gRPC server, queue, block bookkeeping, first-token sampling) and
starts ranks 1..W-1 (prefill_worker/parallel.py) as child processes; a one-rank worker is a group
of one.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid

from pdserve.launch.cli import add_prefill_chunk_arg, add_projection_precision_args
from pdserve.proto.lifecycle import add_worker_process_args

log = logging.getLogger("prefill_worker")
SERVICES = ["pdserve.v1.PrefillWorker"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address")
    p.add_argument("--port", type=int, default=50061, help="gRPC port (0 = any free port)")
    p.add_argument("--kv-host", default=None, help="address NIXL/UCX listens on (none: --host)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8"],
                   help="expert weights in compute (none: bf16 on CPU, fp8 on CUDA)")
    add_projection_precision_args(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-queue", type=int, default=256, help="queued prompts before RESOURCE_EXHAUSTED")
    p.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="queued prompt tokens before RESOURCE_EXHAUSTED")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds one prompt's KV may take to reach its decode worker")
    p.add_argument("--prefix-cache-tokens", type=int, default=65536,
                   help="KV room for cached prompt prefixes beyond the longest prompt (0 = no prefix cache)")
    p.add_argument("--kv-staging-tokens", type=int, default=32768,
                   help="prompts up to this long go to decode workers of a larger TP as a few large "
                        "writes through a staging buffer of their KV's size (0 = none; longer prompts: "
                        "one write per token row)")
    add_prefill_chunk_arg(p)
    add_worker_process_args(p)


def run(a: argparse.Namespace) -> int:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.parallel import check_layout, gather_objects, start_group
    from pdserve.kvtransfer import KVTransferError
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.kvtransfer.selftest import run_selftest
    from pdserve.proto.lifecycle import WorkerLifecycle
    from pdserve.proto.rpc import ensure_port_free, make_server

    from .executor import PrefillExecutor
    from .parallel import build_rank, follower_main, push_report
    from .server import PrefillService

    ensure_port_free(a.host, a.port)  # before minutes of model loading, not after
    world = a.tp
    check_layout(ModelConfig.load(a.model), world, 1)
    worker_id = a.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
    life = WorkerLifecycle("prefill", SERVICES, drain_timeout_s=a.drain_timeout)
    leader = start_group(world, 1, a.device, follower_main, lambda r: (a, worker_id, os.getpid()))
    leader.on_fatal(life.fatal)
    runner, agent = build_rank(a, worker_id, leader.group)
    gather_objects(agent.name, leader.group)  # every rank is up
    runner.group = leader
    executor = PrefillExecutor(runner, agent, max_queue=a.max_queue, max_queued_tokens=a.max_queued_tokens,
                               transfer_timeout_s=a.kv_transfer_timeout,
                               prefix_cache=a.prefix_cache_tokens > 0)

    def push_on_all_ranks(push) -> int:
        """Every rank writes its KV heads into the decode ranks that hold them."""
        reports = leader.call("push", push,
                              lambda p: push_report(agent, p, a.kv_transfer_timeout, executor.current_abort()),
                              want_reply=True)
        errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(reports) if status != "ok"]
        if errors:
            raise KVTransferError("; ".join(errors))
        return sum(n for _, n in reports)

    executor.push = push_on_all_ranks
    service = PrefillService(executor, worker_id=worker_id)
    if a.kv_selftest_mib > 0:
        service.kv_selftest_bytes_per_second = run_selftest(leader.group.device, a.kv_selftest_mib << 20,
                                                            a.kv_host or a.host)
    server = make_server(max_workers=a.max_queue + 16)
    pb_grpc.add_PrefillWorkerServicer_to_server(service, server)

    def teardown() -> None:
        executor.stop()
        leader.shutdown()
        agent.close()

    return life.serve(server, service, host=a.host, port=a.port, ready_file=a.ready_file, worker_id=worker_id,
                      start=executor.start, teardown=teardown, on_fatal_exit=leader.shutdown,
                      describe=f": TP {world}" if world > 1 else "",
                      rank_pids=leader.procs.pids if leader.procs else [])
