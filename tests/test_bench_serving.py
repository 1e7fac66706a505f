"""bench/serving.py: statistics, the seeded workload, argument parsing, the doc section and the
metrics scrape; one small end-to-end run against a spawned cluster (slow)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from pdserve.bench import serving as bs


# ---- statistics ----------------------------------------------------------------------------------
def test_percentile_matches_numpy_linear(rng):
    for n in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert bs.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert math.isnan(bs.percentile([], 50))
    with pytest.raises(ValueError):
        bs.percentile([1.0], 101)


def test_summary_of():
    values = [4.0, 1.0, 3.0, 2.0]
    s = bs.Summary.of(values)
    assert (s.n, s.mean, s.p50) == (4, 2.5, 2.5)
    assert s.p90 == pytest.approx(3.7) and s.p99 == pytest.approx(3.97)
    assert math.isnan(bs.Summary.of([]).mean)


def test_outcome_latencies_spread_multi_token_messages():
    o = bs.Outcome(0, start=10.0, prompt_tokens=5, end=11.0, output_tokens=5,
                   events=[(10.2, 1), (10.4, 1), (10.8, 3)])
    assert o.ttft == pytest.approx(0.2)
    assert o.e2e == pytest.approx(1.0)
    assert o.tpot == pytest.approx(0.8 / 4)
    assert o.inter_token_gaps() == pytest.approx([0.2, 0.4 / 3, 0.4 / 3, 0.4 / 3])
    one = bs.Outcome(1, start=0.0, prompt_tokens=1, end=1.0, output_tokens=1, events=[(0.5, 1)])
    assert math.isnan(one.tpot) and one.inter_token_gaps() == []


def test_summarize_counts_errors_and_throughput():
    reqs = [bs.Request(i, 0.0, [1, 2, 3], max_tokens=4, seed=i) for i in range(4)]
    ok = [bs.Outcome(i, start=float(i), prompt_tokens=3, end=i + 2.0, output_tokens=4 - (i == 1),
                     events=[(i + 0.5, 1), (i + 1.0, 1)]) for i in range(2)]
    bad = [bs.Outcome(2, 0.5, 3).fail("429", "busy", 0.6), bs.Outcome(3, 0.7, 3).fail("timeout", "", 9.0)]
    s = bs.summarize(ok + bad, reqs)
    assert (s.sent, s.completed, s.errors) == (4, 2, {"429": 1, "timeout": 1})
    assert s.duration_s == pytest.approx(9.0)  # first send 0.0 -> last end 9.0, failures included
    assert s.output_tokens == 7 and s.input_tokens == 6 and s.early_stops == 1
    assert s.request_throughput == pytest.approx(2 / 9) and s.total_throughput == pytest.approx(13 / 9)
    assert s.ttft.mean == pytest.approx(0.5) and s.e2e.mean == pytest.approx(2.0)


# ---- workload ------------------------------------------------------------------------------------
def test_poisson_schedule_is_seeded_and_has_the_rate():
    seed = random.randrange(2**32)
    a = bs.poisson_arrivals(np.random.default_rng(seed), 20000, 4.0)
    b = bs.poisson_arrivals(np.random.default_rng(seed), 20000, 4.0)
    assert np.array_equal(a, b)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    # 20000 exponential gaps: the mean is 0.25 s within ~0.7% (one sigma)
    assert np.diff(a).mean() == pytest.approx(0.25, rel=0.03)
    assert np.diff(a).std() == pytest.approx(0.25, rel=0.05)  # exponential: sd == mean
    assert not np.array_equal(a, bs.poisson_arrivals(np.random.default_rng(seed + 1), 20000, 4.0))
    assert np.array_equal(bs.poisson_arrivals(np.random.default_rng(seed), 5, math.inf), np.zeros(5))


def test_workload_is_reproducible_and_streams_are_independent():
    seed = random.randrange(1000)
    w = bs.Workload(50, 2.0, bs.LengthDist(40, "uniform", 0.5), bs.LengthDist(8, "lognormal", 0.5), seed)
    r1, r2 = w.requests(), w.requests()
    assert r1 == r2
    assert all(bs.PROMPT_ID_RANGE[0] <= t < bs.PROMPT_ID_RANGE[1] for r in r1 for t in r.prompt_ids)
    assert all(20 <= len(r.prompt_ids) <= 60 for r in r1)
    assert len({r.seed for r in r1}) == 50
    # another rate moves only the arrivals: prompts, lengths and seeds stay
    faster = bs.Workload(50, 8.0, w.input, w.output, seed).requests()
    assert [(r.prompt_ids, r.max_tokens, r.seed) for r in faster] == [(r.prompt_ids, r.max_tokens, r.seed) for r in r1]
    assert [r.arrival_s for r in faster] != [r.arrival_s for r in r1]
    other = bs.Workload(50, 2.0, w.input, w.output, seed + 1).requests()
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in r1]
    warm = w.warmup(3)
    assert len(warm) == 3 and all(r.arrival_s == 0 for r in warm)
    assert not {tuple(r.prompt_ids) for r in warm} & {tuple(r.prompt_ids) for r in r1}


def test_length_distributions():
    rng = np.random.default_rng(random.randrange(2**32))
    assert np.all(bs.LengthDist(7).sample(rng, 10) == 7)
    u = bs.LengthDist(100, "uniform", 0.5).sample(rng, 20000)
    assert u.min() == 50 and u.max() == 150 and u.mean() == pytest.approx(100, rel=0.02)
    ln = bs.LengthDist(200, "lognormal", 0.5).sample(rng, 20000)
    assert ln.mean() == pytest.approx(200, rel=0.03)  # sigma of the mean ~0.4%
    assert bs.LengthDist(200, "lognormal", 1.0).sample(rng, 1000, maximum=300).max() <= 300
    assert bs.LengthDist(288, "uniform", 0.78).describe() == "uniform 63-513"
    for bad in (dict(mean=0), dict(mean=5, dist="zipf"), dict(mean=5, dist="uniform", spread=1.5)):
        with pytest.raises(bs.BenchError):
            bs.LengthDist(**bad)


# ---- command line --------------------------------------------------------------------------------
def test_parse_args():
    a = bs.parse_args(["--spawn", "--prefill-workers", "2", "--rate", "1.5", "--input-dist", "lognormal",
                       "--num-requests", "10"])
    assert a.spawn and a.prefill_workers == 2 and a.decode_workers == 1 and a.rate == 1.5
    assert a.workload.input == bs.LengthDist(128, "lognormal", 0.5) and a.workload.num_requests == 10
    assert math.isinf(bs.parse_args(["--url", "http://x:1"]).rate)
    assert bs.parse_args(["--url", "http://x:1", "--api", "grpc", "--grpc-target", "x:2"]).api == "grpc"
    for argv in ([], ["--url", "u", "--spawn"], ["--spawn", "--rate", "0"], ["--spawn", "--rate", "fast"],
                 ["--spawn", "--prefill-workers", "0"], ["--url", "u", "--api", "grpc"],
                 ["--spawn", "--input-dist", "uniform", "--input-spread", "2"], ["--spawn", "--warmup", "-1"],
                 ["--spawn", "--rates", "1,0"], ["--spawn", "--rates", "1,x"],
                 ["--spawn", "--rates", "1,2", "--workload", "chat"]):
        with pytest.raises(SystemExit):
            bs.parse_args(argv)
    rates = sorted(random.sample(range(1, 50), 3))
    assert bs.parse_args(["--url", "u", "--rates", ",".join(map(str, rates)) + ",inf"]).rates == [*rates, math.inf]


def test_cpu_accounting_counts_a_process_group():
    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('done', flush=True)\ntime.sleep(30)")
    machine0 = bs.machine_cpu_seconds()
    p = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "done"
        used = bs.group_cpu_seconds({p.pid})
        assert 0.29 <= used < 5.0
        assert bs.machine_cpu_seconds() - machine0 >= 0.29
        assert bs.group_cpu_seconds({p.pid + 10**7}) == 0  # no such group
    finally:
        p.kill()
        p.wait()


# ---- doc section ---------------------------------------------------------------------------------
def test_update_doc_keeps_other_sections(tmp_path):
    doc = tmp_path / "performance.md"
    bs.update_doc(doc, "run A", "table A1")
    text = doc.read_text()
    assert text.startswith(bs.DOC_TITLE) and bs.SECTION_HEADING in text and "table A1" in text
    # another part owns "## Kernels", before and after ours
    doc.write_text(text.replace(bs.SECTION_HEADING, "## Kernels\n\nkernel table\n\n" + bs.SECTION_HEADING)
                   + "\n## Kernels 2\n\nmore\n")
    bs.update_doc(doc, "run B", "table B")
    bs.update_doc(doc, "run A", "table A2")
    text = doc.read_text()
    assert "table A1" not in text and text.count("### run A") == 1
    assert text.index("table A2") < text.index("table B")  # a rerun keeps its place
    assert "## Kernels\n\nkernel table\n" in text and text.rstrip().endswith("## Kernels 2\n\nmore")
    doc.write_text(text.replace(bs.DOC_END, ""))
    with pytest.raises(bs.BenchError):
        bs.update_doc(doc, "run C", "x")


def _replace_kernels_section(path, body: str) -> None:
    """The rule bench/kernels.py follows for its own section: replace from '## Kernels' to the next
    '## ' heading, or append at the end."""
    text = path.read_text()
    start = text.find("## Kernels")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        nxt = text.find("\n## ", start + 3)
        text = text[:start] + body + (text[nxt + 1:] if nxt >= 0 else "")
    path.write_text(text)


def test_kernels_writer_leaves_serving_section(tmp_path):
    doc = tmp_path / "performance.md"
    bs.update_doc(doc, "run A", "serving table")
    _replace_kernels_section(doc, "## Kernels\n\nkernel table 1\n")  # appended after ours
    bs.update_doc(doc, "run B", "serving table B")
    _replace_kernels_section(doc, "## Kernels\n\nkernel table 2\n")
    text = doc.read_text()
    assert "serving table" in text and "serving table B" in text and "kernel table 2" in text
    assert "kernel table 1" not in text
    assert text.index(bs.DOC_BEGIN) < text.index("### run A") < text.index("### run B") < text.index(bs.DOC_END)
    # and with the kernels section first, replacing it stops at our heading
    doc.write_text("# Performance\n\n## Kernels\n\nold\n\n" + text[text.index(bs.SECTION_HEADING):])
    _replace_kernels_section(doc, "## Kernels\n\nnew\n\n")
    text = doc.read_text()
    assert "old" not in text and "new" in text and "serving table B" in text and bs.DOC_BEGIN in text


# ---- server metrics ------------------------------------------------------------------------------
def test_server_view_from_router_metrics():
    from pdserve.proto import pdserve_pb2 as pb
    from pdserve.router.metrics import RouterMetrics

    m = RouterMetrics()
    before = bs.parse_metrics(m.render().decode())
    sizes = [random.randrange(1, 1 << 20) for _ in range(3)]
    for b in sizes:
        m.observe_prefill(pb.PrefillResponse(kv_bytes=b, kv_transfer_seconds=0.5, queue_seconds=0.1,
                                             compute_seconds=0.2))
    m.observe_tokens(1, 0.4, first=True)
    m.retries.labels("prefill", "UNAVAILABLE").inc()
    view = bs.ServerView.delta(before, bs.parse_metrics(m.render().decode()))
    assert view.prefills == 3 and view.kv_bytes == sum(sizes) and view.kv_seconds == pytest.approx(1.5)
    assert view.kv_bandwidth == pytest.approx(sum(sizes) / 1.5)
    assert view.prefill_queue_s == pytest.approx(0.1) and view.prefill_compute_s == pytest.approx(0.2)
    assert view.router_ttft_s == pytest.approx(0.4) and view.retries == 1


def test_render_tables_ratios():
    reqs = [bs.Request(0, 0.0, [1] * 4, 3, 0)]
    fast = bs.summarize([bs.Outcome(0, 0.0, 4, end=1.0, output_tokens=3, events=[(0.1, 1), (0.5, 2)])], reqs)
    slow = bs.summarize([bs.Outcome(0, 0.0, 4, end=2.0, output_tokens=3, events=[(0.2, 1), (1.0, 2)])], reqs)
    md = bs.render_tables(fast, slow, None, "cluster", bs.CPUUse(1.0, 0.1, 2.1), bs.CPUUse(3.0, 0.0, 4.0))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip()}
    assert rows["requests/s"] == ["1.00", "0.50", "2.00x"]
    assert rows["server CPU per completed request (ms)"] == ["1,000.0", "3,000.0", "0.33x"]
    assert rows["other work on the machine (cores busy)"] == ["1.00", "0.50", ""]
    assert rows["TTFT"] == ["cluster", "100.0", "100.0", "100.0", "100.0"]


def test_render_sweep_one_row_per_rate_and_system():
    reqs = [bs.Request(0, 0.0, [1] * 4, 3, 0)]
    t = random.uniform(0.05, 0.5)
    run = bs.summarize([bs.Outcome(0, 0.0, 4, end=4 * t, output_tokens=3, events=[(t, 1), (2 * t, 2)])], reqs)
    md = bs.render_sweep([2.0, math.inf], [run, run], [run, None])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in md.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["2", "cluster"], ["2", "single process"], ["inf", "cluster"]]
    assert rows[0][2:] == ["1 / 1", f"{1 / (4 * t):.2f}", f"{3 / (4 * t):.1f}", f"{1e3 * t:.1f}", f"{1e3 * t:.1f}",
                           f"{1e3 * 1.5 * t:.2f}", f"{1e3 * 1.5 * t:.2f}"]


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_baseline_runs_the_schedule(tiny_mxfp4):
    w = bs.Workload(3, 20.0, bs.LengthDist(16, "uniform", 0.5), bs.LengthDist(3), seed=random.randrange(100))
    outcomes, cpu = bs.run_engine(str(tiny_mxfp4), w.requests(), w.warmup(1), concurrency=2, temperature=1.0,
                                  ignore_eos=True, stop_token_ids=[], max_batch_size=4)
    assert [o.index for o in outcomes] == [0, 1, 2] and all(o.ok for o in outcomes)
    assert all(o.output_tokens == 3 and len(o.events) == 3 and 0 < o.ttft <= o.e2e for o in outcomes)
    assert cpu.server_s > 0
    # concurrency 2: the third request starts no earlier than the first one's end
    assert outcomes[2].start >= min(o.end for o in outcomes[:2]) - 1e-9


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawned_cluster_end_to_end(tiny_mxfp4, tmp_path):
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    argv = ["--spawn", "--model", str(tiny_mxfp4), "--num-requests", "5", "--rate", "8", "--input-len", "32",
            "--input-dist", "uniform", "--output-len", "5", "--warmup", "1", "--max-batch-size", "8",
            "--json", str(out), "--doc", str(doc), "--log-dir", str(tmp_path)]
    assert bs.main(argv) == 0
    r = json.loads(out.read_text())
    cluster, base, server = r["cluster"], r["baseline"], r["server"]
    assert cluster["completed"] == cluster["sent"] == 5 and cluster["errors"] == {}
    assert base["completed"] == 5
    assert server["prefills"] == 5 and server["kv_bytes"] > 0 and server["kv_seconds"] > 0
    for o in r["outcomes"]:
        assert 1 <= o["output_tokens"] <= 5 and o["events"] and o["end"] > o["events"][0][0] > o["start"]
    assert cluster["output_tokens"] == sum(o["output_tokens"] for o in r["outcomes"])
    assert r["cpu"]["server_s"] > 0 and r["cpu"]["client_s"] > 0
    assert r["cpu"]["machine_s"] >= r["cpu"]["server_s"] + r["cpu"]["client_s"] - 0.5  # tick rounding
    text = doc.read_text()
    assert "### tiny-mxfp4, 1P+1D, completions, 5 requests, Poisson 8 req/s" in text and "KV transfer" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rate_sweep_one_cluster_one_baseline_engine(tiny_mxfp4, tmp_path, monkeypatch):
    made = []
    real = bs.baseline_engine
    monkeypatch.setattr(bs, "baseline_engine", lambda *args, **kw: made.append(1) or real(*args, **kw))
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    argv = ["--spawn", "--model", str(tiny_mxfp4), "--num-requests", "3", "--rates", "8,inf", "--input-len", "16",
            "--output-len", "3", "--warmup", "1", "--max-batch-size", "4", "--json", str(out), "--doc", str(doc),
            "--log-dir", str(tmp_path)]
    assert bs.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["rates"] == [8, math.inf]
    assert len(r["runs"]) == 2 and made == [1]
    for run in r["runs"]:
        assert run["cluster"]["completed"] == run["baseline"]["completed"] == 3
        assert run["server"]["prefills"] == 3  # the warm-up (first rate only) is not counted
    assert "Poisson 8 req/s" in r["runs"][0]["title"] and "all at once" in r["runs"][1]["title"]
    text = doc.read_text()
    assert "### tiny-mxfp4, 1P+1D, completions, 3 requests, rates 8, inf req/s" in text
    assert text.count("| 8 | cluster 1P+1D |") == 1 and text.count("| inf | single process |") == 1
