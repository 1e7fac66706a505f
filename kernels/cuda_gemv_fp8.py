"""FP8-weight GEMV for decode batches (up to MAX_M tokens): e4m3 weights with 128x128 block scales
(kernels/fp8.py), bf16 activations, the bias in float32, one rounding to bf16; and gpt-oss' QKV
projection with its RoPE + KV-write epilogue in the same launch.

At decode the attention projections only stream weights, and FP8 halves their bytes. Each CTA
requests its 8 weight rows into shared memory ahead of its PDL wait (kernels/pdl.py), so they stream
while the kernel before it runs. Two e4m3 weights become an f16 tensor-core operand in one
instruction; the token rows are staged in f16 at a power of two per 64 K, exact to 2^-32 of each
step's largest |x|, so the sums are exact products in float32 (cuda_gemv_fp8.cu says why).
Compiled at first use by NVRTC (kernels/nvrtc.py); CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from .fp8 import BLOCK, FP8, cdiv
from .nvrtc import builds_on, load_kernels
from .pdl import enabled as pdl_enabled, launch_cuda

SOURCE = Path(__file__).with_name("cuda_gemv_fp8.cu")
ROWS = 8  # weight rows a CTA of `gemv_fp8` (one group of the mma's 8 rows)
# Weight rows a CTA of the QKV launch (`qkv_rope_fp8`; 8 or 16, half of them rotation pairs' first rows). At 8 its
# 640 CTAs of a 120b layer sit up to six an SM (docs/performance.md, fifty-fourth round), and no CTA of the
# attention after it finds room beside them until some end; 16 rows make 320 CTAs of 58.5 KB, three an SM,
# which leave room for a one-block attention CTA on every SM
QKV_ROWS = 8
WARPS = 4  # warps splitting a CTA's K
STEP_K = 64  # K a warp's step takes (4 lanes x 16 bytes)
MAX_M = 8  # tokens: the mma's rows 0-7
MAX_K = 8192  # a warp's share of K then is at most MAX_WARP_STEPS steps
ROPE_D = 64  # head dim of the RoPE entry (gpt-oss')
# Commit groups a warp's weight copies are split into (1-4): the warp sums each as soon as it has landed, so
# the last bytes are followed by one group's work
GROUPS = 2
# Of them, how many a launch requests ahead of the PDL wait (its `early` argument); the rest right after it,
# behind the token rows' loads (GROUPS: all ahead). Ahead of the wait a CTA's copies fill the memory path that
# its token rows then queue behind (bench/projection_trace.py: the rows staged 3 us after the wait, as the
# weights landed). Half of them ahead measured x0.970 a 20b step and x0.985 a 120b one (36 layers) against all
# of them (docs/performance.md, forty-sixth round); with all ahead, one group had measured as fast as more
EARLY_GROUPS = 1
# Up to how many tokens the engine takes these kernels for FP8 projections (beyond: the Triton FP8
# linear of kernels/triton_fp8_linear, which at 8 tokens measured faster in the step; at 1-4 these
# are 110-250 us a 20b step faster: docs/performance.md, fourteenth round)
MAX_TOKENS = 4
# The streaming entry (`gemv_fp8_stream`, projections of many rows: the vocabulary's): 64-K steps a
# warp requests ahead of its sums (registers: 8 words and a scale a step; 166 registers at 8, so 3
# CTAs of 4 warps an SM; 8 / 3 measured fastest of 3 / 6, 4 / 5, 6 / 4 and 8 / 3 at 1-4 tokens)
STREAM_ROWS = 16  # rows a warp streams at a time (the mma's 16 rows of A)
STREAM_DEPTH = 8
STREAM_CTAS_PER_SM = 3
# Up to how many tokens the engine takes the streaming entry for an FP8 vocabulary projection
# (all it takes; measured on an H200 at 1-8 tokens: 155-161 us for gpt-oss' 201088 rows, against
# 245-247 us through the Triton FP8 linear and 260-357 us for the bf16 weights; docs/performance.md)
STREAM_MAX_TOKENS = 8
SHARED_PER_SM = 227 * 1024  # an H100 / H200 SM's shared memory for CTAs
MAX_WARP_STEPS = 32  # 64-K steps of a warp's share of K (K <= MAX_K), each with its block scale


def static_shared(rows: int = ROWS) -> int:
    """The kernels' static buffers in a build of `rows` rows a CTA: the warps' sums, their block scales, the
    staged token rows' powers of two (a token and 64-K step), the bf16 biases."""
    return 4 * WARPS * MAX_M * rows + 4 * WARPS * MAX_WARP_STEPS + 4 * MAX_M * (MAX_K // STEP_K) + 2 * rows


def max_dynamic_shared(rows: int = ROWS) -> int:
    """The most dynamic shared memory a CTA of that build may ask for (what its module is loaded with)."""
    return SHARED_PER_SM - static_shared(rows)


def w_stride(k: int) -> int:
    """Bytes between staged weight rows: K padded to 64 past a multiple of 128, so that a quarter
    warp's 16-byte reads of rows g and g + 1 fall in distinct banks."""
    return k + (64 - k % 128) % 128


def x_stride(k: int) -> int:
    """Bytes between staged token rows (f16): 16 past a multiple of 128, for the same reason."""
    return 2 * k + 16


def shared_bytes(k: int, m: int, rows: int = ROWS) -> int:
    """A CTA's dynamic shared memory: its `rows` staged weight rows and the m token rows."""
    return rows * w_stride(k) + m * x_stride(k)


def fits(m: int, n: int, k: int, rows: int = ROWS) -> bool:
    """Whether the kernels take an [m, k] x [n, k]^T projection: tokens, rows in CTAs of `rows` (all in one
    128-row scale block), K in steps of 64, and a CTA within an SM's shared memory."""
    return (1 <= m <= MAX_M and n % rows == 0 and k % STEP_K == 0 and k <= MAX_K
            and shared_bytes(k, m, rows) <= max_dynamic_shared(rows))


def available(device: torch.device) -> bool:
    """Hopper or newer with NVRTC and the kernels compiled."""
    return builds_on(device, "FP8 GEMV", _kernels)


def compile_options(groups: int = GROUPS, stream_depth: int = STREAM_DEPTH, trace: bool = False,
                    rows: int = ROWS) -> list[str]:
    """The compiler options of cuda_gemv_fp8.cu (nvcc takes them too); trace: the timing build (GF_TRACE);
    rows: weight rows a CTA of the staged entries (8 or 16)."""
    if rows not in (8, 16):
        raise ValueError(f"a CTA stages 8 or 16 weight rows, got {rows}")
    if not 1 <= groups <= 4:
        raise ValueError(f"GROUPS must be 1-4, got {groups}")
    if not 1 <= stream_depth <= 32:
        raise ValueError(f"STREAM_DEPTH must be 1-32, got {stream_depth}")
    return [f"-DGF_MAX_M={MAX_M}", f"-DGF_ROWS={rows}", f"-DGF_ROPE_D={ROPE_D}", f"-DGF_GROUPS={groups}",
            f"-DGF_STREAM_D={stream_depth}", f"-DGF_TRACE={int(trace)}", "-std=c++17"]


# The timing build (bench/projection_trace.py; never in the engine): while TRACE holds a Trace, `gemv_fp8` and
# `qkv_rope_fp8` launch the build compiled with GF_TRACE, each CTA writing TRACE_WORDS words (the .cu file's
# `GfTrace`) into the Trace's buffer, launch after launch.
TRACE_WORDS = 8


@dataclasses.dataclass
class Trace:
    """Where the timing build's launches write: `buffer` int64 [launches x CTAs x TRACE_WORDS] words, used in
    launch order; `launches` (entry, first word, CTAs) of each launch captured into a CUDA graph. Launches
    outside a capture (a graph's warm-up) all write into `scratch` and are not listed."""

    buffer: torch.Tensor
    scratch: torch.Tensor
    launches: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)

    def take(self, entry: str, ctas: int) -> torch.Tensor:
        words = ctas * TRACE_WORDS
        if not torch.cuda.is_current_stream_capturing():
            if self.scratch.numel() < words:
                raise ValueError(f"a trace scratch of {self.scratch.numel()} words for {ctas} CTAs")
            return self.scratch
        start = self.launches[-1][1] + self.launches[-1][2] * TRACE_WORDS if self.launches else 0
        if start + words > self.buffer.numel():
            raise ValueError(f"the trace buffer ({self.buffer.numel()} words) is full at launch {len(self.launches)}")
        self.launches.append((entry, start, ctas))
        return self.buffer[start:start + words]


