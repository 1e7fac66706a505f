"""The MXFP4 mma kernels (kernels/cuda_moe_mxfp4.cu) on the GPU: gpt-oss-20b expert shape, fresh
random weights and routing, against `experts_forward_ref` in float32 on the exactly dequantised
weights. Tolerance: rel L2 4e-3 (float32 sums; the SwiGLU activations are rounded to f16, or bf16
in bf16-folded launches, and the output to bf16, ~1.6e-3 together). Grouped launches (pairs of an expert served together) must equal per-pair
launches of the same launch shape bit for bit: a column of the mma sees only its own token, so every
sum is the same. Also:
deterministic, replayed from a CUDA graph on new inputs, and every scale byte the packed layout
allows, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from mxfp4_layers import every_code_expert, f16_rows_reference, random_layer, reference
from numerics import rel_l2

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is

DEV = torch.device("cuda")


def _mma():
    from pdserve.kernels import cuda_moe_mxfp4

    if not cuda_moe_mxfp4.available(DEV):
        pytest.skip("the mma kernels need Hopper and NVRTC")
    return cuda_moe_mxfp4.experts_forward_mxfp4_mma


def _seeded():
    return torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))


def _configs():
    from pdserve.kernels.cuda_moe_mxfp4 import CONFIG, PAIR_CONFIG, MmaConfig

    return [CONFIG, PAIR_CONFIG, MmaConfig((4, 2, 3), (4, 4, 2)), MmaConfig((8, 1, 2), (2, 1, 3)),
            MmaConfig((4, 1, 2), (8, 8, 2)), MmaConfig((4, 1, 2), (4, 4, 3)),
            MmaConfig((4, 4, 1, 8), (4, 4, 3, 7)), MmaConfig((4, 4, 1, 6), (4, 4, 3)),
            MmaConfig((4, 4, 3), (4, 2, 2, 0, 1)), MmaConfig((4, 1, 2, 0, 1), (4, 4, 3, 6, 1))]


@pytest.mark.parametrize("t,e", [(1, 32), (3, 8), (8, 8), (16, 32), (64, 8), (64, 32)])
@pytest.mark.parametrize("config", range(10))
def test_mma_moe_against_reference(t, e, config):
    """e = 8 puts many tokens on each expert: blocks of 8 pairs, several per expert. Ten launch
    shapes (the grouped and per-pair defaults; K split over 2 / 4 / 8 warps; 8 warps; 1 and 3 K
    steps a batch; register bounds that spill; zero B read from a row of zeros or skipped), each for
    per-pair and grouped launches alike."""
    import functools

    fwd = functools.partial(_mma(), config=_configs()[config])
    g = _seeded()
    w = random_layer(e, g, DEV)
    wp = w.to_packed()
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    ref = reference(x, weights, ids, w)
    pair = fwd(x, weights, ids, wp)
    grouped = fwd(x, weights, ids, wp, grouped=True)
    assert pair.dtype == torch.bfloat16 and torch.isfinite(pair).all()
    assert rel_l2(pair, ref) < 4e-3, rel_l2(pair, ref)
    assert torch.equal(grouped, pair)
    assert torch.equal(pair, fwd(x, weights, ids, wp))
    # per-pair gate/up staging the token rows ahead of its PDL wait (EARLY_X): the same sums
    assert torch.equal(fwd(x, weights, ids, wp, x_before_routing=True), pair)
    nobias = fwd(x, weights, ids, wp, add_down_bias=False, grouped=True)
    assert rel_l2(nobias, reference(x, weights, ids, w, bias=False)) < 4e-3


@pytest.mark.parametrize("grouped", [False, True])
def test_mma_moe_cuda_graph(grouped):
    fwd = _mma()
    g = _seeded()
    w = random_layer(8, g, DEV)
    wp = w.to_packed()
    x = torch.randn(4, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [0, 2, 4, 6], [1, 3, 5, 7]], device=DEV)
    weights = torch.full((4, 4), 0.25, device=DEV, dtype=torch.bfloat16)
    fwd(x, weights, ids, wp, grouped=grouped)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd(x, weights, ids, wp, grouped=grouped)
    x.copy_(torch.randn(4, 2880, device=DEV, generator=g))
    ids.copy_(torch.tensor([[7, 3, 1, 0], [7, 3, 5, 4], [7, 6, 5, 4], [2, 3, 0, 1]], device=DEV))
    weights.copy_(torch.softmax(torch.randn(4, 4, device=DEV, generator=g), -1))
    graph.replay()
    eager = fwd(x, weights, ids, wp, grouped=grouped)
    assert torch.equal(out, eager)
    assert rel_l2(out, reference(x, weights, ids, w)) < 4e-3


@pytest.mark.parametrize("t", [1, 2, 3])
def test_cluster_sum_equals_the_counter_sum(t, monkeypatch):
    """Per-pair down adding a token's pairs inside a thread-block cluster (CLUSTER_SUM) does the
    counter path's float operations in its order: bit-identical, eager and replayed from a graph."""
    from pdserve.kernels import cuda_moe_mxfp4

    fwd = _mma()
    g = _seeded()
    w = random_layer(32, g, DEV)
    wp = w.to_packed()
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(32, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    monkeypatch.setattr(cuda_moe_mxfp4, "CLUSTER_SUM", False)
    counters = fwd(x, weights, ids, wp)
    monkeypatch.setattr(cuda_moe_mxfp4, "CLUSTER_SUM", True)
    cluster = fwd(x, weights, ids, wp)
    assert torch.equal(cluster, counters)
    assert rel_l2(cluster, reference(x, weights, ids, w)) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fwd(x, weights, ids, wp)
    x.copy_(torch.randn(t, 2880, device=DEV, generator=g))
    graph.replay()
    assert torch.equal(replayed, fwd(x, weights, ids, wp))


_RESIDENT_SHAPES = [(4, 4, 3, 4, 1), (4, 4, 2, 5, 1), (4, 4, 3, 5, 1), (4, 4, 2, 6, 1), (4, 4, 3, 1, 1), (8, 4, 2, 0, 1),
                    (4, 4, 1, 2, 0)]


@pytest.mark.parametrize("shape,tokens", [*((s, 1) for s in _RESIDENT_SHAPES),
                                          *((s, t) for s in ((4, 4, 3, 4, 1), (4, 4, 3, 1, 1), (4, 4, 1, 2, 0))
                                            for t in (2, 3))])
@pytest.mark.parametrize("early_x", [False, True])
def test_resident_gate_up_equals_the_per_pair_launch(shape, tokens, early_x, monkeypatch):
    """A per-pair gate/up of 1-3 tokens as a resident grid (RESIDENT_GATE_UP: each CTA streams several tiles,
    one CTA an SM in (4, 4, 3, 1, 1), so about 11 tiles a CTA at one token; every CTA stages each token's row
    in a region of its own) sums the same K shares in the same order as the per-pair launch (K split over 4
    warps): bit-identical, with pairs that have no expert here (nothing written, down adds zeros), eager and
    replayed from a CUDA graph on new routing."""
    from pdserve.kernels import cuda_moe_mxfp4

    fwd = _mma()
    g = _seeded()
    w = random_layer(32, g, DEV)
    wp = w.to_packed()
    # tokens of different magnitudes: each row staged at its own powers of two
    x = (torch.randn(tokens, 2880, device=DEV, generator=g) * torch.logspace(0, 3, tokens, device=DEV)[:, None]
         ).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(tokens, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    routings = [torch.stack([torch.randperm(32, device=DEV, generator=g)[:4] for _ in range(tokens)]) for _ in range(2)]
    routings.append(torch.tensor([[-1, 5, -1, 30], [7, -1, 2, 11], [-1, -1, -1, 4]][:tokens], device=DEV))
    ids = routings[0].clone()
    monkeypatch.setattr(cuda_moe_mxfp4, "RESIDENT_MAX_TOKENS", 3)
    monkeypatch.setattr(cuda_moe_mxfp4, "RESIDENT_GATE_UP", None)
    waves = [fwd(x, weights, r, wp, x_before_routing=early_x) for r in routings]
    monkeypatch.setattr(cuda_moe_mxfp4, "RESIDENT_GATE_UP", shape)
    resident = [fwd(x, weights, r, wp, x_before_routing=early_x) for r in routings]
    for got, want in zip(resident, waves):
        assert torch.equal(got, want)
    local = routings[2] >= 0
    assert rel_l2(resident[2], reference(x, torch.where(local, weights, 0), torch.where(local, routings[2], 0), w)) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fwd(x, weights, ids, wp, x_before_routing=early_x)
    for r, want in zip(routings[1:], waves[1:]):
        ids.copy_(r)
        graph.replay()
        assert torch.equal(replayed, want)


def test_cluster_sum_pairs_without_a_local_expert_add_zeros():
    """A pair whose expert id is negative (no expert here) adds nothing, while its cluster's other
    pairs still sum: the CTA takes part in the cluster's syncs with zero rows."""
    fwd = _mma()
    g = _seeded()
    w = random_layer(32, g, DEV)
    x = torch.randn(2, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[3, -1, 7, 11], [-1, -1, -1, -1]], device=DEV)
    weights = torch.softmax(torch.randn(2, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    out = fwd(x, weights, ids, w.to_packed())
    local = ids >= 0
    ref = reference(x, torch.where(local, weights, 0), torch.where(local, ids, 0), w)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_l2(out[0], ref[0]) < 4e-3


def _reference_f64(x, weights, ids, w):
    from pdserve.kernels.experts import ExpertWeights, experts_forward_ref
    from pdserve.kernels.mxfp4 import dequantize_mxfp4

    def dq(b, s):  # exact: float32 holds every value, subnormals included
        return dequantize_mxfp4(b, s, torch.float32).double()

    rw = ExpertWeights(dq(w.gate_up_blocks, w.gate_up_scales), w.gate_up_bias.double(),
                       dq(w.down_blocks, w.down_scales), w.down_bias.double())
    return experts_forward_ref(x.double(), weights.double(), ids, rw, add_down_bias=False)


def _scale_cases():
    """(gate/up scale byte, activation scale, down scale byte): the ends of the range the packed
    layout allows (0..192) and around 2^(s - 127) = 1, the activations (anywhere in bf16's range: the
    kernels stage each group at its own power of two) chosen so the gate/up sums stay O(1); pairings
    whose gate/up outputs would fall below 2^-16 (down stages the SwiGLU outputs in f16 at one power of
    two, cuda_moe_mxfp4.act_shift) or whose down outputs would fall out of float32 / bf16 normals test
    no scale and are left out."""
    gate_up = [(0, 2.0**120), (1, 2.0**120), (2, 2.0**120), (66, 2.0**58), (127, 1.0), (129, 2.0**-4),
               (190, 2.0**-66), (192, 2.0**-68)]
    cases = []
    for s_gate_up, x_scale in gate_up:
        for s_down in (3, 4, 127, 128, 129, 190, 192):
            glu = s_gate_up - 127 + math.log2(x_scale)  # log2 of the gate/up outputs, roughly
            out = min(glu, 5.0) + s_down - 127  # SwiGLU clamps at 7
            if -16 < glu < 100 and -100 < out < 100:
                cases.append((s_gate_up, x_scale, s_down))
    return cases


def _every_code_error(fwd, tokens, s_gate_up, x_scale, s_down) -> float:
    """rel L2 against float64 of `fwd` on `every_code_expert` (H = I = 64) for `tokens` tokens routed
    to it with weight 1, no bias; the output must be finite."""
    h = 64
    g = _seeded()
    w = every_code_expert(h, s_gate_up, s_down, g)
    x = (torch.randn(tokens, h, device=DEV, generator=g) * x_scale).to(torch.bfloat16)
    ids = torch.zeros(tokens, 1, dtype=torch.long, device=DEV)
    ones = torch.ones(tokens, 1, dtype=torch.bfloat16, device=DEV)
    got = fwd(x, ones, ids, w.to_packed(), add_down_bias=False)
    want = _reference_f64(x, ones, ids, w)
    assert torch.isfinite(got).all()
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("s_gate_up,x_scale,s_down", _scale_cases())
def test_mma_moe_every_code_and_scale(s_gate_up, x_scale, s_down):
    """Every e2m1 code in every row (+-0.5: e4m3 subnormals converted to f16 for the mma), gate/up and
    down scales from `_scale_cases`; one expert, one token, K = 64 (two groups: a K step with two
    empty group slots), against float64. Tolerance 1e-2: no long sums average the bf16 roundings of
    the activations and the output down, and +- codes cancel; a wrong code or scale is off by far
    more."""
    import functools

    from pdserve.kernels.cuda_moe_mxfp4 import MmaConfig

    fwd = functools.partial(_mma(), config=MmaConfig((4, 1, 3), (4, 1, 3)))
    err = _every_code_error(fwd, 1, s_gate_up, x_scale, s_down)
    assert err < 1e-2, (s_gate_up, s_down, err)


def test_dispatch_takes_the_mma_kernels_for_decode_batches():
    """kernels.moe.experts_forward: packed MXFP4 experts at decode sizes run the mma kernels (the
    same bits as calling them), per pair below MXFP4_MMA_GROUPED_FROM tokens, grouped from there,
    folded from cuda_moe_mxfp4.FOLD_FROM_TOKENS, up to MXFP4_MMA_FOLDED_MAX_TOKENS."""
    from pdserve.kernels import moe

    fwd = _mma()
    g = _seeded()
    wp = random_layer(8, g, DEV).to_packed()
    for t in (1, moe.MXFP4_MMA_GROUPED_FROM, moe.MXFP4_MMA_MAX_TOKENS, moe.MXFP4_MMA_FOLDED_MAX_TOKENS):
        x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
        grouped = t >= moe.MXFP4_MMA_GROUPED_FROM  # per-pair and grouped shapes add down's K in other orders
        assert torch.equal(moe.experts_forward(x, weights, ids, wp), fwd(x, weights, ids, wp, grouped=grouped))
        assert torch.equal(moe.experts_forward(x, weights, ids, wp, x_before_routing=True),
                           fwd(x, weights, ids, wp, grouped=grouped, x_before_routing=True))


def test_trace_build_records_every_cta_and_computes_the_same():
    """The timing build (MX_TRACE, bench/moe_trace.py) gives the same output bits and one sane
    record per CTA of each launch: start <= sums done <= end, on an SM the GPU has."""
    from pdserve.kernels.cuda_moe_mxfp4 import PAIR_CONFIG  # the launch shape of per-pair launches

    fwd = _mma()
    g = _seeded()
    wp = random_layer(8, g, DEV).to_packed()
    x = torch.randn(2, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], device=DEV)
    weights = torch.softmax(torch.randn(2, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    ctas = (5760 // PAIR_CONFIG.rows("gate_up") * 8, 2880 // PAIR_CONFIG.rows("down") * 8)
    bufs = tuple(torch.zeros(n * 4, dtype=torch.int64, device=DEV) for n in ctas)
    traced = fwd(x, weights, ids, wp, trace=bufs)
    assert torch.equal(traced, fwd(x, weights, ids, wp))
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for buf in bufs:
        rec = buf.view(-1, 4).cpu()
        assert (rec[:, 0] > 0).all() and (rec[:, 0] <= rec[:, 1]).all() and (rec[:, 1] <= rec[:, 2]).all()
        assert ((rec[:, 3] >= 0) & (rec[:, 3] < sms)).all()


def _fold_configs():
    """Folded shapes in f16 (the default where the experts allow it: random_layer's do), then in bf16."""
    import dataclasses

    from pdserve.kernels.cuda_moe_mxfp4 import FOLD_CONFIG, MmaConfig

    return [FOLD_CONFIG, MmaConfig((4, 1, 2), (4, 2, 2), slots=8, fold=True),
            MmaConfig((8, 2, 2), (8, 4, 2), slots=16, fold=True), MmaConfig((4, 2, 3), (4, 4, 1), slots=32, fold=True),
            dataclasses.replace(FOLD_CONFIG, fold_f16=False), MmaConfig((4, 2, 3), (4, 4, 1), slots=32, fold=True,
                                                                       fold_f16=False)]


@pytest.mark.parametrize("t,e", [(4, 8), (32, 32), (64, 8), (64, 32), (200, 32)])
@pytest.mark.parametrize("config", range(6))
def test_folded_launches_against_reference(t, e, config):
    """Scales folded into the decoded weights (MX_FOLD): against the float32 reference as the other
    launches, close to the unfolded grouped launch (both within rounding of the same sums; the
    products are the same, their float32 order is not), deterministic, with and without down's
    bias. e = 8 at 64 and 200 tokens: several full blocks per expert."""
    import functools

    from pdserve.kernels.cuda_moe_mxfp4 import CONFIG

    fwd = _mma()
    folded = functools.partial(fwd, config=_fold_configs()[config], grouped=True)
    g = _seeded()
    w = random_layer(e, g, DEV)
    wp = w.to_packed()
    assert wp.fold_exact and wp.fold_f16_exact
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    ref = reference(x, weights, ids, w)
    out = folded(x, weights, ids, wp)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_l2(out, ref) < 4e-3, rel_l2(out, ref)
    assert rel_l2(out, fwd(x, weights, ids, wp, grouped=True, config=CONFIG)) < 4e-3
    assert torch.equal(out, folded(x, weights, ids, wp))
    nobias = folded(x, weights, ids, wp, add_down_bias=False)
    assert rel_l2(nobias, reference(x, weights, ids, w, bias=False)) < 4e-3


def _pairs_by_expert(routing) -> torch.Tensor:
    """A routing layout's (expert, pair) entries, sorted: what the layout holds whatever order its atomics took."""
    expert = routing.block_expert.repeat_interleave(routing.route_m).long()
    live = routing.sorted_slot >= 0
    return (expert[live] * (1 << 32) + routing.sorted_slot[live].long()).sort().values


@pytest.mark.parametrize("t", [1, 4, 37, 64])
def test_routing_launch_writes_the_rows_of_the_f16_fold(t):
    """The routing launch's f16 rows (align_routing's x_f16), with rows of zeros, rows spanning 2^-40 .. 2^20 and
    a strided x: each row times 2^(141 - e) (e the biased exponent of its largest |x|, at least 15) rounded to
    f16, and 2^(e - 141), bit for bit as torch computes them; the routing is the one built without them."""
    from pdserve.kernels.triton_moe import align_routing

    g = _seeded()
    wide = torch.randn(t, 3000, device=DEV, generator=g)
    wide *= torch.exp2(torch.randint(-40, 21, wide.shape, device=DEV, generator=g).float())
    x = wide.to(torch.bfloat16)[:, :2880]
    x[t // 2] = 0
    ids = torch.stack([torch.randperm(32, device=DEV, generator=g)[:4] for _ in range(t)])
    routing, xf, inv = align_routing(ids, 0, 32, 16, x_f16=x)
    plain = align_routing(ids, 0, 32, 16)
    assert torch.equal(routing.block_expert, plain.block_expert)
    # the order of an expert's pairs is the atomics', and an expert with more than a block of pairs splits them
    # over its blocks in that order: compare each expert's pairs as a set, and how many pairs each block holds
    assert torch.equal((routing.sorted_slot.view(-1, 16) >= 0).sum(1), (plain.sorted_slot.view(-1, 16) >= 0).sum(1))
    assert torch.equal(_pairs_by_expert(routing), _pairs_by_expert(plain))
    ref_xf, ref_inv = f16_rows_reference(x)
    assert torch.equal(xf.view(torch.int16), ref_xf.view(torch.int16))
    assert torch.equal(inv.view(torch.int32), ref_inv.view(torch.int32))


def test_folded_launch_replays_from_a_cuda_graph():
    fwd = _mma()
    g = _seeded()
    w = random_layer(8, g, DEV)
    wp = w.to_packed()
    t = 40
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    cfg = _fold_configs()[0]
    fwd(x, weights, ids, wp, grouped=True, config=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd(x, weights, ids, wp, grouped=True, config=cfg)
    x.copy_(torch.randn(t, 2880, device=DEV, generator=g))
    ids.copy_(torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)]))
    weights.copy_(torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1))
    graph.replay()
    assert torch.equal(out, fwd(x, weights, ids, wp, grouped=True, config=cfg))
    assert rel_l2(out, reference(x, weights, ids, w)) < 4e-3


@pytest.mark.parametrize("s_gate_up,x_scale,s_down", [c for c in _scale_cases() if 2 <= min(c[0], c[2])
                                                       and max(c[0], c[2]) <= 128])
def test_folded_every_code_and_scale(s_gate_up, x_scale, s_down):
    """Every e2m1 code at the scale bytes the folded decode takes (2 .. 128: the factor 2^(s - 1) a
    bf16, the smallest product 0.5 * 2^(s - 128) a normal one), against float64, as
    test_mma_moe_every_code_and_scale; 8 tokens on one expert fill an mma's columns."""
    import functools

    from pdserve.kernels.cuda_moe_mxfp4 import MmaConfig

    fwd = functools.partial(_mma(), config=MmaConfig((4, 1, 3), (4, 1, 3), slots=8, fold=True, fold_f16=False),
                            grouped=True)
    err = _every_code_error(fwd, 8, s_gate_up, x_scale, s_down)
    assert err < 1e-2, (s_gate_up, s_down, err)


@pytest.mark.parametrize("s_gate_up,x_scale,s_down", [(104, 2.0**20, 136), (136, 2.0**-8, 104), (104, 2.0**20, 104),
                                                      (136, 2.0**-8, 136), (121, 2.0**5, 127), (104, 2.0**60, 110),
                                                      (136, 2.0**-20, 120)])
def test_folded_f16_every_code_and_scale(s_gate_up, x_scale, s_down):
    """The f16 fold (MX_FOLD 2) at the ends of its scale bytes (104 .. 136: the factor 2^(s - 121) an f16,
    the smallest product 0.5 * 2^(s - 127) the smallest f16 subnormal) and with activations far from 1
    (each token row taken to f16 at its own power of two), every code, against float64."""
    import functools

    from pdserve.kernels.cuda_moe_mxfp4 import MmaConfig
    from pdserve.kernels.mxfp4 import FOLD_F16_MAX_SCALE, FOLD_F16_MIN_SCALE

    assert FOLD_F16_MIN_SCALE <= min(s_gate_up, s_down) and max(s_gate_up, s_down) <= FOLD_F16_MAX_SCALE
    cfg = MmaConfig((4, 1, 3), (4, 1, 3), slots=8, fold=True)
    fwd = functools.partial(_mma(), config=cfg, grouped=True)
    assert cfg.fold_mode(every_code_expert(64, s_gate_up, s_down, _seeded()).to_packed()) == 2
    err = _every_code_error(fwd, 8, s_gate_up, x_scale, s_down)
    assert err < 1e-2, (s_gate_up, s_down, err)


def test_f16_fold_ignores_the_scale_of_a_group_of_zeros():
    """A group whose codes are all zero may carry any scale byte (fold_f16_exact ignores it, and the
    packed rows' padding groups carry 0): the f16 fold clamps its factor so that zero times it stays
    zero, so the output has the same bits as with an ordinary scale byte there."""
    from pdserve.kernels.cuda_moe_mxfp4 import FOLD_CONFIG
    from pdserve.kernels.mxfp4 import PACKED_MAX_SCALE

    fwd = _mma()
    g = _seeded()
    w = random_layer(8, g, DEV)
    w.gate_up_blocks[2, 9, 4] = 0
    w.down_blocks[2, 9, 4] = 0
    t = 16
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
    ids[0] = torch.tensor([2, 0, 1, 3], device=DEV)  # expert 2 is routed
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    outs = []
    for scale in (120, 0, PACKED_MAX_SCALE):
        w.gate_up_scales[2, 9, 4] = scale
        w.down_scales[2, 9, 4] = scale
        wp = w.to_packed()
        assert FOLD_CONFIG.fold_mode(wp) == 2
        outs.append(fwd(x, weights, ids, wp, grouped=True, config=FOLD_CONFIG))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_experts_with_scales_out_of_the_folded_range_are_not_folded():
    """A group with a nonzero code above both folds' ranges: fold_exact and fold_f16_exact are off, an
    explicit folded launch is refused before any launch, and the dispatch keeps them on the unfolded
    kernels."""
    from pdserve.kernels import cuda_moe_mxfp4, moe
    from pdserve.kernels.mxfp4 import FOLD_F16_MAX_SCALE, FOLD_MAX_SCALE

    fwd = _mma()
    g = _seeded()
    w = random_layer(8, g, DEV)
    w.down_scales[3, 17, 5] = max(FOLD_MAX_SCALE, FOLD_F16_MAX_SCALE) + 1
    w.down_blocks[3, 17, 5, 0] = 0x21
    wp = w.to_packed()
    assert not wp.fold_exact and not wp.fold_f16_exact
    t = max(cuda_moe_mxfp4.FOLD_FROM_TOKENS, moe.MXFP4_MMA_GROUPED_FROM)
    x = torch.randn(t, 2880, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device=DEV, generator=g)[:4] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 4, device=DEV, generator=g), -1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="unfolded"):
        fwd(x, weights, ids, wp, grouped=True, config=_fold_configs()[0])
    assert cuda_moe_mxfp4.fold_config(wp, t) is None
    out = fwd(x, weights, ids, wp, grouped=True)
    assert torch.equal(out, fwd(x, weights, ids, wp, grouped=True, config=cuda_moe_mxfp4.CONFIG))
