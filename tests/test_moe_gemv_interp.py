"""The GEMV decode kernels (kernels/triton_moe_gemv.py) in Triton's CPU interpreter, against the
plain-torch reference (kernels.moe.experts_forward_ref and its pieces).

The kernels run in one child process with TRITON_INTERPRET=1 (the variable is read when triton is
imported, so it must not leak into this process or other tests); this process draws the inputs,
runs the references and compares. Every buffer a kernel writes is poisoned first (NaN), so an
unwritten element fails.

Tolerances (relative L2):
- activation quantisation (x, and act * routing weight inside the down launch): bit-exact, same
  arithmetic on the same float32 values;
- stages with float32 results (gate/up + SwiGLU; down + combine fed the kernel's own activations,
  float32 output): 1e-5. Products of e4m3 values and float32 scales differ from the reference's
  by at most a rounding or two, the sums by their order: ~1e-7 expected. A wrong scale, row,
  slot or bias is off by > 1e-2;
- down output in fp16, against the reference rounded to fp16: 2e-4 (float32 results ~1e-7 apart
  rarely round to different fp16 neighbours, each such element then off by 2^-11 relative); in
  bf16, against the float32 reference: 8e-3, because the interpreter casts float32 to bf16 by
  truncation (< 2^-7 relative per element; the GPU rounds to nearest);
- whole layer against experts_forward_ref, and the fused-quantisation activations: 1e-2. Both
  sides quantise activations that differ by ~1e-7, which rarely (~1 % of runs at these sizes)
  moves one element across an e4m3 rounding boundary, a 6 % step of that element; the bf16 case
  also carries the interpreter's truncation (~4e-3). The fp32 / fp16 cases measure ~1e-7.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interp import run_in_interpreter
from numerics import rel_l2

pytest.importorskip("triton")


# name: hidden, inter, global experts, local experts, first local, tokens, x dtype, down bias,
# config (gate_up tile, down tile as (block_n, block_k, num_warps, num_stages)), explicit ids
CASES = {
    # gpt-oss' ragged hidden size shape (320 = 2.5 x 128 blocks), default config, T = 1
    "ragged_bf16_default": dict(h=320, i=256, n_global=8, n_local=8, first=0, t=1, dtype=torch.bfloat16,
                                bias=True, config=None, ids=None),
    # EP slice: experts 4..11 of 16; token 0 all local, token 1 half, token 2 none; TP rank != 0
    # (no down bias); gate/up tiles of 256 rows quantise the activations themselves
    "ep_f32_fused": dict(h=320, i=256, n_global=16, n_local=8, first=4, t=3, dtype=torch.float32,
                         bias=False, config=((256, 64, 4, 2), (32, 128, 2, 2)),
                         ids=[[4, 11, 7, 5], [2, 9, 15, 6], [0, 13, 1, 12]]),
    # hidden size a multiple of 128; K steps narrower than a scale block in down; 128-row gate/up
    "h256_fp16": dict(h=256, i=256, n_global=8, n_local=8, first=0, t=3, dtype=torch.float16,
                      bias=True, config=((128, 256, 4, 2), (64, 64, 2, 2)), ids=None),
}
TOP_K = 4


def _make_case(name: str, spec: dict, seed: int) -> dict:
    from pdserve.kernels.fp8 import quantize_weight_fp8
    from pdserve.kernels.moe import route

    g = torch.Generator().manual_seed(seed)
    h, i, e = spec["h"], spec["i"], spec["n_local"]
    gq, gs = quantize_weight_fp8(torch.randn(e, 2 * i, h, generator=g) * 0.02)
    dq, ds = quantize_weight_fp8(torch.randn(e, h, i, generator=g) * 0.02)
    amp = 1 + 3 * torch.rand(spec["t"], 1, generator=g)
    x = (torch.randn(spec["t"], h, generator=g) * amp).to(spec["dtype"])
    if spec["ids"] is None:
        weights, ids = route(x.float(), torch.randn(spec["n_global"], h, generator=g) * 0.05,
                             torch.randn(spec["n_global"], generator=g) * 0.1, TOP_K)
        weights = weights.to(torch.bfloat16)
    else:
        ids = torch.tensor(spec["ids"], dtype=torch.int64)
        weights = torch.softmax(torch.randn(spec["t"], TOP_K, generator=g), -1).to(spec["dtype"])
    return dict(
        name=name, x=x, weights=weights, ids=ids, first=spec["first"], bias=spec["bias"],
        config=spec["config"], gate_up=gq, gate_up_scale=gs, down=dq, down_scale=ds,
        gate_up_bias=torch.randn(e, 2 * i, generator=g) * 0.1, down_bias=torch.randn(e, h, generator=g) * 0.1,
    )


def _weights(c: dict):
    from pdserve.kernels.moe import ExpertWeights

    return ExpertWeights(c["gate_up"], c["gate_up_bias"], c["down"], c["down_bias"],
                         c["gate_up_scale"], c["down_scale"], c["first"])


def _child(in_path: str, out_path: str) -> None:
    """Runs in the interpreter: every stage of every case, with poisoned buffers."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from pdserve.kernels import triton_moe as tm
    from pdserve.kernels import triton_moe_gemv as tg

    tm.POISON = True
    tm.GEMV_MAX_TOKENS = 4  # exercise the dispatch whatever the tuned default
    cases = torch.load(in_path)
    results = {}
    for c in cases:
        w = _weights(c)
        cfg = tg.DEFAULT_CONFIG if c["config"] is None else tg.GemvConfig(
            tg.GemvTile(*c["config"][0]), tg.GemvTile(*c["config"][1]))
        x, weights, ids = c["x"], c["weights"], c["ids"]
        t, h = x.shape
        x_deq = tm._empty((t, h), torch.float32, x.device)
        act = tg.gate_up_swiglu_gemv(x, weights, ids, w, 7.0, 1.702, cfg.gate_up, x_deq=x_deq)
        act_deq = None if cfg.fused_act_quant else tm._empty(act.shape, torch.float32, x.device)
        out = tg.down_combine_gemv(act, weights, ids, w, c["bias"], x.dtype, cfg.down,
                                   act_quantised=cfg.fused_act_quant, act_deq=act_deq)
        layer = tg.experts_forward_gemv(x, weights, ids, w, add_down_bias=c["bias"], config=cfg)
        r = dict(x_deq=x_deq, act=act, act_deq=act_deq, out=out, layer=layer, fused=cfg.fused_act_quant)
        if c["config"] is None and t <= tm.GEMV_MAX_TOKENS:  # the grouped module's dispatch
            calls = []
            gemv = tg.experts_forward_gemv
            tg.experts_forward_gemv = lambda *a, **k: calls.append(1) or gemv(*a, **k)
            r["dispatched"] = tm.experts_forward(x, weights, ids, w, add_down_bias=c["bias"])
            r["dispatch_calls"] = len(calls)
            tg.experts_forward_gemv = gemv
        results[c["name"]] = r
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(cases, results): inputs drawn fresh, kernels run once in an interpreter child."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    cases = [_make_case(name, spec, seed + n) for n, (name, spec) in enumerate(CASES.items())]
    results = run_in_interpreter(__file__, cases, tmp_path_factory.mktemp("gemv_interp"), seed)
    return {c["name"]: c for c in cases}, results


