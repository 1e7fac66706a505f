"""Prompt logits on a multi-rank worker layout, in processes on this machine (`pdserve logits --tp`).

Spawns `tp` processes that join one process group (gloo on CPU, NCCL on CUDA), each loading only
its shard (`ShardSpec(rank, tp, ep)`) and running the prompt through the paged prefill path; rank
0's float32 logits [L, V] come back. Used to check that every form of parallelism computes the
same function as one rank.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from pdserve.engine.config import DEFAULT_PREFILL_CHUNK


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _rank_main(rank: int, world: int, init_method: str, model_dir: str, ids: list[int], eps: list[int],
               precision: str | None, device: str, out_dir: str, prefill_chunk_tokens: int,
               attention_precision: str, unembedding_precision: str) -> None:
    import torch

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel import ShardSpec, destroy_worker_group, init_worker_group

    torch.set_num_threads(_threads_per_rank(world))
    group = init_worker_group(rank, world, init_method, device=device)
    try:
        for ep in eps:
            shard = ShardSpec(rank, world, ep)
            runner = ModelRunner(model_dir, device=group.device, precision=precision, shard=shard,
                                 num_kv_blocks=PagedKVCache.prompt_blocks(ModelConfig.load(model_dir), len(ids), 16),
                                 prefill_chunk_tokens=prefill_chunk_tokens,
                                 attention_precision=attention_precision,
                                 unembedding_precision=unembedding_precision)
            logits = runner.prompt_logits(ids)
            if rank == 0:
                np.save(Path(out_dir) / f"ep{ep}.npy", logits.float().cpu().numpy())
            del runner
    finally:
        destroy_worker_group()


def parallel_prompt_logits_layouts(model_dir: str, ids: list[int], *, world: int, eps: list[int],
                                   precision: str | None = None, device: str = "cpu",
                                   prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
                                   attention_precision: str = "bf16",
                                   unembedding_precision: str = "bf16") -> dict[int, np.ndarray]:
    """Logits of `ids` for several EP sizes of one world size, from one set of `world` processes:
    ep -> float32 [L, V]. Prompts longer than `prefill_chunk_tokens` run in chunks."""
    import torch.multiprocessing as tmp

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import InvalidRequest
    from pdserve.engine.parallel import check_layout

    cfg = ModelConfig.load(model_dir)
    for ep in eps:
        check_layout(cfg, world, ep)
    if not ids:
        raise InvalidRequest("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    with tempfile.TemporaryDirectory(prefix="pdserve-logits-") as d:
        init = f"file://{Path(d) / 'rendezvous'}"
        tmp.spawn(_rank_main, args=(world, init, str(model_dir), list(ids), list(eps), precision, device, d,
                                             prefill_chunk_tokens, attention_precision, unembedding_precision),
                  nprocs=world, join=True)
        return {ep: np.load(Path(d) / f"ep{ep}.npy") for ep in eps}


def parallel_prompt_logits(model_dir: str, ids: list[int], *, tp: int, ep: int = 1,
                           precision: str | None = None, device: str = "cpu",
                           prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
                           attention_precision: str = "bf16", unembedding_precision: str = "bf16") -> np.ndarray:
    """Float32 logits [L, V] of every prompt position on a worker of `tp` ranks, `ep` expert groups."""
    return parallel_prompt_logits_layouts(model_dir, ids, world=tp, eps=[ep], precision=precision,
                                          device=device, prefill_chunk_tokens=prefill_chunk_tokens,
                                          attention_precision=attention_precision,
                                          unembedding_precision=unembedding_precision)[ep]
