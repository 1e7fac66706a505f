"""A probe of the folded MXFP4 GEMMs in Marlin's shape (docs/performance.md, thirty-sixth round): a resident
grid whose CTAs walk (routing block, tile of 64 x RW rows) units, each unit's K in tiles of KT steps (a step
= 4 groups = 128 k) that stream through a ring of S stages in shared memory by cp.async: the tile's packed
words and scale words, and the B rows of the block's live slots of its 16 (f16: gate/up's are the pairs'
tokens as the routing launch writes them for the f16 fold, down's the pairs' activation rows), so that B
comes from shared memory, shared by the CTA's four warps, not from L1. One barrier a stage. The arithmetic
of a K step is the engine's folded one (kernels/cuda_moe_mxfp4.cu: decode, times 2^(s - 121) in f16,
mma.sync f16 with float32 sums, B columns = 8 pairs), so only the data movement differs. Output: each
pair's float32 sums times its B row's inverse factor (no bias, SwiGLU or top-k sum: a few instructions a
row, and for down the engine's last-CTA sum of a token's partials).

    python -m pdserve.bench.moe_tiles [--experts 128] [--tokens 4,16,64] [--parts gate_up,down]
        [--shapes 2x4,4x3,1x6,2x4x2] [--vllm DIR] [--out FILE.json]

Prints, per GEMM and batch, us a layer of the routing launch + each probe against the routing launch + the
engine's folded launch of that GEMM alone (same routing sets, experts rotated past the L2, one CUDA graph),
each against the copy floor of the touched bytes of that GEMM, and the probes' rel L2 against a float64
reference. With `--vllm DIR` (bench/peer_marlin.py) also Marlin's routing layout + GEMMs, padded as little
as Marlin takes (2944 / 2880): gate/up, and gate/up + down, whose difference is Marlin's down.
"""


from __future__ import annotations

import argparse
import sys

import torch

from pdserve.bench.kernels import copy_bandwidth
from pdserve.bench.moe_mxfp4 import expert_bytes, layer_batch, random_layer, routing_sets, save_rows, time_runs
from pdserve.kernels.mxfp4 import PACKED_HIGH_SHL_MASK, PACKED_HIGH_SHR_MASK, PACKED_LOW_MASK, dequantize_mxfp4
from pdserve.kernels.nvrtc import HEADERS, compile_kernels, resident_ctas

SLOTS, THREADS = 16, 128

