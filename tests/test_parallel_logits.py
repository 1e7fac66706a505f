"""Every parallel layout computes the TP=1 function.

In-process: the MoE's TP dispatch/combine (each rank's local experts over its intermediate slice,
down bias once) sums exactly to the full layer, each rank reads only its slice of the checkpoint,
and vocabulary shards are equal-sized. Multi-process (gloo): prompt logits of TP2 (through the CLI),
TP4, EP2 x TP2 and EP4 x TP1 workers against one rank.

Tolerances of the multi-process comparison. The layouts differ from one rank only in rounding:
each rank's partial attention output and partial expert output is rounded to bf16 before the
float32 all-reduce (one rank rounds the whole sum once). Measured on these random models this
gives ~1e-2 relative L2 per position, the same size as our bf16 engine's distance from the float32
reference (7.6e-3, docs/engine.md). Positions where the router's 4th and 5th expert logits are
within that rounding pick a different expert and move by 0.1-0.2 (a few percent of positions, on
one rank's run as much as on another's). Hence: median per-position error <= 2e-2, at most 15% of
positions above 5e-2, argmax equal on >= 85% of positions. Structural mistakes are not rounding:
the exact in-process checks below catch a misplaced bias or channel at 1e-5.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pdserve.engine.checkpoint import CheckpointReader, load_weights
from pdserve.engine.parallel import ShardSpec
from pdserve.kernels.experts import experts_forward_ref, route

LAYOUTS_4 = [(4, 1), (4, 2), (4, 4)]  # (world, ep): TP4, EP2 x TP2, EP4 x TP1


@pytest.fixture(scope="module")
def odd_vocab_ckpt(tmp_path_factory, tiny_cfg):
    """The tiny model with a vocabulary no TP degree divides (the last shard is padded)."""
    from pdserve.engine.checkpoint_writer import make_random_checkpoint

    cfg = dataclasses.replace(tiny_cfg, vocab_size=50021)
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-v50021", cfg, seed=5)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- in process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world,ep", [(2, 1), *LAYOUTS_4])
def test_moe_dispatch_combine_sums_to_the_full_layer(odd_vocab_ckpt, tiny_cfg, world, ep):
    """Replicated input, full routing on every rank, local experts x intermediate slice per rank:
    the sum of the ranks' outputs (what the one all-reduce computes) is the full MoE layer.
    Computed in float32 so that only summation order differs."""
    cfg = dataclasses.replace(tiny_cfg, vocab_size=50021)
    full = load_weights(odd_vocab_ckpt, cfg).layers[2][1]
    shards = [load_weights(odd_vocab_ckpt, cfg, shard=ShardSpec(r, world, ep)).layers[2][1] for r in range(world)]
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(world * 10 + ep))
    weights, ids = route(x.bfloat16(), full.router_weight, full.router_bias, cfg.experts_per_token)
    weights = weights.float()
    want = experts_forward_ref(x, weights, ids, full.experts, cfg.swiglu_limit, cfg.swiglu_alpha)
    got = sum(experts_forward_ref(x, weights, ids, m.experts, cfg.swiglu_limit, cfg.swiglu_alpha) for m in shards)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # each expert lives in exactly one EP group, each channel on one rank of its group
    assert sorted(m.experts.first_expert for m in shards) == sorted(
        (r // (world // ep)) * (cfg.num_local_experts // ep) for r in range(world))
    # the down bias is added once per expert: by the first rank of its group
    assert sum(int(m.experts.down_bias.any()) for m in shards) == ep


def test_each_rank_reads_only_its_slice(odd_vocab_ckpt, tiny_cfg, monkeypatch):
    """Counting every byte load_weights takes from the files: a rank of EP2 x TP2 reads a quarter
    of the experts (plus, for the down projection, the 32-channel MXFP4 groups its 80-channel
    slice straddles), a quarter of the attention heads and of the vocabulary."""
    read: dict[str, int] = {}
    orig = CheckpointReader.get

    def counting(self, name, **kw):
        t = orig(self, name, **kw)
        read[name] = read.get(name, 0) + t.numel() * t.element_size()
        return t

    monkeypatch.setattr(CheckpointReader, "get", counting)
    cfg = dataclasses.replace(tiny_cfg, vocab_size=50021)
    load_weights(odd_vocab_ckpt, cfg)
    whole = dict(read)

    def share(counts: dict[str, int], kind: str) -> float:
        pick = {
            "experts": lambda n: ".mlp.experts." in n and "bias" not in n,
            "attention": lambda n: n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")),
            "vocab": lambda n: n in ("model.embed_tokens.weight", "lm_head.weight"),
        }[kind]
        return sum(v for n, v in counts.items() if pick(n)) / sum(v for n, v in whole.items() if pick(n))

    for r in range(4):
        read.clear()
        load_weights(odd_vocab_ckpt, cfg, shard=ShardSpec(r, 4, ep_size=2))
        assert share(read, "experts") <= 0.28  # 0.25 gate_up, 0.30 down (3 of 5 groups for half)
        assert share(read, "attention") == pytest.approx(0.25)
        assert share(read, "vocab") == pytest.approx(0.25, abs=1e-4)


def test_vocab_shards_are_equal_and_padded(odd_vocab_ckpt):
    from pdserve.engine.config import ModelConfig

    cfg = ModelConfig.load(odd_vocab_ckpt)
    full = load_weights(odd_vocab_ckpt, cfg)
    parts = [load_weights(odd_vocab_ckpt, cfg, shard=ShardSpec(r, 4)) for r in range(4)]
    rows = -(-cfg.vocab_size // 4)
    assert all(p.unembedding.shape == (rows, cfg.hidden_size) for p in parts)
    assert torch.equal(torch.cat([p.unembedding for p in parts])[: cfg.vocab_size], full.unembedding)
    assert torch.equal(torch.cat([p.embedding for p in parts])[: cfg.vocab_size], full.embedding)
    assert not parts[-1].unembedding[cfg.vocab_size - 3 * rows:].any()  # padding rows are zero


# -- multi-process ------------------------------------------------------------------------------
def assert_same_function(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape and got.dtype == np.float32
    per_pos = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    msg = f"per-position rel L2 {np.round(per_pos, 3)}, argmax agreement {agree:.2f}"
    assert np.median(per_pos) <= 2e-2, msg
    assert (per_pos > 5e-2).mean() <= 0.15, msg
    assert agree >= 0.85, msg


@pytest.fixture(scope="module")
def reference(odd_vocab_ckpt):
    from pdserve.engine.model_runner import ModelRunner

    ids = _prompt(40, 50021, 0)  # crosses the 16-token window and two pages
    return ids, ModelRunner(str(odd_vocab_ckpt), precision="bf16", num_kv_blocks=8).prompt_logits(ids).numpy()


@pytest.mark.slow
def test_cli_logits_tp2_matches_tp1(odd_vocab_ckpt, reference, tmp_path):
    """`pdserve logits --tp 2 --ep 1` (two gloo processes) against one rank."""
    from pdserve.launch.cli import main

    ids, ref = reference
    out = tmp_path / "tp2.npy"
    assert main(["logits", "--model", str(odd_vocab_ckpt), "--prompt-ids", ",".join(map(str, ids)),
                 "--out", str(out), "--tp", "2", "--ep", "1", "--precision", "bf16"]) == 0
    assert_same_function(np.load(out), ref)


@pytest.mark.slow
def test_four_rank_layouts_match_tp1(odd_vocab_ckpt, reference):
    """TP4, EP2 x TP2 and EP4 x TP1, from one set of four processes."""
    from pdserve.launch.parallel_logits import parallel_prompt_logits_layouts

    ids, ref = reference
    out = parallel_prompt_logits_layouts(str(odd_vocab_ckpt), ids, world=4, eps=[ep for _, ep in LAYOUTS_4],
                                         precision="bf16")
    for _, ep in LAYOUTS_4:
        assert_same_function(out[ep], ref)


def test_layouts_the_model_cannot_split_are_refused(odd_vocab_ckpt):
    from pdserve.engine.config import ConfigError
    from pdserve.launch.parallel_logits import parallel_prompt_logits

    with pytest.raises(ConfigError, match="num_key_value_heads"):
        parallel_prompt_logits(str(odd_vocab_ckpt), [1, 2, 3], tp=8, ep=1)
    with pytest.raises(ConfigError, match="divide"):
        parallel_prompt_logits(str(odd_vocab_ckpt), [1, 2, 3], tp=4, ep=3)
