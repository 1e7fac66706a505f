"""Decode MoE from packed MXFP4 experts on the tensor cores: a CUDA kernel (cuda_moe_mxfp4.cu)
compiled at first use by NVRTC through torch, no build step.

Why CUDA: the Triton packed GEMV (kernels/triton_moe_mxfp4.py) is bound by latency on ~5 warps per
SM and by ~30 instructions per packed word. Here each warp streams the K of 16 rows through
double-buffered register batches, and a word costs ~10 instructions: the packed decode (a mask, or
two shifts and masks, to e4m3 bytes, then Hopper's e4m3 -> f16 conversion, two values an
instruction) and one mma.sync that keeps the four groups of a K step apart in float32 (the .cu file
says how), so the scales apply afterwards.
The same decode serves up to 8 tokens of one expert (grouped launches), so batches whose tokens
share experts read each expert once.

Two launches, no host synchronisation (CUDA-graph capturable): gate/up + bias + SwiGLU -> bf16
activations per pair (a per-pair launch's as a resident grid whose CTAs stream several tiles each,
RESIDENT_GATE_UP); down + bias, times the routing weight, with the token's pairs summed in slot
order (deterministic): per-pair launches run a token's pairs as one thread-block cluster that adds
them in distributed shared memory, grouped ones leave it to the last CTA to finish a row tile
(float32 partials and an arrival counter). Grouped launches add the routing layout
of kernels/triton_moe.py (pairs sorted by expert, blocks of 8), which where they fold the scales in f16
also writes the tokens' f16 copy that gate/up reads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .arrival import arrival_counters
from .mxfp4 import (FOLD_F16_MAX_SCALE, FOLD_F16_MIN_SCALE, FOLD_MAX_SCALE, FOLD_MIN_SCALE, PACKED_HIGH_SHL_MASK,
                    PACKED_HIGH_SHR_MASK, PACKED_LOW_MASK, MxExperts)
from .nvrtc import PORTABLE_CLUSTER, builds_on, load_kernels, resident_ctas
from .pdl import enabled as pdl_enabled, launch_cuda


SOURCE = Path(__file__).with_name("cuda_moe_mxfp4.cu")
# the packed word layout (kernels/mxfp4.py), handed to the compiler so the decode has one source
_LAYOUT_MACROS = [f"-DMX_LOW_MASK={PACKED_LOW_MASK:#010x}u", f"-DMX_HIGH_SHL_MASK={PACKED_HIGH_SHL_MASK:#010x}u",
                  f"-DMX_HIGH_SHR_MASK={PACKED_HIGH_SHR_MASK:#010x}u"]


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of each kernel: (warps per CTA, warps sharing a 16-row tile's K steps, K steps
    per register batch, two batches in flight[, CTAs an SM must hold at once: ptxas bounds the
    registers to fit them; 0 or left out: no bound[, 1: threads whose B operand is zero read it from a
    row of zeros instead of skipping the load (the .cu file's MX_ZERO_ROW: no per-step predicate or
    offsets, two registers more)]]). Grouped launches only: `slots` pairs a CTA
    serves (the routing layout's block) and `fold`, the scales folded into the decoded weights so
    that an mma's 8 columns are 8 pairs (the .cu file's MX_FOLD; slots a multiple of 8, experts
    with `MxExperts.fold_exact`), in f16 where the experts allow it (`fold_f16` and
    `MxExperts.fold_f16_exact`: MX_FOLD 2), else in bf16."""

    gate_up: tuple[int, ...] = (4, 1, 2)
    down: tuple[int, ...] = (4, 2, 2)
    slots: int = 8
    fold: bool = False
    fold_f16: bool = True

    def fold_mode(self, w: MxExperts) -> int | None:
        """The .cu file's MX_FOLD for these experts: 0 unfolded, 2 folded in f16, 1 folded in bf16; None
        where this config folds and the experts' scale bytes allow neither fold exactly."""
        if not self.fold:
            return 0
        if self.fold_f16 and w.fold_f16_exact:
            return 2
        return 1 if w.fold_exact else None

    def __post_init__(self):
        if not 1 <= self.slots <= 32 or (self.fold and self.slots % 8):
            raise ValueError(f"grouped launches take 1-32 slots, a multiple of 8 when folded: {self}")

    def rows(self, which: str) -> int:
        nw, ksplit = getattr(self, which)[:2]
        return 16 * nw // ksplit


