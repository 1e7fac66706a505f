// FP8-weight GEMV for a decode batch (M <= 8 tokens): e4m3 weights with one float32 scale per 128x128
// block (kernels/fp8.py), bf16 activations (staged exactly in f16, below), float32 sums, the bias in
// float32, one rounding to bf16. Compiled at run time by NVRTC (kernels/cuda_gemv_fp8.py).
//
// Why: at decode the attention projections are pure weight streaming, and FP8 halves their bytes
// (gpt-oss' QKV 29.5 -> 14.7 MB, O 23.6 -> 11.8 MB a layer). A Triton GEMV of the same weights was
// bound by instruction issue (7-9 SASS instructions a byte, docs/kernels.md); here Hopper's
// conversion turns two e4m3 weights into an f16 tensor-core operand in one instruction (a first version
// built bf16 operands in three integer instructions a pair and was bound by them: docs/kernels.md).
//
// Shape: a CTA owns ROWS = 8 weight rows and its 4 warps split K in steps of 64, which they take in
// pairs: the weights are the A of mma.sync m16n8k16 (f16 in, float32 accumulate), rows g
// holding row g's step s and rows g + 8 its step s + 1; B's 8 columns are 4 tokens' steps s and s + 1.
// Lane (g, tig) reads 16 weight bytes of row g (16 K) in each step and 16 K of its column's token and
// step, and feeds four mmas; the K order inside an mma is permuted alike for A and B. D's diagonal
// blocks are the sums: lane (g, tig) ends with token tig's sums of row g (more tokens: passes of four).
// (The first layout, the tokens as A's rows 0-7 and the 8 rows as B's columns a step at a time, spent
// most of its instructions re-making A's zero rows: docs/kernels.md, item 63.) Each warp copies its share of the 8 rows into shared memory
// (16-byte cp.async, consecutive lanes on consecutive bytes of a row) in GROUPS commit groups, the first
// `early` of them ahead of the PDL wait (weights never change: kernels/pdl.py's contract) and the rest right
// after it, behind the token rows' loads (docs/kernels.md, item 64): so the bytes stream
// while the kernels before run (the QKV launches at the start of the RMSNorm before it, so during the
// MoE's tail too; the O projection during the attention), and after the wait the warp sums each group
// as soon as its copies have landed (a warp sync, no CTA barrier), the last bytes followed only by
// one group's mmas, the CTA's reduction and the epilogue. A warp stages its share of the token rows
// itself (plain loads after the wait, through L2: the kernel before wrote them), in f16 at a power of
// two per 64-K step; the block scales and biases come with the first group.
//
// Exactness: e4m3 -> f16 is exact (subnormals too). Each 64-K step of a token row is staged times
// 2^-e, e chosen so that the step's largest |x| lands in [2^14, 2^15): a bf16 has 8 significant bits
// and an f16 11, so the staged values are exact down to 2^-32 of the step's largest (smaller ones
// round at f16's subnormal spacing, 2^-24 times 2^e). Every product then has at most 15 significant
// bits and is exact in float32; each step's sum times its block's scale and 2^e is added to the row's
// sum. So the result is the float32 dot product with the dequantised weights, in this kernel's order.
//
// Two entry points: `gemv_fp8` writes out [M, N]; `gemv_fp8_rope` is gpt-oss' QKV projection with
// its epilogue (kernels/triton_rope.py): a CTA takes 4 rotation pairs of one head, rounds its sums to
// bf16, rotates q and k heads by YaRN RoPE (each product and sum rounded to bf16, as the torch path
// does) and writes q, and k and v into each token's paged KV slot.
//
// Macros set by the compiler call: GF_MAX_M (most tokens), GF_ROPE_D (head dim of the RoPE entry),
// GF_GROUPS (commit groups a warp's weight copies are split into; the staged entries' `early` argument says how
// many of them are requested before the PDL wait, the rest right after it, behind the token rows' loads),
// GF_TRACE (1: the timing build, whose
// `gemv_fp8` and `gemv_fp8_rope` take a last argument, a u64 buffer of GT_WORDS words a CTA: see `GfTrace`
// below; bench/projection_trace.py, never in the engine).
// Integer arguments are 32-bit (kernels/pdl.launch_cuda passes ints so); offsets are taken in 64 bits.

