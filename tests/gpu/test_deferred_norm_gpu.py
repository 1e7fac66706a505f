"""The norm before an attention block deferred into the MoE's down projection and the FP8 QKV GEMV
(kernels/deferred_norm.py) on the GPU, fresh random inputs each run.

- down (per-pair MXFP4 launches, gpt-oss' expert shape): the new residual equals the norm kernel's
  residual output bit for bit, the weighted rows are bf16(residual * weight) exactly, and the
  partial sums of squares add up to the residual's (float32, another order: relative 1e-5);
- the QKV + RoPE launch on the weighted rows and the partials against the same launch on the norm
  kernel's output: q and the KV rows within a relative L2 of 4e-3 (one bf16 rounding of the input
  moves between the two; a scale left out or wrong is off by far more: the residual is drawn at
  3x unit scale, so the scale is about 1/3), bit-identical from call to call and replayed from a graph;
- the engine with MXFP4 experts and FP8 projections: the deferred path is taken at 1-3 tokens, the
  step's logits agree with the norm kernel's step (2e-2 relative L2 over a random 3-layer model, the
  bound of the FP8 GEMV's engine test), PDL on and off and graph replays are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

from pdserve.kernels.deferred_norm import DeferredNorm  # noqa: E402

DEV = torch.device("cuda")
H = 2880
EPS = 1e-5


@pytest.fixture(autouse=True)
def _needs_kernels():
    from pdserve.kernels import cuda_moe_mxfp4

    if torch.cuda.get_device_capability() < (9, 0) or not cuda_moe_mxfp4.available(DEV):
        pytest.skip("the deferred norm's kernels need Hopper and NVRTC")


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _norm_inputs(t: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream (3x unit scale) and a norm weight."""
    x = (3 * torch.randn(t, H, device=DEV, generator=g)).to(torch.bfloat16)
    w = 1 + 0.5 * torch.randn(H, device=DEV, generator=g)
    return x, w


