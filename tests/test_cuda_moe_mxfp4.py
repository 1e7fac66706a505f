"""The CUDA mma MXFP4 kernels' host side on CPU (the kernels themselves: tests/gpu/
test_moe_mxfp4_mma_gpu.py): the source ships with the installed package, bad inputs are refused
before any launch, and the dispatch never picks them without a Hopper GPU."""

from __future__ import annotations

import re
from importlib import resources
from types import SimpleNamespace

import pytest
import torch

from mxfp4_layers import random_layer


def test_the_kernel_source_ships_with_the_package():
    src = resources.files("pdserve.kernels").joinpath("cuda_moe_mxfp4.cu").read_text()
    assert 'extern "C" __global__' in src and "mx_gate_up" in src and "mx_down" in src


def _problem(t=2, e=4, h=64, i=64):
    g = torch.Generator().manual_seed(0)
    w = random_layer(e, g, h=h, i=i)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(t)])
    return w, x, ids, torch.full((t, 4), 0.25, dtype=torch.bfloat16)


def _without_a_gpu(monkeypatch, resident_ctas: int = 1) -> None:
    """What a launch asks of the device, answered without one: device 0 of one SM that holds `resident_ctas`
    resident gate/up CTAs, and zeroed arrival counters (each test stubs the compile and the launches itself)."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=1))
    monkeypatch.setattr(cm, "resident_ctas", lambda kernel, threads, smem, dev: resident_ctas)
    monkeypatch.setattr(cm, "arrival_counters", lambda *a: torch.zeros(1, dtype=torch.int32))


def test_bad_inputs_are_refused_before_any_launch():
    from pdserve.kernels.cuda_moe_mxfp4 import MmaConfig, experts_forward_mxfp4_mma

    w, x, ids, wts = _problem()
    with pytest.raises(ValueError, match="packed"):
        experts_forward_mxfp4_mma(x, wts, ids, w)  # published layout
    wp = w.to_packed()
    with pytest.raises(ValueError, match="do not match"):
        experts_forward_mxfp4_mma(x[:, :32], wts, ids, wp)
    with pytest.raises(ValueError, match="CTA tiles"):  # 2I = 128 rows, not a multiple of 256
        experts_forward_mxfp4_mma(x, wts, ids, wp, config=MmaConfig((16, 1, 2), (4, 1, 2)))


def test_folded_launches_need_exact_scales_and_blocks_of_eight():
    """MX_FOLD multiplies each decoded pair by 2^(s - 1) in bf16: exact only for scale bytes in
    FOLD_MIN_SCALE .. FOLD_MAX_SCALE, so `to_packed` records whether every group with a nonzero code
    is there (fold_exact), a folded launch of other experts is refused before anything is compiled,
    a folded shape needs slots in mma columns of 8, and the dispatch picks it only for exact experts
    from FOLD_FROM_TOKENS."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels.mxfp4 import FOLD_MAX_SCALE, FOLD_MIN_SCALE

    with pytest.raises(ValueError, match="multiple of 8"):
        cm.MmaConfig(slots=12, fold=True)
    w, x, ids, wts = _problem()
    assert w.to_packed().fold_exact  # random_layer's scale bytes: 118-123
    w.gate_up_scales[1, 5, 0] = FOLD_MIN_SCALE - 1
    w.gate_up_blocks[1, 5, 0] = 0  # a low scale on a group of zeros changes nothing
    assert w.to_packed().fold_exact
    w.gate_up_blocks[1, 5, 0, 3] = 0x10  # one nonzero code there: not exact
    wp = w.to_packed()
    assert not wp.fold_exact
    w.gate_up_scales[1, 5, 0] = FOLD_MAX_SCALE
    assert w.to_packed().fold_exact
    w.gate_up_scales[1, 5, 0] = FOLD_MAX_SCALE + 1
    assert not w.to_packed().fold_exact
    with pytest.raises(ValueError, match="unfolded"):
        cm.experts_forward_mxfp4_mma(x, wts, ids, wp, grouped=True, config=cm.MmaConfig((4, 1, 2), (4, 2, 2),
                                                                                        slots=8, fold=True))
    assert cm.fold_config(wp, 10**6) is None
    exact = random_layer(4, torch.Generator().manual_seed(1), h=64, i=64).to_packed()
    assert cm.fold_config(exact, cm.FOLD_FROM_TOKENS) is cm.FOLD_CONFIG
    assert cm.fold_config(exact, cm.FOLD_FROM_TOKENS - 1) is None


