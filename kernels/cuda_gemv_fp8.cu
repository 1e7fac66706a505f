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
// Shape: a CTA owns ROWS = 8 or 16 weight rows (GF_ROWS) and its 4 warps split K in steps of 64, which they
// take in pairs: the weights of 8 rows are the A of mma.sync m16n8k16 (f16 in, float32 accumulate), rows g
// holding row g's step s and rows g + 8 its step s + 1; B's 8 columns are 4 tokens' steps s and s + 1 (with 16
// rows, each 8-row group's mmas take the same B).
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
// its epilogue (kernels/triton_rope.py): a CTA takes ROWS / 2 rotation pairs of one head, rounds its sums to
// bf16, rotates q and k heads by YaRN RoPE (each product and sum rounded to bf16, as the torch path
// does) and writes q, and k and v into each token's paged KV slot.
//
// Macros set by the compiler call: GF_MAX_M (most tokens), GF_ROWS (weight rows a CTA of the staged entries:
// 8, or 16 for fewer, larger CTAs; the streaming entry ignores it), GF_ROPE_D (head dim of the RoPE entry),
// GF_GROUPS (commit groups a warp's weight copies are split into; the staged entries' `early` argument says how
// many of them are requested before the PDL wait, the rest right after it, behind the token rows' loads),
// GF_TRACE (1: the timing build, whose
// `gemv_fp8` and `gemv_fp8_rope` take a last argument, a u64 buffer of GT_WORDS words a CTA: see `GfTrace`
// below; bench/projection_trace.py, never in the engine).
// Integer arguments are 32-bit (kernels/pdl.launch_cuda passes ints so); offsets are taken in 64 bits.

#include "cuda_common.cuh"

#define ROWS GF_ROWS
#define ROW_GROUPS (ROWS / 8)  // the mma's 8 rows at a time
#define WARPS 4
#define THREADS (WARPS * 32)
#define MAX_M GF_MAX_M
#define STEP_K 64        // K of one step of a warp: 4 lanes x 16 bytes
#define GROUPS GF_GROUPS  // commit groups of a warp's weight copies (1-4)
#define MAX_WARP_STEPS 32  // 64-K steps of a warp's share (K <= 8192)
#define X_BATCH 4        // 16-byte token chunks a lane loads before staging them
#define MAX_STEPS 128    // 64-K steps of K (K <= 8192): the staged rows' powers of two
// CTAs an SM the staged entries are compiled for (register bound 128; QKV's 640 CTAs need 5 an SM, O's 360 3):
// without it ptxas gave the RoPE entry of the paired sums 56 registers and one spill
#define MIN_CTAS 4

#ifndef GF_TRACE
#define GF_TRACE 0
#endif
#if GF_TRACE
// A CTA's record, written by its thread 0 (%globaltimer ns unless said): its start, its weight copies
// requested, the PDL wait passed, warp 0's token rows staged, warp 0's copies landed (not before the staging:
// the warp waits for them there), the CTA's sums done (its barrier passed), its end; its SM.
enum GfTrace { GT_START, GT_ISSUED, GT_PDL, GT_STAGED, GT_LANDED, GT_SUMMED, GT_END, GT_SM, GT_WORDS };
#define GF_TRACE_PARAM , u64* __restrict__ trace
#define GF_STAMP(rec, w) do { if (threadIdx.x == 0) (rec)[w] = (w) == GT_SM ? (u64)sm_id() : now_ns(); } while (0)
#else
#define GF_TRACE_PARAM
#define GF_STAMP(rec, w) do { } while (0)
#endif

__device__ __forceinline__ void copy16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

template <int BYTES>
__device__ __forceinline__ void copy_small(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES) : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// this thread's copies of all but the last `pending` committed groups have landed
__device__ __forceinline__ void wait_groups(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
  }
}

