"""A prefill worker on a TP group of --tp ranks (1, 2, 4, 8).

Rank 0, the leader, is the prefill worker everyone talks to: gRPC server, queue, block bookkeeping,
first-token sampling, exactly as on one rank. It starts ranks 1..W-1 as child processes. Each rank
holds its shard of the model (attention heads, experts' intermediate channels, vocabulary), its own
paged KV cache (its KV heads; same block ids everywhere) and its own NIXL agent. Per prompt the
leader broadcasts two commands: "step" (the forward pass, run by all ranks) and, unless the request
was cancelled meanwhile, "push" (the KVPush: every rank writes its heads into the decode ranks
that hold them, waits, and reports); the leader answers Prefill once every rank reported.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import threading
import uuid

log = logging.getLogger("prefill_worker")


def _push_report(agent, push, timeout_s: float):
    """Run this rank's share of a KVPush; a per-request failure is reported, not raised (the
    group must stay in step): ("ok", bytes) or ("error", message)."""
    from pdserve.kvtransfer import KVTransferError

    from .executor import push_kv

    try:
        return "ok", push_kv(agent, push, timeout_s)
    except KVTransferError as e:
        return "error", f"{type(e).__name__}: {e}"


def _make_runner(a: argparse.Namespace, group):
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner

    from .executor import prefill_kv_blocks

    cfg = ModelConfig.load(a.model)
    blocks = prefill_kv_blocks(cfg.max_context, a.page_size, a.prefix_cache_tokens)
    return ModelRunner(a.model, device=group.device, precision=a.precision, page_size=a.page_size,
                       num_kv_blocks=blocks, shard=group.shard)


def _make_agent(a: argparse.Namespace, worker_id: str, runner, group):
    from pdserve.kvtransfer import KVTransferAgent

    return KVTransferAgent(f"{worker_id}-r{group.rank}-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                           head_range=group.shard.kv_head_range(runner.cfg.num_key_value_heads),
                           listen_host=a.kv_host or a.host)


# -- leader -----------------------------------------------------------------------------------
def run_parallel(a: argparse.Namespace) -> int:
    import torch

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.parallel import (LeaderGroup, RankProcesses, check_layout, cpu_threads_per_rank,
                                 destroy_worker_group, gather_objects, init_worker_group, rendezvous_dir)
    from pdserve.kvtransfer import KVTransferError
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.proto.rpc import add_health, bind, make_server, set_serving, write_ready_file

    from .executor import PrefillExecutor
    from .main import SERVICES
    from .server import PrefillService

    world = a.tp
    check_layout(ModelConfig.load(a.model), world, 1)
    worker_id = a.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
    if a.device == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world))
    rdv = rendezvous_dir()
    init = f"file://{os.path.join(rdv, 'store')}"
    procs = RankProcesses(world, _follower_main, lambda r: (a, worker_id, init, os.getpid()))
    procs.start()

    group = init_worker_group(0, world, init, device=a.device)
    runner = _make_runner(a, group)
    agent = _make_agent(a, worker_id, runner, group)
    gather_objects(agent.name, group)  # every rank is up
    leader = LeaderGroup(group, procs)
    runner.group = leader
    executor = PrefillExecutor(runner, agent, max_queue=a.max_queue, max_queued_tokens=a.max_queued_tokens,
                               transfer_timeout_s=a.kv_transfer_timeout,
                               prefix_cache=a.prefix_cache_tokens > 0)

    def push_on_all_ranks(push) -> int:
        reports = leader.call("push", push, lambda p: _push_report(agent, p, a.kv_transfer_timeout),
                              want_reply=True)
        errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(reports) if status != "ok"]
        if errors:
            raise KVTransferError("; ".join(errors))
        return sum(n for _, n in reports)

    executor.push = push_on_all_ranks
    service = PrefillService(executor, worker_id=worker_id)
    server = make_server(max_workers=a.max_queue + 16)
    pb_grpc.add_PrefillWorkerServicer_to_server(service, server)
    health = add_health(server, SERVICES)
    port = bind(server, a.host, a.port)

    stop = threading.Event()
    exit_code = [0]

    def on_fatal(reason: str) -> None:
        service.draining = True
        set_serving(health, SERVICES, False)
        exit_code[0] = 1
        stop.set()

    leader.on_fatal(on_fatal)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    executor.start()
    server.start()
    log.info("prefill worker %s serving on %s:%d: TP %d", worker_id, a.host, port, world)
    write_ready_file(a.ready_file, role="prefill", address=f"{a.host}:{port}", worker_id=worker_id,
                     rank_pids=procs.pids)
    stop.wait()
    log.info("prefill worker %s stopping", worker_id)
    service.draining = True
    set_serving(health, SERVICES, False)
    if leader.failed is not None:  # the executor may sit in a broken collective: do not wait for it
        server.stop(grace=1.0).wait()
        leader.shutdown()
        shutil.rmtree(rdv, ignore_errors=True)
        log.error("prefill worker %s stopped after a rank failure: %s", worker_id, leader.failed)
        logging.shutdown()
        os._exit(exit_code[0])
    server.stop(grace=5.0).wait()
    executor.stop()
    leader.shutdown()
    agent.close()
    shutil.rmtree(rdv, ignore_errors=True)
    destroy_worker_group()
    return exit_code[0]


# -- followers --------------------------------------------------------------------------------
def _follower_main(rank: int, a: argparse.Namespace, worker_id: str, init: str, leader_pid: int) -> None:
    import torch

    from pdserve.engine.parallel import (cpu_threads_per_rank, destroy_worker_group, follow, gather_objects,
                                 init_worker_group, rendezvous_dir_of, watch_parent)

    for sig in (signal.SIGTERM, signal.SIGINT):  # the leader decides when ranks stop
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    watch_parent(leader_pid, cleanup_dir=rendezvous_dir_of(init))
    agent = None
    try:
        if a.device == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(a.tp))
        group = init_worker_group(rank, a.tp, init, device=a.device)
        runner = _make_runner(a, group)
        agent = _make_agent(a, worker_id, runner, group)
        gather_objects(agent.name, group)
        follow(group, {"step": runner.execute,
                       "push": lambda p: _push_report(agent, p, a.kv_transfer_timeout)})
    except BaseException:
        log.exception("prefill rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    agent.close()
    destroy_worker_group()
