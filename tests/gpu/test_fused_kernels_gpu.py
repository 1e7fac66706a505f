"""The per-layer fused kernels on the GPU, bf16, gpt-oss shapes, fresh random inputs, against the
plain-torch path they replace (engine.model.rms_norm, engine.rope + PagedKVCache.write,
kernels.experts.route), and the whole model with and without them.

Tolerances:
- RoPE + KV write: bit-exact (same roundings, same order); the whole cache is compared, so a write
  to a wrong slot fails too; one token's QKV GEMV + RoPE + KV write in one launch: bit-exact against
  the bf16 GEMV then the RoPE + KV write;
- residual add: bit-exact; normed output: each element within one bf16 rounding step of the plain
  path's and at least 99 % identical (only the float32 sum of squares is summed in another order);
- router logits: within one bf16 step (of the exact value) plus 1e-6 of the sum of |products| of
  cuBLAS's, >= 99 % identical (at most 2 differ among fewer than 200) (float32 sums in another
  order; near-cancelling sums can move by more
  than a step of their small result); ids and weights given the kernel's own logits: bit-exact against torch.topk +
  torch.softmax, on rows without equal logits around the 4th place (torch.topk's order there is
  unspecified);
- the whole model (2 layers): fused vs plain prefill logits rel L2 < 5e-2 (rare one-step logit
  differences can move a near-tied expert choice; a wrong kernel is off by O(1)), and a decode step
  replayed from a CUDA graph equals the eager step bit for bit with the fused kernels.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

pytest.importorskip("triton")

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _gen():
    return torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))


def _within_one_step(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """Every element of bf16 a within one bf16 rounding step of b; fraction exactly equal."""
    a, b = a.float(), b.float()
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
    return bool(((a - b).abs() <= step * 1.0001).all()), float((a == b).float().mean())


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_add_rms_norm(t):
    from pdserve.engine.model import rms_norm
    from pdserve.kernels.triton_norm import add_rms_norm

    g = _gen()
    h = 2880
    x = (torch.randn(t, h, device=DEV, generator=g) * 2).to(BF16)
    d = torch.randn(t, h, device=DEV, generator=g).to(BF16)
    w = 1 + 0.2 * torch.randn(h, device=DEV, generator=g)
    res, out = add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(res, x + d)
    ok, same = _within_one_step(out, rms_norm(x + d, w, 1e-5))
    assert ok and same >= 0.99, same
    same_x, out2 = add_rms_norm(x, None, w, 1e-5)
    assert same_x is x
    ok, same = _within_one_step(out2, rms_norm(x, w, 1e-5))
    assert ok and same >= 0.99, same


@pytest.mark.parametrize("t", [1, 300])
def test_add_rms_norm_reads_ahead_of_its_wait_without_changing_a_bit(t, monkeypatch):
    """EARLY_READS moves the weights' and the residual's loads ahead of the PDL wait, nothing else."""
    from pdserve.kernels import triton_norm

    g = _gen()
    x = (torch.randn(t, 2880, device=DEV, generator=g) * 2).to(BF16)
    d = torch.randn(t, 2880, device=DEV, generator=g).to(BF16)
    w = 1 + 0.2 * torch.randn(2880, device=DEV, generator=g)
    early = triton_norm.add_rms_norm(x, d, w, 1e-5)
    monkeypatch.setattr(triton_norm, "EARLY_READS", False)
    late = triton_norm.add_rms_norm(x, d, w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(early, late))


@pytest.mark.parametrize("t", [1, 5, 64, 513])
@pytest.mark.parametrize("preset_name", ["20b", "120b"])
def test_rope_kv_write(t, preset_name):
    from pdserve.engine.config import preset
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.engine.rope import RotaryEmbedding
    from pdserve.kernels.triton_rope import rope_qkv_write

    cfg = dataclasses.replace(preset(preset_name), num_hidden_layers=2, layer_types=())
    g = _gen()
    hq, hkv, dd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rope = RotaryEmbedding(cfg, DEV)
    cache = PagedKVCache(cfg, num_blocks=64, page_size=16, device=DEV)
    cache.storage.normal_(generator=g)  # the groups' pools are views of this one tensor
    before = cache.storage.clone()
    qkv = torch.randn(t, (hq + 2 * hkv) * dd, device=DEV, generator=g).to(BF16) * 3
    pos = torch.randint(0, cfg.max_position_embeddings, (t,), device=DEV, generator=g)
    slots = torch.randperm(64 * 16, device=DEV, generator=g)[:t]
    layer = 1  # a full-attention layer
    q = rope_qkv_write(qkv, pos, rope.cos, rope.sin, slots, cache.layer_cache(layer), hq, hkv)
    ref_q = rope(qkv[:, : hq * dd].view(-1, hq, dd), pos)
    k = rope(qkv[:, hq * dd : (hq + hkv) * dd].view(-1, hkv, dd), pos)
    v = qkv[:, (hq + hkv) * dd :].view(-1, hkv, dd)
    got = cache.storage.clone()
    cache.storage.copy_(before)
    cache.write(layer, {"full": slots, "sliding": slots}, k, v)
    off = (q != ref_q).float().mean().item()
    assert q.is_contiguous() and torch.equal(q, ref_q), f"{off:.2%} of q differs, max {(q.float() - ref_q.float()).abs().max()}"
    assert not torch.equal(got, before)  # the kernel wrote
    assert torch.equal(got, cache.storage)  # exactly the plain write: those slots of that layer only


@pytest.mark.parametrize("preset_name", ["20b", "120b"])
@pytest.mark.parametrize("layer", [0, 1])  # a windowed and a full-attention layer
def test_qkv_rope_one_launch(preset_name, layer):
    from pdserve.engine.config import preset
    from pdserve.engine.kv_cache import PagedKVCache
    from pdserve.engine.rope import RotaryEmbedding
    from pdserve.kernels.triton_bf16_gemv import bf16_gemv
    from pdserve.kernels.triton_rope import qkv_rope_write, rope_qkv_write

    cfg = dataclasses.replace(preset(preset_name), num_hidden_layers=2, layer_types=())
    g = _gen()
    hq, hkv, dd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    rope = RotaryEmbedding(cfg, DEV)
    cache = PagedKVCache(cfg, num_blocks=64, page_size=16, device=DEV)
    cache.storage.normal_(generator=g)  # the groups' pools are views of this one tensor
    x = torch.randn(1, h, device=DEV, generator=g).to(BF16)
    w = (torch.randn((hq + 2 * hkv) * dd, h, device=DEV, generator=g) * 0.03).to(BF16)
    b = torch.randn((hq + 2 * hkv) * dd, device=DEV, generator=g).to(BF16)
    pos = torch.randint(0, cfg.max_position_embeddings, (1,), device=DEV, generator=g)
    slot = torch.randint(0, 64 * 16, (1,), device=DEV, generator=g)
    before = cache.storage.clone()
    q = qkv_rope_write(x, w, b, pos, rope.cos, rope.sin, slot, cache.layer_cache(layer), hq, hkv)
    fused = cache.storage.clone()
    cache.storage.copy_(before)
    qkv = bf16_gemv(x, w, b)  # gpt-oss' QKV at one token: K not split, as in the fused launch
    ref_q = rope_qkv_write(qkv, pos, rope.cos, rope.sin, slot, cache.layer_cache(layer), hq, hkv)
    assert torch.equal(q, ref_q), f"{(q != ref_q).float().mean():.2%} of q differs"
    assert not torch.equal(fused, before)
    assert torch.equal(fused, cache.storage)


def _router_cases():
    """(tokens, experts, kernel): both kernels route_fused launches, the cluster one up to its token
    limit (cuda_router.MAX_TOKENS; test_cluster_router_token_limit checks the limit itself)."""
    from pdserve.kernels.cuda_router import MAX_TOKENS

    return [(t, e, k) for t in (1, 8, 64, 256) for e in (8, 32, 128)
            for k in ("cuda cluster", "cuda cluster of 12", "triton")
            if k == "triton" or (t <= MAX_TOKENS.get(e, t) and (k == "cuda cluster" or e != 8))]


def _use_router(kernel: str, experts: int, monkeypatch) -> None:
    """route_fused takes the kernel a router test names: "cuda cluster" (the cluster size of cuda_router.CLUSTERS),
    "cuda cluster of 12" or "triton"."""
    from pdserve.kernels import cuda_router

    monkeypatch.setattr(cuda_router, "ENABLED", kernel.startswith("cuda cluster"))
    if kernel == "cuda cluster of 12":
        monkeypatch.setattr(cuda_router, "CLUSTERS", {experts: 12})


@pytest.mark.parametrize("t,experts,kernel", _router_cases())
def test_router(t, experts, kernel, monkeypatch):
    """Both kernels route_fused launches: the thread-block clusters of kernels/cuda_router.py and
    the Triton kernel."""
    from pdserve.kernels import cuda_router
    from pdserve.kernels.experts import route
    from pdserve.kernels.triton_router import route_fused

    _use_router(kernel, experts, monkeypatch)
    g = _gen()
    h = 2880
    x = torch.randn(t, h, device=DEV, generator=g).to(BF16)
    w = (torch.randn(experts, h, device=DEV, generator=g) * 0.02).to(BF16)
    b = (torch.randn(experts, device=DEV, generator=g) * 0.1).to(BF16)
    if kernel.startswith("cuda cluster") and not cuda_router.applies(x, w, b):
        pytest.skip("the cluster router needs Hopper and NVRTC")
    weights, ids, logits = route_fused(x, w, b, 4, return_logits=True)
    ref = torch.nn.functional.linear(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    scale = torch.nn.functional.linear(x.double().abs(), w.double().abs())
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    for got in (logits, ref):
        assert ((got.double() - exact).abs() <= step + 1e-6 * scale).all()
    # sums in another order land on the other side of a rounding boundary for ~1 % of logits: at most
    # 1 % differ, or 2 of the few logits of 8 experts x 8 tokens
    assert int((logits != ref).sum()) <= max(2, 0.01 * logits.numel())
    top5 = torch.topk(logits.float(), 5, dim=-1, sorted=True).values
    clear = (top5[:, :4] != top5[:, 1:5]).all(-1)  # no equal logits among the top 5
    own_w, own_ids = route(logits, torch.eye(experts, device=DEV, dtype=BF16),
                           torch.zeros(experts, device=DEV, dtype=BF16), 4)
    assert torch.equal(ids[clear], own_ids[clear])
    assert torch.equal(weights[clear], own_w[clear])
    # with ties (128 bf16 logits tie often) the picks hold the same logits, lower ids first
    assert torch.equal(logits.gather(1, ids), logits.gather(1, own_ids))
    picked = logits.gather(1, ids)
    tie = picked[:, :-1] == picked[:, 1:]
    assert (ids[:, :-1][tie] < ids[:, 1:][tie]).all() and (ids.sort(-1).values.diff(dim=-1) != 0).all()
    assert torch.equal(weights.float().sum(-1).round(), torch.ones(t, device=DEV))
    for _ in range(3):  # without the logits output, and again: the same (deterministic reduction)
        fast_w, fast_ids = route_fused(x, w, b)
        assert torch.equal(fast_w, weights) and torch.equal(fast_ids, ids)


def test_cluster_router_token_limit():
    """route_fused takes the cluster router for 120b's 128 experts up to MAX_TOKENS[128] tokens, the
    Triton one beyond (where it measured faster), and the cluster one for 20b's 32 up to 256."""
    from pdserve.kernels import cuda_router

    w32 = torch.zeros(32, 2880, device=DEV, dtype=BF16)
    w128 = torch.zeros(128, 2880, device=DEV, dtype=BF16)
    if not cuda_router.available(DEV):
        pytest.skip("the cluster router needs Hopper and NVRTC")
    limit = cuda_router.MAX_TOKENS[128]
    x = torch.zeros(256, 2880, device=DEV, dtype=BF16)
    assert cuda_router.applies(x[:limit], w128, w128[:, 0])
    assert not cuda_router.applies(x[:limit + 1], w128, w128[:, 0])
    assert cuda_router.applies(x, w32, w32[:, 0])