TRACE: Trace | None = None


def _traced(entry: str, ctas: int) -> tuple[dict, list]:
    """The build a launch takes and its extra arguments: the timing build and its part of TRACE, where set."""
    if TRACE is None:
        return {}, []
    return {"trace": True}, [TRACE.take(entry, ctas)]


def _kernels(device_index: int, trace: bool = False, rows: int = ROWS) -> dict:
    return _build(device_index, GROUPS, STREAM_DEPTH, trace, rows)


@functools.cache
def _build(device_index: int, groups: int, stream_depth: int, trace: bool = False, rows: int = ROWS) -> dict:
    return load_kernels(SOURCE, ["gemv_fp8", "gemv_fp8_rope", "gemv_fp8_stream"],
                        compile_options(groups, stream_depth, trace, rows), device_index, max_dynamic_shared(rows))


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           rows: int = ROWS) -> tuple[int, int, int]:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    m, k = x.shape
    n = w.shape[0]
    if not fits(m, n, k, rows):
        raise ValueError(f"the FP8 GEMV takes 1-{MAX_M} tokens, N a multiple of {rows} and K a multiple of "
                         f"{STEP_K} up to {MAX_K}: got M {m}, N {n}, K {k}")
    if x.dtype != torch.bfloat16 or w.dtype != FP8 or scale.dtype != torch.float32 or (
            bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError("the FP8 GEMV takes bf16 x, e4m3 w, float32 scales and a bf16 bias")
    if tuple(scale.shape) != (cdiv(n, BLOCK), cdiv(k, BLOCK)) or not scale.is_contiguous():
        raise ValueError(f"scales {tuple(scale.shape)} are not the contiguous 128x128 grid of w {tuple(w.shape)}")
    if not w.is_contiguous() or (bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous())):
        raise ValueError("the FP8 GEMV takes contiguous w [N, K] and bias [N]")
    if (x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or w.data_ptr() % 16
            or (bias is not None and bias.data_ptr() % 16)):
        raise ValueError("the FP8 GEMV takes 16-byte aligned rows of x and w, and a 16-byte aligned bias")
    return m, n, k


