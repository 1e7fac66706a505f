"""The decode worker's pipelined decode on the GPU: captured CUDA graphs, device-side input ids,
the pinned copy and its event; streams equal the step-by-step loop's (tests/test_decode_worker_pipeline.py
drives both; here on the scripted checkpoint loaded on CUDA)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.model_runner import ModelRunner
from scripted_model import make_scripted_checkpoint
from test_decode_worker_pipeline import SCRIPT, _serve

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("flashinfer")


def test_decode_worker_pipelined_equals_step_by_step_on_gpu(tmp_path):
    ckpt = make_scripted_checkpoint(tmp_path / "pipeline", SCRIPT)
    runner = ModelRunner(str(ckpt), device="cuda", precision="fp8", num_kv_blocks=128)  # bf16 experts sync: no graphs
    runner.decode_graphs = DecodeGraphs(runner.model, runner.cache, 4, max_context=runner.max_context)
    free = runner.cache.num_free_blocks
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    plain, _ = _serve(runner, False, seed)
    piped, launched = _serve(runner, True, seed)
    assert sum(launched) > 5 and runner.cache.num_free_blocks == free, seed
    piped.pop("rc"), plain.pop("rc")  # cancelled at a step that differs between the modes
    assert piped == plain, seed
