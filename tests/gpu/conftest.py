"""GPU tests compare against float32 torch references: keep those references IEEE float32.

Some CUDA images force TF32 for float32 matmuls through the environment; TF32 truncates the
references' inputs to 10 mantissa bits and would be measured as kernel error. These variables are
read when cuBLAS / torch first run a matmul, which happens after collection.
"""

import os

os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "0"

import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

import dataclasses  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def seed():
    """A fresh random seed for a test's inputs, printed so that a failure can be replayed."""
    s = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {s}")
    return s


@pytest.fixture(scope="session")
def narrow_ckpt(tmp_path_factory):
    """gpt-oss-20b's attention geometry (64 q / 8 kv heads, window 128) on narrower, fewer layers:
    the engine tests that run many decode steps."""
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset

    cfg = dataclasses.replace(preset("20b"), hidden_size=640, intermediate_size=768, num_hidden_layers=4,
                              num_local_experts=8, layer_types=())
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "narrow", cfg, seed=0)
