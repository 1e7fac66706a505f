"""A decode worker on several ranks (EP x TP; world = --tp ranks, --ep expert groups).

Rank 0, the leader, is the decode worker everyone talks to: gRPC server, reservations, block
bookkeeping, continuous batching and sampling, exactly as on one rank. It starts ranks 1..W-1 as
child processes. Every rank holds the model's shard for its (ep, tp) place, its own paged KV cache
(its KV heads; the same block ids everywhere since only the leader allocates) and its own NIXL
agent; Reserve hands out one KVPlacement per rank. Each decode step the leader broadcasts the
step's plan and all ranks run the same forward.

KV arrival: prefill ranks write into the decode ranks whose KV heads they share; every write's
notification names the request and the heads it carried (kvtransfer.notify).
Followers forward their notifications to the leader over a pipe; `KVArrivals` declares a request's
KV present once every rank's heads are covered, whatever the prefill worker's TP.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import threading
import time
import uuid

from pdserve.kvtransfer.notify import parse_kv_notification

log = logging.getLogger("decode_worker")


def _covers(got: list[tuple[int, int]], want: tuple[int, int]) -> bool:
    reach = want[0]
    for lo, hi in sorted(got):
        if lo > reach:
            return False
        reach = max(reach, hi)
        if reach >= want[1]:
            return True
    return reach >= want[1]


class KVArrivals:
    """Tracks which heads of each request reached each rank; reports requests complete on all.

    head_ranges : global KV heads [lo, hi) of each rank of this worker, by rank.
    Partial arrivals of requests that never complete (cancelled mid-transfer) are dropped after
    `ttl_s`. Called from one thread (the scheduler loop).
    """

    def __init__(self, head_ranges: list[tuple[int, int]], ttl_s: float = 600.0):
        self.head_ranges = list(head_ranges)
        self.ttl_s = ttl_s
        self._got: dict[str, tuple[float, list[list[tuple[int, int]]]]] = {}

    def feed(self, rank: int, notifs) -> list[str]:
        """Record rank `rank`'s notifications; returns the request ids now complete."""
        done = []
        now = time.monotonic()
        for n in notifs:
            rid, heads = parse_kv_notification(n)
            entry = self._got.setdefault(rid, (now, [[] for _ in self.head_ranges]))
            entry[1][rank].append(heads or self.head_ranges[rank])
            if all(_covers(g, want) for g, want in zip(entry[1], self.head_ranges)):
                del self._got[rid]
                done.append(rid)
        if self._got:
            for rid in [r for r, (t, _) in self._got.items() if now - t > self.ttl_s]:
                del self._got[rid]
        return done


