"""bench/sampler.py on CPU with a small vocabulary: every rule mix timed, the table recorded in its
own section of a results file."""

from __future__ import annotations

from pdserve.bench import sampler


def test_table_has_every_mix_and_batch_and_records_its_section(tmp_path, capsys):
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n\nkept\n")
    args = ["--device", "cpu", "--batches", "1,3", "--vocab", "500", "--generated", "20", "--repeats", "1",
            "--record", str(doc)]
    assert sampler.main(args) == 0
    assert sampler.main(args) == 0  # a second run replaces the section, not appends
    text = doc.read_text()
    assert text.count("<!-- sampler:begin -->") == 1 and "kept" in text
    for mix in sampler.MIXES:
        row = next(line for line in text.splitlines() if line.startswith(f"| {mix} |"))
        assert row.count(" ms") == 2
    assert "batch 3" in capsys.readouterr().out