// Four f16 mmas from Hopper's e4m3 conversion: A's rows g and g + 8 from the lane's 16 e4m3 bytes lo and hi
// (4 of each an mma), B from the lane's 16 f16 values xa, then xb, in the same K order; into two chains p and q
// (their sum is D), or one where both name the same array. What the rows and columns hold is the caller's:
// `Cta::pair` (row g's steps s and sb) and `gemv_fp8_stream` (rows g and g + 8 of one step).
__device__ __forceinline__ void mma_e4m3_step(float p[4], float q[4], const U4& lo, const U4& hi, const U4& xa,
                                              const U4& xb) {
  u32 a[8], b[8];  // word j of rows g (a) and g + 8 (b): f16x2 of bytes 0-1 at 2j, 2-3 at 2j + 1
  e4m3x4_f16x2(lo.x, a[0], a[1]);
  e4m3x4_f16x2(lo.y, a[2], a[3]);
  e4m3x4_f16x2(lo.z, a[4], a[5]);
  e4m3x4_f16x2(lo.w, a[6], a[7]);
  e4m3x4_f16x2(hi.x, b[0], b[1]);
  e4m3x4_f16x2(hi.y, b[2], b[3]);
  e4m3x4_f16x2(hi.z, b[4], b[5]);
  e4m3x4_f16x2(hi.w, b[6], b[7]);
  mma<true>(p, a[0], b[0], a[1], b[1], xa.x, xa.y);
  mma<true>(q, a[2], b[2], a[3], b[3], xa.z, xa.w);
  mma<true>(p, a[4], b[4], a[5], b[5], xb.x, xb.y);
  mma<true>(q, a[6], b[6], a[7], b[7], xb.z, xb.w);
}

