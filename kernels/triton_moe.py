"""MoE expert computation on CUDA with Triton: routing layout, FP8 grouped GEMMs, combine.

`experts_forward` computes what `kernels.experts.experts_forward_ref` computes for FP8 experts, in
four launches and without host synchronisation (CUDA-graph capturable: every buffer size follows
from the input shapes, unused blocks exit early):

1. `align_routing` (`_align_kernel`): program 0 counts the (token, slot) pairs per local expert,
   lays the experts' segments out padded to `route_m` rows and scatters each pair's flat index
   into its segment (pairs routed to other ranks' experts get no row); programs 1.. quantise x to
   e4m3 with one float32 scale per 1x128 group, unless the gate/up GEMM quantises its few A rows
   itself (decode tiles). Long prompts build the same layout in two launches of one program per
   1024 pairs (`_count_kernel`, `_scatter_kernel`).
2. gate/up GEMM with bias-initialised accumulators, clamped SwiGLU and FP8 re-quantisation fused
   (`kernels.triton_fp8_gemm`).
3. down GEMM with bias, times the routing weight, one float32 row per pair.
4. `_combine_kernel`: each token sums its local pairs in slot order -> x.dtype (deterministic).

Launch shapes come from `CONFIGS`, a small table keyed by the average number of rows per local
expert (decode: a few rows, small BLOCK_M, weight-bandwidth bound; prefill: large tiles,
tensor-core bound), tuned on an H200 for H = 2880, I = 3072 (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .buffers import empty
from .experts import ExpertWeights
from .fp8 import BLOCK, FP8, cdiv
from .triton_fp8_gemm import _down_kernel, _gate_up_kernel, _swiglu_quant_kernel

GATE_UP_BLOCK_N = 2 * BLOCK  # 256 gate/up columns -> one 128-wide activation group

@dataclass(frozen=True)
class GemmConfig:
    """One GEMM's tile: BLOCK_M routed rows x BLOCK_N output columns, 128-wide K steps."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # > 1: K split over programs (small decode batches), partials reduced after
    prefetch_scales: bool = True  # load the next K step's scales one step early
    block_k: int = BLOCK


@dataclass(frozen=True)
class MoEConfig:
    """One regime's launch shapes. `route_m` is the routing layout's segment alignment; each
    GEMM's BLOCK_M divides it, so a program's rows always belong to one expert."""

    route_m: int
    gate_up: GemmConfig
    down: GemmConfig
    fuse_act_quant: bool  # gate/up quantises its A rows itself (else the routing launch does)

    def __post_init__(self):
        for g in (self.gate_up, self.down):
            if self.route_m % g.block_m:
                raise ValueError(f"route_m {self.route_m} is not a multiple of block_m {g.block_m}")


# (max average rows per local expert, config), first match wins. ptxas register/spill counts of
# every tile were checked offline and the tiles timed on an H200 ("MoE tile sweep" in
# docs/performance.md, history in docs/kernels.md). Decode tiles quantise A in the routing launch
# (quantising inside the GEMM measured 2x slower) and fetch scales one K step ahead; splitting K
# (GemmConfig.split_k) measured no gain at batch 1 and is left off.
CONFIGS: list[tuple[float, MoEConfig]] = [
    (8, MoEConfig(16, GemmConfig(16, 256, 8, 4), GemmConfig(16, 64, 4, 6), False)),
    (24, MoEConfig(32, GemmConfig(32, 256, 4, 4), GemmConfig(32, 64, 4, 5), False)),
    (96, MoEConfig(64, GemmConfig(64, 256, 8, 4, prefetch_scales=False),
                   GemmConfig(64, 128, 4, 4, prefetch_scales=False), False)),
    (float("inf"), MoEConfig(128, GemmConfig(64, 256, 8, 3, prefetch_scales=False),
                             GemmConfig(64, 128, 4, 4, prefetch_scales=False), False)),
]