def _local(c: dict) -> torch.Tensor:
    """bool [T, k]: the pair's expert is one of this rank's."""
    n_local = c["gate_up"].shape[0]
    return (c["ids"] >= c["first"]) & (c["ids"] < c["first"] + n_local)


@pytest.mark.parametrize("name", list(CASES))
def test_x_quantisation_bit_exact(run, name):
    from pdserve.kernels.fp8 import dequantize_act_fp8, quantize_act_fp8

    c, r = run[0][name], run[1][name]
    has_local = _local(c).any(1)
    ref = dequantize_act_fp8(*quantize_act_fp8(c["x"]))
    assert torch.equal(r["x_deq"][has_local], ref[has_local])
    assert r["x_deq"][~has_local].isnan().all(), "a token with no local expert was quantised"


@pytest.mark.parametrize("name", list(CASES))
def test_gate_up_swiglu_vs_ref(run, name):
    from pdserve.kernels.fp8 import dequantize_act_fp8, fp8_linear_ref, quantize_act_fp8
    from pdserve.kernels.swiglu import swiglu

    c, r = run[0][name], run[1][name]
    local = _local(c).flatten()
    ids, x = c["ids"].flatten() - c["first"], c["x"]
    ref = torch.stack([
        swiglu(fp8_linear_ref(x[p // TOP_K][None], c["gate_up"][e], c["gate_up_scale"][e],
                              c["gate_up_bias"][e]))[0]
        for p, e in enumerate(ids.tolist()) if local[p]
    ])
    got = r["act"][local]
    if r["fused"]:  # rows hold routing weight * fake-quantised SwiGLU
        ref = dequantize_act_fp8(*quantize_act_fp8(ref)) * c["weights"].flatten()[local, None].float()
        err, tol = rel_l2(got, ref), 1e-2
    else:
        err, tol = rel_l2(got, ref), 1e-5
    print(f"{name}: gate/up rel L2 {err:.2e}")
    assert not got.isnan().any() and err < tol
    assert r["act"][~local].isnan().all(), "a pair of another rank's expert was written"


@pytest.mark.parametrize("name", [n for n, s in CASES.items() if not s["config"] or s["config"][0][0] != 256])
def test_act_quantisation_bit_exact(run, name):
    """Inside the down launch: act rows of local pairs -> fake-quantised * routing weight."""
    from pdserve.kernels.fp8 import dequantize_act_fp8, quantize_act_fp8

    c, r = run[0][name], run[1][name]
    local = _local(c).flatten()
    ref = dequantize_act_fp8(*quantize_act_fp8(r["act"][local])) * c["weights"].flatten()[local, None].float()
    assert torch.equal(r["act_deq"][local], ref)


@pytest.mark.parametrize("name", list(CASES))
def test_down_combine_vs_ref(run, name):
    """Down + combine fed the kernel's own activations, against the same arithmetic in torch."""
    from pdserve.kernels.fp8 import dequantize_act_fp8, dequantize_weight_fp8, quantize_act_fp8

    c, r = run[0][name], run[1][name]
    t, h = c["x"].shape
    local = _local(c)
    ref = torch.zeros(t, h)
    for tok in range(t):
        for j in range(TOP_K):
            if not local[tok, j]:
                continue
            e, p = int(c["ids"][tok, j]) - c["first"], tok * TOP_K + j
            rw = c["weights"][tok, j].float()
            a = r["act"][p][None]
            a = a if r["fused"] else dequantize_act_fp8(*quantize_act_fp8(a)) * rw
            y = a[0] @ dequantize_weight_fp8(c["down"][e], c["down_scale"][e]).T
            ref[tok] += y + (c["down_bias"][e] * rw if c["bias"] else 0)
    out = r["out"]
    assert out.dtype == c["x"].dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 8e-3}[out.dtype]
    if out.dtype != torch.bfloat16:  # both rounded to nearest (bf16: see the module docstring)
        ref = ref.to(out.dtype).float()
    err = rel_l2(out.float(), ref)
    print(f"{name}: down + combine rel L2 {err:.2e}")
    assert not out.isnan().any() and err < tol
    assert (out[~local.any(1)] == 0).all()