SOURCE = r"""
#include "cuda_common.cuh"
#include "mxfp4_packed.cuh"
#define ROWS (64 * RW)  // RW m-tiles of 16 rows a warp, four warps
#define SLOTS 16
// B's rows: 0 = the pair's token (gate/up: x), 1 = the pair itself (down: its activation row)
#define B_ROW(pair) (PER_PAIR ? (pair) : (pair) / top_k)
#define CHUNKS ((KG + 3) / 4)
#define KTILES ((CHUNKS + KT - 1) / KT)
#define SCALE_WORDS (((KG + 15) / 16) * 4)
#define BUNIT 20  // words of one (slot, group) of B: its 64 bytes and 16 of padding (conflict-free reads)
#define W_WORDS (KT * ROWS * 16)             // [KT][ROWS][4 groups][4 words]
#define S_WORDS (KT * ROWS)                  // [KT][ROWS] scale words
#define B_WORDS (KT * SLOTS * 4 * BUNIT)     // [KT][SLOTS][4 groups][BUNIT]
#define STAGE_WORDS (W_WORDS + S_WORDS + B_WORDS)
#define UNITS_AHEAD 4
#ifndef EPI
#define EPI 0  // 0: each pair's float32 sums (the probe); 1: gate/up + bias + clamped SwiGLU; 2: down + bias,
#endif         // times the routing weight, summed over the token's pairs
static_assert(KTILES >= 3 || S <= 3, "the unit table holds the units the producer runs ahead by");

struct Unit {
  int expert, n;
  int pair[SLOTS];
  float inv[SLOTS];
};

__device__ __forceinline__ void cp16(u32* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp4(u32* dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// the engine's f16 fold of a packed word (kernels/mxfp4_packed.cuh): decoded, times its group's factor f
__device__ __forceinline__ void decode(u32 w, u32 f, u32 p[4]) {
  decode_word(w, p);
#pragma unroll
  for (int i = 0; i < 4; i++) asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p[i]) : "r"(p[i]), "r"(f));
}

// Stage q of this CTA's sequence (unit q / KTILES of its stride, K tile q % KTILES) into its ring slot.
__device__ __forceinline__ void produce(u32* ring, Unit* units, int q, const u32* __restrict__ words,
                                        const u32* __restrict__ scales, const u16* __restrict__ xf, int stride_x,
                                        const float* __restrict__ x_inv, const int* __restrict__ item_expert,
                                        const int* __restrict__ item_slots, int total, int tiles, int top_k,
                                        int n_rows) {
  const int ul = q / KTILES, kt = q % KTILES;
  const int u = blockIdx.x + ul * gridDim.x;
  if (u >= total) return;
  const int b = u / tiles, tile = u % tiles;
  const int expert = __ldg(item_expert + b);
  Unit& un = units[ul % UNITS_AHEAD];
  if (kt == 0 && threadIdx.x < 32) {
    const int t = threadIdx.x;
    const int pair = t < SLOTS ? __ldg(item_slots + b * SLOTS + t) : -1;
    const unsigned live = __ballot_sync(0xFFFFFFFFu, expert >= 0 && pair >= 0);
    if (t < SLOTS) {
      un.pair[t] = pair;
      un.inv[t] = pair >= 0 && expert >= 0 ? (x_inv ? __ldg(x_inv + B_ROW(pair)) : 1.f) : 0.f;
    }
    if (t == 0) un.expert = expert, un.n = __popc(live);
  }
  if (expert < 0) return;  // the routing layout's unused blocks come last: nothing after this either
  u32* st = ring + (q % S) * STAGE_WORDS;
  const u32* wbase = words + ((i64)expert * n_rows + (i64)tile * ROWS) * (KG * 4);
  for (int j = threadIdx.x; j < ROWS * KT * 4; j += blockDim.x) {
    const int r = j / (KT * 4), piece = j % (KT * 4), jj = piece / 4, qd = piece % 4;
    const int grp = 4 * (kt * KT + jj) + qd;
    const bool live = grp < KG;
    cp16(st + ((jj * ROWS + r) * 4 + qd) * 4, wbase + (i64)r * (KG * 4) + (live ? grp : 0) * 4, live ? 16 : 0);
  }
  const u32* sbase = scales + ((i64)expert * n_rows + (i64)tile * ROWS) * SCALE_WORDS;
  for (int j = threadIdx.x; j < ROWS * KT; j += blockDim.x) {
    const int r = j / KT, jj = j % KT, c = kt * KT + jj;
    cp4(st + W_WORDS + jj * ROWS + r, sbase + (i64)r * SCALE_WORDS + (c < CHUNKS ? c : 0), c < CHUNKS ? 4 : 0);
  }
  // token rows of the block's live slots only: a dead slot's column of B is never written out (an mma's
  // columns do not mix), so whatever its shared memory holds is harmless; past K, zeros (the weights
  // there are zeros, and zero times stale shared memory, which may hold a NaN, is not always zero)
  for (int j = threadIdx.x; j < SLOTS * KT * 16; j += blockDim.x) {
    const int slot = j / (KT * 16), rem = j % (KT * 16), jj = rem / 16, qd = (rem / 4) % 4, v = rem % 4;
    const int grp = 4 * (kt * KT + jj) + qd;
    const int pair = __ldg(item_slots + b * SLOTS + slot);
    if (pair < 0) continue;
    const bool live = grp < KG;
    const u16* src = xf + (i64)B_ROW(pair) * stride_x + (live ? grp : 0) * 32 + v * 8;
    cp16(st + W_WORDS + S_WORDS + ((jj * SLOTS + slot) * 4 + qd) * BUNIT + 4 * v, src, live ? 16 : 0);
  }
}

// gpt-oss' clamped SwiGLU of a (glu, linear) pair, as f16 times 2^act_shift (the engine's mx_gate_up)
__device__ __forceinline__ u16 swiglu(float glu, float lin, float limit, float alpha, int act_shift) {
  glu = fminf(glu, limit);
  lin = fminf(fmaxf(lin, -limit), limit);
  return to_f16(glu / (1.f + expf(-alpha * glu)) * (lin + 1.f) * __int_as_float((127 + act_shift) << 23));
}

// B rows xf (stride_x) times x_inv of the row (none: 1). EPI 0: out[pair, row] float32. EPI 1 (gate/up, rows
// interleaving glu and linear): act[pair, row / 2] f16 times 2^act_shift. EPI 2 (down, B = act): the pair's
// (sums times 2^-act_shift + bias) times route_weight[pair] as float32 partials, and the last CTA of a (token,
// row tile) to arrive (counters, reset by it) adds the token's top_k partials in order into y (bf16).
extern "C" __global__ void __launch_bounds__(128)
mx_tiles(const u32* __restrict__ words, const u32* __restrict__ scales, const u16* __restrict__ xf, int stride_x,
         const float* __restrict__ x_inv, const int* __restrict__ item_expert, const int* __restrict__ item_slots,
         int items, int top_k, int n_rows, float* __restrict__ out, const float* __restrict__ bias,
         u16* __restrict__ act, double limit_d, double alpha_d, int act_shift, const u16* __restrict__ route_weight,
         float* __restrict__ part, int* __restrict__ counters, u16* __restrict__ y, int stride_y) {
  extern __shared__ __align__(16) u32 ring[];
  __shared__ Unit units[UNITS_AHEAD];
  __shared__ int last[SLOTS];
  const float limit = (float)limit_d, alpha = (float)alpha_d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
  const int tiles = n_rows / ROWS, total = items * tiles;
  const int row_w = warp * 16 * RW + g;  // row g of the warp's first m-tile (m-tile r: + 16 r)
#pragma unroll
  for (int q = 0; q < S - 1; q++) {
    produce(ring, units, q, words, scales, xf, stride_x, x_inv, item_expert, item_slots, total, tiles, top_k, n_rows);
    commit();
  }
  float acc[RW][2][2][4];
#pragma unroll
  for (int i = 0; i < 16 * RW; i++) acc[i / 16][(i / 8) % 2][(i / 4) % 2][i % 4] = 0.f;
#pragma unroll 1
  for (int q = 0;; q++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");  // stage q has landed (this thread's copies)
    __syncthreads();  // everyone's copies of stage q, and stage q - 1 read by all: its slot is free
    produce(ring, units, q + S - 1, words, scales, xf, stride_x, x_inv, item_expert, item_slots, total, tiles, top_k,
            n_rows);
    commit();
    const int ul = q / KTILES, kt = q % KTILES;
    const int u = blockIdx.x + ul * gridDim.x;
    if (u >= total) break;
    const Unit& un = units[ul % UNITS_AHEAD];
    if (un.expert < 0) break;
    const u32* st = ring + (q % S) * STAGE_WORDS;
    const int nt = (un.n + 7) / 8;
#pragma unroll
    for (int jj = 0; jj < KT; jj++) {
      if (kt * KT + jj >= CHUNKS) break;
#pragma unroll
      for (int r = 0; r < RW; r++) {
        const int row_l = row_w + 16 * r;
        const U4 wa = *reinterpret_cast<const U4*>(st + ((jj * ROWS + row_l) * 4 + tig) * 4);
        const U4 wb = *reinterpret_cast<const U4*>(st + ((jj * ROWS + row_l + 8) * 4 + tig) * 4);
        const u32 fa = fold_factor_f16(st[W_WORDS + jj * ROWS + row_l] >> (8 * tig));
        const u32 fb = fold_factor_f16(st[W_WORDS + jj * ROWS + row_l + 8] >> (8 * tig));
        u32 pa[4][4], pb[4][4];
        decode(wa.x, fa, pa[0]); decode(wa.y, fa, pa[1]); decode(wa.z, fa, pa[2]); decode(wa.w, fa, pa[3]);
        decode(wb.x, fb, pb[0]); decode(wb.y, fb, pb[1]); decode(wb.z, fb, pb[2]); decode(wb.w, fb, pb[3]);
#pragma unroll
        for (int n = 0; n < 2; n++) {
          if (n >= nt) break;
          const u32* xb = st + W_WORDS + S_WORDS + ((jj * SLOTS + 8 * n + g) * 4 + tig) * BUNIT;
          U4 xv[4];
#pragma unroll
          for (int v = 0; v < 4; v++) xv[v] = *reinterpret_cast<const U4*>(xb + 4 * v);
          float (&c)[2][4] = acc[r][n];
          mma<true>(c[0], pa[0][0], pb[0][0], pa[0][1], pb[0][1], xv[0].x, xv[0].y);
          mma<true>(c[1], pa[2][0], pb[2][0], pa[2][1], pb[2][1], xv[2].x, xv[2].y);
          mma<true>(c[0], pa[0][2], pb[0][2], pa[0][3], pb[0][3], xv[0].z, xv[0].w);
          mma<true>(c[1], pa[2][2], pb[2][2], pa[2][3], pb[2][3], xv[2].z, xv[2].w);
          mma<true>(c[0], pa[1][0], pb[1][0], pa[1][1], pb[1][1], xv[1].x, xv[1].y);
          mma<true>(c[1], pa[3][0], pb[3][0], pa[3][1], pb[3][1], xv[3].x, xv[3].y);
          mma<true>(c[0], pa[1][2], pb[1][2], pa[1][3], pb[1][3], xv[1].z, xv[1].w);
          mma<true>(c[1], pa[3][2], pb[3][2], pa[3][3], pb[3][3], xv[3].z, xv[3].w);
        }
      }
    }
    if (kt == KTILES - 1) {  // the unit's sums: rows g / g + 8 of each m-tile, pairs 8n + 2 tig (+1)
      const int tile = u % tiles;
      const i64 e = un.expert;
#pragma unroll
      for (int r = 0; r < RW; r++) {
        const int row = tile * ROWS + row_w + 16 * r;  // and row + 8 (the same parity: g's)
#pragma unroll
        for (int n = 0; n < 2; n++) {
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const int xi = 8 * n + 2 * tig + h;
            float (&c)[2][4] = acc[r][n];
            const float va = (c[0][h] + c[1][h]) * un.inv[xi], vb = (c[0][2 + h] + c[1][2 + h]) * un.inv[xi];
#if EPI == 0
            if (xi < un.n) {
              const i64 at = (i64)un.pair[xi] * n_rows + row;
              out[at] = va;
              out[at + 8] = vb;
            }
#elif EPI == 1
            // glu rows are even, each linear row the next: row g + 1's sums are lane + 4's (same tig)
            const float la = __shfl_down_sync(0xFFFFFFFFu, va, 4), lb = __shfl_down_sync(0xFFFFFFFFu, vb, 4);
            if ((g & 1) == 0 && xi < un.n) {
              const float* bi = bias + e * n_rows + row;
              u16* dst = act + (i64)un.pair[xi] * (n_rows / 2) + row / 2;
              dst[0] = swiglu(va + bi[0], la + bi[1], limit, alpha, act_shift);
              dst[4] = swiglu(vb + bi[8], lb + bi[9], limit, alpha, act_shift);
            }
#else
            if (xi < un.n) {
              const float unshift = __int_as_float((127 - act_shift) << 23);
              const i64 pair = un.pair[xi];
              const float wgt = from_bf16(route_weight[pair]);
              part[pair * n_rows + row] = (va * unshift + bias[e * n_rows + row]) * wgt;
              part[pair * n_rows + row + 8] = (vb * unshift + bias[e * n_rows + row + 8]) * wgt;
            }
#endif
            c[0][h] = c[1][h] = c[0][2 + h] = c[1][2 + h] = 0.f;
          }
        }
      }
#if EPI == 2
      __threadfence();
      __syncthreads();
      if (threadIdx.x < un.n) {
        const int token = un.pair[threadIdx.x] / top_k;
        last[threadIdx.x] = atomicAdd(counters + (i64)token * tiles + tile, 1) == top_k - 1;
      }
      __syncthreads();
      for (int t = threadIdx.x; t < un.n * ROWS; t += blockDim.x) {
        const int i = t / ROWS, rr = t % ROWS;
        if (!last[i]) continue;
        __threadfence();
        const int token = un.pair[i] / top_k;
        const int row = tile * ROWS + rr;
        float v = 0.f;
        for (int k = 0; k < top_k; k++) v += __ldcg(part + ((i64)token * top_k + k) * n_rows + row);
        y[(i64)token * stride_y + row] = to_bf16(v);
        if (rr == 0) counters[(i64)token * tiles + tile] = 0;
      }
#endif
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}
"""


