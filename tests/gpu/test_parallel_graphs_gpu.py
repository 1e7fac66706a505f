"""2-rank decode replayed from CUDA graphs (NCCL collectives captured in the graph) equals the
same ranks' eager run of the same padded step, bit for bit, for TP2 and EP2 x TP1, while the
batch changes size and requests cross pages and the 128-token window.

Each rank is a spawned process on its own GPU running the same steps (as a decode worker's ranks
do from the leader's plans); the ranks capture every size up front (engine/cuda_graphs.py).
Needs 2 GPUs; skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL TP2 / EP2)")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset

    # gpt-oss attention geometry (64 q / 8 kv heads, window 128) on narrower, fewer layers
    cfg = dataclasses.replace(preset("20b"), hidden_size=640, intermediate_size=768, num_hidden_layers=4,
                              num_local_experts=8, layer_types=())
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "graphs2", cfg, seed=0)


def _rank(rank: int, ckpt: str, ep: int, init: str, out: str) -> None:
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.parallel import destroy_worker_group, init_worker_group
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    group = init_worker_group(rank, 2, init, ep_size=ep, device="cuda", timeout_s=300)
    try:
        runner = ModelRunner(ckpt, device=group.device, shard=group.shard, num_kv_blocks=512,
                             cuda_graph_max_batch=8)
        dg = runner.decode_graphs
        assert dg is not None and sorted(dg._steps) == [1, 2, 4, 8]
        gen = torch.Generator().manual_seed(0)
        lens, steps = [5, 130, 300, 17, 64, 15], [30, 12, 25, 3, 8, 20]
        seqs = []
        for i, (n, m) in enumerate(zip(lens, steps)):
            s = Sequence(f"r{i}", torch.randint(0, 201088, (n,), generator=gen).tolist(),
                         SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True))
            s.blocks = runner.cache.reserve(s.max_tokens, n)
            s.append(int(runner.prefill(s).argmax()), (), runner.max_context)
            seqs.append(s)
        checked, equal = 0, 0
        while seqs:
            replay = runner.decode(seqs)
            eager = dg._forward(dg._steps[dg.size_for(len(seqs))])[: len(seqs)]
            checked += 1
            equal += int(torch.equal(replay, eager))
            keep = []
            for s, t in zip(seqs, replay.argmax(-1).tolist()):
                if s.append(t, (), runner.max_context):
                    runner.cache.release(s.blocks)
                else:
                    keep.append(s)
            seqs = keep
        Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": checked, "equal": equal}))
    finally:
        destroy_worker_group()


@pytest.mark.parametrize("ep", [1, 2], ids=["TP2", "EP2xTP1"])
def test_two_rank_graph_replay_equals_eager(ckpt, ep, tmp_path):
    import torch.multiprocessing as tmp_mp

    tmp_mp.spawn(_rank, args=(str(ckpt), ep, f"file://{tmp_path / 'rdv'}", str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"[parallel-graphs] {'TP2' if ep == 1 else 'EP2xTP1'}: {got}")
    assert got[0] == got[1] and got[0]["steps"] >= 30 and got[0]["equal"] == got[0]["steps"]
