// W4A8 on Hopper's FP8 tensor cores (docs/kernels.md, item 38): one pair's rows of an MXFP4 expert times
// its token's row, through wgmma m64n8k32 e4m3. A CTA is one warpgroup: ROWS rows of the expert over GPC
// of the KG groups of K (the last CTA of a row tile fewer); the KS CTAs of a row tile are one cluster
// that adds their sums. The packed layout's e4m3 bytes (kernels/mxfp4.py) are A as they are; the
// token's row is B in shared memory, quantised to e4m3 with one power of two a group of 32; the 8
// mma columns are 8 groups (each group's sum stays in its own column and is rescaled by its weight
// scale and activation factor after its block of 8 K steps). Shared by kernels/cuda_moe_w4a8.cu (the
// engine's gate/up) and bench/moe_w4a8.py (the probe). Needs cuda_common.cuh and the packed layout's
// masks (MX_LOW_MASK, MX_HIGH_SHL_MASK, MX_HIGH_SHR_MASK). sm_90a.
#pragma once

#define KG 90
#define GPC 24
#define BLOCKS 3
#define KS 4
#define ROWS 64
#define SCALE_BYTES 96  // a packed row's scale bytes (kernels/mxfp4.py PACKED_SCALE_PAD)
#ifndef W4_PIPE
#define W4_PIPE 1  // 1: a block's wgmmas run while the block before is rescaled; 0: one block at a time
#endif
#ifndef W4_MMA
#define W4_MMA 1  // 0: a control without the wgmmas (the decoded words folded into d instead: wrong sums)
#endif
static_assert(KS * GPC >= KG && GPC == 8 * BLOCKS, "a cluster covers K in blocks of 8 groups");
static_assert(KG - (KS - 1) * GPC > 8 * (BLOCKS - 1), "every CTA has groups in each of its blocks: no block is skipped");

__device__ __forceinline__ U4 ld_stream(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 word_of(const U4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// A packed word's e4m3 bytes (kernels/mxfp4.py): values 0..3 in `low`, 4..7 in `high`, as e2m1 * 2^-6
__device__ __forceinline__ void e4m3_words(u32 w, u32& low, u32& high) {
  low = w & MX_LOW_MASK;
  high = ((w << 2) & MX_HIGH_SHL_MASK) | ((w >> 2) & MX_HIGH_SHR_MASK);
}

// four floats as e4m3 bytes (a in byte 0), rounded to nearest even, saturated
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
  u32 r;
  asm("{\n\t.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\tcvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// Shared-memory matrix descriptor of a B tile (K-major, no swizzle): 8 rows (columns n) of 16 bytes
// (k) a core matrix, the two core matrices of k 0-15 and 16-31 128 bytes apart. With N = 8 there is one
// core matrix along N, so both byte offsets are 128: whichever of them the hardware takes for K.
__device__ __forceinline__ u64 b_desc(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(128 >> 4) << 32);
}

// the compiler may not move an operand's definition or use across this point (so the decoded A
// registers are all written before the first wgmma reads them, and ptxas needs no fence between them)
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// d (= or +=) A B: wgmma m64n8k32, e4m3 x e4m3 -> float32, A (64 rows x 32 k) from the warpgroup's
// registers (a0 / a2 row g, a1 / a3 row g + 8 of the warp's 16, k 4q..4q+3 and 16+4q..16+4q+3), B from
// shared memory; accumulate: 0 starts the sums afresh
__device__ __forceinline__ void wgmma_e4m3(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc, int accumulate) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %9, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n\t}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate));
}

// The largest |value| of 8 bf16 (16 bytes), as float bits (magnitudes compare as integers)
__device__ __forceinline__ u32 max_bits(U4 v) {
  const u32 m = __vmaxu2(__vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu), __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu));
  return max(m & 0xFFFFu, m >> 16) << 16;
}


struct W4Smem {
  __align__(128) unsigned char bsm[BLOCKS * 8 * 256];  // a block: 8 K steps of 32 k x 8 columns
  float fxs[GPC];  // each group's activation factor (0 past the CTA's groups)
  float red[ROWS];  // the CTA's row sums, read by the cluster
};