CONFIG = MmaConfig()  # grouped launches (pairs grouped by expert)
# Grouped launches of batches from FOLD_FROM_TOKENS tokens whose experts allow it (fold_exact, or
# fold_f16_exact for the f16 fold):
# FOLD_CONFIG; None: never. H200, 20b layer, uniform random routing (bench/moe_mxfp4.py,
# 2026-12-03), us against CONFIG: 16 tokens 173 vs 192, 32: 199 vs 243, 64: 249 vs 382, 128: 403 vs
# 661 (with down's shape of CONFIG: 8 tokens 132 vs 127); 16 slots against 8: level to 32 tokens,
# 265 vs 304 at 64; down's K in one warp (4, 1, 2) against split over two: 6-8 % faster. Since the
# unfolded launches decode through Hopper's e4m3 -> f16 conversion and the folded ones spread the same
# bytes into bf16 pairs (2026-12-04, kernels.moe.experts_forward's layer): 16 tokens 199 folded vs
# 185 unfolded, 32: 226 vs 250, 64: 264 vs 361, so folding started at 32 tokens. Since the fold decodes
# in f16 too (MX_FOLD 2, 2026-12-05, H100, bench/moe_mxfp4.py): 16 / 32 / 64 tokens 185 / 216 / 257 us
# against 207 / 236 / 280 in bf16 and 278 / 318 / 467 unfolded, 4 / 8 tokens 101 / 137 against 141 / 192
# unfolded; the 20b step (bench/launch_ab.py, random checkpoint) at 4 / 8 / 16 tokens 3.48 / 4.64 / 6.02 ms
# a replay folded against 4.19 / 5.93 / 7.78 unfolded; on an H200 4 / 8 / 16 tokens 3.16 / 4.24 / 5.39 ms
# against 3.87 / 5.48 / 7.25, and the 120b step (8 layers) at 4 / 16 / 64 tokens 1.24 / 2.87 / 5.98 ms
# against 1.40 / 3.38 / 6.91 folded in bf16. So every grouped launch folds (from
# kernels.moe.MXFP4_MMA_GROUPED_FROM) where the experts allow it.
FOLD_CONFIG: MmaConfig | None = MmaConfig((4, 1, 2), (4, 1, 2), slots=16, fold=True)
FOLD_FROM_TOKENS = 4
# Per-pair launches (1-3 tokens): both kernels split their K over 4 warps in batches of 3 K steps, so
# down's first batch, read ahead of the PDL wait (EARLY_DOWN), is half of each warp's weights; down
# keeps to 80 registers so that one token's 720 CTAs fit in one wave (6 a SM; at 96 registers, 5 a
# SM, 60 of them ran in a second wave). 20b step replay on an H200 (bench/launch_ab.py): down's
# shape 1866 -> 1777 us at one token, level at two (2435 us); then gate/up's 1750 -> 1744 / 2407 ->
# 2381 / 2958 -> 2932 us at 1 / 2 / 3 tokens; then down's one wave 1741 -> 1725 / 2385 -> 2388 /
# 2923 -> 2914 us. Per-pair and grouped launches sum K shares in different orders: the same tokens
# in a batch of 3 and of 4 may differ in the last bit.
PAIR_CONFIG = MmaConfig(gate_up=(4, 4, 3, 5, 1), down=(4, 4, 3, 6))
GROUP_SLOTS = CONFIG.slots  # pairs one CTA serves in grouped launches (the routing layout's block)
MAX_TILES = 1 << 17  # (token, row tile) arrival counters of the down kernel, allocated before any capture
# down reads its routing and first batch of weights before the PDL wait, while gate/up still runs
# (the .cu file's MX_EARLY_DOWN)
EARLY_DOWN = True
# each kernel requests its epilogue's bias (down: and its routing weights) with its weights rather
# than after its sums (MX_EARLY_BIAS)
EARLY_BIAS = True
# per-pair down adds one token's top_k pairs inside a thread-block cluster of their CTAs, through
# distributed shared memory, instead of through float32 partials, a fence and an arrival counter in
# global memory (the .cu file's MX_CLUSTER_SUM; same float operations in the same order)
CLUSTER_SUM = True
MAX_CLUSTER = PORTABLE_CLUSTER  # larger top_k take the arrival counters
# per-pair gate/up stages its token's row before the PDL wait, where the caller vouches that the row
# predates the routing (experts_forward_mxfp4_mma's x_before_routing; the .cu file's MX_EARLY_X)
EARLY_X = True
# A per-pair gate/up of 1..RESIDENT_MAX_TOKENS tokens as a resident grid (the .cu file's mx_gate_up_resident) in
# this launch shape (an MmaConfig kernel shape; its CTAs an SM, where given, cap the grid): each CTA streams its
# tiles in turn, so that the next tile's weights are in flight while a tile is summed. It serves per-pair
# launches whose gate/up splits K as it does (PAIR_CONFIG's), so their sums are the same bit for bit. None: one
# CTA a tile (mx_gate_up, in waves). 120b step at 8k keys and 20b step at 1k, one token (8 / 24 layers, H100,
# bench/launch_ab.py): x0.978 / x0.986 a replay against mx_gate_up; (4, 4, 3, 5 | 3, 1) level with it.
RESIDENT_GATE_UP: tuple[int, ...] | None = (4, 4, 3, 4, 1)
# The most tokens a per-pair launch takes the resident gate/up for (each CTA stages every token's row, in a
# region of shared memory of its own); more go to mx_gate_up. H100, bench/launch_ab.py, against one token only
# (120b 8 layers at 8k keys / 20b at 1k; two runs, controls within 0.3 %): two tokens x0.989-0.996 / x0.998-1.008
# a replay, three x1.005-1.010 / x1.020-1.022 (three CTAs an SM, or no row of zeros, did not make it pay).
RESIDENT_MAX_TOKENS = 2
# every launch reads its expert weights with L2's evict-first policy (the .cu file's MX_EVICT_FIRST), so that what
# a later kernel reads (the next layer's weights requested into L2 ahead of it: GptOssModel.prefetch_next)
# outlives them there (level in a 120b step on an H200, x1.002, and no plan of GptOssModel.prefetch_next paid)
EVICT_FIRST = False