# -- leader -----------------------------------------------------------------------------------
def run_parallel(a: argparse.Namespace) -> int:
    import multiprocessing as mp

    import torch

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel import (LeaderGroup, RankProcesses, ShardSpec, check_layout, cpu_threads_per_rank,
                                 destroy_worker_group, gather_objects, init_worker_group, rendezvous_dir)
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.proto import pdserve_pb2_grpc as pb_grpc
    from pdserve.proto.rpc import add_health, bind, make_server, set_serving, write_ready_file

    from .main import SERVICES
    from .scheduler import DecodeScheduler
    from .server import DecodeService

    cfg = ModelConfig.load(a.model)
    check_layout(cfg, a.tp, a.ep)
    world = a.tp
    worker_id = a.worker_id or f"decode-{uuid.uuid4().hex[:8]}"
    if a.device == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world))
    rdv = rendezvous_dir()
    init = f"file://{os.path.join(rdv, 'store')}"
    ctx = mp.get_context("spawn")
    pipes = {r: ctx.Pipe(duplex=False) for r in range(1, world)}  # follower -> leader notifications
    procs = RankProcesses(world, _follower_main, lambda r: (a, worker_id, init, os.getpid(), pipes[r][1]))
    procs.start()
    for r in pipes:
        pipes[r][1].close()  # the leader keeps only the reading ends (EOF when a follower dies)

    group = init_worker_group(0, world, init, ep_size=a.ep, device=a.device)
    runner = ModelRunner(a.model, device=group.device, precision=a.precision, page_size=a.page_size,
                         num_kv_blocks=a.kv_blocks, kv_memory_fraction=a.kv_memory_fraction, shard=group.shard,
                         cuda_graph_max_batch=a.cuda_graph_max_batch)
    agent = KVTransferAgent(f"{worker_id}-r0-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                            head_range=group.shard.kv_head_range(cfg.num_key_value_heads),
                            listen_host=a.kv_host or a.host)
    rank_agents = gather_objects((agent.name, agent.peer_info()), group)
    leader = LeaderGroup(group, procs)
    runner.group = leader

    arrivals = KVArrivals([ShardSpec(r, world, a.ep).kv_head_range(cfg.num_key_value_heads) for r in range(world)])
    readers = {r: pipes[r][0] for r in pipes}

    def notifications() -> list[str]:
        done = arrivals.feed(0, agent.take_notifications())
        for r, conn in list(readers.items()):
            try:
                while conn.poll():
                    done += arrivals.feed(r, conn.recv())
            except (EOFError, OSError):  # the follower died: the rank watcher takes the worker down
                del readers[r]
        return done

    scheduler = DecodeScheduler(runner, max_batch_size=a.max_batch_size)
    scheduler.notification_source = notifications
    service = DecodeService(scheduler, agent, worker_id=worker_id, default_ttl_s=a.reservation_ttl,
                            rank_agents=rank_agents)
    server = make_server(max_workers=2 * a.max_batch_size + 64)
    pb_grpc.add_DecodeWorkerServicer_to_server(service, server)
    health = add_health(server, SERVICES)
    port = bind(server, a.host, a.port)

    stop = threading.Event()
    exit_code = [0]

    def on_fatal(reason: str) -> None:
        set_serving(health, SERVICES, False)
        exit_code[0] = 1
        stop.set()

    leader.on_fatal(on_fatal)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    scheduler.start_loop()
    server.start()
    log.info("decode worker %s serving on %s:%d: %d ranks (attention TP %d, experts EP %d x TP %d), "
             "%d KV blocks of %d tokens", worker_id, a.host, port, world, world, a.ep, world // a.ep,
             runner.cache.num_total_blocks, runner.cache.page_size)
    write_ready_file(a.ready_file, role="decode", address=f"{a.host}:{port}", worker_id=worker_id,
                     rank_pids=procs.pids)
    stop.wait()
    set_serving(health, SERVICES, False)
    if leader.failed is not None:  # the scheduler may sit in a broken collective: do not wait for it
        server.stop(grace=1.0).wait()
        leader.shutdown()
        shutil.rmtree(rdv, ignore_errors=True)
        log.error("decode worker %s stopped after a rank failure: %s", worker_id, leader.failed)
        logging.shutdown()
        os._exit(exit_code[0])
    log.info("decode worker %s draining", worker_id)
    service.drain(timeout_s=10.0)
    server.stop(grace=2.0).wait()
    scheduler.stop()
    leader.shutdown()
    agent.close()
    shutil.rmtree(rdv, ignore_errors=True)
    destroy_worker_group()
    return exit_code[0]


# -- followers --------------------------------------------------------------------------------
def _forward_notifications(agent, conn, stop: threading.Event) -> None:
    """Poll this rank's agent (which also drives its transport) and pass arrivals to the leader."""
    while not stop.is_set():
        try:
            msgs = agent.take_notifications()
            if msgs:
                conn.send(msgs)
        except Exception as e:  # noqa: BLE001 - agent closed or leader gone: the rank is ending
            if not stop.is_set():
                log.error("forwarding KV notifications stopped: %s", e)
            return
        time.sleep(0.001)


def _follower_main(rank: int, a: argparse.Namespace, worker_id: str, init: str, leader_pid: int, conn) -> None:
    import torch

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel import (cpu_threads_per_rank, destroy_worker_group, follow, gather_objects,
                                 init_worker_group, rendezvous_dir_of, watch_parent)
    from pdserve.kvtransfer import KVTransferAgent

    for sig in (signal.SIGTERM, signal.SIGINT):  # the leader decides when ranks stop
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    watch_parent(leader_pid, cleanup_dir=rendezvous_dir_of(init))
    stop = threading.Event()
    agent = None
    try:
        if a.device == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(a.tp))
        cfg = ModelConfig.load(a.model)
        group = init_worker_group(rank, a.tp, init, ep_size=a.ep, device=a.device)
        runner = ModelRunner(a.model, device=group.device, precision=a.precision, page_size=a.page_size,
                             num_kv_blocks=a.kv_blocks, kv_memory_fraction=a.kv_memory_fraction, shard=group.shard,
                             cuda_graph_max_batch=a.cuda_graph_max_batch)
        agent = KVTransferAgent(f"{worker_id}-r{rank}-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                                head_range=group.shard.kv_head_range(cfg.num_key_value_heads),
                                listen_host=a.kv_host or a.host)
        gather_objects((agent.name, agent.peer_info()), group)
        threading.Thread(target=_forward_notifications, args=(agent, conn, stop), name="kv-notifs",
                         daemon=True).start()
        follow(group, {"step": runner.execute})
    except BaseException:
        log.exception("decode rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    stop.set()
    agent.close()
    destroy_worker_group()
