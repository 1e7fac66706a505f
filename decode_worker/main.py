"""Run a decode worker (gRPC): continuous batching, KV admission, token streams."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import uuid

log = logging.getLogger("decode_worker")
SERVICES = ["pdserve.v1.DecodeWorker"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address")
    p.add_argument("--port", type=int, default=50062, help="gRPC port (0 = any free port)")
    p.add_argument("--kv-host", default=None, help="address NIXL/UCX listens on (none: --host)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8"],
                   help="expert weights in compute (none: bf16 on CPU, fp8 on CUDA)")
    p.add_argument("--tp", type=int, default=1, help="ranks of this worker (attention TP)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel groups, dividing --tp (none: --tp, i.e. EP4 TP4 on 4 GPUs)")
    p.add_argument("--max-batch-size", type=int, default=128,
                   help="requests decoded together; more wait (with their KV) for a slot")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="decode batches up to this size replay CUDA graphs captured at start "
                        "(default on CUDA with --tp 1: --max-batch-size; 0 = eager; single-rank only)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks of --page-size tokens (none: sized from free memory)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.85,
                   help="share of the free GPU memory given to KV blocks (without --kv-blocks)")
    p.add_argument("--reservation-ttl", type=float, default=60.0, help="seconds a reservation waits for Decode")
    p.add_argument("--worker-id", default=None, help="name in logs and load reports (none: random)")
    p.add_argument("--ready-file", default=None,
                   help="write {address, ...} here once serving (for launchers)")


def run(a: argparse.Namespace) -> int:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.proto.rpc import (add_health, bind, ensure_port_free, make_server, set_serving,
                                   write_ready_file)

    from .parallel import KVArrivals
    from .scheduler import DecodeScheduler
    from .server import DecodeService

    ensure_port_free(a.host, a.port)  # before minutes of model loading, not after
    if a.max_batch_size < 1 or a.max_batch_size > 1024:
        raise ValueError("--max-batch-size must be in [1, 1024]")
    if a.ep is None:
        a.ep = a.tp
    if a.cuda_graph_max_batch is None:
        a.cuda_graph_max_batch = a.max_batch_size if a.device == "cuda" and a.tp == 1 else 0
    if not 0 <= a.cuda_graph_max_batch <= a.max_batch_size:
        raise ValueError("--cuda-graph-max-batch must be in [0, --max-batch-size]")
    if a.tp != 1 or a.ep != 1:
        from .parallel import run_parallel

        return run_parallel(a)
    worker_id = a.worker_id or f"decode-{uuid.uuid4().hex[:8]}"
    runner = ModelRunner(a.model, device=a.device, precision=a.precision, page_size=a.page_size,
                         num_kv_blocks=a.kv_blocks, kv_memory_fraction=a.kv_memory_fraction,
                         cuda_graph_max_batch=a.cuda_graph_max_batch)
    agent = KVTransferAgent(f"{worker_id}-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                            head_range=(0, runner.cfg.num_key_value_heads), listen_host=a.kv_host or a.host)
    scheduler = DecodeScheduler(runner, max_batch_size=a.max_batch_size)
    arrivals = KVArrivals([agent.head_range])  # complete once every head arrived (any prefill TP)
    scheduler.notification_source = lambda: arrivals.feed(0, agent.take_notifications())
    service = DecodeService(scheduler, agent, worker_id=worker_id, default_ttl_s=a.reservation_ttl)
    server = make_server(max_workers=2 * a.max_batch_size + 64)
    pb_grpc.add_DecodeWorkerServicer_to_server(service, server)
    health = add_health(server, SERVICES)
    port = bind(server, a.host, a.port)
    scheduler.start_loop()
    server.start()
    log.info("decode worker %s serving on %s:%d (%d KV blocks of %d tokens)", worker_id, a.host, port,
             runner.cache.num_total_blocks, runner.cache.page_size)
    write_ready_file(a.ready_file, role="decode", address=f"{a.host}:{port}", worker_id=worker_id)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("decode worker %s draining", worker_id)
    set_serving(health, SERVICES, False)
    service.drain(timeout_s=10.0)
    server.stop(grace=2.0).wait()
    scheduler.stop()
    agent.close()
    return 0
