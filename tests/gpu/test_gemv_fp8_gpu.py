"""The FP8-weight GEMV, its QKV + RoPE entry and its streaming entry (kernels/cuda_gemv_fp8.py) on the
GPU, at gpt-oss' projection shapes (QKV [5120, 2880], O [2880, 4096], the vocabulary [201088, 2880],
their TP-2 shares), fresh random inputs each run.

Reference: x @ (the dequantised e4m3 weights)^T + bias in float32 (kernels.fp8.fp8_weight_linear_ref's
numbers); tolerance: one bf16 rounding of the output plus 1e-5 of the element's magnitude sum
(tests/numerics.py), which only the float32 summation order may use: the kernel's products are exact.
Every e4m3 code (subnormals, both zeros, +-448) goes through it, and token rows over bf16's range. The RoPE entry equals the GEMV
followed by the Triton epilogue bit for bit; results are bit-identical from call to call and when
replayed from a CUDA graph behind a kernel that writes x.
"""

from __future__ import annotations

import pytest
import torch

from numerics import assert_one_bf16_rounding

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

from pdserve.kernels import cuda_gemv_fp8  # noqa: E402
from pdserve.kernels.cuda_gemv_fp8 import gemv_fp8, gemv_fp8_stream, qkv_rope_fp8  # noqa: E402
from pdserve.kernels.fp8 import FP8, dequantize_weight_fp8, quantize_weight_fp8  # noqa: E402

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "qkv tp2": (2560, 2880), "o tp2": (2880, 2048)}
# the streaming entry's: the vocabulary projection (201088 rows) and its TP-2 share; a group count
# that gives some warps one group more than the rest (2120 groups of 16 rows on 2112 warps of an H200)
STREAM_SHAPES = {"vocab": (201088, 2880), "vocab tp2": (100544, 2880), "ragged": (16 * 2113 + 16 * 7, 4096)}


@pytest.fixture(autouse=True)
def _needs_kernel():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 GEMV needs Hopper")
    cuda_gemv_fp8._kernels(torch.cuda.current_device())  # on Hopper it must build: a failure is an error here


def _problem(n: int, k: int, m: int, seed: int, bias: bool = True, row_pad: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wq, ws = quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16) if bias else None
    x = torch.randn(m, k + row_pad, device="cuda", generator=g).to(torch.bfloat16)[:, :k]
    return x, wq, ws, b


def _check(out, x, wq, ws, b):
    assert_one_bf16_rounding(out, x, dequantize_weight_fp8(wq, ws), b)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_matches_reference(shape, m, seed):
    x, wq, ws, b = _problem(*SHAPES[shape], m, seed)
    _check(gemv_fp8(x, wq, ws, b), x, wq, ws, b)