def gemv_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
             rows: int = ROWS) -> torch.Tensor:
    """x [M, K] bf16 @ (w [N, K] e4m3 x its 128x128 block scales)^T + bias [N] -> [M, N] bf16 on one
    CUDA device (`fits(M, N, K, rows)`): float32 sums, the bias added in float32, one rounding; CTAs of
    `rows` weight rows (8 or 16: the same sums in the same order, so the same bits)."""
    m, n, k = _check(x, w, scale, bias, rows)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    build, trace = _traced("gemv_fp8", n // rows)
    launch_cuda(_kernels(_index(x), rows=rows, **build)["gemv_fp8"], (n // rows, 1, 1), (32 * WARPS, 1, 1),
                shared_bytes(k, m, rows), pdl=pdl_enabled(x.device),
                args=[x, x.stride(0), w, scale, bias, out, out.stride(0), m, k, w_stride(k), x_stride(k),
                      _early(), *trace])
    return out


def _early() -> int:
    """The commit groups a staged launch requests ahead of its wait (EARLY_GROUPS within 1..GROUPS)."""
    if not 1 <= EARLY_GROUPS <= GROUPS:
        raise ValueError(f"EARLY_GROUPS must be 1-{GROUPS} (GROUPS), got {EARLY_GROUPS}")
    return EARLY_GROUPS


def stream_fits(m: int, n: int, k: int) -> bool:
    """Whether `gemv_fp8_stream` takes an [m, k] x [n, k]^T projection: as `fits`, rows in groups of
    STREAM_ROWS."""
    return fits(m, n, k) and n % STREAM_ROWS == 0


def gemv_fp8_stream(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                    depth: int = STREAM_DEPTH, ctas_per_sm: int = STREAM_CTAS_PER_SM) -> torch.Tensor:
    """`gemv_fp8` for projections of many rows (the vocabulary projection): each warp streams whole
    groups of STREAM_ROWS rows through a ring of `depth` 64-K steps, the token rows staged once a CTA,
    on `ctas_per_sm` CTAs an SM. Same contract and numerics as `gemv_fp8` (the steps summed in K
    order, so the last bit may differ from it)."""
    m, n, k = _check(x, w, scale, bias)
    if n % STREAM_ROWS:
        raise ValueError(f"the streaming FP8 GEMV takes N a multiple of {STREAM_ROWS}, got {n}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = max(1, min(cdiv(n // STREAM_ROWS, WARPS), sms * ctas_per_sm))
    launch_cuda(_build(_index(x), GROUPS, depth)["gemv_fp8_stream"], (grid, 1, 1), (32 * WARPS, 1, 1),
                m * x_stride(k), pdl=pdl_enabled(x.device),
                args=[x, x.stride(0), w, scale, bias, out, out.stride(0), m, n, k, x_stride(k)])
    return out


def fits_rope(m: int, k: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `qkv_rope_fp8` takes this QKV projection (a head's rows within one 128-row block, a CTA's
    rotation pairs within one head)."""
    return (head_dim == ROPE_D and BLOCK % head_dim == 0 and (head_dim // 2) % (QKV_ROWS // 2) == 0
            and fits(m, (num_q_heads + 2 * num_kv_heads) * head_dim, k, QKV_ROWS))


def qkv_rope_fp8(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, layer_cache: torch.Tensor, num_q_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The QKV projection of M tokens (as `gemv_fp8`) with kernels.triton_rope.rope_qkv_write's
    epilogue in the same launch: x [M, K], w [(Hq + 2 Hkv) D, K] e4m3 with its scales, bias [N] or
    None, positions and flat KV slots [M] int64, cos / sin float32 [max_pos, D/2], layer_cache
    [blocks, 2, page, Hkv, D] bf16. Writes rotated k and v at each token's slot; returns rotated q
    [M, Hq, D]. Equals `gemv_fp8` then `rope_qkv_write` bit for bit."""
    m, n, k = _check(x, w, scale, bias, QKV_ROWS)
    blocks, two, page_size, hkv, d = layer_cache.shape
    if two != 2 or hkv != num_kv_heads or n != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"w {tuple(w.shape)} does not match cache {tuple(layer_cache.shape)} "
                         f"with {num_q_heads} q heads")
    if not fits_rope(m, k, num_q_heads, num_kv_heads, d):
        raise ValueError(f"the FP8 QKV + RoPE kernel takes head dim {ROPE_D}, got {d}")
    if layer_cache.dtype != torch.bfloat16 or layer_cache.stride(-1) != 1:
        raise ValueError("the FP8 QKV + RoPE kernel writes a bf16 cache with contiguous heads")
    if cos.dtype != torch.float32 or cos.stride(1) != 1 or cos.stride() != sin.stride() or sin.dtype != cos.dtype:
        raise ValueError("cos / sin must be float32 tables with contiguous rows and the same strides")
    if (positions.shape != (m,) or slots.shape != (m,) or positions.dtype != torch.int64 or slots.dtype != torch.int64
            or positions.stride(0) != 1 or slots.stride(0) != 1):
        raise ValueError(f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be contiguous "
                         f"int64 [{m}]")
    q = torch.empty(m, num_q_heads, d, dtype=torch.bfloat16, device=x.device)
    build, trace = _traced("gemv_fp8_rope", n // QKV_ROWS)
    launch_cuda(_kernels(_index(x), rows=QKV_ROWS, **build)["gemv_fp8_rope"], (n // QKV_ROWS, 1, 1),
                (32 * WARPS, 1, 1), shared_bytes(k, m, QKV_ROWS), pdl=pdl_enabled(x.device),
                args=[x, x.stride(0), w, scale, bias, m, k, w_stride(k), x_stride(k), positions, cos, sin,
                      cos.stride(0), slots, layer_cache, page_size, *layer_cache.stride()[:4], q, num_q_heads,
                      num_kv_heads, _early(), *trace])
    return q


def _index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()