#include "cuda_gemv_fp8.cuh"

// out[m, n] = x[m, :] . (w[n, :] * scales) + bias[n] for m < M, the CTA's rows n = 8 blockIdx.x + (0 .. 7).
// x [M, K] (row stride stride_x) bf16, w [N, K] e4m3 rows contiguous, scale [ceil(N/128), ceil(K/128)]
// float32, bias [N] bf16 or null, out [M, N] bf16 (row stride stride_out); K a multiple of 64.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
gemv_fp8(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ w, const float* __restrict__ scale,
         const u16* __restrict__ bias, u16* __restrict__ out, int stride_out, int M, int K, int w_stride, int x_stride,
         int early GF_TRACE_PARAM) {
  CTA_SHARED
  Cta cta(w, K, w_stride, x_stride, Rows{(i64)blockIdx.x * ROWS, 4}, smem, sc, xsc, bs, red);
#if GF_TRACE
  cta.rec = trace + (u64)blockIdx.x * GT_WORDS;
#endif
  GF_STAMP(cta.rec, GT_START);
  cta.request(scale, bias, false, early);
  GF_STAMP(cta.rec, GT_ISSUED);
  enter_pdl();  // x is written by the kernel before this one
  GF_STAMP(cta.rec, GT_PDL);
  cta.stage_x(x, stride_x, M, early);
  cta.sum(M);
  GF_STAMP(cta.rec, GT_SUMMED);
  for (int t = threadIdx.x; t < M * ROWS; t += THREADS) {
    const int m = t / ROWS, r = t % ROWS;
    out[(i64)m * stride_out + cta.rows(r)] = to_bf16(cta.total(m, r, bias != nullptr));
  }
  GF_STAMP(cta.rec, GT_END);
  GF_STAMP(cta.rec, GT_SM);
}

