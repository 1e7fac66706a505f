// bf16 GEMV for a decode batch (M <= 8 tokens) whose CTAs copy their weight rows into shared memory
// ahead of their PDL wait. Compiled at run time by NVRTC (kernels/cuda_gemv_staged.py).
//
// Why: the attention output projection follows the decode attention, a kernel bound by latency on
// few CTAs. Launched with programmatic dependent launch (kernels/pdl.py), this kernel's CTAs are
// placed while the attention still runs; each requests its ROWS weight rows (16-byte cp.async
// copies by every thread; one bulk copy a row, issued by one thread, streamed at under 1.5 TB/s)
// before `griddepcontrol.wait`, so the projection's bytes stream from memory during the attention
// instead of after it. Weights never change: reading them ahead of the wait keeps the PDL contract.
// The whole matrix fits the GPU's shared memory (O of gpt-oss: 23.6 MB in 360 CTAs of 8 rows, 3 a
// SM with one token's row).
//
// After the wait the CTA copies the token rows next to the weights (reading x from L2 inside the K
// loop left each warp a chain of dependent reads), and each warp takes a quarter of K and runs
// mma.sync m16n8k16 (bf16 in, float32 accumulate) with the tokens as the 16 rows of A (rows 8-15
// zero) and the CTA's 8 weight rows as the 8 columns of B. A lane reads 8 consecutive K of its row
// (16 bytes) and feeds them to two mmas: the K order inside the mmas is permuted alike for A and B,
// so the sums are the same dot products. The warps' sums are added in a fixed order, the bias in
// float32, one rounding to bf16.
//
// Macros set by the compiler call (kernels/cuda_gemv_staged.py): GS_ROWS (weight rows a CTA: the
// mma's 8), GS_WARPS (warps splitting K), GS_MAX_M (most tokens: the mma's rows 0-7), GS_PAD (bytes
// after each staged row, so that the 16-byte reads of a quarter warp, rows g and g + 1, fall in
// distinct banks).

#include "cuda_common.cuh"

#define ROWS GS_ROWS
#define WARPS GS_WARPS
#define MAX_M GS_MAX_M
#define PAD GS_PAD

// out[m, n] = x[m, :] . w[n, :] + bias[n] for m < M, the CTA's rows n = ROWS * blockIdx.x + (0 .. ROWS).
// x [M, K] (row stride stride_x), w [N, K] rows contiguous, bias [N] or null, out [M, N] (stride_out);
// K a multiple of 64 * WARPS, both 16-byte aligned.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_staged(const u16* __restrict__ x, int stride_x, const u16* __restrict__ w, const u16* __restrict__ bias,
            u16* __restrict__ out, int stride_out, int M, int K) {
  extern __shared__ __align__(16) unsigned char smem[];  // ROWS weight rows, then M token rows, PAD bytes apart
  __shared__ float red[WARPS][MAX_M][ROWS];
  const int row_bytes = K * 2, stride_s = row_bytes + PAD;
  const i64 row0 = (i64)blockIdx.x * ROWS;
  // the CTA's rows, 16 bytes a copy (cp.async, through L2 only), consecutive threads on consecutive bytes
  const int per_row = row_bytes / 16;
  for (int c = threadIdx.x; c < ROWS * per_row; c += WARPS * 32) {
    const int r = c / per_row, v = c % per_row;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"(smem_addr(smem + r * stride_s + v * 16)), "l"(w + (row0 + r) * K + v * 8) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  // the PDL wait (kernels/pdl.py): x is written by the kernel before this one
  enter_pdl();
  // the tokens' rows after the weights, all requested at once
  unsigned char* xs = smem + ROWS * stride_s;
  for (int c = threadIdx.x; c < M * per_row; c += WARPS * 32) {
    const int m = c / per_row, v = c % per_row;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"(smem_addr(xs + m * stride_s + v * 16)), "l"(x + (i64)m * stride_x + v * 8) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;  // A row (token) g, B column (weight row) g
  const int k_per = K / WARPS, k_lo = warp * k_per;
  const bool token = g < M;
  const unsigned char* xr = xs + (token ? g : 0) * stride_s + (i64)k_lo * 2 + tig * 16;
  const unsigned char* wr = smem + g * stride_s + (i64)k_lo * 2 + tig * 16;
  float d[4][4] = {};  // four accumulator chains: each mma waits on the one two blocks back, not on the last

  // the weights and the tokens: this thread's copies, then every thread's
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  // blocks of 32 K (two a step): lane (g, tig) holds K 8 tig .. 8 tig + 7 of a block for token g and row g
#pragma unroll 4
  for (int b = 0; b < k_per / 32; b += 2) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      U4 xv = U4{0u, 0u, 0u, 0u};
      if (token) xv = *reinterpret_cast<const U4*>(xr + (b + h) * 64);
      const U4 wv = *reinterpret_cast<const U4*>(wr + (b + h) * 64);
      mma_rows0_7(d[2 * h], xv.x, xv.y, wv.x, wv.y);
      mma_rows0_7(d[2 * h + 1], xv.z, xv.w, wv.z, wv.w);
    }
  }
  // d[.][0], d[.][1]: token g, weight rows 2 tig, 2 tig + 1 (d[.][2], d[.][3]: the zero rows 8-15 of A)
  if (token) {
    red[warp][g][2 * tig] = (d[0][0] + d[1][0]) + (d[2][0] + d[3][0]);
    red[warp][g][2 * tig + 1] = (d[0][1] + d[1][1]) + (d[2][1] + d[3][1]);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < M * ROWS; t += WARPS * 32) {
    const int m = t / ROWS, r = t % ROWS;
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < WARPS; k++) v += red[k][m][r];
    if (bias != nullptr) v += from_bf16(bias[row0 + r]);
    out[(i64)m * stride_out + row0 + r] = to_bf16(v);
  }
}