@pytest.mark.parametrize("kernel", ["cuda cluster", "cuda cluster of 12", "triton"])
@pytest.mark.parametrize("experts", [32, 128])
def test_router_picks_real_experts_whatever_the_logits(kernel, experts, monkeypatch):
    """NaN and -inf logits (a row of NaN activations, a NaN weight row, -inf biases): every pick is
    a real expert, once a row; NaN competes as -inf, equal logits go to the lower id. A pick past
    the experts would index past the MoE weights (an illegal address, the process lost)."""
    from pdserve.kernels import cuda_router
    from pdserve.kernels.triton_router import route_fused

    _use_router(kernel, experts, monkeypatch)
    g = _gen()
    x = torch.randn(3, 2880, device=DEV, generator=g).to(BF16)
    x[0] = float("nan")
    w = (torch.randn(experts, 2880, device=DEV, generator=g) * 0.02).to(BF16)
    w[5] = float("nan")
    b = torch.zeros(experts, device=DEV, dtype=BF16)
    b[:experts - 2] = float("-inf")
    if kernel.startswith("cuda cluster") and not cuda_router.applies(x, w, b):
        pytest.skip("the cluster router needs Hopper and NVRTC")
    weights, ids = route_fused(x, w, b)
    assert ((ids >= 0) & (ids < experts)).all(), ids
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert sorted(ids[1, :2].tolist()) == [experts - 2, experts - 1] and ids[1, 2:].tolist() == [0, 1]
    assert torch.isfinite(weights[1:]).all()


