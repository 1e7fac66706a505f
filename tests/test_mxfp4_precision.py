"""precision="mxfp4" keeps a checkpoint's MXFP4 experts as published (kernels.mxfp4.MxExperts):
on the CPU (and for prefill-sized batches on CUDA) they run through the bf16 reference on the
routed experts decoded exactly, so the model computes bit for bit what precision="bf16" computes.
The CUDA decode kernel is checked in tests/gpu/test_moe_mxfp4_gpu.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.kernels.mxfp4 import MxExperts


def test_mxfp4_experts_compute_what_bf16_does(tiny_mxfp4):
    mx = ModelRunner(str(tiny_mxfp4), precision="mxfp4", num_kv_blocks=64)
    bf = ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=64)
    assert isinstance(mx.model.w.layers[0][1].experts, MxExperts)
    ids = torch.randint(0, mx.cfg.vocab_size, (int(torch.randint(5, 40, ())),)).tolist()
    assert torch.equal(mx.prompt_logits(ids), bf.prompt_logits(ids))


def test_mxfp4_precision_needs_mxfp4_experts(tiny_bf16):
    with pytest.raises(ValueError, match="mxfp4"):
        ModelRunner(str(tiny_bf16), precision="mxfp4", num_kv_blocks=64)
