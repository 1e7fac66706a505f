"""The CPU-checkable parts of the DeepGEMM peer in bench/kernels.py: the m-grouped layout it
builds, the dequantised reference, and how the parent picks and reports a child run."""

import json
import subprocess
import sys

import pytest
import torch

from pdserve.bench import kernels


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(kernels, "DEV", "cpu")


def test_routing_layout_pads_each_expert_to_the_block(cpu):
    num_e, t, align = 32, 300, 128
    m_idx = kernels._dg_routing(num_e, t, align)
    assert m_idx.dtype == torch.int32 and m_idx.numel() % align == 0
    valid = m_idx[m_idx >= 0]
    assert valid.numel() == t * kernels.TOP_K
    assert torch.all(valid[1:] >= valid[:-1])  # sorted by expert
    for block in m_idx.view(-1, align):  # one expert per block, rows first, padding last
        e = int(block[0])
        assert e >= 0
        n = int((block == e).sum())
        assert torch.all(block[:n] == e) and torch.all(block[n:] == -1)


def test_dequant_matches_blockwise_scaling(cpu):
    r, k, g = 200, 300, 128  # neither a multiple of its block
    x = kernels._rand_fp8((r, k), 384)
    assert torch.all(x[:, k:].float() == 0) and torch.isfinite(x.float()).all()
    s = torch.rand(-(-r // g), -(-k // 128)) + 0.5
    want = torch.empty(r, k)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * g, (bi + 1) * g), slice(bj * 128, min((bj + 1) * 128, k))
            want[rows, cols] = x[rows, cols].float() * s[bi, bj]
    torch.testing.assert_close(kernels._dequant(x, s, g, k), want, rtol=0, atol=0)


class FakeDeepGemm:
    """DeepGEMM's SM90 semantics written out per 128-wide K block: d = sum over K blocks of
    (a_blk @ w_blk^T) * row scale of a * 128x128 block scale of w. `k_tail=False` mimics a kernel
    that drops a partial last K block."""

    __version__ = "0.0-fake"
    __file__ = "/fake/deep_gemm/__init__.py"

    def __init__(self, k_tail: bool):
        self.k_tail, self.k_seen = k_tail, []

    @staticmethod
    def get_mk_alignment_for_contiguous_layout():
        return 128

    def _mm(self, a, sa, w, sw):
        k = a.shape[1]
        nb = -(-k // 128) if self.k_tail else k // 128
        out = torch.zeros(a.shape[0], w.shape[0])
        for j in range(nb):
            cols = slice(j * 128, (j + 1) * 128)
            ws = sw[:, j].repeat_interleave(128)[: w.shape[0]]
            out += (a[:, cols].float() @ w[:, cols].float().T) * sa[:, j : j + 1] * ws
        return out

    def fp8_gemm_nt(self, a, b, d):
        d.copy_(self._mm(a[0], a[1], b[0], b[1]))

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, m_idx):
        self.k_seen.append(a[0].shape[1])
        assert a[1].stride(0) == 1  # activation scales handed over MN-major
        for e in m_idx[m_idx >= 0].unique().tolist():
            rows = m_idx == e
            d[rows] = self._mm(a[0][rows], a[1][rows], b[0][e], b[1][e]).to(d.dtype)


@pytest.mark.parametrize("k_tail", [True, False])
def test_child_checks_results_and_pads_k_only_when_needed(cpu, monkeypatch, capsys, k_tail):
    fake = FakeDeepGemm(k_tail)
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setitem(sys.modules, "tvm_ffi", type(sys)("tvm_ffi"))
    sys.modules["tvm_ffi"].__version__ = "0.0-fake"
    timed = []  # (K of the grouped GEMM the timed function ran, the time handed back)

    def time_graph(fn, reps=25):
        before = len(fake.k_seen)
        fn()
        ran = fake.k_seen[before:]
        assert len(ran) == 1, ran  # a timed function runs exactly one grouped GEMM
        timed.append((ran[0], 1e-3 * (len(timed) + 1)))  # a distinct time per call
        return timed[-1][1]
    monkeypatch.setattr(kernels, "time_graph", time_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(kernels, "MODELS", {"tiny": 4})
    # K of gate_up not a multiple of 128 (like 2880), N of down not either
    monkeypatch.setattr(kernels, "HIDDEN", 200)
    monkeypatch.setattr(kernels, "INTER", 128)
    monkeypatch.setattr(kernels, "TOP_K", 1)
    kernels.deepgemm_child(quick=True)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("DEEPGEMM_JSON ")]
    res = json.loads(lines[-1][len("DEEPGEMM_JSON "):])
    assert res["smoke_rel_err"] < 1e-2
    # only the attempt whose results were right is timed, plain then with the bias add, and each
    # time lands in its own field
    gate_up_k = 200 if k_tail else 256
    assert [k for k, _ in timed] == [gate_up_k, gate_up_k, 128, 128] * 2
    times = iter(t for _, t in timed)
    for t in (1024, 8192):
        case = res[f"tiny/{t}"]
        assert case["gate_up_k"] == gate_up_k and case["down_k"] == 128
        assert case["gate_up_rel_err"] < 1e-2 and case["down_rel_err"] < 1e-2
        assert [case[f] for f in ("gate_up", "gate_up_bias", "down", "down_bias")] == \
            [next(times) for _ in range(4)]
    runs = [k for i, k in enumerate(fake.k_seen) if i == 0 or fake.k_seen[i - 1] != k]
    assert runs == ([200, 128] * 2 if k_tail else [200, 256, 128] * 2)  # padded only if needed


def _completed(stdout: str, stderr: str = "", rc: int = 0):
    return subprocess.CompletedProcess([], rc, stdout, stderr)


def _case(k: int, err: float = 3e-3) -> dict:
    return {"gate_up": 1e-4, "gate_up_bias": 1.2e-4, "gate_up_rel_err": err, "gate_up_k": k,
            "down": 6e-5, "down_bias": 7e-5, "down_rel_err": 3e-3, "down_k": 3072}


def test_source_build_is_tried_first_and_partial_output_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("DG_SITE", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    seen = []
    first = {"version": "0.1.2", "smoke_rel_err": 2e-3, "20b/1024": _case(2880)}

    def fake_run(cmd, env, **kw):
        seen.append(env["PYTHONPATH"])
        lines = "DEEPGEMM_JSON " + json.dumps({"version": "0.1.2"}) + "\nDEEPGEMM_JSON " + json.dumps(first)
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=lines.encode(), stderr=b"slow")

    monkeypatch.setattr(subprocess, "run", fake_run)
    res = kernels.run_deepgemm(quick=True)
    assert seen == [f"{tmp_path}:/somewhere"]  # one attempt: it produced results
    assert res["20b/1024"]["gate_up"] == 1e-4
    assert "0.1.2" in res["status"] and "unpadded" in res["status"] and "partial: timeout" in res["status"]
    assert "WRONG" not in res["status"]


def test_padding_and_wrong_results_are_reported(monkeypatch):
    monkeypatch.delenv("DG_SITE", raising=False)
    out = {"version": "0.1.2", "smoke_rel_err": 0.4, "20b/1024": _case(2944, err=0.3)}
    line = "DEEPGEMM_JSON " + json.dumps(out)
    monkeypatch.setattr(subprocess, "run", lambda cmd, env, **kw: _completed(line))
    status = kernels.run_deepgemm(quick=True)["status"]
    assert "zero-padded to 2944" in status and "WRONG RESULTS" in status and "partial" not in status


def test_all_attempts_failing_gives_the_assertion(monkeypatch, tmp_path):
    monkeypatch.delenv("DG_SITE", raising=False)
    monkeypatch.setenv("DG_TVM_FFI_SITE", str(tmp_path))
    calls = []

    def fake_run(cmd, env, **kw):
        calls.append(cmd)
        assert cmd[:3] == [sys.executable, "-m", "pdserve.bench.kernels"]
        return _completed("", "Assertion error (utils/layout.hpp:16): dim == 2 or dim == 3", rc=-6)

    monkeypatch.setattr(subprocess, "run", fake_run)
    res = kernels.run_deepgemm(quick=False)
    assert len(calls) == 2 and len(res["attempts"]) == 2
    assert "dim == 2 or dim == 3" in res["status"] and "build_deepgemm.sh" in res["status"]
