"""Run a test module's kernels in Triton's CPU interpreter, in a child process.

TRITON_INTERPRET is read when triton is imported, so it must not leak into the test process or
other tests: the module saves its inputs, runs itself as a script with the variable set (its
`__main__` computes the results), and compares them against references in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(module_file: str, cases, tmp: Path, seed: int):
    """`python module_file in.pt out.pt` under TRITON_INTERPRET=1 on `cases`; its saved results."""
    torch.save(cases, tmp / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, module_file, str(tmp / "in.pt"), str(tmp / "out.pt")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"interpreter child failed (seed {seed}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    print(f"seed {seed}")
    return torch.load(tmp / "out.pt")