def rows(rw: int) -> int:
    """Weight rows of a unit: RW m-tiles of 16 rows for each of the four warps."""
    return 64 * rw


def compile_options(kt: int, stages: int, rw: int = 1, k_groups: int = 90, per_pair: bool = False,
                    epilogue: int = 0) -> list[str]:
    """per_pair: B's rows are the pairs' (the down GEMM's activations), not their tokens' (gate/up's x);
    epilogue: the kernel's EPI (0: float32 sums, 1: gate/up's SwiGLU, 2: down's weighted top-k sum)."""
    return ["-std=c++17", f"-DKG={k_groups}", f"-DKT={kt}", f"-DS={stages}", f"-DRW={rw}", f"-DPER_PAIR={int(per_pair)}",
            f"-DEPI={epilogue}",
            f"-DMX_LOW_MASK={PACKED_LOW_MASK:#010x}u",
            f"-DMX_HIGH_SHL_MASK={PACKED_HIGH_SHL_MASK:#010x}u", f"-DMX_HIGH_SHR_MASK={PACKED_HIGH_SHR_MASK:#010x}u"]


def stage_bytes(kt: int, rw: int = 1) -> int:
    """One stage of the ring: KT steps of the unit's rows' words (16 words a row and step), their scale words
    (one a row) and 16 token rows' groups at 20 words each (1280)."""
    return kt * (rows(rw) * 16 + rows(rw) + SLOTS * 4 * 20) * 4


