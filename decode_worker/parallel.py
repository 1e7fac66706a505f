"""The ranks of a decode worker (EP x TP; world = --tp ranks, --ep expert groups): what the
followers run, and how the leader learns that a request's KV arrived on all of them.

Rank 0, the leader (decode_worker/main.py), starts ranks 1..W-1 as child processes. Every rank
holds the model's shard for its (ep, tp) place, its own paged KV cache (its KV heads; the same
block ids everywhere since only the leader allocates) and its own NIXL agent; Reserve hands out one KVPlacement per rank. Each decode step the leader broadcasts the
step's plan and all ranks run the same forward.

KV arrival: prefill ranks write into the decode ranks whose KV heads they share; every write's
notification names the request and the heads it carried (kvtransfer.notify).
Followers forward their notifications to the leader over a pipe; the leader's scheduler declares a
request's KV present once every rank's heads are covered, whatever the prefill worker's TP.
Re-sharded writes (prefill TP > decode TP) are put in place by every rank on the leader's command
(`unpack_on_every_rank`), never by a rank on its own: only the leader knows whether the request
still holds the blocks (kvtransfer.reshard).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid

log = logging.getLogger("decode_worker")


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


def build_rank(a: argparse.Namespace, worker_id: str, group):
    """This rank's share of the worker: its model runner and its NIXL agent (every rank alike)."""
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.launch.cli import projection_precisions

    runner = ModelRunner(a.model, device=group.device, precision=a.precision, page_size=a.page_size,
                         num_kv_blocks=a.kv_blocks, kv_memory_fraction=a.kv_memory_fraction, shard=group.shard,
                         cuda_graph_max_batch=a.cuda_graph_max_batch, **projection_precisions(a))
    agent = KVTransferAgent(f"{worker_id}-r{group.rank}-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                            head_range=group.shard.kv_head_range(runner.cfg.num_key_value_heads),
                            listen_host=a.kv_host or a.host, unpack_on_arrival=False)
    return runner, agent


def unpack_on_every_rank(leader, agent):
    """The scheduler's `kv_unpack`: rank 0's agent and, by a command, every follower's put the
    requests' slotted KV in place; returns once all ranks have (their replies are gathered)."""
    return lambda requests: leader.call("kv_unpack", requests, agent.unpack, want_reply=True)


def rank_commands(runner, agent) -> dict:
    """What a follower rank runs when the leader says so (`engine.parallel.follow`)."""
    return {"step": runner.execute, "kv_unpack": agent.unpack}


def follower_main(rank: int, init: str, a: argparse.Namespace, worker_id: str, leader_pid: int, conn) -> None:
    from pdserve.engine.parallel import gather_objects, run_follower

    def setup(group):
        runner, agent = build_rank(a, worker_id, group)
        gather_objects((agent.name, agent.peer_info()), group)
        stop = threading.Event()
        threading.Thread(target=_forward_notifications, args=(agent, conn, stop), name="kv-notifs",
                         daemon=True).start()

        def cleanup() -> None:
            stop.set()
            agent.close()

        return rank_commands(runner, agent), cleanup

    run_follower(rank, a.tp, init, leader_pid, a.ep, a.device, setup)