def available(device: torch.device | None = None) -> bool:
    """Hopper or newer (bf16x2 multiplies) with NVRTC loadable and the kernels compiled."""
    return builds_on(device, "MXFP4 mma kernels", lambda index: _kernels(
        index, 90, 1, PAIR_CONFIG.gate_up, early_down=EARLY_DOWN, early_x=EARLY_X, early_bias=EARLY_BIAS,
        cluster_sum=CLUSTER_SUM))


@functools.cache
def _kernels(device_index: int, k_groups: int, slots: int, shape: tuple[int, ...], trace: bool = False,
             early_down: bool = False, early_x: bool = False, early_bias: bool = False,
             cluster_sum: bool = False, fold: int = 0, evict_first: bool = False) -> dict:
    """{"mx_gate_up", "mx_down"} compiled for K = 32 * k_groups, `slots` pairs per CTA and the launch
    shape (warps, K split, batch[, min CTAs per SM]) of an MmaConfig; trace: the per-CTA timing build (MX_TRACE);
    early_down: MX_EARLY_DOWN (down only), early_x:
    MX_EARLY_X (per-pair gate/up only), early_bias: MX_EARLY_BIAS, cluster_sum: MX_CLUSTER_SUM (per-pair
    down only: launch it in clusters of (1, top_k, 1)), fold: MX_FOLD (grouped only: 1 bf16, 2 f16), evict_first:
    MX_EVICT_FIRST; callers pass the
    same flags for both kernels, so a shape that serves both compiles once."""
    # the staged rows plus the static reduction buffers can pass the 48 KB a launch gets without
    # asking (8 pairs x K 2880 = 46 KB staged): always allow the staging size explicitly
    return load_kernels(SOURCE, ["mx_gate_up", "mx_down"],
                        compile_options(k_groups, slots, shape, trace, early_down, early_x, early_bias, cluster_sum,
                                        fold, evict_first=evict_first),
                        device_index,
                        _shared_bytes(k_groups, slots, shape, fold))


