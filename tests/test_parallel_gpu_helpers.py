"""The helpers of tests/gpu/test_parallel_gpu.py (depth views of a checkpoint, the figures it
prints and bounds), on the tiny model on CPU: tests under tests/gpu/ are skipped without a GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def gpu_test():
    path = Path(__file__).parent / "gpu" / "test_parallel_gpu.py"
    spec = importlib.util.spec_from_file_location("parallel_gpu_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_depth_view_and_figures(gpu_test, tiny_mxfp4, tmp_path):
    """A view is the checkpoint's first blocks (its logits are a shallower model's, not the full
    one's); the figures read as documented."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner

    view = gpu_test.depth_view(tiny_mxfp4, 2, tmp_path / "two")
    assert gpu_test.depth_view(tiny_mxfp4, 2, tmp_path / "two") == view
    full_cfg, cfg = ModelConfig.load(tiny_mxfp4), ModelConfig.load(view)
    assert cfg.num_hidden_layers == 2 and cfg.layer_types == full_cfg.layer_types[:2]
    assert dataclasses.replace(cfg, num_hidden_layers=4, layer_types=full_cfg.layer_types) == full_cfg
    ids = torch.randint(0, cfg.vocab_size, (20,)).tolist()
    two = ModelRunner(str(view), num_kv_blocks=4).prompt_logits(ids).numpy()
    four = ModelRunner(str(tiny_mxfp4), num_kv_blocks=4).prompt_logits(ids).numpy()
    same = gpu_test.compare(two, two)
    assert same["rel_l2"] == same["max_abs"] == 0 and same["argmax"] == 1
    apart = gpu_test.compare(two, four)
    assert 0.05 < apart["rel_l2"] < 2 and apart["median"] > 0.05
    text = gpu_test.describe("x", apart)
    assert "rel L2" in text and "argmax agreement" in text