// a step input (written before this kernel, anew for every step) through L2 only, as load_early
__device__ __forceinline__ i64 load_input(const i64* p) {
  i64 v;
  asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

// The CTA's rows: row r is base + (r & 3) + ((r >> 2) & 1) * upper + (r >> 3) * next (upper 4, next 8:
// consecutive rows; upper D / 2, next 4: ROWS / 2 rotation pairs of a head). All in one 128-row scale block.
struct Rows {
  i64 base;
  int upper, next;
  __device__ __forceinline__ i64 operator()(int r) const {
    return ROWS == 8 ? base + (r & 3) + (r >> 2) * upper : base + (r & 3) + ((r >> 2) & 1) * upper + (r >> 3) * next;
  }
};

// One CTA's dot products, each warp over its share of K. Shared memory: the staged weight rows at
// ws (row r at r * w_stride), the token rows at xs (x_stride apart) with their powers of two, the
// warps' block scales, the raw bf16 biases, the warps' sums.
struct Cta {
  const unsigned char* __restrict__ w;
  int K, w_stride, x_stride;
  Rows rows;
  unsigned char* ws;
  unsigned char* xs;
  float (*sc)[MAX_WARP_STEPS];
  float (*xsc)[MAX_STEPS];
  u16* bs;
  float (*red)[MAX_M][ROWS];
  int lane, warp, g, tig, s_lo, s_hi, per_group;
#if GF_TRACE
  u64* rec = nullptr;  // this CTA's trace record (the kernels set it)
#endif

  __device__ __forceinline__ Cta(const unsigned char* w_, int K_, int w_stride_, int x_stride_, Rows rows_,
                                 unsigned char* smem, float (*sc_)[MAX_WARP_STEPS], float (*xsc_)[MAX_STEPS], u16* bs_,
                                 float (*red_)[MAX_M][ROWS])
      : w(w_), K(K_), w_stride(w_stride_), x_stride(x_stride_), rows(rows_), ws(smem), xs(smem + ROWS * w_stride_),
        sc(sc_), xsc(xsc_), bs(bs_), red(red_) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    g = lane >> 2;  // A row (token) g, B column (weight row) g
    tig = lane & 3;
    const int steps = K / STEP_K;
    s_lo = warp * steps / WARPS;
    s_hi = (warp + 1) * steps / WARPS;
    per_group = (s_hi - s_lo + GROUPS - 1) / GROUPS;
  }

  // Before the PDL wait: the warp's share of the rows in GROUPS commit groups, the first `early` of them here
  // (the rest after the wait, behind the token rows' loads: stage_x); with the first, the warp's block scales
  // and (warp 0) the biases (bias_pairs: the rows' biases as 4-row runs, false: 8-row runs)
  __device__ __forceinline__ void request(const float* __restrict__ scale, const u16* __restrict__ bias,
                                          bool bias_pairs, int early) {
    const int kb_total = (K + 127) / 128;  // sc[warp][i]: the block scale of step s_lo + i
    if (lane < s_hi - s_lo) copy_small<4>(&sc[warp][lane], scale + (rows(0) / 128) * kb_total + (s_lo + lane) / 2);
    if (warp == 0 && bias != nullptr) {
      const int run = ROWS == 8 ? 0 : lane;  // lane < ROW_GROUPS: its 8-row run
      if (!bias_pairs && lane < ROW_GROUPS) copy16(bs + 8 * run, bias + rows(8 * run));
      if (bias_pairs && lane < ROWS / 4) copy_small<8>(bs + 4 * lane, bias + rows(4 * lane));
    }
    copy(0, early);
  }

  // Commit groups q0 .. q1 - 1 of the warp's rows: row by row, consecutive lanes on consecutive 16 bytes of
  // the row's share of the group (a row's addresses once, then a pointer increment a copy: the copies of the
  // first layout, carried over from row to row, executed about 50 instructions each)
  __device__ __forceinline__ void copy(int q0, int q1) {
#pragma unroll 1
    for (int q = q0; q < q1; q++) {
      const int a = s_lo + q * per_group, b = min(a + per_group, s_hi), per_row = max(b - a, 0) * (STEP_K / 16);
#pragma unroll
      for (int r = 0; r < ROWS; r++) {
        const unsigned char* src = w + rows(r) * K + a * STEP_K + lane * 16;
        unsigned char* dst = ws + r * w_stride + a * STEP_K + lane * 16;
#pragma unroll 1
        for (int c = lane; c < per_row; c += 32, src += 512, dst += 512) copy16(dst, src);
      }
      commit();
    }
  }

  // After the wait: the warp's share of the M token rows in f16, each 64-K step times its own 2^-e
  // (xsc[m][step] = 2^e), X_BATCH 16-byte chunks a lane in flight (a lane's chunks: c over the token's
  // share, then the next token m; no divisions). A step is 8 chunks and 8 consecutive lanes always
  // hold one step's (a token's share is whole steps, lanes advance by 32), so its largest |x| is three
  // shuffles away; every lane runs the same rounds for them.
  // Commit groups late .. GROUPS - 1 (the staged entries' copies not requested ahead of the wait) are requested
  // right after the first round's loads.
  __device__ __forceinline__ void stage_x(const u16* __restrict__ x, int stride_x, int M, int late) {
    const int chunks = (s_hi - s_lo) * (STEP_K / 8);  // a token's share
    if (chunks == 0) return;                           // K < 256: some warps have no steps (nor copies)
    const int rounds = (M * chunks + 32 * X_BATCH - 1) / (32 * X_BATCH);
    int m = 0, c = lane;
    while (c >= chunks) c -= chunks, m++;
    for (int round = 0; round < rounds; round++) {
      U4 v[X_BATCH];
      int mb[X_BATCH], cb[X_BATCH];
#pragma unroll
      for (int b = 0; b < X_BATCH; b++) {
        mb[b] = m;
        cb[b] = c;
        v[b] = m < M ? load_early(x + (i64)m * stride_x + s_lo * STEP_K + c * 8) : U4{0u, 0u, 0u, 0u};
        for (c += 32; c >= chunks;) c -= chunks, m++;
      }
      if (round == 0 && late < GROUPS) copy(late, GROUPS);
#pragma unroll
      for (int b = 0; b < X_BATCH; b++) {
        if ((round * X_BATCH + b) * 32 >= M * chunks) break;  // no lane has a chunk here (the same for all)
        const u32 pairs[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
        float f[8], big = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
          f[2 * i] = __int_as_float(pairs[i] << 16);
          f[2 * i + 1] = __int_as_float(pairs[i] & 0xFFFF0000u);
          big = fmaxf(big, fmaxf(fabsf(f[2 * i]), fabsf(f[2 * i + 1])));
        }
        big = fmaxf(big, __shfl_xor_sync(0xFFFFFFFFu, big, 1));
        big = fmaxf(big, __shfl_xor_sync(0xFFFFFFFFu, big, 2));
        big = fmaxf(big, __shfl_xor_sync(0xFFFFFFFFu, big, 4));
        // big in [2^(E-127), 2^(E-126)): times 2^(141-E) in [2^14, 2^15); E >= 15 keeps both powers
        // normal (an infinite x stays infinite)
        const int E = max(__float_as_int(big) >> 23, 15);
        const float up = __int_as_float((268 - E) << 23);
        if (mb[b] < M) {
          *reinterpret_cast<U4*>(xs + mb[b] * x_stride + s_lo * STEP_K * 2 + cb[b] * 16) =
              U4{f16x2(f[0] * up, f[1] * up), f16x2(f[2] * up, f[3] * up), f16x2(f[4] * up, f[5] * up),
                 f16x2(f[6] * up, f[7] * up)};
          if ((cb[b] & 7) == 0) xsc[mb[b]][s_lo + cb[b] / 8] = __int_as_float((E - 14) << 23);
        }
      }
    }
    __syncwarp();
    GF_STAMP(rec, GT_STAGED);
  }

  // B of step s's mmas: lane g's x at xr (its token, step s or s + 1; 32 bytes)
  struct XStep {
    U4 a, b;
  };
  __device__ __forceinline__ static XStep x_at(const unsigned char* xr, int s) {
    return {*reinterpret_cast<const U4*>(xr + s * 2 * STEP_K), *reinterpret_cast<const U4*>(xr + s * 2 * STEP_K + 16)};
  }

  // Steps s and sb (s + 1; or s again at the end of the warp's share) of 8 weight rows, as the mma's A:
  // rows g are row g's 16 bytes of step s, rows g + 8 row g's of step sb (the F2FP conversions write A's
  // registers directly); B column j is lane g = j's x (x_at). Four mmas in one chain from zero:
  // d[0] = D[g][2 tig] (step s), d[3] = D[g + 8][2 tig + 1] (step sb), the other two unused.
  __device__ __forceinline__ void pair(const unsigned char* wr, const XStep& x, int s, int sb, float d[4]) const {
    const U4 wa = *reinterpret_cast<const U4*>(wr + s * STEP_K);
    const U4 wb = *reinterpret_cast<const U4*>(wr + sb * STEP_K);
    d[0] = d[1] = d[2] = d[3] = 0.f;
    mma_e4m3_step(d, d, wa, wb, x.a, x.b);  // (steps s and sb as A's rows g and g + 8; one chain)
  }

  // The warp's steps in pairs (two pairs at a time: two independent mma chains), each group's once the warp's
  // copies of it have landed; tokens four at a time (B's 8 columns: a token's step s and step s + 1), so lane
  // (g, tig) sums token 4 pass + tig of row g of each 8-row group (the groups' mmas share their B); the warp's
  // sums into red. Why pairs: with the tokens as A's rows (8 of 16 used, the rest zeros re-made around every
  // mma) the loop executed about 108 instructions for each 1 KB of weights, and the sums, bound by their
  // issue, took about 2 us of a QKV launch after its bytes had landed; this loop executes about 40.
  __device__ __forceinline__ void sum(int M) {
    int q = 0;                  // groups waited for
    auto landed = [&](int s) {  // the groups holding steps up to s
      while (q < GROUPS && s >= s_lo + q * per_group) {
        wait_groups(GROUPS - 1 - q);
        __syncwarp();  // the weights (and in group 0 the scales) other lanes of the warp copied
        q++;
        if (q == GROUPS) GF_STAMP(rec, GT_LANDED);
      }
    };
    for (int t0 = 0; t0 < M; t0 += 4) {
      const int col = t0 + (g >> 1), t = t0 + tig;  // B's token (lane g); D's token (lane tig)
      // from step s_lo on, advancing a step at a time: the lane's weight bytes (group 0's row g; group i's
      // 8 i rows further), its column's x (past M: token 0's, unused; odd columns one step ahead), its D
      // token's steps' powers of two and the block scales
      const unsigned char* wr = ws + g * w_stride + tig * 16 + s_lo * STEP_K;
      const int odd = (g & 1) * 2 * STEP_K, group_stride = 8 * w_stride;
      const unsigned char* x_col = xs + (col < M ? col : 0) * x_stride + tig * 32 + s_lo * 2 * STEP_K + odd;
      const float* x_pow = xsc[t < M ? t : 0] + s_lo;
      const float* wsc = sc[warp];
      float acc[ROW_GROUPS];
#pragma unroll
      for (int i = 0; i < ROW_GROUPS; i++) acc[i] = 0.f;
      // a pair's two sums (d[0]: step i, d[3]: step i + 1 from the pointers), in K order
      auto add = [&](float& a, const float d[4], int i) {
        a = fmaf(d[0], wsc[i] * x_pow[i], a);
        a = fmaf(d[3], wsc[i + 1] * x_pow[i + 1], a);
      };
      auto advance = [&](int steps) { wr += steps * STEP_K, x_col += steps * 2 * STEP_K, x_pow += steps, wsc += steps; };
      int s = s_lo;
      for (; s + 3 < s_hi; s += 4) {
        landed(s + 3);
        const XStep xa = x_at(x_col, 0), xb = x_at(x_col, 2);
#pragma unroll
        for (int i = 0; i < ROW_GROUPS; i++) {
          float d[4], e[4];
          pair(wr + i * group_stride, xa, 0, 1, d);
          pair(wr + i * group_stride, xb, 2, 3, e);
          add(acc[i], d, 0);
          add(acc[i], e, 2);
        }
        advance(4);
      }
      if (s + 1 < s_hi) {
        landed(s + 1);
        const XStep xa = x_at(x_col, 0);
#pragma unroll
        for (int i = 0; i < ROW_GROUPS; i++) {
          float d[4];
          pair(wr + i * group_stride, xa, 0, 1, d);
          add(acc[i], d, 0);
        }
        advance(2);
        s += 2;
      }
      if (s < s_hi) {  // the share's last step alone: every column reads step s (in bounds), the odd ones unused
        landed(s);
        const XStep xa = x_at(x_col - odd, 0);
#pragma unroll
        for (int i = 0; i < ROW_GROUPS; i++) {
          float d[4];
          pair(wr + i * group_stride, xa, 0, 0, d);
          acc[i] = fmaf(d[0], wsc[0] * x_pow[0], acc[i]);
        }
      }
      if (t < M) {
#pragma unroll
        for (int i = 0; i < ROW_GROUPS; i++) red[warp][t][8 * i + g] = acc[i];
      }
    }
    __syncthreads();
  }

  // token m's total for row r: the warps' sums in order, then the bias (float32)
  __device__ __forceinline__ float total(int m, int r, bool has_bias) const {
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < WARPS; k++) v += red[k][m][r];
    return has_bias ? v + from_bf16(bs[r]) : v;
  }
};