@functools.cache
def _resident_gate_up(device_index: int, k_groups: int, shape: tuple[int, ...], early_x: bool, tokens: int,
                      evict_first: bool = False):
    """mx_gate_up_resident compiled for K = 32 * k_groups, a per-pair launch shape and `tokens` tokens."""
    return load_kernels(SOURCE, ["mx_gate_up_resident"],
                        compile_options(k_groups, 1, shape, early_x=early_x, resident=tokens, evict_first=evict_first),
                        device_index,
                        _resident_shared_bytes(k_groups, shape, tokens))["mx_gate_up_resident"]


def compile_options(k_groups: int, slots: int, shape: tuple[int, ...], trace: bool = False, early_down: bool = False,
                    early_x: bool = False, early_bias: bool = False, cluster_sum: bool = False,
                    fold: int = 0, resident: int = 0, evict_first: bool = False) -> list[str]:
    """The compiler options of a build of cuda_moe_mxfp4.cu (_kernels' arguments; nvcc takes them too);
    resident: the tokens of a resident gate/up build (MX_RESIDENT), 0 for the other kernels' builds."""
    nw, ksplit, batch, min_ctas, zero_row = (*shape, 0, 0)[:5]
    smem = (_resident_shared_bytes(k_groups, shape, resident) if resident
            else _shared_bytes(k_groups, slots, shape, fold))
    return [f"-DMX_KG={k_groups}", f"-DMX_NW={nw}", f"-DMX_KSPLIT={ksplit}", f"-DMX_D={batch}",
            f"-DMX_MIN_CTAS={min_ctas}", f"-DMX_ZERO_ROW={int(bool(zero_row))}", f"-DMX_SLOTS={slots}",
            f"-DMX_TRACE={int(trace)}", f"-DMX_RESIDENT={int(bool(resident))}",
            f"-DMX_RESIDENT_TOKENS={max(resident, 1)}",
            f"-DMX_EARLY_DOWN={int(early_down)}", f"-DMX_EARLY_X={int(early_x)}", f"-DMX_EARLY_BIAS={int(early_bias)}",
            f"-DMX_CLUSTER_SUM={int(cluster_sum)}", f"-DMX_FOLD={int(fold)}", f"-DMX_EVICT_FIRST={int(evict_first)}",
            f"-DMX_SHARED_BYTES={smem}", "-std=c++17", *_LAYOUT_MACROS]