// A thread's weights: block b's groups g0 + 8b + 4h + q (h = 0, 1) of rows row0, row0 + 8, and the scale
// bytes of its accumulator columns 2q, 2q + 1 (groups g0 + 8b + 2q, + 1)
struct W4Regs {
  U4 wa[BLOCKS][2], wb[BLOCKS][2];
  u32 sa[BLOCKS], sb[BLOCKS];
};

// The thread's weights of rows row0 (its warp's row g) and row0 + 8 of `words` [rows, KG, 16 bytes] and
// `scales` [rows, SCALE_BYTES], groups g0 .. g0 + ng
__device__ __forceinline__ void w4a8_load(W4Regs& r, const U4* __restrict__ words, const unsigned char* __restrict__ scales,
                                          i64 row0, int g0, int ng) {
  const int q = threadIdx.x & 3;
  const U4* w0 = words + row0 * KG;
  const U4* w1 = w0 + 8 * KG;
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gi = 8 * b + 4 * h + q;
      r.wa[b][h] = gi < ng ? ld_stream(w0 + g0 + gi) : U4{0u, 0u, 0u, 0u};
      r.wb[b][h] = gi < ng ? ld_stream(w1 + g0 + gi) : U4{0u, 0u, 0u, 0u};
    }
    const int gs = 8 * b + 2 * q;  // even, and ng is even: both groups in or both out
    r.sa[b] = gs < ng ? __ldg(reinterpret_cast<const u16*>(scales + row0 * SCALE_BYTES + g0 + gs)) : 0u;
    r.sb[b] = gs < ng ? __ldg(reinterpret_cast<const u16*>(scales + (row0 + 8) * SCALE_BYTES + g0 + gs)) : 0u;
  }
}

