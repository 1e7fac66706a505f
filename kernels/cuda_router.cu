// The MoE router for decode batches in one launch of thread-block clusters: logits, top 4, softmax
// over the selected four (kernels/cuda_router.py says why; kernels/triton_router.py has the same
// numerics in Triton). Compiled at run time by NVRTC.
//
// Macros: RT_H (hidden size), RT_E (experts), RT_C (CTAs a token: the cluster), RT_NW (warps a CTA).
//
// Token t is cluster t (grid (RT_C, T)). CTA c of it owns columns [c KC, (c + 1) KC) of every
// expert's weight row: warp w the experts w EPW .. + EPW, each lane 16-byte vectors lane, lane + 32,
// ... of each row. The weights (and CTA 0's bias) are read before the PDL wait (they never change),
// the token's columns after it. A lane's products are summed in float32 in vector order, then over
// the warp's lanes by a butterfly: the CTA's partial logit of each expert goes to shared memory. After a cluster sync, CTA
// 0 adds the RT_C partials of each expert in rank order through distributed shared memory (fixed
// order: deterministic), adds the bias and rounds to bf16 (as a GEMM epilogue would), and its first
// warp picks the top 4 (equal logits: the lower expert id first) and takes their softmax the way
// torch's warp softmax does for a 4-wide row: float32, exp(v - max) with the accurate exp, the sum
// as (e0 + e2) + (e1 + e3), a correctly rounded division, rounded to bf16.

#include "cuda_common.cuh"

#define KC (RT_H / RT_C)           // columns a CTA
#define VEC (KC / 8)                // 16-byte vectors in a CTA's share of one row
#define VPL ((VEC + 31) / 32)       // of them a lane
#define EPW (RT_E / RT_NW)          // experts a warp
#define EPL ((RT_E + 31) / 32)      // logits a lane of the top-4 warp
#define TOP_K 4
static_assert(RT_H % (RT_C * 8) == 0, "a CTA's columns must be whole 16-byte vectors");
static_assert(RT_E % RT_NW == 0, "experts must split evenly over the warps");
static_assert(RT_E >= TOP_K, "the router picks 4 experts");
static_assert(RT_E <= RT_NW * 32, "CTA 0 adds one expert's logit a thread");

__device__ __forceinline__ float lo(u32 w) { return __int_as_float(w << 16); }
__device__ __forceinline__ float hi(u32 w) { return __int_as_float(w & 0xFFFF0000u); }

// s + the 8 products of two vectors of bf16, in element order
__device__ __forceinline__ float dot8(float s, U4 a, U4 b) {
  s = fmaf(lo(a.x), lo(b.x), s); s = fmaf(hi(a.x), hi(b.x), s);
  s = fmaf(lo(a.y), lo(b.y), s); s = fmaf(hi(a.y), hi(b.y), s);
  s = fmaf(lo(a.z), lo(b.z), s); s = fmaf(hi(a.z), hi(b.z), s);
  s = fmaf(lo(a.w), lo(b.w), s); s = fmaf(hi(a.w), hi(b.w), s);
  return s;
}

// A sort key of (bf16 logit f, expert e), unsigned: a larger logit, or an equal one with a lower expert id, is
// a larger key, so one warp-wide unsigned max picks what the top-k order picks. The logit's 16 bits made
// monotonic (negative: all bits flipped; positive: the sign bit set; -0 as +0, which the float comparison ties
// with it) above 0xFFFF - e. Every key of an expert is above 0, the key of none.
__device__ __forceinline__ u32 sort_key(float f, int e) {
  u32 b = __float_as_uint(f) >> 16;
  if (b == 0x8000u) b = 0u;
  const u32 ord = b & 0x8000u ? ~b & 0xFFFFu : b | 0x8000u;
  return ord << 16 | (0xFFFFu - (u32)e);
}
__device__ __forceinline__ float key_logit(u32 k) {
  const u32 ord = k >> 16;
  return __uint_as_float((ord & 0x8000u ? ord & 0x7FFFu : ~ord & 0xFFFFu) << 16);
}
__device__ __forceinline__ i64 key_expert(u32 k) { return 0xFFFF - (i64)(k & 0xFFFFu); }

