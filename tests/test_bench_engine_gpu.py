"""bench/engine_gpu.py runs on CPU with the tiny preset: a chunked prefill timed and profiled per
category (the same code a GPU host runs; no timing is asserted), its figures in the JSON result."""

from __future__ import annotations

import json
import sys

import pytest

from pdserve.bench import engine_gpu, peer_triton


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


def test_attention_precision_comparison_on_cpu(tmp_path, capsys):
    """--compare-attention-precision: the FP8 projections' logits against the torch path and bf16,
    then a prefill per precision, each profiled with its projections labelled as dense GEMMs."""
    args = ["--preset", "tiny", "--device", "cpu", "--precision", "bf16", "--ckpt", str(tmp_path / "ckpt"),
            "--out", str(tmp_path), "--check-tokens", "16", "--prompt-len", "40", "--prefill-chunk-tokens", "32",
            "--profile", "--prefill-only", "--compare-attention-precision"]
    assert engine_gpu.main(args) == 0
    out = capsys.readouterr().out
    assert "FP8 attention projections: logits vs torch path rel L2 0.00e+00" in out  # CPU: the reference itself
    assert "attention bf16:" in out and "attention fp8:" in out
    result = json.loads((tmp_path / "engine_gpu.json").read_text())
    assert set(result["prefill_by_moe_path"]) == {"attention bf16", "attention fp8"}
    assert result["prefill_profile"]["categories"]["dense GEMMs"]["ms"] > 0


def test_profile_labels_fp8_projections(tiny_mxfp4):
    """The profile's labels cover the FP8 projections (engine.model.linear_fp8) like F.linear."""
    import torch

    import pdserve.engine.model as model_mod
    from pdserve.bench.step_profile import labels
    from pdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(str(tiny_mxfp4), precision="bf16", num_kv_blocks=16, attention_precision="fp8")
    a = runner.model.w.layers[0][0]
    x = torch.randn(3, runner.cfg.hidden_size, dtype=torch.bfloat16)
    with torch.profiler.profile() as prof, labels(runner):
        model_mod.linear_fp8(x, a.qkv_weight, a.qkv_scale, a.qkv_bias)
        model_mod.linear_fp8(torch.randn(3, a.o_weight.shape[1], dtype=torch.bfloat16), a.o_weight, a.o_scale,
                             a.o_bias)
    names = {e.name for e in prof.events()}
    assert {"L:qkv GEMM", "L:o_proj GEMM"} <= names


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


def test_peer_triton_needs_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        engine_gpu.main(["--device", "cpu", "--peer-triton", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--peer-triton times decode on CUDA" in capsys.readouterr().err


def test_peer_triton_missing_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        engine_gpu.main(["--peer-triton", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1  # one line, before any work
    assert "pip install gpt-oss" in err and "triton_kernels" in err and "import failed" in err


def test_peer_prefill_chunks_cover_the_context_in_bounded_calls(rng):
    for _ in range(500):
        context, batch = rng.randint(64, 40_000), rng.randint(1, 256)
        chunks = peer_triton.prefill_chunks(context, batch)
        assert sum(chunks) == context, (context, batch, chunks)
        assert min(chunks) >= 64  # the peer's prefill attention alone (no reference check)
        assert max(chunks) * batch <= max(8192, 128 * batch)  # bounded [rows, vocab] logits


def test_critical_path_counts_what_each_kernel_adds():
    """bench/step_profile.critical_path: a kernel launched early (PDL) and waiting for the one before
    adds only the time past that one's end; one that ends inside another adds nothing; a kernel after a
    long gap (the next replay) adds its duration, not the gap."""
    from pdserve.bench.step_profile import critical_path

    kernels = [
        dict(name="a", ts=0.0, dur=10.0),
        dict(name="b", ts=2.0, dur=12.0),   # placed during a, waits: adds 14 - 10
        dict(name="c", ts=5.0, dur=4.0),    # ends inside a: adds nothing
        dict(name="a", ts=15.0, dur=3.0),   # after a 1 us gap: adds gap + its time, 18 - 14
        dict(name="a", ts=1000.0, dur=10.0),  # the next replay: its duration only
    ]
    share = critical_path(list(reversed(kernels)))  # any order: sorted by start
    assert share == {"a": 10.0 + 4.0 + 10.0, "b": 4.0, "c": 0.0}
    assert sum(share.values()) == (18.0 - 0.0) + 10.0  # the spans of the two stretches


def test_gpu_timeline_splits_pipelined_steps_into_busy_idle_and_work_outside_the_graph():
    """bench/step_profile.gpu_timeline: overlapping ops count once as busy, the holes between them
    are idle (the longest named by the ops around them), and ops not launched by a graph replay are
    the work outside it, per step."""
    from pdserve.bench.step_profile import gpu_timeline

    ops = [
        dict(name="copy in", label="other", ts=0.0, dur=2.0),
        dict(name="k1", label="graph", ts=3.0, dur=10.0),     # 1 us idle before it
        dict(name="k2", label="graph", ts=5.0, dur=12.0),     # placed early (PDL): busy to 17
        dict(name="argmax", label="other", ts=20.0, dur=4.0),  # 3 us idle before it
        dict(name="copy in", label="other", ts=24.0, dur=1.0),
        dict(name="k1", label="graph", ts=25.0, dur=5.0),
    ]
    t = gpu_timeline(list(reversed(ops)), steps=2)
    assert t["span_us"] == 30.0 / 2
    assert t["busy_us"] == (2.0 + 14.0 + 10.0) / 2
    assert t["idle_us"] == (1.0 + 3.0) / 2
    assert t["outside_graph_us"] == (2.0 + 4.0 + 1.0) / 2 and t["outside_graph_ops"] == 3 / 2
    assert t["outside_graph"]["copy in"] == {"us": 1.5, "ops": 1.0}
    assert t["gaps"][0] == {"us": 3.0, "after": "k2", "before": "argmax"}
    assert gpu_timeline([], steps=3)["busy_us"] == 0.0


def test_decode_reports_the_steady_state_step_on_cpu(tmp_path, capsys):
    """Decode steps are timed twice: from an idle device (the window's first step plans with nothing
    in flight) and in the pipeline's steady state; both land in the JSON result, per mode."""
    args = ["--preset", "tiny", "--device", "cpu", "--precision", "bf16", "--ckpt", str(tmp_path / "ckpt"),
            "--out", str(tmp_path), "--check-tokens", "16", "--batches", "1", "--decode-steps", "3",
            "--decode-context", "40", "--prefill-tokens", "40"]
    assert engine_gpu.main(args) == 0
    assert "steady state" in capsys.readouterr().out
    decode = json.loads((tmp_path / "engine_gpu.json").read_text())["decode"]
    assert {r["mode"] for r in decode.values()} == {"eager", "graphs"}
    for r in decode.values():
        assert r["step_ms"] > 0 and r["steady_step_ms"] > 0 and 0 <= r["steady_host_wait_ms"] <= r["steady_step_ms"]
