"""The per-layer fused kernels (kernels/triton_norm.py, triton_rope.py, triton_router.py) in
Triton's CPU interpreter, against the plain-torch path they replace.

The kernels run in one child process with TRITON_INTERPRET=1 (read when triton is imported, so it
must not leak into this process); this process draws fresh inputs, runs the references and
compares. Output buffers the kernels fill are checked for NaN (the cache is pre-filled with random
values and compared whole, so a write to a wrong slot fails too). float32 and float16 only: the
interpreter casts float32 to bf16 by truncation (the GPU tests cover bf16).

Tolerances:
- RoPE + KV write: bit-exact (same roundings in the same order); one token's QKV GEMV + RoPE + KV
  write in one launch: bit-exact against the bf16 GEMV then the RoPE + KV write;
- residual add: bit-exact; the normed output: rel L2 2e-6 (float32) / 1e-3 (float16): the sum of
  squares is summed in another order and the interpreter's rsqrt is 1/sqrt, not libdevice's;
- router logits: rel L2 1e-6 / 1e-3 (summation order); ids: the top 4 of the kernel's own logits
  (equal ones: the lower id first), and the reference's top 4 up to twice the largest logit error
  (the summation order, or float16 rounding, may swap logits the reference puts that close);
  weights, against torch's softmax of the kernel's own top-4 logits: 1e-6 (the interpreter's exp is
  numpy's, not libdevice's: the GPU test is bit-exact).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from numerics import rel_l2

pytest.importorskip("triton")

DTYPES = (torch.float32, torch.float16)


def _cases(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for dt in DTYPES:
        # norm: ragged hidden size (not a power of two), a few rows
        t, h = 3, 200
        out.append(dict(kind="norm", dtype=dt, x=(torch.randn(t, h, generator=g) * 3).to(dt),
                        delta=torch.randn(t, h, generator=g).to(dt),
                        weight=1 + 0.1 * torch.randn(h, generator=g), eps=1e-5))
        # rope: 6 q heads / 2 kv heads (head groups not a power of two), D 16, page 4
        t, hq, hkv, d, blocks, page = 5, 6, 2, 16, 7, 4
        pos = torch.randint(0, 500, (t,), generator=g)
        slots = torch.randperm(blocks * page, generator=g)[:t]
        cache = torch.randn(blocks, 2, page, hkv, d, generator=g).to(dt)
        out.append(dict(kind="rope", dtype=dt, qkv=torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dt),
                        pos=pos, slots=slots, cache=cache, hq=hq, hkv=hkv))
        # one token's projection too (K ragged: 600 = a 512-wide step and a masked one)
        k = 600
        out.append(dict(kind="qkv_rope", dtype=dt, x=torch.randn(1, k, generator=g).to(dt),
                        w=(torch.randn((hq + 2 * hkv) * d, k, generator=g) * 0.05).to(dt),
                        b=torch.randn((hq + 2 * hkv) * d, generator=g).to(dt), pos=pos[:1], slots=slots[:1],
                        cache=cache, hq=hq, hkv=hkv))
        # router: 128 experts (the launch shape of triton_router.LAUNCH_SHAPES: 16 splits of 64
        # columns), 32 (8 splits of 128) and 8 (2 splits); the bias lifts a few experts (one vector
        # for all rows, so a row's 4th and 5th logits may still be close, or equal in float16)
        for e in (128, 32, 8):
            t, h = 4, 1000
            x = torch.randn(t, h, generator=g).to(dt)
            w = (torch.randn(e, h, generator=g) * 0.05).to(dt)
            b = torch.zeros(e)
            for r in range(t):
                top = torch.randperm(e, generator=g)[:4]
                b[top] += 3 + torch.rand(4, generator=g)
            out.append(dict(kind="router", dtype=dt, x=x, w=w, b=b.to(dt)))
        # NaN logits (a row of NaN activations, one NaN weight row, -inf biases): every pick is a real
        # expert, once a row (a pick past the experts would index past the MoE weights)
        e, h = 32, 1000
        x = torch.randn(3, h, generator=g).to(dt)
        x[0] = float("nan")
        w = (torch.randn(e, h, generator=g) * 0.05).to(dt)
        w[5] = float("nan")
        b = torch.zeros(e)
        b[:30] = float("-inf")
        out.append(dict(kind="router_nan", dtype=dt, x=x, w=w, b=b.to(dt)))
    return out


def _rope_cfg():
    import dataclasses

    from pdserve.engine.config import preset

    return dataclasses.replace(preset("tiny"), head_dim=16)


def _child(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.engine.rope import RotaryEmbedding
    from pdserve.kernels.triton_norm import add_rms_norm
    from pdserve.kernels.triton_bf16_gemv import GemvConfig, bf16_gemv
    from pdserve.kernels.triton_rope import qkv_rope_write, rope_qkv_write
    from pdserve.kernels.triton_router import route_fused

    rope = RotaryEmbedding(_rope_cfg(), torch.device("cpu"), max_positions=512)
    results = []
    for c in torch.load(in_path):
        if c["kind"] == "norm":
            res, out = add_rms_norm(c["x"], c["delta"], c["weight"], c["eps"])
            same, normed = add_rms_norm(c["x"], None, c["weight"], c["eps"])
            results.append(dict(res=res, out=out, same=same, normed=normed))
        elif c["kind"] == "rope":
            cache = c["cache"].clone()
            q = rope_qkv_write(c["qkv"], c["pos"], rope.cos, rope.sin, c["slots"], cache, c["hq"], c["hkv"])
            results.append(dict(q=q, cache=cache))
        elif c["kind"] == "qkv_rope":
            two_step, fused = c["cache"].clone(), c["cache"].clone()
            qkv = bf16_gemv(c["x"], c["w"], c["b"], GemvConfig(block_n=8, block_k=512, split_k=1))  # K unsplit, as fused
            q2 = rope_qkv_write(qkv, c["pos"], rope.cos, rope.sin, c["slots"], two_step, c["hq"], c["hkv"])
            q1 = qkv_rope_write(c["x"], c["w"], c["b"], c["pos"], rope.cos, rope.sin, c["slots"], fused,
                                c["hq"], c["hkv"])
            results.append(dict(q_fused=q1, cache_fused=fused, q=q2, cache=two_step))
        elif c["kind"] == "router_nan":
            w, ids = route_fused(c["x"], c["w"], c["b"], 4)
            results.append(dict(weights=w, ids=ids))
        else:
            w, ids, logits = route_fused(c["x"], c["w"], c["b"], 4, return_logits=True)
            again = route_fused(c["x"], c["w"], c["b"], 4)  # the arrival counters were reset
            results.append(dict(weights=w, ids=ids, logits=logits, again=again))
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    seed = module_seed
    cases = _cases(seed)
    return cases, run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("fused_interp"), seed)


def _of(run, kind):
    cases, results = run
    return [(c, r) for c, r in zip(cases, results) if c["kind"] == kind]


def test_add_rms_norm(run):
    from pdserve.engine.model import rms_norm

    for c, r in _of(run, "norm"):
        x = c["x"] + c["delta"]
        assert torch.equal(r["res"], x)
        assert torch.equal(r["same"], c["x"])
        tol = 2e-6 if c["dtype"] == torch.float32 else 1e-3
        for got, inp in ((r["out"], x), (r["normed"], c["x"])):
            assert got.dtype == c["dtype"] and not got.isnan().any()
            assert rel_l2(got, rms_norm(inp, c["weight"], c["eps"])) < tol


def test_rope_kv_write(run):
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.engine.rope import RotaryEmbedding

    rope = RotaryEmbedding(_rope_cfg(), torch.device("cpu"), max_positions=512)
    for c, r in _of(run, "rope"):
        hq, hkv = c["hq"], c["hkv"]
        d = c["cache"].shape[-1]
        qkv = c["qkv"]
        q = rope(qkv[:, : hq * d].view(-1, hq, d), c["pos"])
        k = rope(qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d), c["pos"])
        v = qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
        cache = c["cache"].clone()
        page = cache.shape[2]
        PagedKVCache.write(_OneLayer(cache, page), 0, {"full": c["slots"]}, k, v)
        assert r["q"].is_contiguous() and torch.equal(r["q"], q)
        assert torch.equal(r["cache"], cache)


def test_qkv_rope_one_launch(run):
    for c, r in _of(run, "qkv_rope"):
        assert not r["q_fused"].isnan().any()
        assert torch.equal(r["q_fused"], r["q"])
        assert torch.equal(r["cache_fused"], r["cache"])
        assert not torch.equal(r["cache"], c["cache"])  # the token's K and V were written


class _OneLayer:
    """Just enough of a PagedKVCache for its `write` on a bare layer tensor."""

    def __init__(self, cache, page_size):
        self.cache, self.page_size, self.layer_group = cache, page_size, [("full", 0)]

    def layer_cache(self, layer):
        return self.cache


def test_router(run):
    for c, r in _of(run, "router"):
        ref_logits = torch.nn.functional.linear(c["x"].float(), c["w"].float(), c["b"].float())
        tol = 1e-6 if c["dtype"] == torch.float32 else 1e-3
        assert rel_l2(r["logits"], ref_logits) < tol
        # the top 4 of its own rounded logits, equal ones lower id first (the kernel's rule; torch.topk
        # leaves their order open): a stable descending sort
        own = torch.sort(r["logits"], dim=-1, descending=True, stable=True)
        assert torch.equal(r["ids"], own.indices[:, :4])
        # and the reference's top 4, up to the kernel's own logit error: its summation order can swap two
        # logits the reference puts closer than twice that error (float16 rounding can tie them outright)
        err = (r["logits"].float() - ref_logits).abs().max().item()
        picked = ref_logits.gather(1, r["ids"])
        top = torch.topk(ref_logits, 4, dim=-1, sorted=True).values
        assert (picked - top).abs().max().item() <= 2 * err, (r["ids"], picked, top, err)
        assert r["weights"].dtype == c["dtype"]
        assert torch.equal(r["again"][0], r["weights"]) and torch.equal(r["again"][1], r["ids"])
        tol = 1e-6 if c["dtype"] == torch.float32 else 1e-3  # float16: the weights' own rounding
        assert rel_l2(r["weights"], torch.softmax(own.values[:, :4].float(), -1)) < tol


def test_router_picks_real_experts_whatever_the_logits(run):
    for c, r in _of(run, "router_nan"):
        e = c["w"].shape[0]
        ids = r["ids"]
        assert ((ids >= 0) & (ids < e)).all(), ids
        assert all(len(set(row.tolist())) == 4 for row in ids), ids
        # row 1: expert 5's logit is NaN, 30, 31 the only finite ones: they come first, then the
        # lowest ids among the rest (all compete as -inf)
        assert ids[1, :2].sort().values.tolist() == [30, 31] and ids[1, 2:].tolist() == [0, 1]


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