def test_not_available_without_a_gpu(monkeypatch):
    from pdserve.kernels import cuda_moe_mxfp4, experts, moe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cuda_moe_mxfp4.available()
    w, x, ids, wts = _problem()
    out = moe.experts_forward(x, wts, ids, w.to_packed())  # CPU: the reference, not the kernels
    assert torch.equal(out, experts.experts_forward_mxfp4_ref(x, wts, ids, w))


def test_trace_buffers_too_small_are_refused_before_any_launch():
    """The timing build writes 4 int64 words per CTA of each launch: a buffer with fewer words (or
    another dtype) is refused before anything is compiled or launched."""
    from pdserve.kernels.cuda_moe_mxfp4 import MmaConfig, experts_forward_mxfp4_mma

    w, x, ids, wts = _problem(t=1, h=128, i=128)
    cfg = MmaConfig((4, 1, 2), (4, 2, 2))  # gate/up 2I = 256 rows: 4 tiles x 4 pairs; down 128: 4 x 4
    ok = torch.zeros(4 * 16, dtype=torch.int64)
    for bad in (torch.zeros(4 * 16 - 1, dtype=torch.int64), torch.zeros(4 * 16, dtype=torch.int32)):
        with pytest.raises(ValueError, match="trace buffer"):
            experts_forward_mxfp4_mma(x, wts, ids, w.to_packed(), config=cfg, trace=(bad, ok))
        with pytest.raises(ValueError, match="trace buffer"):
            experts_forward_mxfp4_mma(x, wts, ids, w.to_packed(), config=cfg, trace=(ok, bad))


@pytest.mark.parametrize("dtype,grouped,vouched,early", [
    (torch.bfloat16, False, True, True),
    (torch.bfloat16, False, False, False),  # the caller does not vouch for the order
    (torch.bfloat16, True, True, False),  # grouped CTAs take their rows from the routing
    (torch.float32, False, True, False),  # x converted by the launch just before gate/up
])
def test_gate_up_reads_x_ahead_of_its_wait_only_where_x_predates_the_routing(monkeypatch, dtype, grouped, vouched,
                                                                             early):
    """The build each launch gets (MX_EARLY_X), with the compile and the launches stubbed out; one token's
    resident gate/up (RESIDENT_GATE_UP) gets the same flag in its own build."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    builds, launched = [], []
    _without_a_gpu(monkeypatch)
    monkeypatch.setattr(cm, "_kernels", lambda *a: builds.append(a[6]) or {"mx_gate_up": "gu", "mx_down": "dn"})
    monkeypatch.setattr(cm, "_resident_gate_up", lambda dev, kg, shape, early_x, *a: builds.append(early_x) or "gu")
    monkeypatch.setattr(cm, "launch_cuda", lambda kernel, *a, **k: launched.append(kernel))
    w, x, ids, wts = _problem(t=1, h=128, i=128)
    cfg = cm.MmaConfig((4, 1, 2) if grouped else (4, 4, 3), (4, 2, 2))
    if grouped:
        monkeypatch.setattr("pdserve.kernels.triton_moe.align_routing",
                            lambda *a: type("R", (), {"max_blocks": 1, "block_expert": ids, "sorted_slot": ids})())
    cm.experts_forward_mxfp4_mma(x.to(dtype), wts, ids, w.to_packed(), config=cfg, grouped=grouped,
                                 x_before_routing=vouched)
    assert launched == ["gu", "dn"]
    if cm.resident_serves(cfg, 1, grouped, 4):  # the resident gate/up's build, then down's and gate/up's
        assert builds == [early, early, early]
    else:
        assert builds == [early, early]  # gate/up's and down's builds alike (one compile where shapes match)


@pytest.mark.parametrize("grouped,top_k,cluster_sum", [
    (False, 4, True),  # per pair: down in clusters of the token's pairs
    (True, 4, False),  # grouped CTAs serve pairs of many tokens: the arrival counters
    (False, 9, False),  # more pairs than a portable cluster holds: the arrival counters
])
def test_per_pair_down_launches_in_clusters_of_a_tokens_pairs(monkeypatch, grouped, top_k, cluster_sum):
    """The build each launch gets (MX_CLUSTER_SUM) and the cluster shape down is launched with, with
    the compile and the launches stubbed out."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    builds, launched = [], []
    monkeypatch.setattr(cm, "_kernels", lambda *a: builds.append(a[8]) or {"mx_gate_up": "gu", "mx_down": "dn"})
    monkeypatch.setattr(cm, "launch_cuda", lambda kernel, grid, *a, cluster=None, **k: launched.append(
        (kernel, grid, cluster)))
    monkeypatch.setattr(cm, "arrival_counters", lambda *a: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    g = torch.Generator().manual_seed(0)
    w = random_layer(16, g, h=128, i=128)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=g)[:top_k] for _ in range(2)])
    wts = torch.full((2, top_k), 1 / top_k, dtype=torch.bfloat16)
    if grouped:
        monkeypatch.setattr("pdserve.kernels.triton_moe.align_routing",
                            lambda *a: type("R", (), {"max_blocks": 1, "block_expert": ids, "sorted_slot": ids})())
    cm.experts_forward_mxfp4_mma(x, wts, ids, w.to_packed(), config=cm.MmaConfig((4, 1, 2), (4, 2, 2)),
                                 grouped=grouped)
    assert builds == [cluster_sum, cluster_sum]
    (gu, _, gu_cluster), (dn, dn_grid, dn_cluster) = launched
    assert (gu, gu_cluster, dn) == ("gu", None, "dn")
    assert dn_cluster == ((1, top_k, 1) if cluster_sum else None)
    if cluster_sum:
        assert dn_grid[1] == 2 * top_k  # one CTA row per pair: whole clusters