#define CTA_SHARED                                          \
  extern __shared__ __align__(16) unsigned char smem[];     \
  __shared__ float red[WARPS][MAX_M][ROWS];                 \
  __shared__ float sc[WARPS][MAX_WARP_STEPS];               \
  __shared__ float xsc[MAX_M][MAX_STEPS];                   \
  __shared__ __align__(16) u16 bs[ROWS];

// out[m, n] = x[m, :] . (w[n, :] * scales) + bias[n] for m < M, the CTA's rows n = ROWS blockIdx.x + (0 .. ROWS - 1).
// x [M, K] (row stride stride_x) bf16, w [N, K] e4m3 rows contiguous, scale [ceil(N/128), ceil(K/128)]
// float32, bias [N] bf16 or null, out [M, N] bf16 (row stride stride_out); K a multiple of 64.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
gemv_fp8(const u16* __restrict__ x, int stride_x, const unsigned char* __restrict__ w, const float* __restrict__ scale,
         const u16* __restrict__ bias, u16* __restrict__ out, int stride_out, int M, int K, int w_stride, int x_stride,
         int early GF_TRACE_PARAM) {
  CTA_SHARED
  Cta cta(w, K, w_stride, x_stride, Rows{(i64)blockIdx.x * ROWS, 4, 8}, smem, sc, xsc, bs, red);
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

__device__ __forceinline__ float bf16_round(float v) { return from_bf16(to_bf16(v)); }

// gpt-oss' QKV projection with its epilogue, for M tokens. Rows of w: q heads, then k heads, then v
// heads, D = GF_ROPE_D each; CTA p takes head h = p / (D / ROWS) and the P = ROWS / 2 rotation pairs j .. j + P - 1
// (j = P (p % (D / ROWS))), rows h D + j + (0..P-1) and h D + D/2 + j + (0..P-1). Sums rounded to bf16 (the
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
  constexpr int D = GF_ROPE_D, HALF = D / 2, P = ROWS / 2;  // P: the CTA's rotation pairs
  static_assert(HALF % P == 0, "a CTA's rotation pairs within one head");
  CTA_SHARED
  const int h = blockIdx.x / (HALF / P), j = (blockIdx.x % (HALF / P)) * P;
  Cta cta(w, K, w_stride, x_stride, Rows{(i64)h * D + j, HALF, 4}, smem, sc, xsc, bs, red);
#if GF_TRACE
  cta.rec = trace + (u64)blockIdx.x * GT_WORDS;
#endif
  GF_STAMP(cta.rec, GT_START);
  cta.request(scale, bias, true, early);
  GF_STAMP(cta.rec, GT_ISSUED);
  enter_pdl();  // x, positions and slots are written before this kernel
  GF_STAMP(cta.rec, GT_PDL);
  // the epilogue thread's (token m, pair i) position, table entries and slot, in flight during the sums
  const int m = threadIdx.x / P, i = threadIdx.x % P;
  const bool epilogue = threadIdx.x < M * P, rotate = h < HQ + HKV;
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
  const int r1 = ROWS == 8 ? i : (i & 3) + (i >> 2) * 8;  // pair i's rows (Rows: the upper half 4 rows on)
  const float x1 = bf16_round(cta.total(m, r1, bias != nullptr)), x2 = bf16_round(cta.total(m, r1 + 4, bias != nullptr));
  float o1 = x1, o2 = x2;
  if (rotate) {  // q or k
    c = bf16_round(c);
    s = bf16_round(s);
    const float a = bf16_round(__fmul_rn(x1, c)), b = bf16_round(__fmul_rn(x2, s));
    const float cc = bf16_round(__fmul_rn(x2, c)), dd = bf16_round(__fmul_rn(x1, s));
    o1 = __fsub_rn(a, b);
    o2 = __fadd_rn(cc, dd);
  }
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
  Cta cta(w, K, 0, x_stride, Rows{0, 4, 8}, smem, sc, xsc, bs, red);  // its token rows only (no weights staged)
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