def test_every_e4m3_code_exactly(seed):
    """Weights drawn from all 254 finite e4m3 codes (subnormals and -0 included), block scales from
    2^-20 to 2^4 and not powers of two, x over many binades: still within the reference's bound."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = 256, 2880
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes).to(torch.uint8)  # NaN codes -> finite
    wq = codes.view(FP8)
    ws = torch.exp2(torch.rand(2, 23, device="cuda", generator=g) * 24 - 20)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    x = (torch.randn(3, k, device="cuda", generator=g) * torch.exp2(torch.randint(
        -30, 10, (3, k), device="cuda", generator=g).float())).to(torch.bfloat16)
    _check(gemv_fp8(x, wq, ws, b), x, wq, ws, b)


@pytest.mark.parametrize("k", [64, 128, 192])
def test_k_shorter_than_a_step_a_warp(k, seed):
    """K below 4 steps of 64: some warps have no share of K (and stage and sum nothing)."""
    x, wq, ws, b = _problem(256, k, 3, seed)
    _check(gemv_fp8(x, wq, ws, b), x, wq, ws, b)


def test_token_steps_over_the_whole_bf16_range(seed):
    """Each 64-K step of a token row is staged in f16 at its own power of two: steps whose largest
    |x| lies anywhere from bf16's subnormals to 2^60, and steps of zeros, keep the reference's bound,
    and every token takes its own powers (8 tokens, one launch)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k, m = 512, 2880, 8
    wq, ws = quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    powers = torch.randint(-140, 61, (m, k // 64), device="cuda", generator=g).float()
    powers[torch.rand(m, k // 64, device="cuda", generator=g) < 0.1] = float("-inf")  # all-zero steps
    x = (torch.randn(m, k, device="cuda", generator=g) * torch.exp2(powers).repeat_interleave(64, 1)).to(torch.bfloat16)
    _check(gemv_fp8(x, wq, ws, b), x, wq, ws, b)


@pytest.mark.parametrize("m", [1, 4])
def test_without_bias_and_with_strided_rows(m, seed):
    x, wq, ws, _ = _problem(*SHAPES["o"], m, seed, bias=False, row_pad=64)
    assert x.stride(0) != x.shape[1]
    _check(gemv_fp8(x, wq, ws, None), x, wq, ws, None)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_sixteen_row_ctas_change_no_bit(shape, m, bias, seed):
    """CTAs of 16 weight rows (two of the mma's 8-row groups on one B) sum each row in the order CTAs of 8 do:
    the same bits, with and without bias."""
    x, wq, ws, b = _problem(*SHAPES[shape], m, seed, bias=bias)
    assert torch.equal(gemv_fp8(x, wq, ws, b, rows=16), gemv_fp8(x, wq, ws, b))


@pytest.mark.parametrize("groups, early", [(1, 1), (2, 2), (4, 4), (4, 3)])
def test_commit_groups_change_no_bit(groups, early, seed, monkeypatch):
    """How a warp's copies are grouped (cuda_gemv_fp8.GROUPS), and how many groups are requested before the
    wait (EARLY_GROUPS; all of them where it equals GROUPS), change when it sums, not what: the results equal
    the default build's bit for bit, QKV and O, and the RoPE entry's q and cache."""
    cases = [_problem(*SHAPES[shape], 3, seed) for shape in ("qkv", "o")]
    want = [gemv_fp8(*c) for c in cases]
    x, wq, ws, b, positions, rope, slots, cache = _rope_case(3, seed)
    rope_args = (x, wq, ws, b, positions, rope.cos, rope.sin, slots)
    want_cache = cache.clone()
    want_q = qkv_rope_fp8(*rope_args, want_cache, 64, 8)
    monkeypatch.setattr(cuda_gemv_fp8, "GROUPS", groups)
    monkeypatch.setattr(cuda_gemv_fp8, "EARLY_GROUPS", early)
    for c, w in zip(cases, want):
        assert torch.equal(gemv_fp8(*c), w)
    got_cache = cache.clone()
    assert torch.equal(qkv_rope_fp8(*rope_args, got_cache, 64, 8), want_q) and torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("entry", ["staged", "stream"])
def test_graph_replay_behind_a_writer_is_bit_identical(entry, seed):
    """Captured behind a kernel that writes x (the attention's place in the step): each replay reads
    that replay's x (the kernel waits for it), and equals the eager call bit for bit. The streaming
    entry at the vocabulary's TP-2 share, without bias, token rows strided."""
    if entry == "staged":
        gemv, (src, wq, ws, b) = gemv_fp8, _problem(*SHAPES["o"], 2, seed)
    else:
        gemv, (src, wq, ws, b) = gemv_fp8_stream, _problem(*STREAM_SHAPES["vocab tp2"], 2, seed, bias=False, row_pad=64)
    x = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.copy_(src)
        gemv(x, wq, ws, b)  # compile and load outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            torch.mul(src, 1.0, out=x)
            out = gemv(x, wq, ws, b)
    for scale in (1.0, -2.0):
        src.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv(src, wq, ws, b))


def _rope_case(m: int, seed: int, hq: int = 64, hkv: int = 8, d: int = 64, page: int = 16):
    from pdserve.engine.config import preset
    from pdserve.engine.rope import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(seed)
    x, wq, ws, b = _problem((hq + 2 * hkv) * d, 2880, m, seed)
    rope = RotaryEmbedding(preset("20b"), torch.device("cuda"))
    positions = torch.randint(0, 4096, (m,), device="cuda", generator=g)
    slots = torch.randperm(64 * page, device="cuda", generator=g)[:m]
    cache = torch.randn(64, 2, page, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    return x, wq, ws, b, positions, rope, slots, cache


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("heads", [(64, 8), (32, 4)])
@pytest.mark.parametrize("qkv_rows", [8, 16])
def test_rope_entry_equals_the_gemv_then_the_epilogue(m, heads, qkv_rows, seed, monkeypatch):
    """qkv_rope_fp8 (one launch; CTAs of 4 or 8 rotation pairs, cuda_gemv_fp8.QKV_ROWS) against gemv_fp8
    then kernels.triton_rope.rope_qkv_write: q and the whole cache bit-identical (the KV slots written,
    nothing else touched); TP-2's heads too."""
    from pdserve.kernels.triton_rope import rope_qkv_write

    monkeypatch.setattr(cuda_gemv_fp8, "QKV_ROWS", qkv_rows)
    hq, hkv = heads
    x, wq, ws, b, positions, rope, slots, cache = _rope_case(m, seed, hq, hkv)
    want_cache = cache.clone()
    want_q = rope_qkv_write(gemv_fp8(x, wq, ws, b), positions, rope.cos, rope.sin, slots, want_cache, hq, hkv)
    q = qkv_rope_fp8(x, wq, ws, b, positions, rope.cos, rope.sin, slots, cache, hq, hkv)
    assert torch.equal(q, want_q)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("shape", list(STREAM_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_stream_matches_reference(shape, m, seed):
    x, wq, ws, b = _problem(*STREAM_SHAPES[shape], m, seed, bias=shape == "ragged")
    _check(gemv_fp8_stream(x, wq, ws, b), x, wq, ws, b)


@pytest.mark.parametrize("depth,ctas_per_sm", [(1, 1), (3, 2), (6, 4)])
def test_stream_every_code_and_token_steps_over_the_bf16_range(depth, ctas_per_sm, seed):
    """The streaming entry on all finite e4m3 codes, block scales off powers of two, and token rows
    whose 64-K steps span bf16's range (zero steps included), at ring depths and grids that move the
    group boundaries through the ring; 301 groups of 16 rows, so the last CTA has warps without one."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k, m = 16 * 301, 2880, 4
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=g, dtype=torch.int32)
    wq = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes).to(torch.uint8).view(FP8)
    ws = torch.exp2(torch.rand(-(-n // 128), 23, device="cuda", generator=g) * 24 - 20)
    powers = torch.randint(-140, 61, (m, k // 64), device="cuda", generator=g).float()
    powers[torch.rand(m, k // 64, device="cuda", generator=g) < 0.1] = float("-inf")
    x = (torch.randn(m, k, device="cuda", generator=g) * torch.exp2(powers).repeat_interleave(64, 1)).to(torch.bfloat16)
    _check(gemv_fp8_stream(x, wq, ws, None, depth=depth, ctas_per_sm=ctas_per_sm), x, wq, ws, None)


def test_engine_decode_takes_the_fp8_gemvs(tmp_path, monkeypatch):
    """A decode step of the engine with FP8 projections runs QKV (with its epilogue) and O through
    these kernels, and its logits agree with the Triton FP8 linear's step (same weights, other
    summation order: bound 2e-2 relative L2 over a 2-layer random model)."""
    pytest.importorskip("flashinfer")
    import dataclasses

    from numerics import rel_l2
    from pdserve.engine.checkpoint_writer import make_random_checkpoint
    from pdserve.engine.config import preset
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.sequence import Sequence

    cfg = dataclasses.replace(preset("20b"), hidden_size=640, intermediate_size=768, num_hidden_layers=2,
                              num_local_experts=8, layer_types=())
    ckpt = make_random_checkpoint(tmp_path / "ckpt", cfg, seed=0)
    runner = ModelRunner(str(ckpt), device="cuda", num_kv_blocks=256, attention_precision="fp8")
    ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
    seqs = []
    for i, p in enumerate([ids[:9], ids[:40]]):
        s = Sequence(f"r{i}", list(p), SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        s.blocks = runner.cache.reserve(s.max_tokens, len(p))
        s.append(int(runner.prefill(s).argmax()), (), runner.max_context)
        seqs.append(s)
    calls = {"gemv_fp8": 0, "qkv_rope_fp8": 0}
    for name in calls:
        real = getattr(cuda_gemv_fp8, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(cuda_gemv_fp8, name, counted)
    fast = runner.decode(seqs).float()
    assert calls == {"gemv_fp8": 2, "qkv_rope_fp8": 2}
    for s in seqs:  # the same step again (eager: no decode graphs; its KV slots written again)
        s.num_cached -= 1
    monkeypatch.setattr(cuda_gemv_fp8, "MAX_TOKENS", 0)
    triton = runner.decode(seqs).float()
    assert calls == {"gemv_fp8": 2, "qkv_rope_fp8": 2}
    assert rel_l2(fast, triton) < 2e-2
