"""launch/serve.py on CUDA hosts, without a GPU: which GPUs each worker gets (CUDA_VISIBLE_DEVICES)
and in which order workers start when they share a GPU and size their KV caches from free memory."""

from __future__ import annotations

import random

import pytest

from pdserve.launch.serve import ClusterSpec, LocalCluster


def _cluster(monkeypatch, tmp_path, visible: int, **spec) -> LocalCluster:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(visible)))
    c = LocalCluster(ClusterSpec(model=str(tmp_path), device="cuda", **spec), log_dir=tmp_path)
    c._gpus = c.gpu_plan()
    return c


def test_one_gpu_shared_prefill_loads_before_decode_sizes_its_kv(monkeypatch, tmp_path):
    c = _cluster(monkeypatch, tmp_path, 1)
    assert c.gpu_plan() == {"prefill-0": "0", "decode-0": "0"}
    assert c.start_waves() == [[("prefill", 0)], [("decode", 0)]]


def test_fixed_kv_blocks_or_disjoint_gpus_start_together(monkeypatch, tmp_path):
    blocks = random.randint(1, 1 << 16)
    c = _cluster(monkeypatch, tmp_path, 1, kv_blocks=blocks)
    assert c.start_waves() == [[("prefill", 0), ("decode", 0)]]
    c = _cluster(monkeypatch, tmp_path, 2)
    assert c.gpu_plan() == {"prefill-0": "0", "decode-0": "1"}
    assert c.start_waves() == [[("prefill", 0), ("decode", 0)]]


def test_decode_workers_sharing_a_gpu_start_one_after_another(monkeypatch, tmp_path):
    n = random.randint(2, 4)
    c = _cluster(monkeypatch, tmp_path, 1, decode_workers=n)
    assert c.start_waves() == [[("prefill", 0)]] + [[("decode", i)] for i in range(n)]
    # 3 GPUs, 1 prefill + 4 decode: GPUs 0 1 2 0 1 -> decode-0 (GPU 1) and decode-1 (GPU 2) together
    c = _cluster(monkeypatch, tmp_path, 3, decode_workers=4)
    assert c.start_waves() == [[("prefill", 0)], [("decode", 0), ("decode", 1), ("decode", 2)], [("decode", 3)]]


def test_cpu_has_no_plan_and_one_wave(tmp_path):
    c = LocalCluster(ClusterSpec(model=str(tmp_path), decode_workers=2), log_dir=tmp_path)
    assert c.gpu_plan() == {} and c.start_waves() == [[("prefill", 0), ("decode", 0), ("decode", 1)]]


def test_kv_memory_fraction_reaches_decode_workers_only_without_kv_blocks(monkeypatch, tmp_path):
    spawned = []
    frac = round(random.uniform(0.1, 0.9), 3)
    for blocks in (None, 128):
        c = LocalCluster(ClusterSpec(model=str(tmp_path), kv_blocks=blocks, kv_memory_fraction=frac), log_dir=tmp_path)
        monkeypatch.setattr(c, "_spawn", lambda name, args, env=None: spawned.append((name, args)))
        c.start_worker("decode", 0)
        c.start_worker("prefill", 0)
    (_, d1), (_, p1), (_, d2), (_, p2) = spawned
    assert d1[d1.index("--kv-memory-fraction") + 1] == str(frac)
    assert "--kv-memory-fraction" not in d2 + p1 + p2 and d2[d2.index("--kv-blocks") + 1] == "128"


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "-0.2", "half"])
def test_serve_refuses_a_kv_memory_fraction_outside_0_1(bad, capsys):
    from pdserve.launch.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-memory-fraction", bad])
    assert "--kv-memory-fraction" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--kv-memory-fraction", "0.4"]).kv_memory_fraction == 0.4


def test_decode_precision_reaches_decode_workers_only(monkeypatch, tmp_path):
    """`pdserve serve --decode-precision mxfp4` is a decode-worker flag; prefill keeps its default."""
    import argparse

    from pdserve.launch import serve

    class Stop(Exception):
        pass

    def capture(spec, *args, **kwargs):
        raise Stop(spec)

    monkeypatch.setattr(serve, "LocalCluster", capture)
    p = argparse.ArgumentParser()
    serve.add_args(p)
    for precision in ("mxfp4", None):
        argv = ["--model", str(tmp_path), "--port", "0", "--grpc-port", "0"]
        with pytest.raises(Stop) as stopped:
            serve.run(p.parse_args(argv + (["--decode-precision", precision] if precision else [])))
        spec = stopped.value.args[0]
        assert "--precision" not in spec.extra_prefill_args
        d = spec.extra_decode_args
        assert (d[d.index("--precision") + 1] == precision) if precision else "--precision" not in d
