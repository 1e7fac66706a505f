"""Run a decode worker (gRPC): continuous batching, KV admission, token streams.

One code path for any number of ranks (EP x TP; world = --tp ranks, --ep expert groups): rank 0,
the leader, is the decode worker everyone talks to (gRPC server, reservations, block bookkeeping,
continuous batching and sampling) and starts ranks 1..W-1 (decode_worker/parallel.py) as child
processes; a one-rank worker is a group of one.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid

from pdserve.launch.cli import CLIError, add_projection_precision_args
from pdserve.proto.lifecycle import add_worker_process_args

log = logging.getLogger("decode_worker")
SERVICES = ["pdserve.v1.DecodeWorker"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address")
    p.add_argument("--port", type=int, default=50062, help="gRPC port (0 = any free port)")
    p.add_argument("--kv-host", default=None, help="address NIXL/UCX listens on (none: --host)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8", "mxfp4"],
                   help="expert weights in compute (none: bf16 on CPU, fp8 on CUDA); mxfp4: as published, "
                        "--tp 1 only, the fastest single-stream decode on an H200 but slower than fp8 from a "
                        "few concurrent requests (docs/performance.md)")
    add_projection_precision_args(p)
    p.add_argument("--tp", type=int, default=1, help="ranks of this worker (attention TP)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel groups, dividing --tp (none: --tp, i.e. EP4 TP4 on 4 GPUs)")
    p.add_argument("--max-batch-size", type=int, default=128,
                   help="requests decoded together; more wait (with their KV) for a slot")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="decode batches up to this size replay CUDA graphs captured at start "
                        "(default on CUDA with --tp 1: --max-batch-size; 0 = eager; with --tp > 1 only "
                        "when given: multi-rank capture is not yet proven on GPUs)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks, each a --page-size page of the full-attention or of the sliding-window "
                        "layers; a request takes one for each page of the first and a window's worth of the second "
                        "(none: sized from free memory)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.85,
                   help="share of the free GPU memory given to KV blocks (without --kv-blocks)")
    p.add_argument("--reservation-ttl", type=float, default=60.0, help="seconds a reservation waits for Decode")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a request's KV transfer may run, from the prefill worker's start of "
                        "it, before the request fails (keep >= the prefill workers' own)")
    add_worker_process_args(p)


def run(a: argparse.Namespace) -> int:
    import multiprocessing as mp

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.parallel import ShardSpec, check_layout, gather_objects, start_group
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.kvtransfer.selftest import run_selftest
    from pdserve.proto.lifecycle import WorkerLifecycle
    from pdserve.proto.rpc import ensure_port_free, make_server

    from .parallel import build_rank, follower_main, unpack_on_every_rank
    from .scheduler import DecodeScheduler
    from .server import DecodeService

    ensure_port_free(a.host, a.port)  # before minutes of model loading, not after
    if a.max_batch_size < 1 or a.max_batch_size > 1024:
        raise ValueError("--max-batch-size must be in [1, 1024]")
    if a.kv_transfer_timeout <= 0:
        raise ValueError("--kv-transfer-timeout must be positive")
    if a.ep is None:
        a.ep = a.tp
    if a.precision == "mxfp4" and a.tp > 1:
        raise CLIError("--precision mxfp4 keeps the experts as published on one rank: use --tp 1")
    if a.cuda_graph_max_batch is None:
        a.cuda_graph_max_batch = a.max_batch_size if a.device == "cuda" and a.tp == 1 else 0
    if not 0 <= a.cuda_graph_max_batch <= a.max_batch_size:
        raise ValueError("--cuda-graph-max-batch must be in [0, --max-batch-size]")
    cfg = ModelConfig.load(a.model)
    check_layout(cfg, a.tp, a.ep)
    world = a.tp
    worker_id = a.worker_id or f"decode-{uuid.uuid4().hex[:8]}"
    life = WorkerLifecycle("decode", SERVICES, drain_timeout_s=a.drain_timeout)
    pipes = {r: mp.get_context("spawn").Pipe(duplex=False) for r in range(1, world)}  # follower -> leader
    leader = start_group(world, a.ep, a.device, follower_main, lambda r: (a, worker_id, os.getpid(), pipes[r][1]))
    for r in pipes:
        pipes[r][1].close()  # the leader keeps only the reading ends (EOF when a follower dies)
    leader.on_fatal(life.fatal)
    group = leader.group
    runner, agent = build_rank(a, worker_id, group)
    runner.group = leader
    rank_agents = gather_objects((agent.name, agent.peer_info()), group)

    # a request's KV is present once every head of every rank arrived (whatever the prefill TP)
    head_ranges = [ShardSpec(r, world, a.ep).kv_head_range(cfg.num_key_value_heads) for r in range(world)]
    readers = {r: pipes[r][0] for r in pipes}

    def notifications() -> list[tuple[int, bytes]]:
        out = [(0, n) for n in agent.take_notifications()]
        for r, conn in list(readers.items()):
            try:
                while conn.poll():
                    out += [(r, n) for n in conn.recv()]
            except (EOFError, OSError):  # the follower died: the rank watcher takes the worker down
                del readers[r]
        return out

    scheduler = DecodeScheduler(runner, max_batch_size=a.max_batch_size, head_ranges=head_ranges,
                                transfer_timeout_s=a.kv_transfer_timeout)
    scheduler.notification_source = notifications
    scheduler.kv_unpack = unpack_on_every_rank(leader, agent)
    service = DecodeService(scheduler, agent, worker_id=worker_id, default_ttl_s=a.reservation_ttl,
                            rank_agents=rank_agents)
    if a.kv_selftest_mib > 0:
        service.kv_selftest_bytes_per_second = run_selftest(group.device, a.kv_selftest_mib << 20,
                                                            a.kv_host or a.host)
    server = make_server(max_workers=2 * a.max_batch_size + 64)
    pb_grpc.add_DecodeWorkerServicer_to_server(service, server)

    def teardown() -> None:
        scheduler.stop()
        leader.shutdown()
        agent.close()

    layout = f", {world} ranks (attention TP {world}, experts EP {a.ep} x TP {world // a.ep})" if world > 1 else ""
    return life.serve(server, service, host=a.host, port=a.port, ready_file=a.ready_file, worker_id=worker_id,
                      start=scheduler.start_loop, teardown=teardown, on_fatal_exit=leader.shutdown,
                      describe=f"{layout} ({runner.cache.num_total_blocks} KV blocks of {runner.cache.page_size} tokens)",
                      rank_pids=leader.procs.pids if leader.procs else [])
