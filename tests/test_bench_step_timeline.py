"""bench/step_timeline.py's layer table on a made-up timeline: kernels launched ahead of their
predecessor's end (PDL), two layer types alternating, the first and last windows of a step left out."""

from __future__ import annotations

import pytest

from pdserve.bench import step_timeline


def _step(t0: float, layers: int) -> list[tuple[str, float, float]]:
    """One replay: an embedding, then per layer route / gate_up / down / norm / QKV / attention (a longer
    one every other layer), each launched 0.5 us before the kernel ahead of it ends."""
    out, t = [("embed", t0, t0 + 1.0)], t0 + 1.0
    for i in range(layers):
        for name, dur in [("route", 2.0), ("mx_gate_up", 18.0), ("mx_down", 12.0), ("norm", 1.0),
                          ("gemv_fp8_rope", 7.0), ("attention_full" if i % 2 else "attention_window", 3.0 + i % 2)]:
            out.append((name, t - 0.5, t + dur))
            t += dur
    return out


def test_adds_sum_to_the_span_and_layer_types_stay_apart():
    rows = step_timeline.layer_table([_step(0.0, 9), _step(1000.0, 9)])
    windows = {r["window"] for r in rows}
    assert len(windows) == 2  # the windowed and the full layers' sequences, equally common
    for w in windows:
        mine = [r for r in rows if r["window"] == w]
        assert [r["kernel"] for r in mine][:4] == ["mx_gate_up", "mx_down", "norm", "gemv_fp8_rope"]
        assert mine[-1]["kernel"] == "route"
        assert all(r["lead_us"] == pytest.approx(0.5) for r in mine)
        assert mine[0]["adds_us"] == pytest.approx(18.0) and mine[0]["us"] == pytest.approx(18.5)
        attention = mine[4]["adds_us"]
        assert attention == pytest.approx(3.0 if mine[4]["kernel"] == "attention_window" else 4.0)
        assert sum(r["adds_us"] for r in mine) == pytest.approx(2 + 18 + 12 + 1 + 7 + attention)
    assert all(r["windows"] == 6 for r in rows)  # 9 layers: 6 middle windows a replay, 3 of each type, 2 replays


def test_no_marker_is_an_error():
    with pytest.raises(RuntimeError, match="route"):
        step_timeline.layer_table([[("a", 0.0, 1.0)]])


def test_windows_of_the_same_names_stay_apart_by_parity():
    """gpt-oss' windowed and full layers may run the same kernels for different times."""
    step, t = [], 0.0
    for i in range(9):
        for name, dur in [("route", 2.0), ("attention", 3.0 + 2 * (i % 2))]:
            step.append((name, t, t + dur))
            t += dur
    rows = step_timeline.layer_table([step])
    assert sorted(r["adds_us"] for r in rows if r["kernel"] == "attention") == [3.0, 5.0]