// gpt-oss' QKV projection with its epilogue, for M tokens. Rows of w: q heads, then k heads, then v
// heads, D = GF_ROPE_D each; CTA p takes head h = p / (D / 8) and the 4 rotation pairs j .. j + 3
// (j = 4 (p % (D / 8))), rows h D + j + (0..3) and h D + D/2 + j + (0..3). Sums rounded to bf16 (the
// projection's output), then q and k heads rotated (half-split, cos / sin [positions, D/2] float32
// tables rounded to bf16, each product and each sum rounded to bf16): q heads to q [M, HQ, D], k and
// v heads into the KV slot slots[m] of layer_cache [blocks, 2, page, HKV, D] (K at 0, V at 1).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
gemv_fp8_rope(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ w,
              const float* __restrict__ scale, const u16* __restrict__ bias, int M, int K, int w_stride, int x_stride,
              const i64* __restrict__ positions, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
              int stride_cos, const i64* __restrict__ slots, u16* __restrict__ cache, int page_size, int stride_cb,
              int stride_ckv, int stride_co, int stride_ch, u16* __restrict__ q, int HQ, int HKV,
              int early GF_TRACE_PARAM) {
  constexpr int D = GF_ROPE_D, HALF = D / 2;
  CTA_SHARED
  const int h = blockIdx.x / (HALF / 4), j = (blockIdx.x % (HALF / 4)) * 4;
  Cta cta(w, K, w_stride, x_stride, Rows{(i64)h * D + j, HALF}, smem, sc, xsc, bs, red);
#if GF_TRACE
  cta.rec = trace + (u64)blockIdx.x * GT_WORDS;
#endif
  GF_STAMP(cta.rec, GT_START);
  cta.request(scale, bias, true, early);
  GF_STAMP(cta.rec, GT_ISSUED);
  enter_pdl();  // x, positions and slots are written before this kernel
  GF_STAMP(cta.rec, GT_PDL);
  // the epilogue thread's (token m, pair i) position, table entries and slot, in flight during the sums
  const int m = threadIdx.x / 4, i = threadIdx.x % 4;
  const bool epilogue = threadIdx.x < M * 4, rotate = h < HQ + HKV;
  float c = 0.f, s = 0.f;
  i64 slot = 0;
  if (epilogue) {
    if (rotate) {
      const i64 pos = load_input(positions + m);
      c = cos_t[pos * stride_cos + j + i];
      s = sin_t[pos * stride_cos + j + i];
    }
    if (h >= HQ) slot = load_input(slots + m);
  }
  cta.stage_x(x, stride_x, M, early);
  cta.sum(M);
  GF_STAMP(cta.rec, GT_SUMMED);
  GF_STAMP(cta.rec, GT_SM);  // (thread 0 is an epilogue thread: it stamps the end too)
  if (!epilogue) return;
  const float x1 = bf16_round(cta.total(m, i, bias != nullptr)), x2 = bf16_round(cta.total(m, i + 4, bias != nullptr));
  float o1 = x1, o2 = x2;
  if (rotate) rope_pair(o1, o2, c, s);  // q or k
  u16* dst;
  if (h < HQ) {
    dst = q + ((i64)m * HQ + h) * D;
  } else {
    const i64 page = slot / page_size;
    const bool is_k = h < HQ + HKV;
    dst = cache + page * stride_cb + (slot - page * page_size) * stride_co + (is_k ? h - HQ : h - HQ - HKV) * stride_ch +
          (is_k ? 0 : stride_ckv);
  }
  dst[j + i] = to_bf16(o1);
  dst[HALF + j + i] = to_bf16(o2);
  GF_STAMP(cta.rec, GT_END);
}

// Streaming entry for projections of many rows (the vocabulary projection: 201088 rows, 580 MB of
// e4m3), where `gemv_fp8`'s CTA of 8 rows, all copied before any sum, streamed at 2.6 TB/s: every CTA
// staged the token rows again, and a CTA's bytes arrived before its sums began. Here each warp owns
// whole 16-row groups (groups warp, warp + all warps, ...) over all of K and streams them through a
// ring of GF_STREAM_D 64-K steps in registers (a lane's 16 bytes of rows g and g + 8 a step, with the
// step's block scale), so its loads run D steps ahead of its sums across group boundaries. The token
// rows are staged once per CTA (each warp its quarter, as `gemv_fp8` does). The weights are the mma's
// A (16 rows: the F2FP conversions write its registers directly) and the tokens its B columns (lane
// (g, tig) supplies token g's 16 K, the same K order as its weight bytes), so a lane ends with rows g
// and g + 8 of tokens 2 tig and 2 tig + 1: no reduction across warps. The first D steps are requested
// before the PDL wait. Numerics as `gemv_fp8` (exact products, float32 sums), the steps added in K
// order.
#define STREAM_D GF_STREAM_D
#define STREAM_ROWS 16

// 16 weight bytes, read once: not kept in L1 (not volatile: the compiler may schedule it)
__device__ __forceinline__ U4 load_once(const void* p) {
  U4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}


struct StreamStep {
  U4 lo, hi;  // 16 bytes of rows g and g + 8
  float scale;  // the step's 128x128 block scale
};

