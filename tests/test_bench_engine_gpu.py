"""bench/engine_gpu.py runs on CPU with the tiny preset: a chunked prefill timed and profiled per
category (the same code a GPU host runs; no timing is asserted), its figures in the JSON result."""

from __future__ import annotations

import json

from pdserve.bench import engine_gpu


def test_chunked_prefill_profile_on_cpu(tmp_path, capsys):
    args = ["--preset", "tiny", "--device", "cpu", "--precision", "bf16", "--ckpt", str(tmp_path / "ckpt"),
            "--out", str(tmp_path), "--check-tokens", "16", "--prompt-len", "72", "--prefill-chunk-tokens", "32",
            "--profile", "--prefill-only"]
    assert engine_gpu.main(args) == 0
    out = capsys.readouterr().out
    assert "prefill 72 tokens (3 chunks of <= 32)" in out
    result = json.loads((tmp_path / "engine_gpu.json").read_text())
    assert result["prefill_tokens"] == 72 and result["prefill_tok_s"] > 0
    prof = result["prefill_profile"]
    assert (prof["tokens"], prof["chunk"], prof["time"]) == (72, 32, "host")
    cats = prof["categories"]
    for c in ("MoE", "attention", "dense GEMMs", "norms/RoPE", "router"):
        assert cats[c]["ms"] > 0, c  # every model part was seen, in every chunk
        assert cats[c]["floor_ms"] is None  # no FP8 rate on CPU
        assert f"| {c} |" in out


def test_prefill_flops_count_the_model():
    from pdserve.bench.step_profile import prefill_flops
    from pdserve.engine.config import preset

    cfg = preset("20b")
    f = prefill_flops(cfg, 8192, 8192, 64, 8)
    # 24 layers x 4 experts x 6 H I per token; a full layer's causal pairs, a sliding layer's window
    assert f["MoE"] == 8192 * 24 * 4 * 6 * 2880 * 2880
    window = cfg.sliding_window
    sliding_pairs = window * (window + 1) / 2 + (8192 - window) * window
    assert f["attention"] == 12 * 4 * 64 * 64 * (8192 * 8193 / 2 + sliding_pairs)
    assert 50e12 < sum(f.values()) < 60e12  # ~56 TFLOP: the 67 ms floor at ~840 TFLOP/s
    assert prefill_flops(cfg, 8192, 1024, 64, 8)["dense GEMMs"] > f["dense GEMMs"]  # a vocab row per chunk
