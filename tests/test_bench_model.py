"""bench/model.py's logic on CPU: cost model, layouts, the doc section it owns, one tiny run."""

from __future__ import annotations

import importlib
import json

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("pdserve.bench.model")


def test_cost_model_and_layouts(bench):
    # 1 GPU-second at $3/h for 1M tokens of output per second: $0.000833 per 1M tokens
    assert bench.usd_per_m_output(1, 1e6) == pytest.approx(3 / 3600)
    # TP4 prefill of 8192 tokens in 0.5 s: 4 GPUs * 0.5 s * $3/3600 s / 8192 tokens * 1e6
    assert bench.usd_per_m_input(4, 0.5, 8192) == pytest.approx(4 * 0.5 * 3 / 3600 / 8192 * 1e6)
    assert [lay.name for lay in bench.prefill_layouts(4)] == ["TP1", "TP2", "TP4"]
    assert [lay.name for lay in bench.decode_layouts(4, quick=True)] == ["TP1", "EP2TP2", "EP4TP4"]
    assert "TP4" in [lay.name for lay in bench.decode_layouts(8, quick=False)]
    assert bench.Layout.parse("ep4tp4") == bench.Layout(4, 4)
    with pytest.raises(ValueError):
        bench.Layout.parse("DP2")
    # --multi-rank-graphs rows: their own layout name, sorted after the eager rows of the layout
    row = {"context": 128, "batch": 1, "step_s": 0.01}
    [graphs] = bench.enrich("20b", "decode", bench.Layout(2, 2), {"rows": [row]}, graphs=True)
    assert graphs["layout"] == "EP2TP2 graphs" and graphs["gpus"] == 2
    assert sorted(["EP2TP2 graphs", "TP1", "EP2TP2"], key=bench._layout_key) == ["TP1", "EP2TP2", "EP2TP2 graphs"]


def test_doc_section_replaces_only_its_markers(bench, tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n\n## Kernels\nk\n\n<!-- serving:begin -->\ns\n<!-- serving:end -->\n")
    bench.update_doc(doc, f"{bench.BEGIN}\nfirst\n{bench.END}")
    bench.update_doc(doc, f"{bench.BEGIN}\nsecond\n{bench.END}")
    text = doc.read_text()
    assert text.count(bench.BEGIN) == 1 and "second" in text and "first" not in text
    assert text.startswith("# Performance\n\n## Kernels\nk\n\n<!-- serving:begin -->\ns\n<!-- serving:end -->\n")


@pytest.mark.slow
def test_tiny_run_on_cpu(bench, tmp_path):
    """One rank, both sections, the tiny grid: rows, CSVs and the doc section come out."""
    out, doc = tmp_path / "out", tmp_path / "perf.md"
    assert bench.main(["--device", "cpu", "--preset", "tiny", "--quick", "--max-ranks", "1", "--out", str(out),
                       "--doc", str(doc), "--ckpt-dir", str(tmp_path / "ckpt")]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    pre = [r for r in rows if r["section"] == "prefill"]
    dec = [r for r in rows if r["section"] == "decode"]
    assert [r["input_tokens"] for r in pre] == [64, 256] and all(r["latency_s"] > 0 for r in pre)
    assert {(r["context"], r["batch"]) for r in dec} == {(128, 1), (128, 4), (512, 1), (512, 4)}
    for r in dec:
        assert r["tok_s_total"] == pytest.approx(r["batch"] * r["tok_s_per_request"])
        assert r["usd_per_m_output"] == pytest.approx(3 / 3600 / r["tok_s_total"] * 1e6)
    assert (out / "decode.csv").read_text().count("\n") == 5
    assert "### tiny: decode at context 512" in doc.read_text()
