"""The ranks of a prefill worker (a TP group of --tp ranks: 1, 2, 4, 8): what every rank builds
and what the followers run.

Rank 0, the leader (prefill_worker/main.py), starts ranks 1..W-1 as child processes. Each rank
holds its shard of the model (attention heads, experts' intermediate channels, vocabulary), its own
paged KV cache (its KV heads; same block ids everywhere) and its own NIXL agent. Per prompt the
leader broadcasts two commands: "step" (the forward pass, run by all ranks) and, unless the request
was cancelled meanwhile, "push" (the KVPush: every rank writes its heads into the decode ranks
that hold them, waits, and reports); the leader answers Prefill once every rank reported.
"""

from __future__ import annotations

import argparse
import logging
import uuid

log = logging.getLogger("prefill_worker")


def push_report(agent, push, timeout_s: float, abort=None):
    """Run this rank's share of a KVPush; a per-request failure is reported, not raised (the
    group must stay in step): ("ok", bytes) or ("error", message). `abort` (the leader's: a
    Cancel) stops this rank's writes; the other ranks' end within the transfer timeout."""
    from pdserve.kvtransfer import KVTransferError

    from .executor import push_kv

    try:
        return "ok", push_kv(agent, push, timeout_s, abort)
    except KVTransferError as e:
        return "error", f"{type(e).__name__}: {e}"


def kv_staging_bytes(cache, tokens: int) -> int:
    """Room to pack one prompt of up to `tokens` tokens for decode ranks holding fewer KV heads
    than ours (decode TP > prefill TP): its pages (sliding layers: the window's) of every pool,
    whichever decode ranks they are split among (kvtransfer.staging)."""
    if tokens <= 0:
        return 0
    from pdserve.kvtransfer.staging import ALIGN

    pages = -(-tokens // cache.page_size)
    total = 0
    for name, pool in cache.pools.items():
        n = min(pages, cache.sliding_window_pages) if name == "sliding" else pages
        total += n * pool[:, 0].numel() * pool.element_size() + 8 * ALIGN  # (8: regions' alignment)
    return total


def build_rank(a: argparse.Namespace, worker_id: str, group):
    """This rank's share of the worker: its model runner (KV room for the longest prompt plus the
    prefix cache) and its NIXL agent (every rank alike)."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.kvtransfer import KVTransferAgent
    from pdserve.launch.cli import projection_precisions

    from .executor import prefill_kv_blocks

    cfg = ModelConfig.load(a.model)
    blocks = prefill_kv_blocks(cfg, a.page_size, a.prefix_cache_tokens)
    runner = ModelRunner(a.model, device=group.device, precision=a.precision, page_size=a.page_size,
                         num_kv_blocks=blocks, shard=group.shard, prefill_chunk_tokens=a.prefill_chunk_tokens,
                         **projection_precisions(a))
    staging = kv_staging_bytes(runner.cache, min(cfg.max_context, a.kv_staging_tokens))
    agent = KVTransferAgent(f"{worker_id}-r{group.rank}-{uuid.uuid4().hex[:6]}", runner.cache.pools,
                            head_range=group.shard.kv_head_range(cfg.num_key_value_heads),
                            listen_host=a.kv_host or a.host, staging_bytes=staging)
    return runner, agent


# -- followers --------------------------------------------------------------------------------
def follower_main(rank: int, init: str, a: argparse.Namespace, worker_id: str, leader_pid: int) -> None:
    from pdserve.engine.parallel import gather_objects, run_follower

    def setup(group):
        runner, agent = build_rank(a, worker_id, group)
        gather_objects(agent.name, group)
        handlers = {"step": runner.execute, "push": lambda p: push_report(agent, p, a.kv_transfer_timeout)}
        return handlers, agent.close

    run_follower(rank, a.tp, init, leader_pid, 1, a.device, setup)
