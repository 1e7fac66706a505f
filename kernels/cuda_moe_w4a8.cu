// One token's per-pair MXFP4 gate/up with bias and gpt-oss' clamped SwiGLU on Hopper's FP8 tensor cores
// (W4A8 through wgmma m64n8k32; kernels/cuda_moe_w4a8.cuh has the product, docs/kernels.md item 38).
// Compiled at run time by NVRTC for sm_90a (kernels/cuda_moe_w4a8.py); the decode's down projection
// stays kernels/cuda_moe_mxfp4.cu's `mx_down`, which reads what this writes as `mx_gate_up` writes it.
#include "cuda_common.cuh"
#include "cuda_moe_w4a8.cuh"

// act[pair, (ROWS tile + r) / 2] = SwiGLU(glu row r, linear row r + 1) of the pair's expert (blocks
// [E, n_rows, KG, 16 bytes], scales [E, n_rows, SCALE_BYTES], bias float32 [E, n_rows]; rows interleave
// glu (even) and linear (odd)) times the pair's token row of x (bf16, row pair / top_k), as f16 times
// 2^act_shift. Grid (n_rows / ROWS * KS, pairs), clusters of (KS, 1, 1), launched with PDL: the
// expert ids (pair_expert, int64, < 0: not local) are read after the wait; early_x: the caller vouches
// that x was written before the launch that wrote the ids, so the row is staged ahead of the wait.
extern "C" __global__ void __launch_bounds__(128) w4a8_gate_up_swiglu(
    const U4* __restrict__ words, const unsigned char* __restrict__ scales, const float* __restrict__ bias,
    const u16* __restrict__ x, int stride_x, const long long* __restrict__ pair_expert, int top_k, int n_rows,
    u16* __restrict__ act, double limit_d, double alpha_d, int act_shift, int early_x) {
  __shared__ W4Smem sm;
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2;
  const int ks = blockIdx.x % KS, tile = blockIdx.x / KS, pair = blockIdx.y;
  const int g0 = ks * GPC, ng = min(GPC, KG - g0);
  const u16* xrow = x + (i64)(pair / top_k) * stride_x;
  if (early_x) w4a8_stage_b(sm, xrow, g0, ng);
  enter_pdl();
  const i64 e = __ldcg(pair_expert + pair);
  if (e < 0) return;  // the pair's expert is not here: its whole cluster (one pair) leaves
  W4Regs r;
  w4a8_load(r, words, scales, e * n_rows + tile * ROWS + warp * 16 + g, g0, ng);
  // CTA ks finishes rows 16 ks .. + 15 of the tile: thread t < 8 the pair (glu, linear) 2t, 2t + 1
  const int row = ks * (ROWS / KS) + 2 * tid;
  float bias_glu = 0.f, bias_lin = 0.f;
  if (tid < ROWS / KS / 2) {
    bias_glu = bias[e * n_rows + tile * ROWS + row];
    bias_lin = bias[e * n_rows + tile * ROWS + row + 1];
  }
  if (!early_x) w4a8_stage_b(sm, xrow, g0, ng);
  w4a8_row_sums(sm, r);
  if (tid < ROWS / KS / 2) {  // the cluster's K shares in order, as the probe adds them
    float glu = 0.f, lin = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) glu += load_peer(&sm.red[row], k), lin += load_peer(&sm.red[row + 1], k);
    const float limit = (float)limit_d, alpha = (float)alpha_d;
    glu = fminf(glu + bias_glu, limit);
    lin = fminf(fmaxf(lin + bias_lin, -limit), limit);
    const float out = glu / (1.f + expf(-alpha * glu)) * (lin + 1.f);
    act[(i64)pair * (n_rows / 2) + (tile * ROWS + row) / 2] = to_f16(out * __int_as_float((127 + act_shift) << 23));
  }
  cluster_sync_relaxed();  // the peers' shared memory stays until every read of it is done
}
