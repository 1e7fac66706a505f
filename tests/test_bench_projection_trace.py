"""bench/projection_trace.py's reading of the FP8 projections' timing build, on records written here: which
launches it pools, and the times it reports."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import projection_trace as pt
from pdserve.kernels import cuda_gemv_fp8 as gf


def _record(start, pdl, staged, landed, end, sm):
    """One CTA's words (ns): issued 10 ns after start, summed 100 ns before end."""
    return [start, start + 10, pdl, staged, landed, end - 100, end, sm]


def _trace(kinds: list[str], qkv: list[list[int]]) -> tuple[gf.Trace, torch.Tensor]:
    """A Trace of a step: per layer the QKV launch (every layer the CTAs `qkv`, shifted by 1 ms a layer) and an
    O launch of one CTA."""
    trace = pt.new_trace(2 * len(kinds), len(qkv), torch.device("cpu"))
    words = []
    for layer in range(len(kinds)):
        for entry, recs in (("gemv_fp8_rope", qkv), ("gemv_fp8", [_record(0, 0, 1000, 1000, 2000, 0)])):
            trace.launches.append((entry, len(words), len(recs)))
            words += [v + (1_000_000 * layer if i != 7 else 0) for r in recs for i, v in enumerate(r)]
    trace.buffer[:len(words)] = torch.tensor(words)
    return trace, trace.buffer.clone()


def test_times_are_from_the_first_wait_passed_over_the_middle_layers_of_each_kind():
    kinds = ["windowed", "full"] * 3
    qkv = [_record(0, 1000, 1500, 1600, 3000, 0),  # placed before the wait, copies landed with the staging
           _record(500, 1200, 1700, 2500, 4000, 0),  # copies landed 0.8 us after the staging
           _record(2000, 2000, 2400, 2500, 5000, 1),  # placed after the wait
           _record(1000, 1100, 1400, 1500, 9000, 2)]
    trace, buf = _trace(kinds, qkv)
    rows = pt.summarize([buf, buf], trace, kinds)
    by = {(r["launch"], r["layers"]): r for r in rows}
    assert set(by) == {("QKV + RoPE", "windowed"), ("QKV + RoPE", "full"), ("O", "windowed"), ("O", "full")}
    r = by[("QKV + RoPE", "full")]
    assert r["launches"] == 2 and r["ctas"] == 4  # layer 3 only (1 and 5 left out), two replays
    assert r["end"][1.0] == pytest.approx(8.0) and r["start"][1.0] == pytest.approx(1.0)  # us from t = 1000 ns
    assert r["pdl"][0.1] == pytest.approx(torch.quantile(torch.tensor([0., .2, 1., .1]), 0.1).item())
    assert r["placed_after_wait"] == 1 and r["late_landing"] == 1 and r["ctas_per_sm_max"] == 2
    assert r["timer_step_ns"] == 10
    assert by[("O", "windowed")]["launches"] == 2 and by[("O", "windowed")]["end"][0.5] == pytest.approx(2.0)


def test_more_launches_than_layers_is_an_error():
    kinds = ["windowed", "full"]
    trace, buf = _trace(kinds, [_record(0, 0, 1, 1, 2, 0)])
    assert len(pt.summarize([buf], trace, kinds)) == 4
    trace.launches.append(trace.launches[0])
    with pytest.raises(ValueError, match="launched 3 times for 2 layers"):
        pt.summarize([buf], trace, kinds)
