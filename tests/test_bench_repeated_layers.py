"""bench/repeated_layers.py: a shallow checkpoint loaded as a deeper model, and everything as it was once
the context ends. (That each layer gets its own device memory: tests/gpu/test_repeated_layers_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.bench.repeated_layers import alias_repeated, repeated_layers
from pdserve.engine.checkpoint import CheckpointError, CheckpointReader, load_weights
from pdserve.engine.checkpoint_writer import make_random_checkpoint
from pdserve.engine.config import ModelConfig


def _tensors(layer) -> list[torch.Tensor]:
    attn, moe = layer
    return [attn.qkv_weight, attn.o_weight, attn.sinks, attn.norm, moe.router_weight, moe.norm,
            moe.experts.gate_up_blocks, moe.experts.gate_up_scales, moe.experts.down_blocks]


def test_layers_repeat_with_their_types(tiny_mxfp4):
    n = ModelConfig.load(tiny_mxfp4).num_hidden_layers
    with repeated_layers(3 * n):
        cfg = ModelConfig.load(tiny_mxfp4)
        w = load_weights(tiny_mxfp4, cfg, precision="mxfp4")
    assert cfg.num_hidden_layers == 3 * n == len(w.layers)
    assert [cfg.is_sliding(i) for i in range(3 * n)] == [cfg.is_sliding(i % n) for i in range(3 * n)]
    for i in range(n, 3 * n):
        for copy, stored in zip(_tensors(w.layers[i]), _tensors(w.layers[i % n])):
            assert torch.equal(copy, stored)
    # the layers of the checkpoint differ from each other, so the equality above is not vacuous
    assert not torch.equal(w.layers[0][0].qkv_weight, w.layers[1][0].qkv_weight)


def test_everything_is_restored_after_the_context(tiny_mxfp4):
    n = ModelConfig.load(tiny_mxfp4).num_hidden_layers
    with repeated_layers(2 * n):
        pass
    assert ModelConfig.load(tiny_mxfp4).num_hidden_layers == n
    with pytest.raises(CheckpointError, match="not found"):
        CheckpointReader(tiny_mxfp4).get(f"model.layers.{n}.input_layernorm.weight")
    with repeated_layers(None):
        assert ModelConfig.load(tiny_mxfp4).num_hidden_layers == n


def test_an_odd_checkpoint_depth_cannot_be_repeated(tmp_path, tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, num_hidden_layers=3, layer_types=())
    ckpt = make_random_checkpoint(tmp_path / "odd", cfg, seed=0, experts="mxfp4")
    with repeated_layers(6), pytest.raises(ValueError, match="alternation"):
        ModelConfig.load(ckpt)
    with repeated_layers(2):  # fewer layers than stored: the first two, as they are
        assert ModelConfig.load(ckpt).num_hidden_layers == 2


def test_aliased_layers_share_the_stored_layers_objects(tiny_mxfp4):
    n = ModelConfig.load(tiny_mxfp4).num_hidden_layers
    with repeated_layers(2 * n):
        w = load_weights(tiny_mxfp4, ModelConfig.load(tiny_mxfp4), precision="mxfp4")
    assert w.layers[n] is not w.layers[0]
    alias_repeated(w, n)
    assert len(w.layers) == 2 * n
    assert all(w.layers[i] is w.layers[i % n] for i in range(2 * n))
    assert len({id(layer) for layer in w.layers}) == n