// The token's row `xrow` (bf16, its groups g0 .. g0 + ng) into the CTA's B tiles and factors; ends
// with the writes visible to wgmma (proxy fence, CTA barrier).
__device__ __forceinline__ void w4a8_stage_b(W4Smem& sm, const u16* __restrict__ xrow, int g0, int ng) {
  const int tid = threadIdx.x;
  // the token's row as B, every 16-byte row of the CTA's blocks written once: thread (group gi, word
  // wq) quantises values 8 wq .. 8 wq + 7 of group gi to e4m3 times 2^(134 - e) (e: the biased exponent
  // of the group's largest |x|, at least 8), so that |values| <= 256. They sit in K step 4 (gl / 4) + wq
  // of block gi / 8 (gl = gi % 8), column gl, k 4 (gl % 4) .. + 3 and, 128 bytes on (the next core
  // matrix), k + 16; the other 12 bytes of those two rows are zero, and so are column gl's rows of
  // K step 4 (1 - gl / 4) + wq, which the thread writes too. Groups past the CTA's share: zeros.
  {
    const int gi = tid >> 2, wq = tid & 3;  // a group's 4 threads are adjacent lanes
    const bool in = gi < ng;
    // from L2 (ld.global.cg): the engine stages it ahead of its PDL wait, where a line of an earlier
    // layer's row in this SM's L1 must not stand in for it
    const U4 v = in ? load_early(xrow + (g0 + gi) * 32 + 8 * wq)
                    : U4{0u, 0u, 0u, 0u};
    u32 m = max_bits(v);
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const u32 e = max(m >> 23, 8u);
    const float down = __int_as_float((261u - e) << 23);  // 2^(134 - e)
    if (gi < GPC) {
      const u32 vw[4] = {v.x, v.y, v.z, v.w};
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[2 * j] = __int_as_float(vw[j] << 16) * down;
        f[2 * j + 1] = __int_as_float(vw[j] & 0xFFFF0000u) * down;
      }
      const u32 lo = e4m3x4(f[0], f[1], f[2], f[3]), hi = e4m3x4(f[4], f[5], f[6], f[7]);  // zeros past ng
      const int blk = gi >> 3, gl = gi & 7, c = gl & 3;
      U4 rlo = U4{0u, 0u, 0u, 0u}, rhi = U4{0u, 0u, 0u, 0u};
      (c == 0 ? rlo.x : c == 1 ? rlo.y : c == 2 ? rlo.z : rlo.w) = lo;
      (c == 0 ? rhi.x : c == 1 ? rhi.y : c == 2 ? rhi.z : rhi.w) = hi;
      unsigned char* row = sm.bsm + blk * 2048 + gl * 16;
      const int s = 4 * (gl >> 2) + wq, z = 4 * (1 - (gl >> 2)) + wq;
      *reinterpret_cast<U4*>(row + s * 256) = rlo;
      *reinterpret_cast<U4*>(row + s * 256 + 128) = rhi;
      *reinterpret_cast<U4*>(row + z * 256) = U4{0u, 0u, 0u, 0u};
      *reinterpret_cast<U4*>(row + z * 256 + 128) = U4{0u, 0u, 0u, 0u};
      if (wq == 0) sm.fxs[gi] = in ? __int_as_float((e - 7u) << 23) : 0.f;  // 2^(e - 134)
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the generic writes, before wgmma reads them
  __syncthreads();
}

// The CTA's row sums over its groups into sm.red (rows warp * 16 + g, + 8), then the cluster's barrier:
// after it, every CTA of the row tile may read every CTA's sums (load_peer).
__device__ __forceinline__ void w4a8_row_sums(W4Smem& sm, const W4Regs& r) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  float t0 = 0.f, t1 = 0.f;  // rows row0, row0 + 8: this thread's columns, every block
  const u32 base = smem_addr(sm.bsm);
  u32 a[BLOCKS][8][4];  // a block's A registers: held until its wgmmas are known complete
  float d[BLOCKS][4];
  // column c of block b: group g0 + 8b + c; its weight scale 2^(s - 127) times the e4m3 bytes' 2^6,
  // times the activations' 2^(e - 134)
  auto rescale = [&](int b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operand(d[b][i]);
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_operand(a[b][s][i]);
    const float x0 = sm.fxs[8 * b + 2 * q], x1 = sm.fxs[8 * b + 2 * q + 1];
    t0 += d[b][0] * (__int_as_float(((r.sa[b] & 0xFFu) + 6u) << 23) * x0) + d[b][1] * (__int_as_float(((r.sa[b] >> 8) + 6u) << 23) * x1);
    t1 += d[b][2] * (__int_as_float(((r.sb[b] & 0xFFu) + 6u) << 23) * x0) + d[b][3] * (__int_as_float(((r.sb[b] >> 8) + 6u) << 23) * x1);
  };
#pragma unroll
  for (int b = 0; b < BLOCKS; ++b) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      u32 l0, h0, l1, h1;
      e4m3_words(word_of(r.wa[b][s >> 2], s & 3), l0, h0);
      e4m3_words(word_of(r.wb[b][s >> 2], s & 3), l1, h1);
      a[b][s][0] = l0, a[b][s][1] = l1, a[b][s][2] = h0, a[b][s][3] = h1;
    }
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) fence_operand(a[b][s][i]);
#pragma unroll
    for (int i = 0; i < 4; ++i) d[b][i] = 0.f, fence_operand(d[b][i]);
#if W4_MMA
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < 8; ++s)
      wgmma_e4m3(d[b], a[b][s][0], a[b][s][1], a[b][s][2], a[b][s][3], b_desc(base + b * 2048 + s * 256), s);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
    {
      u32 f = 0u;
#pragma unroll
      for (int s = 0; s < 8; ++s) f ^= a[b][s][0] ^ a[b][s][1] ^ a[b][s][2] ^ a[b][s][3];
      d[b][0] = __int_as_float(f & 0x007FFFFFu);
    }
#endif
#if !W4_MMA
    rescale(b);
#elif W4_PIPE  // block b's wgmmas run while block b - 1 is rescaled
    if (b > 0) {
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      rescale(b - 1);
    }
#else  // each block waited for before the next is decoded
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    rescale(b);
#endif
  }
#if W4_MMA && W4_PIPE
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  rescale(BLOCKS - 1);
#endif
  t0 += __shfl_xor_sync(0xFFFFFFFFu, t0, 1);
  t0 += __shfl_xor_sync(0xFFFFFFFFu, t0, 2);
  t1 += __shfl_xor_sync(0xFFFFFFFFu, t1, 1);
  t1 += __shfl_xor_sync(0xFFFFFFFFu, t1, 2);
  if (q == 0) {
    sm.red[warp * 16 + g] = t0;
    sm.red[warp * 16 + g + 8] = t1;
  }
  cluster_sync();  // every CTA's row sums are in its shared memory
}