extern "C" __global__ void __launch_bounds__(THREADS)
gemv_fp8_stream(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ w,
                const float* __restrict__ scale, const u16* __restrict__ bias, u16* __restrict__ out, int stride_out,
                int M, int N, int K, int x_stride) {
  CTA_SHARED
  Cta cta(w, K, 0, x_stride, Rows{0, 4}, smem, sc, xsc, bs, red);  // its token rows only (no weights staged)
  const int steps = K / STEP_K, kb_total = (K + 127) / 128, groups = N / STREAM_ROWS,
            stride_groups = gridDim.x * WARPS;
  const int g = cta.g, tig = cta.tig;
  // the ring: the next step to request is step ls of group lg, at wp (this lane's 16 bytes of row g;
  // row g + 8's are 8 rows further) with its block scale at sp[ls / 2]; pointers advance, no index products
  int lg = blockIdx.x * WARPS + cta.warp, ls = 0;
  const unsigned char* wp = w + ((i64)lg * STREAM_ROWS + g) * K + tig * 16;
  const float* sp = scale + (((i64)lg * STREAM_ROWS) >> 7) * kb_total;
  const i64 group_jump = (i64)stride_groups * STREAM_ROWS * K - (i64)steps * STEP_K, upper = 8 * (i64)K;
  StreamStep ring[STREAM_D];
  auto request = [&](StreamStep& r, bool early) {  // past the warp's last group: step 0 of group 0 (unused)
    const bool mine = lg < groups;
    const unsigned char* p = mine ? wp : w;
    const float* q = mine ? sp + (ls >> 1) : scale;
    r.lo = early ? load_early(p) : load_once(p);
    r.hi = early ? load_early(p + upper) : load_once(p + upper);
    r.scale = early ? load_early_f32(q) : __ldg(q);  // .cg: ptxas keeps it ahead of the wait, not .nc
    wp += STEP_K;
    if (++ls == steps) {
      ls = 0;
      lg += stride_groups;
      wp += group_jump;
      sp = scale + (((i64)lg * STREAM_ROWS) >> 7) * kb_total;
    }
  };
#pragma unroll
  for (int i = 0; i < STREAM_D; i++) request(ring[i], true);
  enter_pdl();  // x is written by the kernel before this one
  cta.stage_x(x, stride_x, M, GROUPS);
  __syncthreads();  // every warp reads all of K of the token rows
  // B column g: token g (tokens past M: token 0's; their sums are not kept); D columns: tokens t0, t0 + 1
  const unsigned char* xr = cta.xs + (g < M ? g : 0) * x_stride + tig * 32;
  const int t0 = 2 * tig, t1 = 2 * tig + 1;
  const float* xsc0 = cta.xsc[t0 < M ? t0 : 0];
  const float* xsc1 = cta.xsc[t1 < M ? t1 : 0];
  int cg = blockIdx.x * WARPS + cta.warp, cs = 0;  // the step summed next
  float acc[4] = {0.f, 0.f, 0.f, 0.f};            // rows g, g + 8 x tokens t0, t1 (the mma's d order)
  while (cg < groups) {
#pragma unroll
    for (int i = 0; i < STREAM_D; i++) {
      const StreamStep r = ring[i];
      request(ring[i], false);
      const U4 xa = *reinterpret_cast<const U4*>(xr + cs * 2 * STEP_K);
      const U4 xb = *reinterpret_cast<const U4*>(xr + cs * 2 * STEP_K + 16);
      const float f0 = r.scale * xsc0[cs], f1 = r.scale * xsc1[cs];
      float p[4] = {0.f, 0.f, 0.f, 0.f}, q[4] = {0.f, 0.f, 0.f, 0.f};
      mma_e4m3_step(p, q, r.lo, r.hi, xa, xb);
      acc[0] += (p[0] + q[0]) * f0;
      acc[1] += (p[1] + q[1]) * f1;
      acc[2] += (p[2] + q[2]) * f0;
      acc[3] += (p[3] + q[3]) * f1;
      if (++cs == steps) {  // the group's sums are complete
        const i64 n = (i64)cg * STREAM_ROWS + g;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int t = j & 1 ? t1 : t0;
          const i64 row = n + (j >> 1) * 8;
          if (t < M) out[(i64)t * stride_out + row] = to_bf16(acc[j] + (bias != nullptr ? from_bf16(bias[row]) : 0.f));
          acc[j] = 0.f;
        }
        cs = 0;
        cg += stride_groups;
        if (cg >= groups) break;
      }
    }
  }
}
