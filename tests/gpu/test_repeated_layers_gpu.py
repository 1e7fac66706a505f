"""bench/repeated_layers.py on the GPU: each repeated layer loads into its own device memory, so a
whole-depth step streams every layer's bytes (none is an alias of the layer it repeats)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.repeated_layers import repeated_layers
from pdserve.engine.checkpoint import load_weights
from pdserve.engine.config import ModelConfig

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is


@pytest.mark.parametrize("attention_precision", ["bf16", "fp8"])
def test_repeated_layers_own_their_memory(tiny_mxfp4, attention_precision):
    with repeated_layers(4 * ModelConfig.load(tiny_mxfp4).num_hidden_layers):
        cfg = ModelConfig.load(tiny_mxfp4)
        w = load_weights(tiny_mxfp4, cfg, precision="mxfp4", device="cuda", attention_precision=attention_precision)
    seen = {}
    for i, (attn, moe) in enumerate(w.layers):
        fields = [(f"{part}.{k}", t) for part, obj in (("attention", attn), ("moe", moe), ("experts", moe.experts))
                  for k, t in vars(obj).items() if isinstance(t, torch.Tensor)]
        for name, t in fields:
            assert t.is_cuda, name
            assert seen.setdefault(t.untyped_storage().data_ptr(), (i, name)) == (i, name)
    assert len({p for p, (i, _) in seen.items() if i == 0}) >= 10