def select_config(num_pairs: int, num_experts: int) -> MoEConfig:
    rows_per_expert = num_pairs / max(num_experts, 1)
    for bound, cfg in CONFIGS:
        if rows_per_expert <= bound:
            return cfg
    return CONFIGS[-1][1]


@dataclass
class Routing:
    """Block-aligned layout of the routed rows (device tensors, fixed sizes for a given T)."""

    sorted_slot: torch.Tensor  # int32 [max_blocks * route_m]: pair index t * top_k + j, or -1
    block_expert: torch.Tensor  # int32 [max_blocks]: local expert of each block, or -1
    route_m: int
    top_k: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()

    @property
    def max_rows(self) -> int:
        return self.sorted_slot.numel()


@triton.jit
def _local_experts(ids_ptr, offs, num_pairs, first_expert, num_experts):
    """The pairs' local expert ids, and which pairs are local (in range, on this rank)."""
    in_range = offs < num_pairs
    e = (tl.load(ids_ptr + offs, mask=in_range, other=-1) - first_expert).to(tl.int32)
    return e, in_range & (e >= 0) & (e < num_experts)


@triton.jit
def _segments(counts, num_experts, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr):
    """Per-expert pair counts -> (each expert's blocks, the block its segment ends before)."""
    counts = tl.where(tl.arange(0, NUM_BINS) < num_experts, counts, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    return blocks, tl.cumsum(blocks, 0)


@triton.jit
def _write_block_experts(block_end, block_expert_ptr, num_experts, max_blocks, CHUNK_B: tl.constexpr):
    """Block b belongs to the first expert whose segment ends after it (-1: unused)."""
    for bstart in range(0, max_blocks, CHUNK_B):
        b = bstart + tl.arange(0, CHUNK_B)
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)