class Probe:
    """The kernel for one GEMM of the layer: `part` "gate_up" (B = the pairs' tokens, x) or "down" (B = the
    pairs' activation rows), with the epilogue `epilogue` (compile_options)."""

    def __init__(self, kt: int, stages: int, rw: int, part: str, k_groups: int, device: torch.device,
                 epilogue: int = 0):
        self.kt, self.stages, self.rw, self.part = kt, stages, rw, part
        self.smem = stages * stage_bytes(kt, rw)
        index = device.index if device.index is not None else torch.cuda.current_device()
        options = compile_options(kt, stages, rw, k_groups, per_pair=part == "down", epilogue=epilogue)
        self.kernel = compile_kernels(SOURCE, ["mx_tiles"], options, index, self.smem, include=HEADERS)["mx_tiles"]
        self.grid = resident_ctas(self.kernel, THREADS, self.smem, index)

    def __call__(self, w, routing, b: torch.Tensor, b_inv: torch.Tensor | None, top_k: int,
                 out: torch.Tensor | None = None, *, act: torch.Tensor | None = None, limit: float = 7.0,
                 alpha: float = 1.702, act_shift: int = 0, route_weight: torch.Tensor | None = None,
                 partials: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                 y: torch.Tensor | None = None) -> None:
        """EPI 0: out[pair, row] = the pair's sums times b_inv of its B row (its token's for gate/up, its own
        for down; None: 1). EPI 1: act (f16, times 2^act_shift). EPI 2: y (bf16 [T, H]) through partials
        [T k, H] float32 and counters (T x row tiles, zero)."""
        from pdserve.kernels.pdl import launch_cuda

        blocks, scales = getattr(w, self.part + "_blocks"), getattr(w, self.part + "_scales")
        if blocks.shape[1] % rows(self.rw):
            raise ValueError(f"{blocks.shape[1]} {self.part} rows are not a multiple of {rows(self.rw)}")
        launch_cuda(self.kernel, (self.grid, 1, 1), (THREADS, 1, 1), self.smem, pdl=False, args=[
            blocks, scales, b, b.stride(0), b_inv, routing.block_expert, routing.sorted_slot, routing.max_blocks, top_k,
            blocks.shape[1], out, getattr(w, self.part + "_bias").contiguous(), act, float(limit), float(alpha),
            act_shift, route_weight, partials, counters, y, y.stride(0) if y is not None else 0])