def test_a_grid_of_partial_clusters_is_refused_before_any_launch():
    from pdserve.kernels.pdl import launch_cuda

    with pytest.raises(ValueError, match="whole number of clusters"):
        launch_cuda(None, (180, 6, 1), (128, 1, 1), 0, [], pdl=True, cluster=(1, 4, 1))


def test_the_fold_is_in_f16_only_for_experts_whose_scales_allow_it():
    """MX_FOLD 2 multiplies each decoded pair by 2^(s - 121) in f16: exact only for scale bytes in
    FOLD_F16_MIN_SCALE .. FOLD_F16_MAX_SCALE, so `to_packed` records that apart (fold_f16_exact), a
    folded config takes f16 only there (and only with fold_f16), bf16 where only fold_exact holds, and
    experts exact in f16 alone are still folded by the dispatch."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels.mxfp4 import FOLD_F16_MAX_SCALE, FOLD_F16_MIN_SCALE, FOLD_MAX_SCALE

    f16, bf16, unfolded = cm.MmaConfig(fold=True), cm.MmaConfig(fold=True, fold_f16=False), cm.MmaConfig()
    w, *_ = _problem()
    wp = w.to_packed()
    assert wp.fold_exact and wp.fold_f16_exact  # random_layer's scale bytes: 118-123
    assert (f16.fold_mode(wp), bf16.fold_mode(wp), unfolded.fold_mode(wp)) == (2, 1, 0)
    w.down_scales[2, 7, 1] = FOLD_F16_MIN_SCALE - 1
    w.down_blocks[2, 7, 1] = 0  # a low scale on a group of zeros changes nothing
    assert w.to_packed().fold_f16_exact
    w.down_blocks[2, 7, 1, 9] = 0x01  # one nonzero code (+0.5) there: bf16 only
    wp = w.to_packed()
    assert wp.fold_exact and not wp.fold_f16_exact and f16.fold_mode(wp) == 1
    w.down_scales[2, 7, 1] = FOLD_F16_MIN_SCALE
    assert w.to_packed().fold_f16_exact
    assert FOLD_MAX_SCALE < FOLD_F16_MAX_SCALE
    w.down_scales[2, 7, 1] = FOLD_F16_MAX_SCALE  # above the bf16 fold's range: f16 only, still folded
    wp = w.to_packed()
    assert wp.fold_f16_exact and not wp.fold_exact and f16.fold_mode(wp) == 2
    assert cm.fold_config(wp, cm.FOLD_FROM_TOKENS) is cm.FOLD_CONFIG
    w.down_scales[2, 7, 1] = FOLD_F16_MAX_SCALE + 1
    assert not w.to_packed().fold_f16_exact


def _kernel_params(name: str) -> int:
    """How many parameters the .cu file's kernel `name` takes (without the timing build's trace buffer)."""
    from pdserve.kernels.cuda_moe_mxfp4 import SOURCE

    match = re.search(rf'extern "C" __global__[^;{{]*?\b{name}\(([^)]*)\)', SOURCE.read_text())
    return match.group(1).replace("TRACE_PARAM", "").count(",") + 1


@pytest.mark.parametrize("mode", ["per pair", "grouped", "folded in f16"])
def test_every_launch_passes_each_kernel_its_parameters(monkeypatch, mode):
    """The launches of experts_forward_mxfp4_mma hand each kernel as many arguments as its signature has, with the
    compile and the launches stubbed out: cuLaunchKernelEx would read a short list past its end."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    launched = []
    kernels = {"mx_gate_up": "mx_gate_up", "mx_down": "mx_down"}
    monkeypatch.setattr(cm, "_kernels", lambda *a: kernels)
    monkeypatch.setattr(cm, "launch_cuda", lambda kernel, *a, args, **k: launched.append((kernel, len(args))))
    monkeypatch.setattr("pdserve.kernels.pdl.launch_cuda", lambda kernel, *a, args, **k: launched.append(
        (kernel, len(args))))
    monkeypatch.setattr(cm, "arrival_counters", lambda *a: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    w, x, ids, wts = _problem(t=2, h=128, i=128)
    wp = w.to_packed()
    config = {"per pair": cm.MmaConfig((4, 1, 2), (4, 2, 2)), "grouped": cm.MmaConfig((4, 1, 2), (4, 2, 2)),
              "folded in f16": cm.MmaConfig((4, 1, 2), (4, 1, 2), slots=16, fold=True)}[mode]

    def routing(*a, x_f16=None):
        r = type("R", (), {"max_blocks": 1, "block_expert": ids, "sorted_slot": ids})()
        return r if x_f16 is None else (r, x_f16.half(), torch.ones(x_f16.shape[0]))

    if mode != "per pair":
        monkeypatch.setattr("pdserve.kernels.triton_moe.align_routing", routing)
    cm.experts_forward_mxfp4_mma(x, wts, ids, wp, config=config, grouped=mode != "per pair")
    assert [k for k, _ in launched] == ["mx_gate_up", "mx_down"]
    for kernel, n in launched:
        assert n == _kernel_params(kernel), (kernel, n)


def test_per_pair_launches_of_a_few_tokens_take_the_resident_gate_up_with_its_parameters(monkeypatch):
    """With RESIDENT_GATE_UP set, the per-pair gate/up of 1..RESIDENT_MAX_TOKENS tokens is mx_gate_up_resident,
    built for that many tokens, on a grid of at most what the SMs hold (and the shape's CTAs an SM) and no more
    than its tiles, handed as many arguments as its signature has; more tokens and a gate/up that splits K over
    another number of warps keep mx_gate_up."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    launched, builds = [], []
    _without_a_gpu(monkeypatch, resident_ctas=7)
    monkeypatch.setattr(cm, "_kernels", lambda *a: {"mx_gate_up": "mx_gate_up", "mx_down": "mx_down"})
    monkeypatch.setattr(cm, "_resident_gate_up", lambda *a: builds.append(a[4]) or "mx_gate_up_resident")
    monkeypatch.setattr(cm, "launch_cuda", lambda kernel, grid, *a, args, **k: launched.append((kernel, grid, args)))
    monkeypatch.setattr(cm, "RESIDENT_MAX_TOKENS", 3)
    w, x, ids, wts = _problem(t=4, h=128, i=128)
    wp = w.to_packed()
    per_pair = cm.MmaConfig((4, 4, 3), (4, 4, 3))
    for shape, t, ctas in (((4, 4, 3, 5, 1), 1, 5), ((4, 4, 3, 5, 1), 3, 5), ((4, 4, 3, 0, 1), 2, 7),
                           ((4, 4, 3, 0, 1), 1, 7)):
        # 2I = 256 rows in 16-row tiles: 16 a pair, 64 at one token; 7 CTAs fit, the shape asks for 5 an SM
        monkeypatch.setattr(cm, "RESIDENT_GATE_UP", shape)
        launched.clear()
        cm.experts_forward_mxfp4_mma(x[:t], wts[:t], ids[:t], wp, config=per_pair)
        kernel, grid, args = launched[0]
        assert (kernel, grid, builds[-1]) == ("mx_gate_up_resident", (ctas, 1, 1), t)
        assert len(args) == _kernel_params(kernel) and args[5:7] == [t, 4]  # n_tokens, top_k
    monkeypatch.setattr(cm, "resident_ctas", lambda kernel, threads, smem, dev: 100)
    launched.clear()  # fewer tiles than would fit: one CTA a tile
    cm.experts_forward_mxfp4_mma(x[:1], wts[:1], ids[:1], wp, config=per_pair)
    assert launched[0][1] == (64, 1, 1)
    for t, config in ((4, per_pair), (1, cm.MmaConfig((4, 2, 3), (4, 4, 3)))):
        launched.clear()  # four tokens; one token in a gate/up that splits K otherwise (other sums)
        cm.experts_forward_mxfp4_mma(x[:t], wts[:t], ids[:t], wp, config=config)
        assert launched[0][0] == "mx_gate_up"


@pytest.mark.parametrize("evict_first", [False, True])
@pytest.mark.parametrize("tokens", [1, 4])
def test_every_build_of_a_launch_reads_the_weights_evict_first_only_when_asked(monkeypatch, tokens, evict_first):
    """EVICT_FIRST reaches every kernel build a launch takes (per-pair gate/up and down, the resident gate/up),
    as MX_EVICT_FIRST in its compiler options."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    builds = []
    _without_a_gpu(monkeypatch)
    monkeypatch.setattr(cm, "_kernels", lambda *a: builds.append(a[-1]) or {"mx_gate_up": "gu", "mx_down": "dn"})
    monkeypatch.setattr(cm, "_resident_gate_up", lambda *a: builds.append(a[-1]) or "gu")
    monkeypatch.setattr(cm, "launch_cuda", lambda *a, **k: None)
    monkeypatch.setattr(cm, "EVICT_FIRST", evict_first)
    w, x, ids, wts = _problem(t=4, h=128, i=128)
    cm.experts_forward_mxfp4_mma(x[:tokens], wts[:tokens], ids[:tokens], w.to_packed(),
                                 config=cm.MmaConfig((4, 4, 3), (4, 4, 3)))
    assert len(builds) == (3 if tokens <= cm.RESIDENT_MAX_TOKENS else 2) and set(builds) == {evict_first}
    flag = [o for o in cm.compile_options(90, 1, (4, 4, 3), evict_first=evict_first) if "EVICT" in o]
    assert flag == [f"-DMX_EVICT_FIRST={int(evict_first)}"]


@pytest.mark.parametrize("resident", [False, True])
def test_each_launch_gets_its_l2_prefetch_and_its_whole_16_byte_units(monkeypatch, resident):
    """experts_forward_mxfp4_mma(..., l2_prefetch={"gate_up": a, "down": b}) hands each launch (the gate/up one
    CTA a tile or the resident one) its tensor and its bytes rounded down to whole 16-byte units (what one bulk
    prefetch a CTA takes) as its last two arguments, (None, 0) where it names none, and refuses a tensor it could not
    hand over whole (not contiguous) or a launch the MoE does not have."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm

    launched = []
    _without_a_gpu(monkeypatch)
    monkeypatch.setattr(cm, "_kernels", lambda *a: {"mx_gate_up": "mx_gate_up", "mx_down": "mx_down"})
    monkeypatch.setattr(cm, "_resident_gate_up", lambda *a: "mx_gate_up")
    monkeypatch.setattr(cm, "RESIDENT_GATE_UP", (4, 1, 2) if resident else None)
    monkeypatch.setattr(cm, "launch_cuda", lambda kernel, *a, args, **k: launched.append((kernel, args)))
    w, x, ids, wts = _problem(t=1, h=128, i=128)
    wp, cfg = w.to_packed(), cm.MmaConfig((4, 1, 2), (4, 2, 2))
    qkv, o = torch.empty(5120 * 3 + 7, dtype=torch.uint8), torch.empty(4096 * 5, dtype=torch.uint8)
    for asked in ({"down": qkv}, {"gate_up": qkv, "down": o}, {"gate_up": o}, {}):
        launched.clear()
        cm.experts_forward_mxfp4_mma(x, wts, ids, wp, config=cfg, l2_prefetch=asked)
        for kernel, args in launched:
            which = asked.get(kernel.removeprefix("mx_"))
            if kernel == "mx_gate_up":
                assert len(args) == _kernel_params("mx_gate_up_resident" if resident else "mx_gate_up")
            expected = [None, 0] if which is None else [which, which.numel() // 16 * 16]
            assert [args[-2] is expected[0], args[-1]] == [True, expected[1]], kernel
    with pytest.raises(ValueError, match="contiguous"):
        cm.experts_forward_mxfp4_mma(x, wts, ids, wp, config=cfg, l2_prefetch={"down": torch.empty(64, 2)[:, 0]})
    with pytest.raises(ValueError, match="launches"):
        cm.experts_forward_mxfp4_mma(x, wts, ids, wp, config=cfg, l2_prefetch={"router": qkv})
