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

// (v, id) beats (u, jd): a larger logit, or an equal one with a lower expert id
__device__ __forceinline__ bool beats(float v, int id, float u, int jd) { return v > u || (v == u && id < jd); }

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
      const float neg_inf = -__int_as_float(0x7f800000u);
      float cur[EPL];
      u32 taken = 0u;  // bit i: expert lane + 32 i is picked already
#pragma unroll
      for (int i = 0; i < EPL; i++) cur[i] = lane + 32 * i < RT_E ? logit[lane + 32 * i] : neg_inf;
      float val[TOP_K];
      int id[TOP_K];
#pragma unroll
      for (int k = 0; k < TOP_K; k++) {
        float bv = neg_inf;
        int bi = 0x7fffffff;  // loses to every expert left, one at -inf too
#pragma unroll
        for (int i = 0; i < EPL; i++) {
          const int e = lane + 32 * i;
          if (e < RT_E && !(taken >> i & 1u) && beats(cur[i], e, bv, bi)) bv = cur[i], bi = e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, o);
          const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
          if (beats(ov, oi, bv, bi)) bv = ov, bi = oi;
        }
        val[k] = bv;
        id[k] = bi;
#pragma unroll
        for (int i = 0; i < EPL; i++)
          if (lane + 32 * i == bi) taken |= 1u << i;
      }
      if (lane < TOP_K) {
        const float m = val[0];
        float ex[TOP_K];
#pragma unroll
        for (int k = 0; k < TOP_K; k++) ex[k] = expf(val[k] - m);
        const float total = (ex[0] + ex[2]) + (ex[1] + ex[3]);
        float mine = ex[0];
        int mine_id = id[0];
#pragma unroll
        for (int k = 1; k < TOP_K; k++)
          if (lane == k) mine = ex[k], mine_id = id[k];
        weights[t * TOP_K + lane] = to_bf16(__fdiv_rn(mine, total));
        ids[t * TOP_K + lane] = mine_id;
      }
    }
  }
  cluster_sync_relaxed();
}