class Layer:
    """A whole MoE layer on these kernels: the routing launch (align_routing, which also writes the tokens as
    f16 for the fold), gate/up + SwiGLU, down + the weighted top-k sum; shapes (KT, S, RW) per GEMM."""

    def __init__(self, gate_up: tuple[int, int, int], down: tuple[int, int, int], k_groups: int,
                 device: torch.device):
        self.gate_up = Probe(*gate_up, "gate_up", k_groups, device, epilogue=1)
        self.down = Probe(*down, "down", k_groups, device, epilogue=2)
        self.name = "tiles layer {}x{}x{} / {}x{}x{}".format(*gate_up, *down)

    def __call__(self, w, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, limit: float = 7.0,
                 alpha: float = 1.702) -> torch.Tensor:
        """x [T, H] bf16, ids [T, k], wts [T, k] -> [T, H] bf16."""
        from pdserve.kernels import cuda_moe_mxfp4 as cm
        from pdserve.kernels.arrival import arrival_counters
        from pdserve.kernels.triton_moe import align_routing

        if not w.fold_f16_exact:
            raise ValueError("these experts have scale bytes outside the f16 fold's exact range")
        (t, h), k, e = x.shape, ids.shape[1], w.gate_up_blocks.shape[0]
        i = w.down_blocks.shape[2] * 32
        routing, xf, inv = align_routing(ids, 0, e, SLOTS, x_f16=x)
        shift = cm.act_shift(limit)
        act = torch.empty(t * k, i, dtype=torch.float16, device=x.device)
        self.gate_up(w, routing, xf, inv, k, act=act, limit=limit, alpha=alpha, act_shift=shift)
        y = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
        partials = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, "mx_tiles_down", t * (h // rows(self.down.rw)))
        self.down(w, routing, act, None, k, act_shift=shift, route_weight=wts.to(torch.bfloat16).contiguous().view(-1),
                  partials=partials, counters=counters, y=y)
        return y


def fold_gate_up(w, routing, xf, x_inv, ids: torch.Tensor, top_k: int, act: torch.Tensor) -> None:
    """The engine's folded gate/up launch alone (kernels.cuda_moe_mxfp4, FOLD_CONFIG, f16 fold), as
    experts_forward_mxfp4_mma launches it."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels.pdl import launch_cuda

    cfg, (_, n2, hg, _) = cm.FOLD_CONFIG, w.gate_up_blocks.shape
    dev = xf.device.index if xf.device.index is not None else torch.cuda.current_device()
    kernel = cm._kernels(dev, hg, cfg.slots, cfg.gate_up, False, cm.EARLY_DOWN, False, cm.EARLY_BIAS, False,
                         2)["mx_gate_up"]
    launch_cuda(kernel, (n2 // cfg.rows("gate_up"), routing.max_blocks, 1), (32 * cfg.gate_up[0], 1, 1),
                cm._shared_bytes(hg, cfg.slots, cfg.gate_up, 2), pdl=False, args=[
                    w.gate_up_blocks, w.gate_up_scales, w.gate_up_bias.contiguous(), xf, xf.stride(0), x_inv,
                    ids.view(-1), routing.block_expert, routing.sorted_slot, 1, top_k, n2, act, 7.0, 1.702,
                    cm.act_shift(7.0), None, 0])


def fold_down(w, routing, act: torch.Tensor, ids: torch.Tensor, top_k: int, wts: torch.Tensor,
              res: torch.Tensor) -> None:
    """The engine's folded down launch alone (kernels.cuda_moe_mxfp4, FOLD_CONFIG, f16 fold, grouped: per-pair
    float32 partials, then the last CTA of a (token, row tile) adds them), as experts_forward_mxfp4_mma
    launches it. act: the pairs' f16 activation rows [T k, I]; wts: bf16 routing weights [T k]; res: bf16
    [T, H]."""
    from pdserve.kernels import cuda_moe_mxfp4 as cm
    from pdserve.kernels.arrival import arrival_counters
    from pdserve.kernels.pdl import launch_cuda

    cfg, (_, h, ig, _) = cm.FOLD_CONFIG, w.down_blocks.shape
    t = ids.shape[0]
    dev = act.device.index if act.device.index is not None else torch.cuda.current_device()
    kernel = cm._kernels(dev, ig, cfg.slots, cfg.down, False, cm.EARLY_DOWN, False, cm.EARLY_BIAS, False, 2)["mx_down"]
    grid = (h // cfg.rows("down"), routing.max_blocks, 1)
    part = torch.empty(t * top_k, h, dtype=torch.float32, device=act.device)
    counters = arrival_counters(act.device, "mxfp4_mma_down", max(cm.MAX_TILES, t * grid[0]))
    launch_cuda(kernel, grid, (32 * cfg.down[0], 1, 1), cm._shared_bytes(ig, cfg.slots, cfg.down, 2), pdl=False, args=[
        w.down_blocks, w.down_scales, w.down_bias.contiguous(), act, ids.view(-1), routing.block_expert,
        routing.sorted_slot, 1, top_k, h, 1, wts, part, counters, res, res.stride(0), 0, None, 0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="4,16,64")
    ap.add_argument("--parts", default="gate_up,down,layer",
                    help="what to time: gate_up, down (each GEMM alone), layer (the whole MoE)")
    ap.add_argument("--layer-shapes", default="2x4x2/2x4x1,1x4x1/1x4x1",
                    help="whole-layer kernels, gate/up KTxSxRW / down KTxSxRW, comma-separated")
    ap.add_argument("--shapes", default="1x4,1x6,2x4,2x6,4x3,1x4x2,2x4x2,2x3x3",
                    help="KTxS[xRW]: K steps a stage, stages, m-tiles of 16 rows a warp (default 1); a part "
                         "skips the shapes whose 64 x RW rows do not divide its rows")
    ap.add_argument("--vllm", default=None, help="the vllm/ folder of vLLM's unpacked wheel: Marlin's GEMMs too")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    e, k, h, i = a.experts, 4, 2880, 2880
    w, wp, g = random_layer(e, dev)
    shapes = [([int(v) for v in shape.split("x")] + [1])[:3] for shape in a.shapes.split(",")]
    marlin = None
    if a.vllm:
        from pathlib import Path

        from pdserve.bench.peer_marlin import MarlinExperts, MarlinMoE

        root = Path(a.vllm)
        marlin = (MarlinMoE(root / "_moe_C_stable_libtorch.abi3.so", root / "scalar_type.py", dev),
                  MarlinExperts(w, 2944, 2880))
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; {e} experts", flush=True)
    results = []
    for part in a.parts.split(","):
        if part == "layer":
            layers = [Layer(*[tuple(int(v) for v in half.split("x")) for half in pair.split("/")],
                            wp.gate_up_blocks.shape[2], dev) for pair in a.layer_shapes.split(",")]
            per_expert = expert_bytes(wp)
            print(f"layer: {per_expert / 1e6:.2f} MB an expert; " + ", ".join(
                f"{m.name}: {m.gate_up.grid} / {m.down.grid} CTAs" for m in layers), flush=True)
            for t in [int(v) for v in a.tokens.split(",")]:
                results += time_layer(t, e, k, w, wp, g, layers, marlin, per_expert * 1e6 / bw)
            continue
        blocks = getattr(wp, part + "_blocks")
        per_expert = expert_bytes(wp, (part,), biases=False)
        probes = {f"{part} kt{kt} s{st} rw{rw}": Probe(kt, st, rw, part, blocks.shape[2], dev)
                  for kt, st, rw in shapes if blocks.shape[1] % rows(rw) == 0}
        print(f"{part}: {per_expert / 1e6:.2f} MB an expert; grids " + ", ".join(
            f"{n} {p.grid} CTAs ({p.smem // 1024} KB)" for n, p in probes.items()), flush=True)
        for t in [int(v) for v in a.tokens.split(",")]:
            results += probe_part(part, t, e, k, h, i, w, wp, g, probes, marlin, per_expert * 1e6 / bw)
    save_rows(a.out, bw, results)
    return 0


def time_layer(t, e, k, w, wp, g, layers, marlin, us_per_expert) -> list:
    """Time the whole MoE layer at t tokens: the engine's path (kernels.moe.experts_forward), each Layer and
    Marlin's whole MoE, each against kernels.experts' reference (rel L2)."""
    from pdserve.kernels.experts import experts_forward_mxfp4_ref
    from pdserve.kernels.moe import experts_forward

    x, wts, id_sets, touched = layer_batch(t, e, k, g)
    ref = experts_forward_mxfp4_ref(x, wts, id_sets[0], w).float()
    runs = {"pdserve (engine path)": (lambda s: experts_forward(x, wts, s, wp), id_sets)}
    runs.update({m.name: (lambda s, m=m: m(wp, x, s, wts), id_sets) for m in layers})
    if marlin is not None:
        peer, mw = marlin
        runs["marlin whole"] = (lambda s: peer.forward(x, wts, s, mw), [s.to(torch.int32) for s in id_sets])
    errors = {name: float((fn(sets[0]).float() - ref).norm() / ref.norm()) for name, (fn, sets) in runs.items()}
    del ref
    timed: list = []
    time_runs(runs, errors, t, touched * us_per_expert, timed, "reference")
    for r in timed:
        r["part"] = "layer"
    return timed


def probe_part(part, t, e, k, h, i, w, wp, g, probes, marlin, us_per_expert) -> list:
    """Time one GEMM of the layer at t tokens: the routing launch + the engine's folded launch, + each probe,
    and Marlin's (gate/up; for down, gate/up + down, whose difference is printed), on the same routing sets."""
    from pdserve.kernels.triton_moe import align_routing

    dev = wp.gate_up_blocks.device
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    act_in = (torch.randn(t * k, i, device=dev) * 0.5).to(torch.float16)  # down's B: its activation rows
    ones = torch.ones(t * k, device=dev)
    id_sets = routing_sets(t, e, k, g)
    touched = sum(len(set(s.flatten().tolist())) for s in id_sets) / len(id_sets)
    n_out = 2 * i if part == "gate_up" else h
    out = torch.zeros(t * k, n_out, device=dev)
    act = torch.empty(t * k, i, dtype=torch.float16, device=dev)
    res = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    wts = torch.ones(t, k, dtype=torch.bfloat16, device=dev)  # routing weights (Marlin's down multiplies by them)

    def probe_run(s, p):
        if part == "gate_up":
            routing, xf, inv = align_routing(s, 0, e, SLOTS, x_f16=x)
            p(wp, routing, xf, inv, k, out)
        else:
            p(wp, align_routing(s, 0, e, SLOTS), act_in, ones, k, out)

    def engine_run(s):
        if part == "gate_up":
            routing, xf, inv = align_routing(s, 0, e, SLOTS, x_f16=x)
            fold_gate_up(wp, routing, xf, inv, s, k, act)
        else:
            fold_down(wp, align_routing(s, 0, e, SLOTS), act_in, s, k, wts.view(-1), res)

    s0 = id_sets[0]
    ref = torch.zeros(t * k, n_out, dtype=torch.float64, device=dev)
    for ex in s0.unique().tolist():  # one expert decoded at a time
        pairs = (s0.view(-1) == ex).nonzero().view(-1)
        wd = dequantize_mxfp4(*w.published(part, ex), dtype=torch.float64)  # [rows, K]
        b = x.double()[pairs // k] if part == "gate_up" else act_in.double()[pairs]
        ref[pairs] = b @ wd.t()
    engine = f"engine fold {part}"
    runs = {engine: (engine_run, id_sets)}
    runs.update({n: (lambda s, p=p: probe_run(s, p), id_sets) for n, p in probes.items()})
    errors = {engine: float("nan")}
    for name, p in probes.items():
        out.zero_()
        probe_run(s0, p)
        errors[name] = float((out.double() - ref).norm() / ref.norm())
    if marlin is not None:
        peer, mw = marlin
        xp = torch.nn.functional.pad(x, (0, mw.hp - h))
        act_m = torch.nn.functional.pad(act_in.to(torch.bfloat16), (0, mw.ip - i))
        id32 = [s.to(torch.int32) for s in id_sets]
        runs["marlin gate/up"] = (lambda s: peer.gemms(xp, wts, s, mw)[0], id32)
        gate_up, down = peer.gemms(xp, wts, s0.to(torch.int32), mw)
        if part == "gate_up":
            got, bias = gate_up[:, :2 * i].double(), w.gate_up_bias[s0.view(-1)].double()
        else:
            runs["marlin gate/up + down"] = (lambda s: (lambda gu, dn: dn(act_m))(*peer.gemms(xp, wts, s, mw)), id32)
            got, bias = down(act_m)[:, :h].double(), w.down_bias[s0.view(-1)].double()
            errors["marlin gate/up + down"] = float((got - ref - bias).norm() / (ref + bias).norm())
        errors["marlin gate/up"] = float("nan") if part == "down" else float(
            (got - ref - bias).norm() / (ref + bias).norm())
    del ref
    timed: list = []
    time_runs(runs, errors, t, touched * us_per_expert, timed, "float64")
    us = {r["run"]: r["us"] for r in timed}
    if "marlin gate/up + down" in us:
        print(f"T={t:3d} marlin down (the difference) {us['marlin gate/up + down'] - us['marlin gate/up']:8.1f} us",
              flush=True)
    for r in timed:
        r["part"] = part
    return timed


if __name__ == "__main__":
    sys.exit(main())