@triton.jit
def _quantize_program(pid, x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s, QUANT_ROWS: tl.constexpr):
    """Quantising program pid (0-based among them): one QUANT_ROWS x 128 tile of x."""
    groups = tl.cdiv(K, 128)
    rows = (pid // groups) * QUANT_ROWS + tl.arange(0, QUANT_ROWS)
    _quantize_group(x_ptr, q_ptr, s_ptr, rows, pid % groups, T, K, stride_x, stride_q, stride_s)


@triton.jit
def _f16_row_program(row, x_ptr, xf_ptr, inv_ptr, K, stride_x, stride_f, F16_ROW: tl.constexpr):
    """Row `row` of x (bf16, K <= F16_ROW values) as f16 times 2^(141 - e), e the biased exponent of its
    largest |x| (at least 15): that |x| lands in [2^14, 2^15), so every bf16 of the row down to 2^-31 of it
    stays exact; inv_ptr[row] = 2^(e - 141) undoes it (the convention of cuda_moe_mxfp4.cu's stage_rows, a
    row here where there a group). The tokens of the MXFP4 experts folded in f16 (that file's MX_FOLD 2,
    whose gate/up multiplies its sums by inv)."""
    cols = tl.arange(0, F16_ROW)
    ok = cols < K
    r64 = row.to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    e = tl.maximum(tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=0) >> 23, 15)  # magnitudes compare as bits
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(xf_ptr + r64 * stride_f + cols, (x * up).to(tl.float16), mask=ok)
    tl.store(inv_ptr + row, ((e - 14) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _extra_program(pid, x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s,
                   QUANT_ROWS: tl.constexpr, F16_ROW: tl.constexpr):
    """Program pid (0-based among the routing launch's extra programs): a QUANT_ROWS x 128 tile of x
    quantised to e4m3 (QUANT_ROWS > 0), or row pid of x as f16 at one power of two (F16_ROW > 0)."""
    if QUANT_ROWS > 0:
        _quantize_program(pid, x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s, QUANT_ROWS)
    if F16_ROW > 0:
        _f16_row_program(pid, x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, F16_ROW)


@triton.jit
def _align_kernel(
    ids_ptr, num_pairs, first_expert, num_experts,
    sorted_slot_ptr, block_expert_ptr, cursor_ptr, max_blocks,
    x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
    QUANT_ROWS: tl.constexpr, F16_ROW: tl.constexpr,
):
    """Program 0 builds the routing layout; programs 1.. (when QUANT_ROWS or F16_ROW > 0) each quantise
    one QUANT_ROWS x 128 tile of the activations or write one row in f16 (_extra_program), so no separate
    launch is needed for that."""
    pid = tl.program_id(0)
    if pid > 0:
        _extra_program(pid - 1, x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s, QUANT_ROWS, F16_ROW)
        return
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        e, local = _local_experts(ids_ptr, start + tl.arange(0, CHUNK), num_pairs, first_expert, num_experts)
        counts += tl.histogram(tl.where(local, e, num_experts), NUM_BINS)
    blocks, block_end = _segments(counts, num_experts, BLOCK_M, NUM_BINS)
    tl.store(cursor_ptr + tl.arange(0, NUM_BINS), (block_end - blocks) * BLOCK_M)
    _write_block_experts(block_end, block_expert_ptr, num_experts, max_blocks, CHUNK_B)
    for rstart in range(0, max_blocks * BLOCK_M, CHUNK):
        r = rstart + tl.arange(0, CHUNK)
        tl.store(sorted_slot_ptr + r, tl.full((CHUNK,), -1, tl.int32), mask=r < max_blocks * BLOCK_M)
    tl.debug_barrier()

    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e, local = _local_experts(ids_ptr, offs, num_pairs, first_expert, num_experts)
        pos = tl.atomic_add(cursor_ptr + tl.where(local, e, 0), 1, mask=local)
        tl.store(sorted_slot_ptr + pos, offs.to(tl.int32), mask=local)


@triton.jit
def _count_kernel(
    ids_ptr, num_pairs, first_expert, num_experts, sorted_slot_ptr, slot_rows, share, counts_ptr,
    x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s,
    NUM_BINS: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, QUANT_ROWS: tl.constexpr,
    F16_ROW: tl.constexpr,
):
    """Long prompts, first launch: program p < cdiv(num_pairs, CHUNK) counts its chunk's pairs per
    local expert (row p of counts) and sets its `share` of the routed rows to -1 (the second
    launch overwrites the used ones); the programs after them convert x, as `_align_kernel`'s do."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(num_pairs, CHUNK)
    if pid >= chunks:
        _extra_program(pid - chunks, x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s, QUANT_ROWS, F16_ROW)
        return
    e, local = _local_experts(ids_ptr, pid * CHUNK + tl.arange(0, CHUNK), num_pairs, first_expert, num_experts)
    tl.store(counts_ptr + pid * NUM_BINS + tl.arange(0, NUM_BINS),
             tl.histogram(tl.where(local, e, num_experts), NUM_BINS))
    for i in range(0, share, FILL):
        r = i + tl.arange(0, FILL)
        tl.store(sorted_slot_ptr + pid * share + r, tl.full((FILL,), -1, tl.int32),
                 mask=(r < share) & (pid * share + r < slot_rows))


@triton.jit
def _scatter_kernel(
    ids_ptr, num_pairs, first_expert, num_experts, sorted_slot_ptr, block_expert_ptr, max_blocks,
    counts_ptr, cursor_ptr,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Long prompts, second launch: program p lays the segments out from every chunk's counts and
    places its chunk's pairs after those of the chunks before it (atomics on its own cursor row:
    programs never contend); program 0 also writes each block's expert."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(num_pairs, CHUNK)
    bins = tl.arange(0, NUM_BINS)
    total = tl.zeros((NUM_BINS,), dtype=tl.int32)
    before = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for rstart in range(0, chunks, ROWS):  # the counts, ROWS chunks at a time
        rows = rstart + tl.arange(0, ROWS)
        counts = tl.load(counts_ptr + rows[:, None] * NUM_BINS + bins[None, :], mask=(rows < chunks)[:, None], other=0)
        total += tl.sum(counts, 0)
        before += tl.sum(tl.where((rows < pid)[:, None], counts, 0), 0)
    blocks, block_end = _segments(total, num_experts, BLOCK_M, NUM_BINS)
    tl.store(cursor_ptr + pid * NUM_BINS + bins, (block_end - blocks) * BLOCK_M + before)
    if pid == 0:
        _write_block_experts(block_end, block_expert_ptr, num_experts, max_blocks, CHUNK_B)
    tl.debug_barrier()
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    e, local = _local_experts(ids_ptr, offs, num_pairs, first_expert, num_experts)
    pos = tl.atomic_add(cursor_ptr + pid * NUM_BINS + tl.where(local, e, 0), 1, mask=local)
    tl.store(sorted_slot_ptr + pos, offs.to(tl.int32), mask=local)


# Batches of more (token, slot) pairs than this build the routing layout in two launches of many
# programs (`_count_kernel`, `_scatter_kernel`) instead of one program that counts and places
# every pair itself: that program's serial loop of atomics grows with the prompt. On an H200
# (2026-12-02, `python -m pdserve.bench.kernels --sections routing`, 128-row segments, 120b): one
# program 25.5 / 79.6 / 149 / 642 us at 4k / 16k / 33k / 131k pairs, two launches 53 / 34 / 34 /
# 50 us (20b alike); the crossing lies between 4k and 16k pairs. Decode batches stay below it.
ROUTING_PARALLEL_FROM = 8192
ROUTING_CHUNK = 1024  # pairs per program of the two-launch layout


def align_routing(
    topk_ids: torch.Tensor, first_expert: int, num_experts: int, route_m: int,
    x: torch.Tensor | None = None, x_f16: torch.Tensor | None = None,
) -> Routing | tuple[Routing, torch.Tensor, torch.Tensor]:
    """topk_ids int [T, k] (global expert ids) -> `Routing` over the local experts
    [first_expert, first_expert + num_experts). Order inside an expert's segment is arbitrary
    (atomics); every row is computed independently, so results do not depend on it.

    With `x` [T, H], the same launch also quantises it (as `quantize_act`) and returns
    (routing, x_fp8, x_scales). With `x_f16` [T, H] bf16 instead, it writes each row as f16 times the
    power of two that takes its largest |x| into [2^14, 2^15) and returns (routing, rows [T, H] f16,
    inverse factors [T] float32): the tokens of the MXFP4 experts folded in f16 (kernels/cuda_moe_mxfp4)."""
    if x is not None and x_f16 is not None:
        raise ValueError("the routing launch either quantises x or writes it in f16, not both")
    t, k = topk_ids.shape
    pairs = t * k
    max_blocks = max(cdiv(pairs, route_m) + min(num_experts, pairs), 1)
    dev = topk_ids.device
    sorted_slot = empty((max_blocks * route_m,), torch.int32, dev)
    block_expert = empty((max_blocks,), torch.int32, dev)
    num_bins = triton.next_power_of_2(num_experts + 1)
    quant, f16_row = 0, 0  # the extra programs' kind: rows of a quantised tile, or an f16 row's block
    if x is not None:
        x = x.contiguous()
        xq = empty(tuple(x.shape), FP8, dev)
        xs = empty((t, cdiv(x.shape[1], BLOCK)), torch.float32, dev)
        extra_args = (x, xq, xs, t, x.shape[1], x.stride(0), xq.stride(0), xs.stride(0))
        quant = 16
        extra_programs = cdiv(t, quant) * cdiv(x.shape[1], BLOCK)
    elif x_f16 is not None:
        if x_f16.dtype != torch.bfloat16 or x_f16.dim() != 2 or x_f16.shape[0] != t or x_f16.stride(1) != 1:
            raise ValueError(f"x_f16 must be [{t}, H] bf16 with unit column stride, got {x_f16.dtype} "
                             f"{tuple(x_f16.shape)}")
        xq = empty(tuple(x_f16.shape), torch.float16, dev)
        xs = empty((t,), torch.float32, dev)
        extra_args = (x_f16, xq, xs, t, x_f16.shape[1], x_f16.stride(0), xq.stride(0), 1)
        extra_programs, f16_row = t, triton.next_power_of_2(x_f16.shape[1])
    else:
        extra_args = (sorted_slot, sorted_slot, sorted_slot, 0, 0, 0, 0, 0)
        extra_programs = 0
    ids = topk_ids.contiguous().view(-1)
    chunk_b = max(16, 8192 // num_bins)
    if pairs > ROUTING_PARALLEL_FROM:
        chunks = cdiv(pairs, ROUTING_CHUNK)
        counts = empty((chunks, num_bins), torch.int32, dev)
        cursor = empty((chunks, num_bins), torch.int32, dev)
        _count_kernel[(chunks + extra_programs,)](
            ids, pairs, first_expert, num_experts, sorted_slot, sorted_slot.numel(), cdiv(sorted_slot.numel(), chunks),
            counts, *extra_args,
            NUM_BINS=num_bins, CHUNK=ROUTING_CHUNK, FILL=1024, QUANT_ROWS=quant, F16_ROW=f16_row, num_warps=4)
        _scatter_kernel[(chunks,)](
            ids, pairs, first_expert, num_experts, sorted_slot, block_expert, max_blocks, counts, cursor,
            BLOCK_M=route_m, NUM_BINS=num_bins, CHUNK=ROUTING_CHUNK, CHUNK_B=chunk_b,
            ROWS=max(1, 2048 // num_bins), num_warps=4)
    else:
        cursor = empty((num_bins,), torch.int32, dev)
        _align_kernel[(1 + extra_programs,)](
            ids, pairs, first_expert, num_experts, sorted_slot, block_expert, cursor, max_blocks, *extra_args,
            BLOCK_M=route_m, NUM_BINS=num_bins, CHUNK=1024, CHUNK_B=chunk_b, QUANT_ROWS=quant, F16_ROW=f16_row,
            num_warps=8)
    routing = Routing(sorted_slot, block_expert, route_m, k)
    return routing if x is None and x_f16 is None else (routing, xq, xs)


@triton.jit
def _quantize_group(x_ptr, q_ptr, s_ptr, rows, g, T, K, stride_x, stride_q, stride_s):
    """Rows x one 128-wide K group: amax / 448 scale, round to nearest e4m3 (IEEE division, so
    the result is bit-identical to `kernels.fp8.quantize_act_fp8` on the CPU)."""
    cols = g * 128 + tl.arange(0, 128)
    ok = (rows < T)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=ok)
    tl.store(s_ptr + rows64 * stride_s + g, scale, mask=rows < T)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _quantize_group(x_ptr, q_ptr, s_ptr, rows, tl.program_id(1), T, K, stride_x, stride_q, stride_s)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 FP8 quantisation, as `kernels.fp8.quantize_act_fp8`:
    [T, K] -> (e4m3 [T, K], float32 [T, ceil(K/128)])."""
    t, k = x.shape
    x = x.contiguous()
    q = empty((t, k), FP8, x.device)
    s = empty((t, cdiv(k, BLOCK)), torch.float32, x.device)
    if t:
        rows = 16
        _quant_kernel[(cdiv(t, rows), cdiv(k, BLOCK))](
            x, q, s, t, k, x.stride(0), q.stride(0), s.stride(0), ROWS=rows, num_warps=4
        )
    return q, s


def _check_tile(routing: Routing, cfg: GemmConfig) -> None:
    if routing.route_m % cfg.block_m or cfg.block_k != BLOCK:
        raise ValueError(
            f"tile {cfg.block_m}x{cfg.block_n}x{cfg.block_k} does not fit routing blocks of "
            f"{routing.route_m} rows and 128-wide scale groups"
        )


def gate_up_swiglu(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    routing: Routing,
    w: ExpertWeights,
    limit: float,
    alpha: float,
    cfg: GemmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed rows of a ([T, H] e4m3 with scales, or bf16 when a_scale is None) through
    gate/up + bias + SwiGLU -> (e4m3 [max_rows, I], float32 [max_rows, I/128]) in routing order."""
    n, kdim = w.gate_up.shape[1], w.gate_up.shape[2]
    _check_tile(routing, cfg)
    if cfg.block_n != GATE_UP_BLOCK_N or cfg.block_k != BLOCK:
        raise ValueError("gate/up tiles must be 256 columns x 128 K (one activation group)")
    out = empty((routing.max_rows, n // 2), FP8, a.device)
    out_scale = empty((routing.max_rows, n // 2 // BLOCK), torch.float32, a.device)
    a_fp8 = a_scale is not None
    split = cfg.split_k
    partial = empty((split, routing.max_rows, n), torch.float32, a.device) if split > 1 else None
    grid = (routing.max_rows // cfg.block_m * cdiv(n, cfg.block_n) * split,)
    _gate_up_kernel[grid](
        a, a_scale if a_fp8 else a, w.gate_up, w.gate_up_scale, w.gate_up_bias,
        partial if split > 1 else out, out_scale, routing.sorted_slot, routing.block_expert,
        n, kdim, routing.top_k, float(limit), float(alpha),
        a.stride(0), a_scale.stride(0) if a_fp8 else 0,
        w.gate_up.stride(0), w.gate_up.stride(1), w.gate_up_scale.stride(0),
        w.gate_up_scale.stride(1), w.gate_up_bias.stride(0),
        partial.stride(1) if split > 1 else out.stride(0), out_scale.stride(0),
        partial.stride(0) if split > 1 else 0,
        ROUTE_M=routing.route_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        A_FP8=a_fp8, SPLIT_K=split, PREFETCH_SCALES=cfg.prefetch_scales,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        _swiglu_quant_kernel[(routing.max_rows // 16, n // GATE_UP_BLOCK_N)](
            partial, w.gate_up_bias, out, out_scale, routing.sorted_slot, routing.block_expert,
            n, float(limit), float(alpha),
            partial.stride(0), partial.stride(1), w.gate_up_bias.stride(0), out.stride(0),
            out_scale.stride(0), out_scale.stride(1),
            ROUTE_M=routing.route_m, BLOCK_M=16, SPLIT_K=split, num_warps=4,
        )
    return out, out_scale


def down_weighted(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    routing: Routing,
    w: ExpertWeights,
    topk_weights: torch.Tensor,
    add_down_bias: bool,
    cfg: GemmConfig,
) -> torch.Tensor:
    """Routed e4m3 rows [max_rows, I] through down (+ bias) times the routing weight ->
    float32 [split_k, T * top_k, H]: one row per pair and K split (rows of non-local pairs are
    not written); the pair's contribution is the sum over the splits."""
    n, kdim = w.down.shape[1], w.down.shape[2]
    _check_tile(routing, cfg)
    pairs = topk_weights.numel()
    out = empty((cfg.split_k, pairs, n), torch.float32, a.device)
    grid = (routing.max_rows // cfg.block_m * cdiv(n, cfg.block_n) * cfg.split_k,)
    _down_kernel[grid](
        a, a_scale, w.down, w.down_scale, w.down_bias, topk_weights.contiguous().view(-1), out,
        routing.sorted_slot, routing.block_expert, n, kdim,
        a.stride(0), a_scale.stride(0),
        w.down.stride(0), w.down.stride(1), w.down_scale.stride(0), w.down_scale.stride(1),
        w.down_bias.stride(0), out.stride(1), out.stride(0),
        ROUTE_M=routing.route_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_BIAS=add_down_bias, SPLIT_K=cfg.split_k, PREFETCH_SCALES=cfg.prefetch_scales,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


@triton.jit
def _combine_kernel(
    pair_ptr, ids_ptr, out_ptr, H, first_expert, num_experts, stride_s, stride_p, stride_o,
    TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j) - first_expert
        local = (e >= 0) & (e < num_experts)
        for s in tl.static_range(SPLITS):
            acc += tl.load(pair_ptr + s * stride_s + (t * TOP_K + j) * stride_p + offs,
                           mask=ok & local, other=0.0)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(pair_out: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_experts: int,
            dtype: torch.dtype) -> torch.Tensor:
    """float32 [splits, T * k, H] pair rows -> [T, H] in `dtype`: each token's local pairs (and
    their K splits) summed in a fixed order, so the result is deterministic."""
    if pair_out.dim() == 2:
        pair_out = pair_out.unsqueeze(0)
    t, k = topk_ids.shape
    h = pair_out.shape[2]
    out = empty((t, h), dtype, pair_out.device)
    if t:
        block_h = 1024
        _combine_kernel[(t, cdiv(h, block_h))](
            pair_out, topk_ids.contiguous(), out, h, first_expert, num_experts,
            pair_out.stride(0), pair_out.stride(1), out.stride(0),
            TOP_K=k, SPLITS=pair_out.shape[0], BLOCK_H=block_h, num_warps=4,
        )
    return out


def _check_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: ExpertWeights):
    if not w.is_fp8 or w.gate_up_scale is None or w.down_scale is None:
        raise TypeError("triton_moe needs float8_e4m3fn expert weights with block scales")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a float [T, H] tensor, got {x.dtype} {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
            f"do not match x {tuple(x.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    e, n2, h = w.gate_up.shape
    if x.shape[1] != h or w.down.shape != (e, h, n2 // 2):
        raise ValueError(
            f"expert shapes gate_up {tuple(w.gate_up.shape)} / down {tuple(w.down.shape)} do not "
            f"match hidden size {x.shape[1]}"
        )
    if (n2 // 2) % BLOCK:
        raise ValueError(f"intermediate size {n2 // 2} must be a multiple of {BLOCK} (see fp8.pad_intermediate)")
    for name in ("gate_up", "down", "gate_up_scale", "down_scale", "gate_up_bias", "down_bias"):
        t = getattr(w, name)
        if not t.is_contiguous():
            raise ValueError(f"ExpertWeights.{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"ExpertWeights.{name} is on {t.device}, x on {x.device}")


def experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    limit: float = 7.0,
    alpha: float = 1.702,
    add_down_bias: bool = True,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.experts.experts_forward_ref` for FP8 experts: x [T, H] ->
    [T, H] in x.dtype, the routing-weighted sum over the token's *local* experts."""
    _check_inputs(x, topk_weights, topk_ids, w)
    t, h = x.shape
    if t == 0:
        return torch.empty_like(x)
    e = w.num_local_experts
    cfg = config or select_config(topk_ids.numel(), e)
    x = x.contiguous()
    if cfg.fuse_act_quant:
        routing = align_routing(topk_ids, w.first_expert, e, cfg.route_m)
        act, act_scale = gate_up_swiglu(x, None, routing, w, limit, alpha, cfg.gate_up)
    else:
        routing, xq, xs = align_routing(topk_ids, w.first_expert, e, cfg.route_m, x)
        act, act_scale = gate_up_swiglu(xq, xs, routing, w, limit, alpha, cfg.gate_up)
    pair_out = down_weighted(act, act_scale, routing, w, topk_weights, add_down_bias, cfg.down)
    return combine(pair_out, topk_ids, w.first_expert, e, x.dtype)
