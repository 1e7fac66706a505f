"""bench/attention_trace.summarize: the per-block figures it derives from the cluster attention's
timing records (CPU; the records are made up with known times)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pdserve.bench.attention_trace import (  # noqa: E402
    T_BLOCKS, T_END, T_FOLDED, T_ISSUED, T_MET, T_MY_BLOCKS, T_PDL, T_START, report, summarize,
)
from pdserve.kernels.cuda_decode_attention import TRACE_WORDS  # noqa: E402


def _warp(pdl_us: float, blocks: list[tuple[float, float]], end_us: float) -> torch.Tensor:
    """One warp's record in ns, with a large absolute offset as %globaltimer has."""
    base = 1_700_000_000_000_000
    r = torch.zeros(TRACE_WORDS, dtype=torch.int64)
    ns = lambda us: base + round(us * 1e3)
    r[T_START], r[T_ISSUED], r[T_PDL] = ns(-5.0), ns(-4.5), ns(pdl_us)
    for j, (landed, summed) in enumerate(blocks):
        r[T_BLOCKS + 2 * j], r[T_BLOCKS + 2 * j + 1] = ns(landed), ns(summed)
    r[T_FOLDED], r[T_MET], r[T_END], r[T_MY_BLOCKS] = ns(end_us - 1.0), ns(end_us - 0.5), ns(end_us), len(blocks)
    return r


def test_blocks_split_into_waiting_for_copies_and_sums():
    # two blocks in flight (stages 2): block 2's copies are requested when block 0 is summed
    a = _warp(0.0, [(0.5, 1.5), (1.6, 2.4), (4.0, 5.0)], 7.0)
    b = _warp(0.2, [(0.7, 1.7), (1.8, 2.6)], 4.0)
    idle = torch.zeros(TRACE_WORDS, dtype=torch.int64)  # a warp of an idle cluster writes nothing
    s = summarize([torch.stack([a, b, idle])], stages=2)
    assert s["warps"] == 2 and s["blocks_per_warp"] == [2, 3]
    b0, b1, b2 = s["blocks"]
    assert b0["waited"][0] == pytest.approx(0.5) and b0["sums"][0] == pytest.approx(1.0)
    assert b1["waited"][0] == pytest.approx(0.1) and b1["sums"][0] == pytest.approx(0.8)
    assert b1["in_flight"] is None
    # only warp a walks block 2: it waited 1.6 us after block 1's sums, 2.5 us after the request
    assert b2["waited"][0] == pytest.approx(1.6) and b2["sums"][0] == pytest.approx(1.0)
    assert b2["in_flight"] == pytest.approx(2.5)
    assert s["end"][2] == pytest.approx(7.0) and s["timer_step_ns"] == pytest.approx(100.0)
    assert s["met"][0] == pytest.approx(5.0)  # the median of 6.5 and 3.5
    assert "issue->land" in report("case", s)


def test_times_are_taken_from_each_reps_earliest_wait():
    early = summarize([torch.stack([_warp(0.0, [(1.0, 2.0)], 3.0)])], stages=2)
    shifted = _warp(0.0, [(1.0, 2.0)], 3.0)
    shifted[: T_END + 1] += 10_000  # the same warp 10 us later: every time word, not its block count
    late = summarize([torch.stack([shifted])], stages=2)
    assert late["blocks"][0]["landed"] == early["blocks"][0]["landed"]
