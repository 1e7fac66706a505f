"""Run a prefill worker (gRPC): batch-size-1 prompts, KV pushed to decode workers over NIXL."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import uuid

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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-queue", type=int, default=256, help="queued prompts before RESOURCE_EXHAUSTED")
    p.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="queued prompt tokens before RESOURCE_EXHAUSTED")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds one prompt's KV may take to reach its decode worker")
    p.add_argument("--prefix-cache-tokens", type=int, default=65536,
                   help="KV room for cached prompt prefixes beyond the longest prompt (0 = no prefix cache)")
    p.add_argument("--worker-id", default=None, help="name in logs and load reports (none: random)")
    p.add_argument("--ready-file", default=None,
                   help="write {address, ...} here once serving (for launchers)")


def run(a: argparse.Namespace) -> int:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.proto.rpc import (add_health, bind, ensure_port_free, make_server, set_serving,
                                   write_ready_file)

    from .executor import PrefillExecutor, prefill_kv_blocks
    from .server import PrefillService

    ensure_port_free(a.host, a.port)  # before minutes of model loading, not after
    if a.tp != 1:
        from .parallel import run_parallel

        return run_parallel(a)
    worker_id = a.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
    from pdserve.engine.config import ModelConfig

    cfg = ModelConfig.load(a.model)
    blocks = prefill_kv_blocks(cfg.max_context, a.page_size, a.prefix_cache_tokens)
    runner = ModelRunner(a.model, device=a.device, precision=a.precision, page_size=a.page_size,
                         num_kv_blocks=blocks)
    agent = KVTransferAgent(f"{worker_id}-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                            head_range=(0, cfg.num_key_value_heads), listen_host=a.kv_host or a.host)
    executor = PrefillExecutor(runner, agent, max_queue=a.max_queue, max_queued_tokens=a.max_queued_tokens,
                               transfer_timeout_s=a.kv_transfer_timeout,
                               prefix_cache=a.prefix_cache_tokens > 0)
    service = PrefillService(executor, worker_id=worker_id)
    server = make_server(max_workers=a.max_queue + 16)
    pb_grpc.add_PrefillWorkerServicer_to_server(service, server)
    health = add_health(server, SERVICES)
    port = bind(server, a.host, a.port)
    executor.start()
    server.start()
    log.info("prefill worker %s serving on %s:%d", worker_id, a.host, port)
    write_ready_file(a.ready_file, role="prefill", address=f"{a.host}:{port}", worker_id=worker_id)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("prefill worker %s draining", worker_id)
    service.draining = True
    set_serving(health, SERVICES, False)
    server.stop(grace=5.0).wait()
    executor.stop()
    agent.close()
    return 0
