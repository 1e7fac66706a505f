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
