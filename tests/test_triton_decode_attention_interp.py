"""The Triton split-KV decode attention (kernels/triton_decode_attention.py) in Triton's CPU
interpreter, against `sink_attention_ref` (one query per request: its last position).

The kernel runs in a child process with TRITON_INTERPRET=1 (read when triton is imported, so it
must not leak into this process); this process draws fresh inputs (requests of 1, 15, 16, 17 and
300 keys on shuffled 16-token pages, page-table entries past a request's pages pointing far
outside the cache so a stray read fails, padded rows beyond the batch), runs the reference and
compares. Outputs are poisoned with NaN first, so an unwritten element fails.

Configurations: the default tiling (a few 64-key splits per request), a fine one (16-key blocks,
up to 16 splits: the combine runs more than one step, or folds them all in one), and the tilings
the engine runs by layer type; full attention and windows of 128 and 21 keys, GQA groups of 4
(padded to 16 rows) and 8 (gpt-oss).

Tolerances (relative L2): float32 1e-5 (the same softmax in another order, ~1e-7); bf16 1e-2:
the inputs are exact in both, but the interpreter casts float32 to bf16 by truncation (< 2^-7
relative per element; the GPU rounds to nearest), measured ~4e-3. Running a launch twice is
bit-identical and leaves the arrival counters at zero, and reading each split's first block before
the PDL wait (`EARLY_KV`) gives the same bits as reading it in the loop.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from numerics import rel_l2

pytest.importorskip("triton")

PAGE = 16
LENS = [1, 15, 16, 17, 300]
FINE = dict(block_n=16, min_keys=16, programs=1024, max_splits=16)
FINE_ONE_FOLD = dict(FINE, combine_splits=16)  # every partial folded in one combine step


def _engine_tilings() -> dict[str, dict]:
    from dataclasses import asdict

    from pdserve.kernels.triton_decode_attention import FULL_LAYERS, WINDOWED_LAYERS

    return {"full": asdict(FULL_LAYERS), "window": asdict(WINDOWED_LAYERS)}


def _cases(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    engine = _engine_tilings()
    out = []
    for dtype, hq, hkv, d, window_left, cfg in (
        (torch.float32, 8, 2, 16, -1, {}),
        (torch.float32, 8, 2, 16, 127, FINE),
        (torch.float32, 16, 2, 32, 20, {}),
        (torch.float32, 16, 2, 32, -1, FINE),
        (torch.bfloat16, 16, 2, 64, -1, FINE),
        (torch.bfloat16, 16, 2, 64, 127, {}),
        (torch.float32, 16, 2, 32, -1, FINE_ONE_FOLD),
        (torch.bfloat16, 16, 2, 64, -1, engine["full"]),
        (torch.bfloat16, 16, 2, 64, 127, engine["window"]),
    ):
        lens = LENS[:]
        perm_lens = torch.randperm(len(lens), generator=g).tolist()
        lens = [lens[i] for i in perm_lens]
        pages = [-(-k // PAGE) for k in lens]
        total = sum(pages) + 3
        perm = torch.randperm(total, generator=g).tolist()
        rows = len(lens) + 2  # two padded table rows past the batch
        table = torch.full((rows, max(pages) + 2), 1 << 20, dtype=torch.int32)  # far outside the cache
        at = 0
        for i, p in enumerate(pages):
            table[i, :p] = torch.tensor(perm[at : at + p], dtype=torch.int32)
            at += p
        out.append(dict(
            dtype=dtype, window_left=window_left, cfg=cfg, lens=lens, table=table,
            seq_lens=torch.tensor(lens + [1] * (rows - len(lens)), dtype=torch.int32),
            kv=torch.randn(total, 2, PAGE, hkv, d, generator=g).to(dtype),
            q=torch.randn(len(lens), hq, d, generator=g).to(dtype),
            sinks=torch.randn(hq, generator=g) * 2, sm_scale=d ** -0.5,
        ))
    return out


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels import triton_decode_attention as tda
    from pdserve.kernels.triton_decode_attention import DecodeConfig, DecodeScratch, num_splits, paged_decode_attention

    results = []
    for c in torch.load(in_path):
        q, kv = c["q"], c["kv"]
        cfg = DecodeConfig(**c["cfg"])
        hq, hkv, d = q.shape[1], kv.shape[3], q.shape[2]
        max_keys = max(c["lens"]) if c["window_left"] < 0 else c["window_left"] + 1
        splits = num_splits(q.shape[0], hkv, max_keys, torch.device("cpu"), cfg)
        scratch = DecodeScratch(q.shape[0], hkv, hq // hkv, d, splits, "cpu")
        outs = []
        for early in (True, True, False):
            tda.EARLY_KV = early
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(q, kv, c["table"], c["seq_lens"], c["sinks"], c["sm_scale"], c["window_left"],
                                   scratch, out=out, cfg=cfg)
            outs.append(out)
        results.append(dict(out=outs[0], again=outs[1], late=outs[2], splits=splits, counters=scratch.count.clone()))
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    seed = module_seed
    cases = _cases(seed)
    return cases, run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("decode_interp"), seed)


def _reference(c) -> torch.Tensor:
    from pdserve.kernels.attention import sink_attention_ref

    kv, outs = c["kv"], []
    for i, n in enumerate(c["lens"]):
        pages = c["table"][i, : -(-n // PAGE)].long()
        k = kv[pages, 0].flatten(0, 1)[:n]
        v = kv[pages, 1].flatten(0, 1)[:n]
        outs.append(sink_attention_ref(c["q"][i : i + 1].float(), k.float(), v.float(), c["sinks"], c["sm_scale"],
                                       c["window_left"]))
    return torch.cat(outs)


def test_matches_reference(run):
    cases, results = run
    for c, r in zip(cases, results):
        assert not r["out"].isnan().any(), "unwritten output element"
        assert r["out"].dtype == c["dtype"]
        tol = 1e-5 if c["dtype"] == torch.float32 else 1e-2
        err = rel_l2(r["out"], _reference(c))
        assert err < tol, f"window {c['window_left']} cfg {c['cfg']} splits {r['splits']}: rel L2 {err:.2e}"


def test_deterministic_and_counters_reset(run):
    cases, results = run
    assert max(r["splits"] for r in results) >= 16  # the fine tiling folds partials in >1 combine step
    for r in results:
        assert torch.equal(r["out"], r["again"])
        assert not r["counters"].any()


def test_first_block_read_early_changes_nothing(run):
    """EARLY_KV (each split's first block read before the PDL wait, the step's key re-read after
    it) runs the same arithmetic in the same order as reading every block in the loop."""
    _, results = run
    for r in results:
        assert torch.equal(r["out"], r["late"])


def test_rejects_mismatched_inputs():
    from pdserve.kernels.triton_decode_attention import DecodeScratch, paged_decode_attention

    q = torch.zeros(2, 8, 16)
    kv = torch.zeros(4, 2, PAGE, 2, 16)
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    sinks = torch.zeros(8)
    scratch = DecodeScratch(2, 2, 4, 16, 1, "cpu")
    with pytest.raises(ValueError, match="does not match"):
        paged_decode_attention(q, torch.zeros(4, 2, PAGE, 3, 16), table, lens, sinks, 0.25, -1, scratch)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kv, table.long(), lens, sinks, 0.25, -1, scratch)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, kv, table, lens, sinks.to(torch.bfloat16), 0.25, -1, scratch)
    with pytest.raises(ValueError, match="page-table rows"):
        paged_decode_attention(q, kv, table[:1], lens, sinks, 0.25, -1, scratch)
    with pytest.raises(ValueError, match="scratch"):
        paged_decode_attention(torch.zeros(3, 8, 16), kv, torch.zeros(3, 3, dtype=torch.int32),
                               torch.ones(3, dtype=torch.int32), sinks, 0.25, -1, scratch)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