@pytest.mark.parametrize("name", list(CASES))
def test_layer_vs_experts_forward_ref(run, name):
    from pdserve.kernels.moe import experts_forward_ref

    c, r = run[0][name], run[1][name]
    ref = experts_forward_ref(c["x"], c["weights"], c["ids"], _weights(c), 7.0, 1.702, c["bias"])
    layer = r["layer"]
    err = rel_l2(layer.float(), ref.float())
    print(f"{name}: layer rel L2 {err:.2e}")
    assert layer.dtype == c["x"].dtype and not layer.isnan().any() and err < 1e-2
    none_local = ~_local(c).any(1)
    assert (layer[none_local] == 0).all()
    assert torch.equal(layer, r["out"]), "experts_forward_gemv differs from its two stages"
    if "dispatched" in r:
        assert r["dispatch_calls"] == 1, "triton_moe.experts_forward did not take the GEMV path"
        assert torch.equal(r["dispatched"], layer)


def test_ep_case_has_every_kind_of_token():
    c = _make_case("ep_f32_fused", CASES["ep_f32_fused"], 0)
    n_local = _local(c).sum(1).tolist()
    assert n_local == [4, 2, 0]


def test_config_validation():
    from pdserve.kernels.triton_moe_gemv import GemvConfig, GemvTile

    for bad in (dict(block_n=48), dict(block_n=512), dict(block_k=16), dict(block_k=96),
                dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(ValueError):
            GemvTile(**{**dict(block_n=64, block_k=128, num_warps=4, num_stages=2), **bad})
    with pytest.raises(ValueError, match="down block_n"):
        GemvConfig(GemvTile(64, 128, 4, 2), GemvTile(256, 128, 4, 2))
    assert GemvConfig(GemvTile(256, 64, 8, 2), GemvTile(16, 512, 4, 2)).fused_act_quant


def test_weight_shape_errors_are_actionable():
    from pdserve.kernels.triton_moe_gemv import experts_forward_gemv

    c = _make_case("h256_fp16", CASES["h256_fp16"], 1)
    w = _weights(c)
    w.down_scale = w.down_scale[:, :, :1].contiguous()
    with pytest.raises(ValueError, match="down_scale has shape"):
        experts_forward_gemv(c["x"], c["weights"], c["ids"], w)
    w = _weights(c)
    w.gate_up = w.gate_up.float()
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        experts_forward_gemv(c["x"], c["weights"], c["ids"], w)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
