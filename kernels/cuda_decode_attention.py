"""Paged decode attention with sinks whose splits meet in distributed shared memory
(cuda_decode_attention.cu), compiled at first use by NVRTC through torch, no build step.

Why CUDA: the Triton split-KV kernel (kernels/triton_decode_attention.py) spreads a request's keys
over programs that meet through float32 partials in global memory, a fence and an arrival counter,
and the last program to arrive reads every partial back: memory round trips on the step's critical
path after the attention's sums, in every full-attention layer (at one token of 1k keys a full
layer's attention added 9.3 us to the step against 4.5 for a windowed one, which has no split;
docs/performance.md, twenty-second round). Here the CTAs of a (request, KV head) are one
thread-block cluster: each folds its warps' partials in its shared memory, and after one cluster
barrier the thread that owns each output reads the cluster's partials through distributed shared
memory. Same semantics and tolerances as the Triton kernel (not the same rounding: the split of
the keys and the order of the sums differ); deterministic, so a replayed graph equals the eager
step bit for bit.

gpt-oss shapes only: head dim 64, up to 8 query heads a KV head, bf16 q, cache and output; the
attention object (kernels/flashinfer_attention.py) takes this kernel in its "triton" decode mode
where `applies` says so, the Triton kernel otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .nvrtc import builds_on, load_kernels
from .pdl import enabled as pdl_enabled, launch_cuda

SOURCE = Path(__file__).with_name("cuda_decode_attention.cu")
HEAD_DIM = 64
BLOCK = 128  # keys a block (32 rows a warp of a CTA)
THREADS = 128
LOG2E = 1.4426950408889634
MAX_CLUSTER = 16  # Hopper's largest thread-block cluster (non-portable past nvrtc.PORTABLE_CLUSTER)
# the attention object takes these kernels where they apply (False: the Triton kernel always)
ENABLED = True


@dataclass(frozen=True)
class ClusterConfig:
    """cluster: CTAs a cluster (1-16; past 8, the portable size, the kernel asks Hopper for it), which
    take a request's 128-key blocks in turn (1: no cluster, one CTA folds and writes); stages: blocks a CTA holds in shared memory at once (the first `stages` are
    read ahead of the PDL wait); max_rows: most requests a launch (0: never this kernel);
    max_groups: most clusters a (request, KV head), a power of two (the grid holds that many; a
    request busies only as many as its blocks need, and where that is more than one, the last of its
    CTAs to arrive folds the clusters' partials through global memory and an arrival counter);
    lookahead: blocks ahead of a CTA's copies whose page-table entries a lane has requested (1: the
    next block's, requested one loop iteration before its copies; a block's sums take less time than
    a load's round trip, so larger values are for long requests, docs/kernels.md)."""

    cluster: int
    stages: int
    max_rows: int
    max_groups: int = 1
    lookahead: int = 1

    def __post_init__(self):
        if not 1 <= self.cluster <= MAX_CLUSTER:
            raise ValueError(f"a cluster holds 1-{MAX_CLUSTER} CTAs, not {self.cluster}")


# By layer type (H200, docs/performance.md, twenty-third round). Full layers from three requests:
# clusters of 8 CTAs (the portable size), so up to 1k keys are one block a CTA, all read ahead of the
# wait and folded in distributed shared memory, and one cluster a request: spare clusters for long
# requests (a grid holding 4 at one request) cost 4 us a full layer at 1k keys in the decode step,
# though idle, and more blocks of shared memory a CTA (4, 6) did not speed long requests up. Windowed
# layers (128 keys): one CTA, one block. Both up to 4 requests, the batches measured in the step.
FULL_LAYERS = ClusterConfig(cluster=8, stages=2, max_rows=4)
WINDOWED_LAYERS = ClusterConfig(cluster=1, stages=1, max_rows=4)
# Full layers up to its max_rows requests: clusters of 16 CTAs (past the portable size; Hopper allows
# 16 on request), so that one request's 8 KV heads busy 128 SMs where clusters of 8 busy 64; None:
# FULL_LAYERS at every batch. H200, docs/performance.md, twenty-fifth round: the kernel alone at one
# request 16.3 / 33.8 us at 8k / 32k keys against 18.8 / 48.6 (8.9 against 9.2 at 1k); in the 120b
# step at 8k keys x0.96 at one request, x0.98 at two; in the 20b step at 1k keys level
FULL_LAYERS_FEW: ClusterConfig | None = ClusterConfig(cluster=16, stages=2, max_rows=2)


def _padded_rows(rows: int) -> int:
    """Requests counted as the next power of two, as the Triton kernel counts its splits: an eager
    step then launches what the graph of the size it is padded to launches."""
    return 1 << max(rows - 1, 0).bit_length()


def config_for(window_left: int, rows: int = 1) -> ClusterConfig:
    """The launch shape for a layer of this type at `rows` requests (`_padded_rows` of them)."""
    if window_left >= 0:
        return WINDOWED_LAYERS
    if FULL_LAYERS_FEW is not None and _padded_rows(rows) <= FULL_LAYERS_FEW.max_rows:
        return FULL_LAYERS_FEW
    return FULL_LAYERS


def shared_bytes(cfg: ClusterConfig) -> int:
    """A CTA's dynamic shared memory: `stages` blocks of K and V, then the warps' and the CTA's
    partials (the .cu file's `Shared`)."""
    partials = 4 * (4 * 8 * 2 + 4 * 8 * HEAD_DIM + 8 * 2 + 8 * HEAD_DIM) + 16
    return cfg.stages * 2 * BLOCK * HEAD_DIM * 2 + partials


def groups_for(rows: int, num_kv_heads: int, cfg: ClusterConfig, device: torch.device, splits: int) -> int:
    """Clusters a (request, KV head) in the grid: enough for about two CTAs a SM at `rows` requests
    (counted as the next power of two, as the Triton kernel counts its splits, so an eager step and
    the graph of the size it is padded to launch the same grid per request, and add alike), at most
    `cfg.max_groups` and the partial slots of the attention's scratch (`splits`)."""
    from .triton_decode_attention import _sm_count

    if cfg.cluster == 1:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = max(1, min(2 * sms // (_padded_rows(rows) * num_kv_heads * cfg.cluster), cfg.max_groups, splits))
    return 1 << (want.bit_length() - 1)


def applies(q: torch.Tensor, kv_cache: torch.Tensor, window_left: int) -> bool:
    """Whether this kernel takes the decode attention of q [T, Hq, D] over kv_cache [pages, 2, page,
    Hkv, D] for a layer of this type (device, dtypes, shapes, batch bound)."""
    t, hq, d = q.shape
    cfg = config_for(window_left, t)
    _, two, page, hkv, d_kv = kv_cache.shape
    return (q.is_cuda and q.dtype == kv_cache.dtype == torch.bfloat16 and d == d_kv == HEAD_DIM and two == 2
            and hq % hkv == 0 and hq // hkv <= 8 and page & (page - 1) == 0 and 1 <= t <= cfg.max_rows
            and q.stride(-1) == 1 and q.stride(1) % 2 == 0 and q.stride(0) % 2 == 0
            and kv_cache.stride(-1) == 1 and kv_cache.stride(-2) == d and kv_cache.stride(2) % 8 == 0
            and kv_cache.stride(1) % 8 == 0 and kv_cache.stride(0) % 8 == 0 and kv_cache.data_ptr() % 16 == 0
            # the copies take a page's byte offset as a 32-bit factor and offsets inside a page in 32 bits
            and 2 * max(kv_cache.stride(0), kv_cache.stride(1), page * kv_cache.stride(2)) < 2**31
            and available(q.device))


def available(device: torch.device) -> bool:
    """Hopper or newer (clusters, distributed shared memory) with NVRTC loadable."""
    return builds_on(device, "CUDA decode attention", lambda index: _kernel(index, 8, 16, FULL_LAYERS))


TRACE_WORDS = 40  # u64 words a warp of the timing build writes (the .cu file's `Trace`)


def compile_options(group: int, page: int, cfg: ClusterConfig, trace: bool = False,
                    early_launch: bool = False) -> list[str]:
    """The compiler options of a build of cuda_decode_attention.cu (nvcc takes them too); trace: the
    timing build (DA_TRACE); early_launch: the next kernel launches at this one's start (DA_EARLY_LAUNCH)."""
    return [f"-DDA_GROUP={group}", f"-DDA_PAGE={page}", f"-DDA_C={cfg.cluster}", f"-DDA_STAGES={cfg.stages}",
            f"-DDA_LOOK={cfg.lookahead}", f"-DDA_TRACE={int(trace)}", f"-DDA_EARLY_LAUNCH={int(early_launch)}",
            "-std=c++17"]


@functools.cache
def _kernel(device_index: int, group: int, page: int, cfg: ClusterConfig, trace: bool = False,
            early_launch: bool = False):
    return load_kernels(SOURCE, ["decode_attention"], compile_options(group, page, cfg, trace, early_launch),
                        device_index, shared_bytes(cfg), cluster=cfg.cluster)["decode_attention"]


def _trace_shape(rows: int, num_kv_heads: int, cfg: ClusterConfig, device: torch.device, splits: int) -> tuple:
    """[clusters a (request, KV head), KV heads, rows, CTAs a cluster, warps, TRACE_WORDS]: the grid's order."""
    groups = groups_for(rows, num_kv_heads, cfg, device, splits)
    return (groups, num_kv_heads, rows, cfg.cluster, THREADS // 32, TRACE_WORDS)


def trace_buffer(rows: int, num_kv_heads: int, cfg: ClusterConfig, device: torch.device, splits: int) -> torch.Tensor:
    """A zeroed int64 record for every warp of one launch of the timing build, in the grid's order."""
    return torch.zeros(_trace_shape(rows, num_kv_heads, cfg, device, splits), dtype=torch.int64, device=device)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     sinks: torch.Tensor, sm_scale: float, window_left: int, scratch,
                     out: torch.Tensor | None = None, cfg: ClusterConfig | None = None,
                     trace: torch.Tensor | None = None, early_launch: bool = False) -> torch.Tensor:
    """`triton_decode_attention.paged_decode_attention`'s result (same arguments) [T, Hq, D] bf16,
    into `out` where given; the caller checked `applies` (and the shapes, as that function does).
    `scratch` (the Triton kernel's `DecodeScratch` for these rows) holds the partials of requests
    that span more than one cluster. No host synchronisation: capturable in a CUDA graph. trace: run
    the timing build, which fills this `trace_buffer` (bench/attention_trace.py). early_launch: the next
    kernel launches at this one's start (kernels/pdl.py's exception: only where it reads nothing but
    weights ahead of its own wait)."""
    t, hq, _ = q.shape
    cfg = cfg or config_for(window_left, t)
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.stride(1) % 2:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with contiguous heads")
    if t == 0:
        return out
    if not scratch.fits(t, hkv, scratch.shape[2]) or scratch.o.shape[3] < hq // hkv:
        raise ValueError(f"scratch {scratch.shape} does not fit {t} rows x {hkv} KV heads")
    groups = groups_for(t, hkv, cfg, q.device, scratch.shape[2])
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    kernel = _kernel(dev, hq // hkv, page, cfg, trace is not None, early_launch)
    if trace is not None and tuple(trace.shape) != _trace_shape(t, hkv, cfg, q.device, scratch.shape[2]):
        raise ValueError(f"trace must be trace_buffer({t}, {hkv}, ...), got {tuple(trace.shape)}")
    launch_cuda(kernel, (cfg.cluster, t, hkv * groups), (THREADS, 1, 1), shared_bytes(cfg), pdl=pdl_enabled(q.device),
                cluster=(cfg.cluster, 1, 1) if cfg.cluster > 1 else None,
                args=[q, q.stride(0), q.stride(1), kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                      block_tables, block_tables.stride(0), seq_lens, sinks, out, out.stride(0), out.stride(1),
                      float(sm_scale) * LOG2E, int(window_left) if window_left >= 0 else -1,
                      scratch.o, scratch.m, scratch.l, scratch.count, scratch.shape[2], scratch.o.shape[3], hkv]
                + ([trace] if trace is not None else []))
    return out