@pytest.mark.parametrize("t", [1, 2, 3])
def test_down_writes_residual_weighted_rows_and_partials(t, seed):
    from mxfp4_layers import random_layer

    from pdserve.kernels.cuda_moe_mxfp4 import PAIR_CONFIG, experts_forward_mxfp4_mma
    from pdserve.kernels.triton_norm import add_rms_norm

    g = _gen(seed)
    wp = random_layer(32, g, DEV).to_packed()
    x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(32, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    resid, w = _norm_inputs(t, g)
    y = experts_forward_mxfp4_mma(x, weights, ids, wp, x_before_routing=True)
    norm = DeferredNorm(resid, w, EPS)
    assert experts_forward_mxfp4_mma(x, weights, ids, wp, x_before_routing=True, defer_norm=norm) is None
    want_resid, _ = add_rms_norm(resid, y, w, EPS)
    assert torch.equal(norm.residual, want_resid)
    assert torch.equal(norm.weighted, (norm.residual.float() * w).to(torch.bfloat16))
    assert norm.sumsq.shape == (t, H // PAIR_CONFIG.rows("down") * 4)
    want_sumsq = norm.residual.double().square().sum(1)
    assert torch.allclose(norm.sumsq.double().sum(1), want_sumsq, rtol=1e-5, atol=0)
    again = DeferredNorm(resid, w, EPS)
    experts_forward_mxfp4_mma(x, weights, ids, wp, x_before_routing=True, defer_norm=again)
    assert all(torch.equal(a, b) for a, b in [(again.residual, norm.residual), (again.weighted, norm.weighted),
                                              (again.sumsq, norm.sumsq)])


def _qkv_case(m: int, g, hq: int = 64, hkv: int = 8, d: int = 64, page: int = 16):
    from pdserve.engine.config import preset
    from pdserve.engine.rope import RotaryEmbedding
    from pdserve.kernels.fp8 import quantize_weight_fp8

    n = (hq + 2 * hkv) * d
    wq, ws = quantize_weight_fp8(torch.randn(n, H, device=DEV, generator=g) / H**0.5)
    b = (0.1 * torch.randn(n, device=DEV, generator=g)).to(torch.bfloat16)
    rope = RotaryEmbedding(preset("20b"), DEV)
    positions = torch.randint(0, 4096, (m,), device=DEV, generator=g)
    slots = torch.randperm(64 * page, device=DEV, generator=g)[:m]
    cache = torch.randn(64, 2, page, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    return wq, ws, b, positions, rope, slots, cache, hq, hkv


def _deferred(m: int, g) -> DeferredNorm:
    """A deferred norm as down leaves it: 720 partials a token (any split of the squares)."""
    resid, w = _norm_inputs(m, g)
    norm = DeferredNorm(resid, w, EPS)
    norm.allocate(720)
    norm.residual.copy_(resid)
    norm.weighted.copy_((resid.float() * w).to(torch.bfloat16))
    norm.sumsq.copy_(resid.float().square().view(m, 720, 4).sum(-1))
    return norm


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_qkv_finishes_the_deferred_norm(m, seed):
    from pdserve.kernels.cuda_gemv_fp8 import qkv_rope_fp8
    from pdserve.kernels.triton_norm import add_rms_norm

    g = _gen(seed)
    wq, ws, b, positions, rope, slots, cache, hq, hkv = _qkv_case(m, g)
    norm = _deferred(m, g)
    _, normed = add_rms_norm(norm.residual, None, norm.weight, EPS)
    want_cache = cache.clone()
    want_q = qkv_rope_fp8(normed, wq, ws, b, positions, rope.cos, rope.sin, slots, want_cache, hq, hkv)
    q = qkv_rope_fp8(norm.weighted, wq, ws, b, positions, rope.cos, rope.sin, slots, cache, hq, hkv, norm=norm)
    written = slots.tolist()
    pages, offs = slots // cache.shape[2], slots % cache.shape[2]
    got_kv, want_kv = cache[pages, :, offs], want_cache[pages, :, offs]
    assert rel_l2(q, want_q) < 4e-3, rel_l2(q, want_q)
    assert rel_l2(got_kv, want_kv) < 4e-3, rel_l2(got_kv, want_kv)
    # nothing but the tokens' slots changed
    untouched = torch.ones(cache.shape[0] * cache.shape[2], dtype=torch.bool, device=DEV)
    untouched[written] = False
    flat, want_flat = cache.transpose(1, 2).reshape(-1, 2, hkv, 64), want_cache.transpose(1, 2).reshape(-1, 2, hkv, 64)
    assert torch.equal(flat[untouched], want_flat[untouched])
    # the scale matters here (about 1/3): without it the rows are far off
    plain = qkv_rope_fp8(norm.weighted, wq, ws, b, positions, rope.cos, rope.sin, slots, cache.clone(), hq, hkv)
    assert rel_l2(plain, want_q) > 0.5
    # deterministic, and replayed from a graph on new partials
    assert torch.equal(qkv_rope_fp8(norm.weighted, wq, ws, b, positions, rope.cos, rope.sin, slots, cache, hq, hkv,
                                    norm=norm), q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = qkv_rope_fp8(norm.weighted, wq, ws, b, positions, rope.cos, rope.sin, slots, cache, hq, hkv,
                               norm=norm)
    torch.cuda.current_stream().wait_stream(stream)
    norm.sumsq.mul_(4.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, qkv_rope_fp8(norm.weighted, wq, ws, b, positions, rope.cos, rope.sin, slots, cache, hq,
                                         hkv, norm=norm))
    assert rel_l2(out, q) > 0.1  # four times the squares: half the scale


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    import dataclasses

    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset

    cfg = dataclasses.replace(preset("20b"), hidden_size=640, intermediate_size=768, num_hidden_layers=3,
                              num_local_experts=8, layer_types=())
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "deferred", cfg, seed=0)


def _decode(ckpt, prompts, steps: int, graphs: bool, defer: bool, counts: list | None = None):
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    r = ModelRunner(str(ckpt), device="cuda", precision="mxfp4", attention_precision="fp8", num_kv_blocks=256,
                    cuda_graph_max_batch=len(prompts) if graphs else 0)
    r.model.defer_norm = defer
    if counts is not None:
        real = r.model._moe
        r.model._moe = lambda i, t, defer_norm=None: counts.append(defer_norm is not None) or real(i, t, defer_norm)
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(f"r{i}", list(p), SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True))
        s.blocks = r.cache.reserve(s.max_tokens, len(p))
        s.append(int(r.prefill(s).argmax()), (), r.max_context)
        seqs.append(s)
    out = []
    for _ in range(steps):
        logits = r.decode(seqs)
        out.append(logits.float().clone())
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t, (), r.max_context)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_engine_defers_the_norm(mx_ckpt, batch, monkeypatch, seed):
    pytest.importorskip("flashinfer")
    from pdserve.kernels import pdl

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 201088, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 200, (batch,), generator=gen)]
    counts = []
    deferred = _decode(mx_ckpt, prompts, 4, graphs=False, defer=True, counts=counts)
    # decode steps: the first two layers' norms deferred, the last layer's MoE ends the model
    assert counts[-3:] == [True, True, False]
    kernel = _decode(mx_ckpt, prompts, 4, graphs=False, defer=False)
    for a, b in zip(deferred, kernel):
        assert torch.isfinite(a).all()
        assert rel_l2(a, b) < 2e-2, rel_l2(a, b)
    # a graph of one token replays the eager step (3 tokens replay as 4: grouped launches, no deferral)
    replayed = _decode(mx_ckpt, prompts, 4, graphs=True, defer=True)
    if batch == 1:
        assert all(torch.equal(a, b) for a, b in zip(replayed, deferred))
    if pdl.enabled(DEV):  # down reads the residual ahead of its wait: no race shows with PDL off
        monkeypatch.setenv("PDSERVE_PDL", "0")
        assert all(torch.equal(a, b) for a, b in zip(_decode(mx_ckpt, prompts, 4, graphs=False, defer=True), deferred))