def _staging_words(k_groups: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The .cu file's staging sizes in words: a staged row (XROW: whole K steps), the groups' factors (XF_WORDS)
    and the row of zeros (XZERO_WORDS, 0 where the shape has none)."""
    steps = (k_groups + 3) // 4
    zero_row = (*shape, 0, 0)[4]
    return steps * 64 + 4, steps * 4, steps * 64 + 32 if zero_row else 0


def _whole_bank_rows(words: int) -> int:
    """words rounded up to whole rows of the 32 banks (the .cu file's XZERO_AT and TOKEN_WORDS)."""
    return (words + 31) // 32 * 32


def _shared_bytes(k_groups: int, slots: int, shape: tuple[int, ...], fold: int = 0) -> int:
    """Dynamic shared memory: the staged activation rows (the .cu file's XROW words each, whole K
    steps), the groups' factors (XF_WORDS floats) and, with MX_ZERO_ROW, the row of zeros at XZERO_AT;
    folded launches read the rows from global memory."""
    if fold:
        return 0
    row, factors, zeros = _staging_words(k_groups, shape)
    staged = slots * row + factors
    return (_whole_bank_rows(staged) + zeros if zeros else staged) * 4


def _resident_shared_bytes(k_groups: int, shape: tuple[int, ...], tokens: int) -> int:
    """The resident gate/up's dynamic shared memory: a region a token (its staged row and groups' factors,
    padded to whole rows of banks: the .cu file's TOKEN_WORDS), then the row of zeros where the shape has one."""
    row, factors, zeros = _staging_words(k_groups, shape)
    return (tokens * _whole_bank_rows(row + factors) + zeros) * 4


def act_shift(limit: float) -> int:
    """The power of two gate/up multiplies its f16 SwiGLU outputs by (down stages them as they are):
    the largest that keeps them below 2^15, where |glu * sigmoid(alpha glu)| <= max(limit, 0.3) (glu is
    clamped above at limit; below zero the product stays above -0.3) and |lin + 1| <= limit + 1. For
    gpt-oss' limit 7: 2^9, outputs below 28672, exact in f16 down to 2^-23."""
    if not 0 < limit <= 128:
        raise ValueError(f"the MXFP4 mma kernels stage the SwiGLU outputs in f16: limit must be in (0, 128], not {limit}")
    return math.floor(math.log2(2.0**15 / (max(limit, 0.3) * (limit + 1))))


def _resident_launch(dev: int, k_groups: int, rows: int, tokens: int, top_k: int, early_x: bool) -> tuple:
    """(kernel, grid, block, dynamic shared memory) of RESIDENT_GATE_UP for `tokens` x `top_k` pairs of `rows`
    (2I) weight rows: as many CTAs as the SMs hold (at most the shape's CTAs an SM, where given), no more than
    tiles."""
    shape = RESIDENT_GATE_UP
    tile = MmaConfig(gate_up=shape).rows("gate_up")
    if rows % tile:
        raise ValueError(f"the resident gate/up takes rows in tiles of its shape {shape}: 2I = {rows}")
    threads, smem = 32 * shape[0], _resident_shared_bytes(k_groups, shape, tokens)
    kernel = _resident_gate_up(dev, k_groups, shape, early_x, tokens, EVICT_FIRST)
    ctas = min(rows // tile * tokens * top_k, resident_ctas(kernel, threads, smem, dev))
    if len(shape) > 3 and shape[3] > 0:  # the shape's CTAs an SM, where more would fit
        ctas = min(ctas, shape[3] * torch.cuda.get_device_properties(dev).multi_processor_count)
    return kernel, (ctas, 1, 1), (threads, 1, 1), smem


def resident_serves(config: MmaConfig, tokens: int, grouped: bool, top_k: int) -> bool:
    """Whether RESIDENT_GATE_UP serves this launch's gate/up: a per-pair launch of up to RESIDENT_MAX_TOKENS
    tokens (their pairs read by one warp), in a config whose gate/up splits K over as many warps (so the same
    sums, bit for bit)."""
    return (RESIDENT_GATE_UP is not None and 1 <= tokens <= RESIDENT_MAX_TOKENS and not grouped
            and tokens * top_k <= 32 and RESIDENT_GATE_UP[1] == config.gate_up[1])


def fold_config(w: MxExperts, tokens: int) -> MmaConfig | None:
    """FOLD_CONFIG where it serves a grouped launch of `tokens` tokens on these experts, else None."""
    if FOLD_CONFIG is None or tokens < FOLD_FROM_TOKENS or FOLD_CONFIG.fold_mode(w) is None:
        return None
    return FOLD_CONFIG


L2_PREFETCH_LAUNCHES = ("gate_up", "down")


def _l2_prefetch_args(l2_prefetch: dict[str, torch.Tensor] | None, device: torch.device) -> dict[str, list]:
    """Each launch's last two kernel arguments (l2_next, l2_bytes): the tensor l2_prefetch names for it and its
    whole 16-byte units, or (None, 0)."""
    if not l2_prefetch:
        return {launch: [None, 0] for launch in L2_PREFETCH_LAUNCHES}
    unknown = set(l2_prefetch) - set(L2_PREFETCH_LAUNCHES)
    if unknown:
        raise ValueError(f"l2_prefetch names launches {sorted(unknown)}; the MoE has {list(L2_PREFETCH_LAUNCHES)}")
    args = {}
    for launch in L2_PREFETCH_LAUNCHES:
        t = l2_prefetch.get(launch)
        if t is None:
            args[launch] = [None, 0]
            continue
        if t.device != device or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("l2_prefetch takes contiguous tensors on the experts' device, 16-byte aligned")
        n = t.numel() * t.element_size() // 16 * 16
        if n >= 2**31:
            raise ValueError(f"l2_prefetch of {n} bytes: the kernels take fewer than 2^31")
        args[launch] = [t if n else None, n]
    return args


def experts_forward_mxfp4_mma(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MxExperts,
    limit: float = 7.0, alpha: float = 1.702, add_down_bias: bool = True, grouped: bool = False,
    config: MmaConfig | None = None, trace: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_before_routing: bool = False, l2_prefetch: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: sum over the token's top-k experts of weight * expert(x), all
    experts local, experts packed (`MxExperts.to_packed()`). grouped: pairs that share an expert
    are served together (routing layout first); else one CTA column per pair. config: CONFIG
    (grouped) or PAIR_CONFIG when None. trace: uint64 buffers of 4 words per CTA of each launch
    (gate/up, down): the kernels' timing build records each CTA's start, sums done, end
    (%globaltimer ns) and SM (bench/moe_trace.py). x_before_routing: the caller vouches that x was
    written before the launch that computed the routing (the model routes x on the GPU), so a
    per-pair gate/up may read it ahead of its PDL wait (EARLY_X; kernels/pdl.py). l2_prefetch: {launch ("gate_up"
    or "down"): weights a later kernel of the step reads (never written during it)}, which that launch requests
    into L2 ahead of its wait, each CTA a share (whole 16-byte units of the contiguous tensor)."""
    if w.layout != "packed":
        raise ValueError("the MXFP4 mma kernels read packed blocks (MxExperts.to_packed)")
    l2_args = _l2_prefetch_args(l2_prefetch, x.device)
    if config is None:
        config = PAIR_CONFIG if not grouped else fold_config(w, x.shape[0]) or CONFIG
    fold = config.fold_mode(w) if grouped else 0
    if fold is None:
        f16 = f" or, in f16, {FOLD_F16_MIN_SCALE}..{FOLD_F16_MAX_SCALE}" if config.fold_f16 else ""
        raise ValueError("these experts have scale bytes outside the folded decode's exact range "
                         f"({FOLD_MIN_SCALE}..{FOLD_MAX_SCALE}{f16}): launch them unfolded")
    t, h = x.shape
    k = topk_ids.shape[1]
    e, n2, hg, _ = w.gate_up_blocks.shape
    i = n2 // 2
    ig = w.down_blocks.shape[2]
    if hg * 32 != h or w.down_blocks.shape[1] != h or ig * 32 != i:
        raise ValueError(f"MXFP4 experts {tuple(w.gate_up_blocks.shape)} / {tuple(w.down_blocks.shape)} "
                         f"do not match x {tuple(x.shape)}")
    rows_gu, rows_dn = config.rows("gate_up"), config.rows("down")
    if n2 % rows_gu or h % rows_dn:
        raise ValueError(f"the mma kernels take rows in CTA tiles of {rows_gu} / {rows_dn}: 2I = {n2}, H = {h}")
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    xb = x.to(torch.bfloat16).contiguous()
    wts = topk_weights.to(torch.bfloat16).contiguous().view(-1)
    ids = topk_ids.to(torch.int64).contiguous().view(-1)
    x_in, x_inv = xb, None
    if grouped:
        from .triton_moe import align_routing

        if fold == 2:  # the same launch writes the tokens as f16, each row times a power of two that x_inv undoes
            routing, x_in, x_inv = align_routing(topk_ids, 0, e, config.slots, x_f16=xb)
        else:
            routing = align_routing(topk_ids, 0, e, config.slots)
        items, item_expert, item_slots, slots = routing.max_blocks, routing.block_expert, routing.sorted_slot, config.slots
    else:
        items, item_expert, item_slots, slots = t * k, ids, ids, 1  # the item arrays are not read
    grid_gu, grid_dn = (n2 // rows_gu, items, 1), (h // rows_dn, items, 1)
    if trace is not None:  # 4 int64 words per CTA of each launch, written by the kernels
        for buf, ctas in zip(trace, (grid_gu[0] * items, grid_dn[0] * items)):
            if buf.dtype != torch.int64 or not buf.is_contiguous() or buf.numel() < 4 * ctas:
                raise ValueError(f"a trace buffer needs {4 * ctas} contiguous int64 words, got "
                                 f"{buf.numel()} {buf.dtype}")
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    # (a converted copy of x would be written by the launch just before gate/up: never read early)
    early_x = EARLY_X and x_before_routing and not grouped and xb is x
    cluster_sum = CLUSTER_SUM and not grouped and k <= MAX_CLUSTER
    flags = (trace is not None, EARLY_DOWN, early_x, EARLY_BIAS, cluster_sum, fold, EVICT_FIRST)
    gate_up = _kernels(dev, hg, slots, config.gate_up, *flags)["mx_gate_up"]
    down = _kernels(dev, ig, slots, config.down, *flags)["mx_down"]
    trace_args = ([trace[0]], [trace[1]]) if trace is not None else ([], [])
    # SwiGLU activations: bf16 for bf16-folded launches, else f16 times 2^shift (`act_shift`)
    shift = act_shift(limit)
    act = torch.empty(t * k, i, dtype=torch.bfloat16 if fold == 1 else torch.float16, device=x.device)
    pdl = pdl_enabled(x.device)
    if resident_serves(config, t, grouped, k) and trace is None:
        launch_cuda(*_resident_launch(dev, hg, n2, t, k, early_x), pdl=pdl, args=[
            w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias.contiguous(), x_in, ids, t, k, n2, act, float(limit),
            float(alpha), shift, *l2_args["gate_up"]])
    else:
        launch_cuda(gate_up, grid_gu, (32 * config.gate_up[0], 1, 1), _shared_bytes(hg, slots, config.gate_up, fold),
                    pdl=pdl, args=[
            w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias.contiguous(), x_in, x_in.stride(0), x_inv, ids,
            item_expert, item_slots, int(grouped), k, n2, act, float(limit), float(alpha), shift, *l2_args["gate_up"],
            *trace_args[0]])
    if cluster_sum:  # the cluster adds the token's pairs: no partials, no counters
        part = counters = None
    else:
        part = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, "mxfp4_mma_down", max(MAX_TILES, t * grid_dn[0]))
    res = out if out.dtype == torch.bfloat16 else torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    launch_cuda(down, grid_dn, (32 * config.down[0], 1, 1), _shared_bytes(ig, slots, config.down, fold), pdl=pdl,
                cluster=(1, k, 1) if cluster_sum else None, args=[
        w.down_blocks, w.down_scales, w.down_bias.contiguous(), act, ids, item_expert, item_slots, int(grouped), k, h,
        int(add_down_bias), wts, part, counters, res, res.stride(0), shift, *l2_args["down"], *trace_args[1]])
    if res is not out:
        out.copy_(res)
    return out
