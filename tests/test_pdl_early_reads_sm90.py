"""The kernels that read ahead of their PDL wait (kernels/pdl.py), compiled offline for sm_90: no GPU,
Triton's compiler and the ptxas and cuobjdump its wheel ships; the CUDA kernels through NVRTC, as
the engine builds them (tests/nvrtc_offline.py).

Each compiles with its early reads on and off, and in its SASS the early variant issues global loads
before `griddepcontrol.wait` (ACQBULK) while the other issues none there. So this fails if a change
lets ptxas sink the early loads past the wait (it does so with non-coherent `ld.global.nc` loads,
docs/kernels.md), if a late variant starts reading before its wait, or if a variant no longer
compiles for the GPU (Triton's CPU interpreter does not type-check: a variable rebound with another
type inside a branch compiles there and fails on the GPU, as the first early-read attention did).
The bench kernel built on the same helpers (bench/pdl_chain.py) is checked
here too: what their SASS must hold for their figures to mean what the benches say.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from nvrtc_offline import compile_cuda

triton = pytest.importorskip("triton")

_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _sass(cubin: bytes, tmp: Path, function: str | None = None) -> list[str]:
    """The SASS instruction mnemonics of a cubin, in order (predicates dropped)."""
    assert _CUOBJDUMP.exists(), f"Triton's NVIDIA backend ships cuobjdump; not found at {_CUOBJDUMP}"
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    cmd = [str(_CUOBJDUMP), "-sass"] + (["-fun", function] if function else []) + [str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    ops = []
    for line in out.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(1))
    return ops


def _loads_before_wait(ops: list[str]) -> list[str]:
    assert "ACQBULK" in ops, "no griddepcontrol.wait in the kernel"
    return [op for op in ops[: ops.index("ACQBULK")] if op.startswith("LDG")]


def _compile(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 2) -> bytes:
    """fn compiled for sm_90 with these argument types (the rest i32), pointers and int arguments
    taken as multiples of 16 (as Triton specialises the engine's strides and pointers)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in names}
    div = [a for a in names
           if sig[a].startswith("*") or (sig[a] == "i32" and (a.startswith(("stride", "K", "N")) or a == "H"))]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    return k.asm["cubin"]


def _attention(early: bool, splits: int):
    from pdserve.kernels import triton_decode_attention as tda

    cfg = tda.FULL_LAYERS if splits > 1 else tda.WINDOWED_LAYERS
    types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "table_ptr": "*i32", "lens_ptr": "*i32", "sinks_ptr": "*fp32",
             "out_ptr": "*bf16", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "count_ptr": "*i32",
             "qk_scale": "fp32"}
    consts = dict(GROUP=8, GROUP_P2=8, BLOCK_H=16, D=64, PAGE=16, BLOCK_N=cfg.block_n, MIN_KEYS=cfg.min_keys,
                  SPLITS=splits, COMBINE=min(cfg.combine_splits, splits), DOT_F32=False, WHILE_LOOP=False,
                  EARLY_KV=early, PDL=True)
    return _compile(tda._decode_kernel, types, consts, cfg.num_warps, cfg.num_stages)


def _router(early: bool):
    from pdserve.kernels import triton_router as tr

    block_k, warps = tr.launch_shape(32)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "weight_ptr": "*bf16", "ids_ptr": "*i64",
             "logits_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    consts = dict(H=2880, E=32, BLOCK_E=32, BLOCK_K=block_k, SPLITS=triton.cdiv(2880, block_k),
                  SPLITS_P2=triton.next_power_of_2(triton.cdiv(2880, block_k)), WRITE_LOGITS=False,
                  ACCURATE_EXP=True, EARLY_WEIGHTS=early, PDL=True)
    return _compile(tr._router_kernel, types, consts, warps)


def _gemv(early: bool):
    from pdserve.kernels import triton_bf16_gemv as g

    n, k = 2880, 4096  # gpt-oss' O projection, one token
    cfg = g.select_config(1, n, k)
    split, k_per = g.launch_shape(cfg, n, k)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32"}
    consts = dict(TOKENS=1, BLOCK_M=g.m_bucket(1), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=True,
                  SPLIT_K=split, K_PER=k_per, NUM_STAGES=cfg.num_stages, EARLY=early, PDL=True)
    return _compile(g._bf16_gemv_kernel, types, consts, cfg.num_warps, cfg.num_stages)


