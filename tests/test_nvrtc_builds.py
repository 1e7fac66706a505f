"""Every CUDA kernel build the engine makes at run time, compiled by NVRTC for sm_90 on this host (no GPU),
within its spill budget.

On the GPU the kernels are compiled at first use by NVRTC through torch (kernels/nvrtc.py), which is
stricter than nvcc in places nvcc's tests do not reach: a function without `__device__` is a host
function, which NVRTC's JIT mode refuses (a `constexpr` helper at file scope did exactly that, and only
NVRTC said so). A build that fails there leaves the engine on its Triton kernels with one line in the
log, so it has to fail here instead. The NVRTC library comes from the `nvidia-cuda-nvrtc` wheel (the
test extra); the options are the modules' own `compile_options` for the engine's shapes of gpt-oss
(20b and 120b share them) and each kernel's timing build, and the bench probes' sources.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nvrtc_offline import compile_cuda


def _builds() -> dict[str, tuple[Path, list[str]]]:
    from pdserve.kernels import cuda_decode_attention as da
    from pdserve.kernels import cuda_gemv_fp8 as gf
    from pdserve.kernels import cuda_gemv_staged as gs
    from pdserve.kernels import cuda_moe_mxfp4 as mx
    from pdserve.kernels import cuda_router as rt

    builds = {}
    for name, cfg in (("full", da.FULL_LAYERS), ("full, few requests", da.FULL_LAYERS_FEW or da.FULL_LAYERS),
                      ("windowed", da.WINDOWED_LAYERS)):
        for trace in (False, True):
            builds[f"attention {name}{', timing' if trace else ''}"] = (da.SOURCE, da.compile_options(8, 16, cfg, trace))
    flags = dict(early_down=mx.EARLY_DOWN, early_bias=mx.EARLY_BIAS)
    for which in ("gate_up", "down"):
        builds[f"mxfp4 per pair {which}"] = (mx.SOURCE, mx.compile_options(
            90, 1, getattr(mx.PAIR_CONFIG, which), early_x=mx.EARLY_X, cluster_sum=mx.CLUSTER_SUM, **flags))
        builds[f"mxfp4 per pair {which}, timing"] = (mx.SOURCE, mx.compile_options(
            90, 1, getattr(mx.PAIR_CONFIG, which), trace=True, early_x=mx.EARLY_X, cluster_sum=mx.CLUSTER_SUM, **flags))
        builds[f"mxfp4 per pair {which}, evict first"] = (mx.SOURCE, mx.compile_options(
            90, 1, getattr(mx.PAIR_CONFIG, which), early_x=mx.EARLY_X, cluster_sum=mx.CLUSTER_SUM, evict_first=True,
            **flags))
        builds[f"mxfp4 grouped {which}"] = (mx.SOURCE, mx.compile_options(
            90, mx.CONFIG.slots, getattr(mx.CONFIG, which), **flags))
        if mx.FOLD_CONFIG is not None:
            for fold, dtype in ((1, "bf16"), (2, "f16")):
                builds[f"mxfp4 folded {dtype} {which}"] = (mx.SOURCE, mx.compile_options(
                    90, mx.FOLD_CONFIG.slots, getattr(mx.FOLD_CONFIG, which), fold=fold, **flags))
    if mx.RESIDENT_GATE_UP is not None:
        for tokens in range(1, mx.RESIDENT_MAX_TOKENS + 1):
            builds[f"mxfp4 resident gate_up, {tokens} tokens"] = (mx.SOURCE, mx.compile_options(
                90, 1, mx.RESIDENT_GATE_UP, early_x=mx.EARLY_X, resident=tokens, **flags))
    builds["fp8 gemv"] = (gf.SOURCE, gf.compile_options())
    builds["fp8 gemv, timing"] = (gf.SOURCE, gf.compile_options(trace=True))
    builds["fp8 gemv, all copies before the wait"] = (gf.SOURCE, gf.compile_options(groups=1))
    builds["fp8 gemv, 16 rows"] = (gf.SOURCE, gf.compile_options(rows=16))
    builds["staged gemv"] = (gs.SOURCE, gs.compile_options())
    for experts in (32, 128):
        builds[f"router, {experts} experts"] = (rt.SOURCE, rt.compile_options(experts, 2880, *rt.shape(experts, 2880)))
        builds[f"router, {experts} experts, 12 CTAs"] = (
            rt.SOURCE, rt.compile_options(experts, 2880, 12, rt.shape(experts, 2880)[1]))
    return builds


BUILDS = list(_builds())


# spill stores (bytes) ptxas may leave in the entries the engine launches from a build: none, except
# per-pair MXFP4 down, held to 80 registers so one token's 720 CTAs run in one wave (docs/kernels.md),
# and the timing build of per-pair gate/up (bench/moe_trace.py only), whose trace stores take a few of
# the 96 registers that keep 5 CTAs a SM, and the two-token resident gate/up at its 128-register bound (one value,
# since the packed layout's tile-major order: the last, partial K step's row offset)
SPILL_BUDGET = {"mxfp4 per pair down": 16, "mxfp4 per pair down, evict first": 16, "mxfp4 per pair down, timing": 16,
                "mxfp4 per pair gate_up, timing": 16, "mxfp4 resident gate_up, 2 tokens": 4}


def _spills(log: str) -> dict[str, int]:
    """{entry: spill-store bytes} from ptxas' -v report."""
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    stores = [int(b) for b in re.findall(r"(\d+) bytes spill stores", log)]
    assert len(entries) == len(stores), log
    return dict(zip(entries, stores))


def _launched(name: str, entries: set[str]) -> set[str]:
    """The entries of a build the engine launches (a MXFP4 build compiles both kernels for one of them)."""
    if name.startswith("mxfp4"):
        return {("mx_gate_up_resident" if "resident" in name else "mx_gate_up") if "gate_up" in name else "mx_down"}
    return entries


@pytest.mark.parametrize("name", BUILDS)
def test_engine_build_compiles_with_nvrtc_within_its_spill_budget(name):
    source, options = _builds()[name]
    _, log = compile_cuda(source.read_text(), options)
    spills = _spills(log)
    for entry in _launched(name, set(spills)):
        assert spills[entry] <= SPILL_BUDGET.get(name, 0), f"{entry} spills {spills[entry]} bytes:\n{log}"


def test_bench_probe_compiles_with_nvrtc():
    """The bench probe that compiles its own sources (bench/pdl_chain.py)."""
    from pdserve.bench import pdl_chain

    compile_cuda(pdl_chain.SOURCE, [])
    compile_cuda(pdl_chain.BARRIER_SOURCE, [])
    compile_cuda(pdl_chain.OVERLAP_SOURCE, ["-std=c++17"])


def test_a_host_function_fails_the_build():
    """What this file guards against: NVRTC refuses an unannotated function that device code calls."""
    with pytest.raises(AssertionError, match="host function"):
        compile_cuda("constexpr int f() { return 1; }\n"
                 "extern \"C\" __global__ void k(int* o) { constexpr int v = f(); o[0] = v; }\n", ["-std=c++17"])


def test_every_kernel_source_is_built_here():
    """A new .cu file in kernels/ gets its engine builds listed above, or this fails."""
    from pdserve.kernels.nvrtc import HEADERS

    built = {source.name for source, _ in _builds().values()}
    assert built == {p.name for p in HEADERS.glob("*.cu")}
