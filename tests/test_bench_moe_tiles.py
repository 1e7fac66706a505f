"""The Marlin-shaped folded probe (bench/moe_tiles.py, gate/up and down) builds for sm_90 with NVRTC at its
shapes, without spills, and its ring fits one SM's shared memory."""

import re

import pytest

from nvrtc_offline import compile_cuda


@pytest.mark.parametrize("kt,stages,rw", [(1, 4, 1), (1, 6, 1), (2, 4, 1), (2, 6, 1), (4, 3, 1), (1, 4, 2),
                                          (2, 4, 2), (2, 3, 3)])
@pytest.mark.parametrize("per_pair,epilogue", [(False, 0), (True, 0), (False, 1), (True, 2)],
                         ids=["gate_up", "down", "gate_up+swiglu", "down+sum"])
def test_probe_builds_without_spills(kt, stages, rw, per_pair, epilogue):
    from pdserve.bench import moe_tiles

    _, log = compile_cuda(moe_tiles.SOURCE, moe_tiles.compile_options(kt, stages, rw, per_pair=per_pair,
                                                                      epilogue=epilogue))
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log
    assert stages * moe_tiles.stage_bytes(kt, rw) <= 227 * 1024
    assert 5760 % moe_tiles.rows(rw) == 0  # gpt-oss' gate/up rows split into whole tiles


def test_the_engine_launches_it_times_get_each_kernel_parameter(monkeypatch):
    """The probe times the engine's folded gate/up and down launches on their own (moe_tiles.fold_gate_up,
    fold_down, copies of experts_forward_mxfp4_mma's launches): each must hand its kernel as many arguments
    as the kernel's signature has."""
    import torch

    from pdserve.bench import moe_tiles
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from test_cuda_moe_mxfp4 import _kernel_params, _problem

    launched = []
    monkeypatch.setattr(cm, "_kernels", lambda *a: {"mx_gate_up": "mx_gate_up", "mx_down": "mx_down"})
    monkeypatch.setattr("pdserve.kernels.pdl.launch_cuda", lambda kernel, *a, args, **k: launched.append(
        (kernel, len(args))))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    w, x, ids, _ = _problem(t=2, h=128, i=128)
    routing = type("R", (), {"max_blocks": 1, "block_expert": ids, "sorted_slot": ids})()
    moe_tiles.fold_gate_up(w.to_packed(), routing, x.half(), torch.ones(2), ids, 4, torch.empty(8, 128))
    moe_tiles.fold_down(w.to_packed(), routing, torch.empty(8, 128).half(), ids, 4, torch.ones(8).bfloat16(),
                        torch.empty(2, 128).bfloat16())
    assert launched == [("mx_gate_up", _kernel_params("mx_gate_up")), ("mx_down", _kernel_params("mx_down"))]


@pytest.mark.parametrize("epilogue", [0, 1, 2])
def test_the_probe_launch_gets_each_kernel_parameter(monkeypatch, epilogue):
    """moe_tiles.Probe hands mx_tiles as many arguments as its signature has, whatever the epilogue."""
    import torch

    from pdserve.bench import moe_tiles
    from test_cuda_moe_mxfp4 import _problem

    match = re.search(r'extern "C" __global__[^;{]*?\bmx_tiles\(([^)]*)\)', moe_tiles.SOURCE)
    params = match.group(1).count(",") + 1
    launched = []
    monkeypatch.setattr("pdserve.kernels.pdl.launch_cuda", lambda kernel, *a, args, **k: launched.append(len(args)))
    probe = moe_tiles.Probe.__new__(moe_tiles.Probe)
    probe.kernel, probe.grid, probe.smem, probe.rw, probe.part = "mx_tiles", 1, 0, 1, "gate_up"
    w, _, ids, _ = _problem(t=2, h=128, i=128)
    routing = type("R", (), {"max_blocks": 1, "block_expert": ids, "sorted_slot": ids})()
    probe(w.to_packed(), routing, torch.empty(2, 128).half(), None, 4, torch.empty(8, 256),
          act=torch.empty(8, 128).half(), y=torch.empty(2, 128).bfloat16())
    assert launched == [params]