def _qkv_rope(early: bool):
    from pdserve.kernels import triton_bf16_gemv as g
    from pdserve.kernels import triton_rope as r

    cfg = g.select_config(1, 5120, 2880)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
             "sin_ptr": "*fp32", "slot_ptr": "*i64", "cache_ptr": "*bf16", "q_ptr": "*bf16"}
    consts = dict(HQ=64, HKV=8, D=64, HAS_BIAS=True, BLOCK_K=cfg.block_k, K_PER=triton.cdiv(2880, cfg.block_k),
                  NUM_STAGES=cfg.num_stages, ACCURATE=True, EARLY=early, PDL=True)
    return _compile(r._qkv_rope_kernel, types, consts, cfg.num_warps, cfg.num_stages)


KERNELS = {
    "attention, one split (windowed)": lambda early: _attention(early, 1),
    "attention, 32 splits (full)": lambda early: _attention(early, 32),
    "router": _router,
    "bf16 GEMV": _gemv,
    "QKV + RoPE": _qkv_rope,
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_triton_kernels_read_ahead_of_the_wait_only_when_asked(name, tmp_path):
    early = _loads_before_wait(_sass(KERNELS[name](True), tmp_path))
    late = _loads_before_wait(_sass(KERNELS[name](False), tmp_path))
    assert any(op.startswith("LDG.E.128") for op in early), f"{name}: no vector load before the wait: {early}"
    assert not late, f"{name}: loads before the wait with early reads off: {late}"


@pytest.mark.parametrize("early_reads", [True, False])
@pytest.mark.parametrize("early_launch", [True, False])
def test_norm_lets_the_next_kernel_launch_before_its_wait_only_when_asked(early_launch, early_reads, tmp_path):
    """kernels/triton_norm.py: with EARLY_LAUNCH the launch of the next kernel (PREEXIT) comes before
    the wait (ACQBULK), else after it; with EARLY (EARLY_READS) the weights and the residual row are requested
    before the wait and the block's output after it, else every load after it."""
    from pdserve.kernels import triton_norm as tn

    types = {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*fp32", "res_ptr": "*bf16", "out_ptr": "*bf16",
             "inv_h": "fp32", "eps": "fp32"}
    consts = dict(HAS_DELTA=True, BLOCK=4096, ACCURATE=True, EARLY_LAUNCH=early_launch, EARLY=early_reads,
                  PDL=True)
    ops = _sass(_compile(tn._add_rms_norm_kernel, types, consts, 16), tmp_path)
    early = _loads_before_wait(ops)
    late = [op for op in ops[ops.index("ACQBULK"):] if op.startswith("LDG")]
    if early_reads:  # per thread 8 float32 weights (2 x 16 bytes) and 8 bf16 of x (16 bytes), then 8 of delta
        assert len(early) == 3 and all(op.startswith("LDG.E.128") for op in early), early
        assert sum(op.startswith("LDG.E.128.STRONG.GPU") for op in early) == 1, early  # x through L2 only
        assert len(late) == 1, late
    else:
        assert not early and len(late) == 4, late
    assert "PREEXIT" in ops
    assert (ops.index("PREEXIT") < ops.index("ACQBULK")) == early_launch


def _mx_sass(tmp: Path, function: str, shape: tuple[int, ...], slots: int, early_down: int, early_x: int,
            early_bias: bool = False, cluster_sum: bool = False) -> list[str]:
    """One MXFP4 kernel's SASS, compiled by NVRTC for sm_90 with the engine's options
    (cuda_moe_mxfp4.compile_options)."""
    from pdserve.kernels.cuda_moe_mxfp4 import SOURCE, compile_options

    cubin, _ = compile_cuda(SOURCE.read_text(), compile_options(90, slots, shape, False, early_down, early_x,
                                                                early_bias, cluster_sum))
    return _sass(cubin, tmp, function)


def _mx_loads_before_wait(*args, **kwargs) -> list[str]:
    """The loads ahead of the first wait in one MXFP4 kernel (_mx_sass' arguments)."""
    return _loads_before_wait(_mx_sass(*args, **kwargs))


@pytest.mark.parametrize("launch", ["grouped", "per pair", "per pair, cluster sum"])
def test_mxfp4_down_reads_its_routing_and_first_batch_ahead_of_the_wait(launch, tmp_path):
    """Both launch shapes of the down kernel (ptxas sank the first batch's `ld.global.nc` loads past
    the wait in the grouped shape, not in the per-pair one), per-pair also with MX_CLUSTER_SUM; with
    MX_EARLY_BIAS also its routing weights, which the router wrote before gate/up ran."""
    from pdserve.kernels.cuda_moe_mxfp4 import CONFIG, GROUP_SLOTS, PAIR_CONFIG

    shape, slots = (CONFIG.down, GROUP_SLOTS) if launch == "grouped" else (PAIR_CONFIG.down, 1)
    cluster = launch.endswith("cluster sum")
    late = _mx_loads_before_wait(tmp_path, "mx_down", shape, slots, 0, 0, True, cluster)
    early = _mx_loads_before_wait(tmp_path, "mx_down", shape, slots, 1, 0, False, cluster)
    assert not late, f"loads before the wait with MX_EARLY_DOWN=0: {late}"
    weights = [op for op in early if ".128" in op]
    assert len(weights) >= 2 * shape[2], f"the first batch's weight loads are not all ahead of the wait: {early}"
    assert not [op for op in early if ".U16" in op], f"routing weights read early without MX_EARLY_BIAS: {early}"
    early = _mx_loads_before_wait(tmp_path, "mx_down", shape, slots, 1, 0, True, cluster)
    assert [op for op in early if ".U16" in op], f"no routing weight read ahead of the wait: {early}"


@pytest.mark.parametrize("kernel", ["mx_down", "mx_gate_up", "mx_gate_up_resident"])
def test_mxfp4_launches_request_later_weights_into_l2_with_one_bulk_prefetch_ahead_of_the_wait(kernel, tmp_path):
    """Each MXFP4 kernel's l2_prefetch (GptOssModel.prefetch_next): a CTA's share of the later kernel's weights is
    one bulk L2 prefetch (UBLKPF.L2) issued ahead of the wait, in the engine's per-pair builds."""
    from pdserve.kernels.cuda_moe_mxfp4 import PAIR_CONFIG, RESIDENT_GATE_UP, SOURCE, compile_options

    if kernel == "mx_gate_up_resident":
        cubin, _ = compile_cuda(SOURCE.read_text(), compile_options(90, 1, RESIDENT_GATE_UP, early_x=True, resident=1))
        ops = _sass(cubin, tmp_path, kernel)
    else:
        shape = PAIR_CONFIG.down if kernel == "mx_down" else PAIR_CONFIG.gate_up
        ops = _mx_sass(tmp_path, kernel, shape, 1, 1, int(kernel == "mx_gate_up"), True, True)
    assert ops.count("UBLKPF.L2") == 1, [op for op in ops if "BLK" in op]
    assert ops.index("UBLKPF.L2") < ops.index("ACQBULK")


def test_mxfp4_down_cluster_sum_adds_in_shared_memory_without_atomics(tmp_path):
    """MX_CLUSTER_SUM: per-pair down syncs its cluster (UCGABAR) and reads its peers' rows from
    distributed shared memory (LD through a mapped address), with no arrival counter (ATOM / RED) and
    no float32 partials in global memory; without it, the counter path's atomic is there and no
    cluster barrier."""
    from pdserve.kernels.cuda_moe_mxfp4 import PAIR_CONFIG

    cluster = _mx_sass(tmp_path, "mx_down", PAIR_CONFIG.down, 1, 1, 1, True, True)
    counters = _mx_sass(tmp_path, "mx_down", PAIR_CONFIG.down, 1, 1, 1, True, False)
    assert cluster.count("UCGABAR_ARV") >= 2 and "LD.E" in cluster, sorted(set(cluster))
    assert not [op for op in cluster if op.startswith(("ATOM", "RED"))], sorted(set(cluster))
    assert [op for op in cluster if op.startswith("STG")] == ["STG.E.U16"] * len(
        [op for op in cluster if op.startswith("STG")]), "stores other than the bf16 rows"
    assert any(op.startswith(("ATOM", "RED")) for op in counters)
    assert not any(op.startswith("UCGABAR") for op in counters)


def test_mxfp4_gate_up_stages_its_token_row_ahead_of_the_wait_in_per_pair_launches_only(tmp_path):
    """MX_EARLY_X: a per-pair gate/up (one pair a CTA) loads its token's row before the wait; a
    grouped one (whose rows come from the routing) and a build without it load nothing there."""
    from pdserve.kernels.cuda_moe_mxfp4 import CONFIG, GROUP_SLOTS, PAIR_CONFIG

    early = _mx_loads_before_wait(tmp_path, "mx_gate_up", PAIR_CONFIG.gate_up, 1, 1, 1)
    assert any(op.startswith("LDG.E.128") for op in early), f"no row load before the wait: {early}"
    assert not _mx_loads_before_wait(tmp_path, "mx_gate_up", PAIR_CONFIG.gate_up, 1, 1, 0)
    assert not _mx_loads_before_wait(tmp_path, "mx_gate_up", CONFIG.gate_up, GROUP_SLOTS, 1, 1)


def _k_steps(ops: list[str]) -> list[list[str]]:
    """The K steps of an unrolled MXFP4 K loop: the instructions between two branches that hold the
    step's 8 mmas (each step of use_batch ends in the branch of its `c >= CHUNKS` test)."""
    steps, cur = [], []
    for op in ops:
        if op.startswith("BRA"):
            if sum(o.startswith("HMMA") for o in cur) == 8:
                steps.append(cur)
            cur = []
        else:
            cur.append(op)
    return steps


def test_mxfp4_per_pair_gate_up_reads_zero_b_from_the_zero_row_without_per_step_work(tmp_path):
    """MX_ZERO_ROW (per-pair gate/up's default): every thread loads its 4 B words a K step from shared
    memory, the zero ones from the row of zeros, so a step has no predicated load, no zeroed registers
    and no offsets rebuilt from the thread index, and fewer instructions than the predicated build of
    the same shape (about 113 against 130-145 on 2026-12-05), with no spills at 5 CTAs a SM."""
    from pdserve.kernels.cuda_moe_mxfp4 import PAIR_CONFIG, SOURCE, compile_options

    assert PAIR_CONFIG.gate_up[4:5] == (1,)
    sizes = {}
    for zero_row in (1, 0):
        shape = (*PAIR_CONFIG.gate_up[:4], zero_row)
        cubin, report = compile_cuda(SOURCE.read_text(), compile_options(90, 1, shape, early_x=True, early_bias=True))
        steps = _k_steps(_sass(cubin, tmp_path, "mx_gate_up"))
        assert len(steps) >= 4, steps
        sizes[zero_row] = max(len(step) for step in steps[2:])
        if zero_row:
            entry = report[report.index("'mx_gate_up'"):]
            assert re.search(r" 0 bytes spill stores", entry.split("Compiling entry")[0]), report
            for step in steps[2:]:  # (the first two also hold the next batch's loads)
                assert step.count("LDS.128") == 4 and "CS2R" not in step and "S2R" not in step, step
    assert sizes[1] < 0.9 * sizes[0], sizes


@pytest.mark.parametrize("experts", [32, 128])
def test_cluster_router_reads_its_weights_ahead_of_the_wait_and_x_after_it(experts, tmp_path):
    """kernels/cuda_router.cu: every weight load of a lane (and CTA 0's bias) comes before the
    wait, its token columns' loads after it; CTA 0 reads its peers' partial logits through the
    cluster and picks the top 4 by warp-wide reductions."""
    from pdserve.kernels.cuda_router import SOURCE, compile_options, shape

    cluster, warps = shape(experts, 2880)
    cubin, _ = compile_cuda(SOURCE.read_text(), compile_options(experts, 2880, cluster, warps))
    ops = _sass(cubin, tmp_path)
    vectors = -(-2880 // cluster // 8 // 32)  # 16-byte vectors a lane reads of one row's share
    early = _loads_before_wait(ops)
    weights = [op for op in early if op.startswith("LDG.E.128")]
    assert len(weights) == experts // warps * vectors and len(set(weights)) == 1, early
    assert [op for op in early if not op.startswith("LDG.E.128")] == ["LDG.E.U16.STRONG.GPU"], early  # the bias
    late = [op for op in ops[ops.index("ACQBULK"):] if op.startswith("LDG")]
    assert len(late) == vectors and all(op.startswith("LDG.E.128") for op in late), late
    assert "UCGABAR_ARV" in ops and "LD.E" in ops
    assert not [op for op in ops if op.startswith(("ATOM", "RED.", "REDG"))]  # no atomics: the partials meet in the cluster
    assert "REDUX.MAX" in ops  # the top 4 by warp-wide max reductions (item 71 of docs/kernels.md)


def test_staged_gemv_requests_its_weights_ahead_of_the_wait_and_reads_x_after_it(tmp_path):
    """kernels/cuda_gemv_staged.cu: the async copies of the CTA's weight rows (LDGSTS) come before
    the wait, those of x (written by the kernel ahead) after it, and no other global load before it."""
    from pdserve.kernels.cuda_gemv_staged import SOURCE, compile_options

    cubin, _ = compile_cuda(SOURCE.read_text(), compile_options())
    ops = _sass(cubin, tmp_path)
    early = _loads_before_wait(ops)
    assert any(op.startswith("LDGSTS") for op in early), f"no weight copy ahead of the wait: {early}"
    assert all(op.startswith(("LDGSTS", "LDGDEPBAR")) for op in early), f"loads other than the weight copies ahead of the wait: {early}"
    assert any(op.startswith("LDGSTS") for op in ops[ops.index("ACQBULK"):]), "no copy of x after the wait"


@pytest.mark.parametrize("rows", [8, 16])
@pytest.mark.parametrize("entry", ["gemv_fp8", "gemv_fp8_rope"])
def test_fp8_gemv_requests_its_weights_scales_and_bias_ahead_of_the_wait_and_x_after_it(entry, rows, tmp_path):
    """kernels/cuda_gemv_fp8.cu, in CTAs of 8 and of 16 rows: the async copies of the CTA's e4m3 rows, its
    block scales and its biases (LDGSTS) are all it reads before the wait; x, the positions and the slots
    (written by the step) come after it, through L2; the K loop feeds f16 mmas from Hopper's e4m3
    conversion, without spills."""
    from pdserve.kernels.cuda_gemv_fp8 import SOURCE, compile_options, static_shared

    cubin, report = compile_cuda(SOURCE.read_text(), compile_options(rows=rows))
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills and set(spills) == {"0"}, report
    # the module sizes its dynamic shared memory by the staged entries' static buffers (the streaming
    # entry keeps only the token rows' powers of two of them)
    smem = {int(v) for v in re.findall(r"(\d+) bytes smem", report)}
    assert static_shared(rows) in smem and max(smem) == static_shared(rows), report
    ops = _sass(cubin, tmp_path, entry)
    early = _loads_before_wait(ops)
    assert any(op.startswith("LDGSTS") for op in early), f"no weight copy ahead of the wait: {early}"
    others = {op for op in early if not op.startswith(("LDGSTS", "LDGDEPBAR"))}
    assert not others, f"loads ahead of the wait besides the async copies: {others}"
    late = ops[ops.index("ACQBULK"):]
    assert "LDG.E.128.STRONG.GPU" in late, "x not read after the wait through L2"
    assert "HMMA.16816.F32" in late and "F2FP.F16.E4M3.UNPACK_B" in late
    if entry == "gemv_fp8_rope":
        assert "LDG.E.64.STRONG.GPU" in late, "positions / slots not read after the wait through L2"


@pytest.mark.parametrize("entry", ["gemv_fp8", "gemv_fp8_rope"])
def test_fp8_gemv_with_late_copies_loads_x_before_them(entry, tmp_path):
    """cuda_gemv_fp8.EARLY_GROUPS: with fewer commit groups ahead of the wait than the build has (the launch's
    `early` argument), the others' copies come after it, and the token rows' loads are issued before them (so
    the rows do not queue behind them)."""
    from pdserve.kernels.cuda_gemv_fp8 import SOURCE, compile_options

    cubin, report = compile_cuda(SOURCE.read_text(), compile_options(groups=2))
    assert set(re.findall(r"(\d+) bytes spill stores", report)) == {"0"}, report
    ops = _sass(cubin, tmp_path, entry)
    late = ops[ops.index("ACQBULK"):]
    assert any(op.startswith("LDGSTS") for op in _loads_before_wait(ops)), "no weight copy ahead of the wait"
    copies = [i for i, op in enumerate(late) if op.startswith("LDGSTS")]
    x_loads = [i for i, op in enumerate(late) if op == "LDG.E.128.STRONG.GPU"]
    assert copies and x_loads, late
    assert min(x_loads) < min(copies), "the late copies are issued before the token rows' loads"


def test_fp8_stream_requests_its_weights_and_scales_ahead_of_the_wait_and_x_after_it(tmp_path):
    """cuda_gemv_fp8.cu's streaming entry: before the wait it reads only the first ring steps' weights
    and their block scales (through L2: ptxas may place non-coherent loads after the wait); the token
    rows come after it, through L2, and the ring's later steps skip L1; the ring feeds f16 mmas from
    Hopper's e4m3 conversion."""
    from pdserve.kernels.cuda_gemv_fp8 import SOURCE, STREAM_DEPTH, compile_options

    cubin, _ = compile_cuda(SOURCE.read_text(), compile_options())
    ops = _sass(cubin, tmp_path, "gemv_fp8_stream")
    early = _loads_before_wait(ops)
    # rows g and g + 8 and the block scale, each ring step
    assert early.count("LDG.E.128.STRONG.GPU") == 2 * STREAM_DEPTH, early
    assert early.count("LDG.E.STRONG.GPU") == STREAM_DEPTH and len(early) == 3 * STREAM_DEPTH, early
    late = ops[ops.index("ACQBULK"):]
    assert "LDG.E.128.STRONG.GPU" in late, "x not read after the wait through L2"
    assert "LDG.E.NA.128.CONSTANT" in late, "the ring's later steps not read past L1"
    assert "HMMA.16816.F32" in late and "F2FP.F16.E4M3.UNPACK_B" in late


@pytest.mark.parametrize("layers", ["full", "full, few requests", "windowed", "full, entries 3 blocks ahead",
                                    "full, few requests, timing build"])
def test_cluster_decode_attention_copies_its_first_blocks_ahead_of_the_wait(layers, tmp_path):
    """kernels/cuda_decode_attention.cu: the request's length and page-table entries (strong L2
    loads) and the async copies of its first blocks' keys and values come before the wait; q and the
    step's own key row are read after it; full layers fold through the cluster, with one atomic (the
    arrival counter of requests that span several clusters), windowed ones without either. The timing
    build (bench/attention_trace.py) keeps all of that: its figures are the engine build's."""
    from pdserve.kernels.cuda_decode_attention import (FULL_LAYERS, FULL_LAYERS_FEW, SOURCE, WINDOWED_LAYERS,
                                                       compile_options)

    import dataclasses

    few = FULL_LAYERS_FEW or FULL_LAYERS
    cfg = {"full": FULL_LAYERS, "full, few requests": few, "windowed": WINDOWED_LAYERS,
           "full, entries 3 blocks ahead": dataclasses.replace(FULL_LAYERS, lookahead=3),
           "full, few requests, timing build": few}[layers]
    options = compile_options(8, 16, cfg, trace=layers.endswith("timing build"))
    cubin, report = compile_cuda(SOURCE.read_text(), options)
    assert "spill" not in report or " 0 bytes spill stores" in report, report
    ops = _sass(cubin, tmp_path)
    early = _loads_before_wait(ops)
    assert any(op.startswith("LDGSTS") for op in early), f"no key copy ahead of the wait: {early}"
    assert all(op.startswith(("LDGSTS", "LDGDEPBAR", "LDG.E.STRONG.GPU")) for op in early), early
    late = [op for op in ops[ops.index("ACQBULK"):] if op.startswith("LDG")]
    assert any(op.startswith("LDG.E.STRONG.GPU") for op in late), f"q is not read after the wait: {late}"
    assert len([op for op in ops if op.startswith(("ATOM", "RED"))]) == (cfg.cluster > 1)
    assert ("UCGABAR_ARV" in ops) == (cfg.cluster > 1)


@pytest.mark.parametrize("layers", ["full, few requests", "windowed"])
@pytest.mark.parametrize("early_launch", [False, True])
def test_cluster_decode_attention_lets_the_next_kernel_launch_at_its_start_only_when_asked(layers, early_launch,
                                                                                          tmp_path):
    """kernels/cuda_decode_attention.cu with DA_EARLY_LAUNCH: the next kernel's launch (PREEXIT) comes before
    the wait (ACQBULK), else after it; one of each either way, and the reads ahead of the wait are unchanged."""
    from pdserve.kernels.cuda_decode_attention import FULL_LAYERS, FULL_LAYERS_FEW, SOURCE, WINDOWED_LAYERS, compile_options

    cfg = {"full, few requests": FULL_LAYERS_FEW or FULL_LAYERS, "windowed": WINDOWED_LAYERS}[layers]
    cubin, report = compile_cuda(SOURCE.read_text(), compile_options(8, 16, cfg, early_launch=early_launch))
    assert "spill" not in report or " 0 bytes spill stores" in report, report
    ops = _sass(cubin, tmp_path)
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1, (ops.count("ACQBULK"), ops.count("PREEXIT"))
    assert (ops.index("PREEXIT") < ops.index("ACQBULK")) == early_launch
    early = _loads_before_wait(ops)
    assert early and all(op.startswith(("LDGSTS", "LDGDEPBAR", "LDG.E.STRONG.GPU")) for op in early), early


def test_pdl_chain_bench_link_reads_nothing_before_its_wait(tmp_path):
    """bench/pdl_chain.py's link kernel (what a boundary costs): in the engine's order (its first
    branch) every load after `griddepcontrol.wait`, the next kernel's launch right after it, no spills;
    so its chain measures dependent kernels."""
    from pdserve.bench.pdl_chain import SOURCE

    cubin, report = compile_cuda(SOURCE, [])
    assert set(re.findall(r"(\d+) bytes spill stores", report)) == {"0"}, report
    ops = _sass(cubin, tmp_path, "link")
    wait = ops.index("ACQBULK")
    assert not [op for op in ops[:wait] if op.startswith("LDG")], ops[:wait]
    assert "PREEXIT" in ops[wait:] and any(op.startswith("LDG") for op in ops[wait:])


def test_pdl_chain_bench_counters_hand_off_release_and_acquire(tmp_path):
    """bench/pdl_chain.py --counters: a CTA counts itself with a release at GPU scope (a fence, then the
    reduction) and the next kernel's CTAs poll with acquire loads, pausing between polls; without these
    the counters would hand off data that is not yet visible."""
    from pdserve.bench.pdl_chain import SOURCE

    cubin, _ = compile_cuda(SOURCE, [])
    ops = _sass(cubin, tmp_path, "link")
    red = [i for i, op in enumerate(ops) if op.startswith("REDG.E.ADD.STRONG.GPU")]
    assert len(red) == 1, red
    stores = [i for i, op in enumerate(ops) if op.startswith("STG")]
    assert any(op.startswith("MEMBAR.ALL.GPU") for op in ops[max(stores):red[0]]), ops[max(stores):red[0] + 1]
    poll = ops.index("NANOSLEEP")
    loads = [op for op in ops[poll - 6:poll + 4] if op.startswith("LDG")]
    assert loads and all(op.startswith("LDG.E.STRONG.GPU") for op in loads), ops[poll - 6:poll + 4]


def test_pdl_overlap_probe_triggers_at_the_spin_start_and_waits_in_the_probe(tmp_path):
    """bench/pdl_chain.py --overlap: the spin lets its dependents launch before it spins (PREEXIT ahead
    of its loop) and the probe reads the clock on both sides of its wait, so its figures say when a
    PDL launch is placed and when its wait passes."""
    from pdserve.bench.pdl_chain import OVERLAP_SOURCE

    cubin, _ = compile_cuda(OVERLAP_SOURCE, ["-std=c++17"])
    spin = _sass(cubin, tmp_path, "spin")
    assert "PREEXIT" in spin and spin.index("PREEXIT") < spin.index("BRA"), spin
    probe = _sass(cubin, tmp_path, "probe")
    clock = [i for i, op in enumerate(probe) if op.startswith(("S2UR", "CS2R", "S2R"))]
    wait = probe.index("ACQBULK")
    assert any(i < wait for i in clock) and any(i > wait for i in clock), probe


def test_pdl_chain_bench_cluster_phases_hand_off_through_the_cluster(tmp_path):
    """bench/pdl_chain.py --clusters: between phases a cluster barrier (arrive, then wait; the release
    arrival is fenced, as in the engine's cluster kernels), the value read from the cluster's first CTA
    by a generic load (distributed shared memory), and no counter in global memory, so its figures are
    those of a hand-off inside a cluster."""
    from pdserve.bench.pdl_chain import BARRIER_SOURCE

    cubin, report = compile_cuda(BARRIER_SOURCE, [])
    assert set(re.findall(r"(\d+) bytes spill stores", report)) == {"0"}, report
    ops = _sass(cubin, tmp_path, "cluster_phases")
    arrive, wait = ops.index("UCGABAR_ARV"), ops.index("UCGABAR_WAIT")
    assert arrive < wait and "MEMBAR.ALL.GPU" in ops[arrive - 4:arrive], ops[arrive - 4:wait + 1]
    assert "LD.E" in ops, ops
    assert not [op for op in ops if op.startswith(("REDG", "RED.E", "ATOMG"))], ops