// x [T, RT_H] bf16 (row stride stride_x), w [RT_E, RT_H] bf16, bias [RT_E] bf16 -> weights [T, 4]
// bf16 and ids [T, 4] int64 by descending logit; logits [T, RT_E] bf16 where not null (for tests).
extern "C" __global__ void __launch_bounds__(RT_NW * 32)
route(const u16* __restrict__ x, int stride_x, const u16* __restrict__ w, const u16* __restrict__ bias,
      u16* __restrict__ weights, i64* __restrict__ ids, u16* __restrict__ logits) {
  __shared__ float part[RT_E];   // this CTA's partial logits, read by CTA 0
  __shared__ float logit[RT_E];  // CTA 0: the rounded logits
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 rank = cluster_rank();
  const i64 t = blockIdx.y;
  const int k0 = (int)rank * KC;
  U4 wv[EPW][VPL];
#pragma unroll
  for (int e = 0; e < EPW; e++)
#pragma unroll
    for (int j = 0; j < VPL; j++) {
      const int v = lane + 32 * j;
      wv[e][j] = v < VEC ? load_early(w + (i64)(warp * EPW + e) * RT_H + k0 + 8 * v) : U4{0u, 0u, 0u, 0u};
    }
  const int e_own = threadIdx.x;  // CTA 0: the expert whose logit this thread completes
  const float bias_own = rank == 0 && e_own < RT_E ? __int_as_float((u32)__ldcg(bias + e_own) << 16) : 0.f;
  enter_pdl();
  U4 xv[VPL];
#pragma unroll
  for (int j = 0; j < VPL; j++) {
    const int v = lane + 32 * j;
    xv[j] = v < VEC ? load_early(x + t * stride_x + k0 + 8 * v) : U4{0u, 0u, 0u, 0u};
  }
#pragma unroll
  for (int e = 0; e < EPW; e++) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VPL; j++) s = dot8(s, wv[e][j], xv[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if (lane == 0) part[warp * EPW + e] = s;
  }
  cluster_sync();
  if (rank == 0) {
    if (e_own < RT_E) {
      float s = 0.f;
      for (int c = 0; c < RT_C; c++) s += load_peer(part + e_own, (u32)c);
      const u16 b = to_bf16(s + bias_own);
      if (logits != nullptr) logits[t * RT_E + e_own] = b;
      const float f = __int_as_float((u32)b << 16);
      logit[e_own] = f != f ? -__int_as_float(0x7f800000u) : f;  // a NaN logit competes as -inf
    }
    __syncthreads();
    if (warp == 0) {
      // four rounds of one warp-wide max over the lanes' sort keys; the winner's lane clears its key
      u32 key[EPL];
#pragma unroll
      for (int i = 0; i < EPL; i++) key[i] = lane + 32 * i < RT_E ? sort_key(logit[lane + 32 * i], lane + 32 * i) : 0u;
      u32 top[TOP_K];
#pragma unroll
      for (int k = 0; k < TOP_K; k++) {
        u32 best = key[0];
#pragma unroll
        for (int i = 1; i < EPL; i++) best = max(best, key[i]);
        top[k] = __reduce_max_sync(0xFFFFFFFFu, best);
#pragma unroll
        for (int i = 0; i < EPL; i++)
          if (key[i] == top[k]) key[i] = 0u;
      }
      if (lane < TOP_K) {
        const float m = key_logit(top[0]);
        float ex[TOP_K];
#pragma unroll
        for (int k = 0; k < TOP_K; k++) ex[k] = expf(key_logit(top[k]) - m);
        const float total = (ex[0] + ex[2]) + (ex[1] + ex[3]);
        float mine = ex[0];
        u32 mine_key = top[0];
#pragma unroll
        for (int k = 1; k < TOP_K; k++)
          if (lane == k) mine = ex[k], mine_key = top[k];
        weights[t * TOP_K + lane] = to_bf16(__fdiv_rn(mine, total));
        ids[t * TOP_K + lane] = key_expert(mine_key);
      }
    }
  }
  cluster_sync_relaxed();
}