@pytest.mark.parametrize("kernel", ["cuda cluster", "cuda cluster of 12"])
@pytest.mark.parametrize("experts", [32, 128])
def test_cluster_router_ties_signed_zeros(kernel, experts, monkeypatch):
    """A logit that rounds to -0 ties with the +0 ones, as the float comparison has it (the Triton router's too):
    the cluster router orders picks by one unsigned key a logit, and -0's bits would put it below +0."""
    from pdserve.kernels import cuda_router
    from pdserve.kernels.triton_router import route_fused

    _use_router(kernel, experts, monkeypatch)
    x = torch.zeros(1, 2880, device=DEV, dtype=BF16)
    w = torch.zeros(experts, 2880, device=DEV, dtype=BF16)
    b = torch.zeros(experts, device=DEV, dtype=BF16)
    x[0, 0], w[0, 0] = -(2.0**-70), 2.0**-77  # expert 0's logit: -2^-147 in float32, -0 in bf16
    if not cuda_router.available(DEV):
        pytest.skip("the cluster router needs Hopper and NVRTC")
    assert cuda_router.applies(x, w, b)  # where it builds, this call takes it: no silent fall-back to Triton
    weights, ids, logits = route_fused(x, w, b, 4, return_logits=True)
    assert torch.signbit(logits[0, 0]) and not torch.signbit(logits[0, 1:]).any()  # the case is there
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(weights, torch.full_like(weights, 0.25))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset

    cfg = dataclasses.replace(preset("20b"), num_hidden_layers=2, num_local_experts=8, layer_types=())
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "fused", cfg, seed=0)


