"""Checkpoint layout, MXFP4 decoding, FP8 128x128 conversion and sharded reads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.engine.checkpoint import CheckpointError, CheckpointReader, load_weights
from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.parallel import ShardSpec
from pdserve.kernels.fp8 import (dequantize_weight_fp8, pad_intermediate, quantize_weight_fp8,
                         quantize_weight_fp8_exact)
from pdserve.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def test_layout_matches_published_checkpoints(tiny_mxfp4, tiny_cfg):
    r = CheckpointReader(tiny_mxfp4)
    index = json.loads((tiny_mxfp4 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded like the real ones
    E, H, I = tiny_cfg.num_local_experts, tiny_cfg.hidden_size, tiny_cfg.intermediate_size
    p = "model.layers.0.mlp.experts."
    assert r.shape(p + "gate_up_proj_blocks") == (E, 2 * I, H // 32, 16)
    assert r.shape(p + "gate_up_proj_scales") == (E, 2 * I, H // 32)
    assert r.shape(p + "down_proj_blocks") == (E, H, I // 32, 16)
    assert r.get(p + "down_proj_scales").dtype == torch.uint8
    assert r.get("model.layers.0.self_attn.sinks").dtype == torch.bfloat16
    cfg = json.loads((tiny_mxfp4 / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert ModelConfig.load(tiny_mxfp4) == tiny_cfg


def test_mxfp4_decoding_bit_exact_against_reference(tiny_mxfp4):
    weights = pytest.importorskip("gpt_oss.torch.weights")
    ref = weights.Checkpoint(str(tiny_mxfp4), torch.device("cpu"))
    r = CheckpointReader(tiny_mxfp4)
    for layer in (0, 3):
        for proj in ("gate_up_proj", "down_proj"):
            p = f"model.layers.{layer}.mlp.experts.{proj}"
            theirs = ref._get_mxfp4_tensor(p + "_blocks", p + "_scales", dtype=torch.bfloat16)
            ours = dequantize_mxfp4(r.get(p + "_blocks"), r.get(p + "_scales"))
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_mxfp4_round_trip():
    w = torch.randn(3, 64, 96) * 0.05
    blocks, scales = quantize_mxfp4(w)
    once = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(once), torch.float32), once)  # idempotent
    assert float((once - w).norm() / w.norm()) < 0.2  # 3-bit magnitudes: coarse but close


def test_fp8_block_quantisation_ragged_edges():
    w = torch.randn(2, 300, 2880) * 0.02  # neither dim a multiple of 128; 2880 ends in a 64 block
    q, s = quantize_weight_fp8(w)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn and s.shape == (2, 3, 23)
    err = float((dequantize_weight_fp8(q, s) - w).norm() / w.norm())
    assert 0 < err < 0.04  # e4m3: 3 mantissa bits


def test_mxfp4_to_fp8_is_lossless_when_exponents_fit():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (256, 8, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 128, (256, 8), generator=g, dtype=torch.uint8)  # spread 7 binades
    scales[:64, :2] = 100  # inside block (0, 0): groups 20+ binades apart -> cannot be exact
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    q, s, exact = quantize_weight_fp8_exact(w)
    assert exact.tolist() == [[False, True], [True, True]]
    back = dequantize_weight_fp8(q, s)
    assert torch.equal(back[128:], w[128:]) and torch.equal(back[:, 128:], w[:, 128:])
    assert torch.log2(s[exact]).frac().eq(0).all()  # power-of-two scales where exact


def test_pad_intermediate_shards_in_whole_blocks():
    assert pad_intermediate(2880) == 3072
    for tp in (1, 2, 4, 8):
        assert (3072 // tp) % 128 == 0


def test_convert_then_load_equals_on_the_fly_fp8(tiny_mxfp4, tmp_path):
    from pdserve.engine.checkpoint_writer import convert_checkpoint
    from pdserve.engine.model_runner import ModelRunner

    dst = tmp_path / "fp8"
    stats = convert_checkpoint(tiny_mxfp4, dst, progress=False)
    assert stats["exact_blocks"] == stats["blocks"] > 0  # random MXFP4 spans 3 binades: all exact
    assert ModelConfig.load(dst).experts_format == "fp8"
    ids = torch.randint(0, 201088, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    a = ModelRunner(str(dst), precision="fp8", num_kv_blocks=16).prompt_logits(ids)
    b = ModelRunner(str(tiny_mxfp4), precision="fp8", num_kv_blocks=16).prompt_logits(ids)
    assert torch.equal(a, b)
    # and the FP8 checkpoint also loads for bf16 compute, giving the MXFP4 model exactly
    c = ModelRunner(str(dst), precision="bf16", num_kv_blocks=16).prompt_logits(ids)
    d = ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=16).prompt_logits(ids)
    assert torch.equal(c, d)


def test_ranks_read_only_their_slice(tiny_mxfp4, tiny_cfg):
    full = load_weights(tiny_mxfp4, tiny_cfg)
    parts = [load_weights(tiny_mxfp4, tiny_cfg, shard=ShardSpec(r, 4, ep_size=2)) for r in range(4)]
    a0, m0 = full.layers[1]
    # attention: heads split 4 ways, K/V heads too
    assert parts[1].layers[1][0].qkv_weight.shape[0] == a0.qkv_weight.shape[0] // 4
    assert parts[1].layers[1][0].o_bias is None and parts[0].layers[1][0].o_bias is not None
    # experts: 2 EP groups of 4 experts, each expert's intermediate split over 2 ranks
    e = parts[3].layers[1][1].experts
    assert e.first_expert == 4 and e.gate_up.shape == (4, tiny_cfg.intermediate_size, tiny_cfg.hidden_size)
    assert torch.equal(e.gate_up, m0.experts.gate_up[4:8, tiny_cfg.intermediate_size:])
    assert torch.equal(e.down, m0.experts.down[4:8, :, tiny_cfg.intermediate_size // 2:])
    assert not e.down_bias.any() and parts[2].layers[1][1].experts.down_bias.any()
    # vocabulary-parallel embedding
    assert torch.equal(parts[2].embedding, full.embedding[2 * 201088 // 4 : 3 * 201088 // 4])


def test_corrupt_and_missing_checkpoints(tiny_mxfp4, tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.load(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_mxfp4, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 15}))
    with pytest.raises(ConfigError, match="multiple"):
        ModelConfig.load(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.load(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError):
        load_weights(bad, ModelConfig.load(bad))
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_weights(bad, ModelConfig.load(bad))


def test_parallel_random_checkpoint_is_complete_and_independent_of_worker_count(tiny_cfg, tmp_path):
    """workers > 1 (big checkpoints): same tensor names, shapes and dtypes as one process, one
    shard per layer, and the same weights for any worker count (per-layer generators)."""
    from pdserve.engine.checkpoint_writer import make_random_checkpoint

    one = CheckpointReader(make_random_checkpoint(tmp_path / "one", tiny_cfg, seed=5))
    two = CheckpointReader(make_random_checkpoint(tmp_path / "two", tiny_cfg, seed=5, workers=2))
    three = CheckpointReader(make_random_checkpoint(tmp_path / "three", tiny_cfg, seed=5, workers=3))
    names = sorted(one.weight_map)
    assert sorted(two.weight_map) == names == sorted(three.weight_map)
    for n in names:
        a, b, c = one.get(n), two.get(n), three.get(n)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(b, c), n
    layer = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    assert not torch.equal(one.get(layer), two.get(layer))  # its own generator per layer
    assert torch.equal(one.get("model.embed_tokens.weight"), two.get("model.embed_tokens.weight"))
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= tiny_cfg.num_hidden_layers
    assert index["metadata"]["total_size"] == json.loads(
        (tmp_path / "one" / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def test_parallel_writer_refuses_a_main_script_read_from_stdin(tmp_path, tiny_cfg, monkeypatch):
    """`python - <<EOF` has no main file for spawned workers to re-import: a clear error, not a pool
    that restarts failing workers forever (and nothing written)."""
    import sys

    from pdserve.engine.checkpoint_writer import make_random_checkpoint

    monkeypatch.setattr(sys.modules["__main__"], "__file__", "<stdin>", raising=False)
    with pytest.raises(RuntimeError, match="not a file"):
        make_random_checkpoint(tmp_path / "ckpt", tiny_cfg, seed=0, workers=2)
    assert not (tmp_path / "ckpt").exists()
