"""bench/kvtransfer.py on CPU: the bytes a request moves, the doc section it owns, one quick run of
every case (UCX over TCP) whose rows must add up."""

from __future__ import annotations

import importlib
import json
import random

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("pdserve.bench.kvtransfer")


def test_request_bytes_are_the_pages_a_decode_worker_needs(bench):
    """The closed form against the worker's own page lists (PagedKVCache.transfer_pages)."""
    from pdserve.engine.kv_cache import PagedKVCache

    cfg = bench.model_config()
    # 1024 tokens: 64 pages on each of the 12 full layers, pages 56..63 (in the 128-key window) on
    # the 12 sliding ones; 32 KiB per page and layer for 8 heads x 64 dims in bf16
    assert bench.request_kv_bytes(cfg, 1024) == 32768 * 12 * (64 + 8)
    for n in [1, 16, 17, 128, 129, 145, random.randrange(200, 5000)]:
        cache = PagedKVCache(cfg, num_blocks=2 * -(-n // 16), page_size=16, device="cpu")
        seq = cache.reserve(n, local_prompt_tokens=n)
        cache.prepare(seq, 0, n)
        cache.finish_prefill(seq, n)
        pages = cache.transfer_pages(seq, n)
        want = sum(len(pages[g]) * cache.pools[g][:, 0].numel() * 2 for g in pages)
        assert bench.request_kv_bytes(cfg, n) == want, n


def test_doc_section_replaces_only_its_markers(bench, tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n\n<!-- model:begin -->\nm\n<!-- model:end -->\n")
    bench.update_doc(doc, f"{bench.BEGIN}\nfirst\n{bench.END}")  # absent: appended at the end
    assert doc.read_text() == ("# Performance\n\n<!-- model:begin -->\nm\n<!-- model:end -->\n\n"
                               f"{bench.BEGIN}\nfirst\n{bench.END}\n")
    doc.write_text(doc.read_text() + "\n## After\na\n")
    bench.update_doc(doc, f"{bench.BEGIN}\nsecond\n{bench.END}")
    text = doc.read_text()
    assert text.count(bench.BEGIN) == 1 and "second" in text and "first" not in text
    assert text.startswith("# Performance\n\n<!-- model:begin -->\nm\n<!-- model:end -->\n")
    assert text.endswith(f"{bench.END}\n\n## After\na\n")


@pytest.mark.slow
def test_quick_cpu_run_of_every_case(bench, tmp_path):
    doc, out = tmp_path / "perf.md", tmp_path / "kv.json"
    doc.write_text("# Performance\n\nkept\n")
    assert bench.main(["--device", "cpu", "--quick", "--cases", "all", "--reps", "1",
                       "--doc", str(doc), "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    rows = {r["case"]: r for r in saved["rows"]}
    assert set(rows) == set(bench.CASES) and not any("FAILED" in n for n in saved["notes"])
    assert "TP2 -> TP1, 1024 tokens: " in " ".join(saved["notes"])  # its bandwidth against TP1 -> TP1
    want = bench.request_kv_bytes(bench.model_config(), 1024)
    for r in rows.values():
        assert r["tokens"] == 1024 and r["bytes"] == want and r["reps"] == 1
        assert r["time_s"] > 0 and r["gb_s"] == pytest.approx(want / r["time_s"] / 1e9)
    pages = 12 * (64 + 8)  # (layer, page) pairs of the request
    # consecutive blocks: one fused range per layer; a churned allocator (every other block free,
    # so no two neighbours): one per page
    assert rows["tp1-tp1"]["descriptors"] == 24
    assert rows["tp1-tp1-shuffled"]["descriptors"] == pages
    # re-sharded: one range per layer and (sender, receiver) pair, packed (TP1 -> TP2) or slotted
    # (TP2 -> TP1); the per-token-row fallback one per (layer, page, k/v, token) and decode rank
    assert rows["tp1-tp2"]["descriptors"] == rows["tp2-tp1"]["descriptors"] == 2 * 24
    assert rows["tp1-tp2-rows"]["descriptors"] == 2 * pages * 32
    assert rows["tp2-tp1"]["placement"] == "cpu,cpu -> cpu"
    text = doc.read_text()
    assert text.startswith("# Performance\n\nkept\n") and text.count(bench.BEGIN) == 1
    assert "| TP1 -> TP2 (staged) | 1024 | cpu -> cpu,cpu | 27.0 MiB | 48 |" in text
    # the section renders again from the JSON alone (what a device run brings back)
    doc2 = tmp_path / "perf2.md"
    assert bench.main(["--render-only", str(out), "--doc", str(doc2)]) == 0
    assert bench.render_table(saved["rows"]) in doc2.read_text()