def test_model_fused_vs_plain(ckpt, monkeypatch):
    from pdserve.engine.model_runner import ModelRunner

    fused = ModelRunner(str(ckpt), device="cuda", num_kv_blocks=256)
    monkeypatch.setenv("PDSERVE_FUSED_KERNELS", "0")
    plain = ModelRunner(str(ckpt), device="cuda", num_kv_blocks=256)
    assert fused.model.fused and not plain.model.fused
    ids = torch.randint(0, 201088, (300,)).tolist()
    a, b = fused.prompt_logits(ids), plain.prompt_logits(ids)
    assert torch.isfinite(a).all()
    err = rel_l2(a, b)
    print(f"fused vs plain prefill logits: rel L2 {err:.2e}")
    assert err < 5e-2


def test_qkv_rope_launch_keeps_the_decode_step(ckpt):
    """One token's QKV GEMV + RoPE + KV write in one launch (GptOssModel.fuse_qkv_rope) gives the
    decode step the logits of the two separate fused kernels, bit for bit, step after step (two
    copies of one request, one through each)."""
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    r = ModelRunner(str(ckpt), device="cuda", num_kv_blocks=256)
    assert r.model.fused and r.model.fuse_qkv_rope
    prompt = torch.randint(0, 201088, (150,)).tolist()
    seqs = []
    for name in ("fused", "separate"):
        s = Sequence(name, list(prompt), SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
        s.blocks = r.cache.reserve(s.max_tokens, len(prompt))
        s.append(int(r.prefill(s).argmax()), (), r.max_context)
        seqs.append(s)
    for _ in range(8):
        logits = []
        for s, flag in zip(seqs, (True, False)):
            r.model.fuse_qkv_rope = flag
            logits.append(r.decode([s]))
        assert torch.isfinite(logits[0]).all() and torch.equal(logits[0], logits[1])
        tok = int(logits[0].argmax())
        for s in seqs:
            s.append(tok, (), r.max_context)
