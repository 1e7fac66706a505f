// Paged decode attention with sinks for small batches (one query per request), the splits of a
// (request, KV head) one thread-block cluster that folds its partials in distributed shared memory.
// Compiled at run time by NVRTC (kernels/cuda_decode_attention.py says why and when it runs).
//
// Semantics are kernels.attention.sink_attention_ref for the last position of each request: keys at
// positions >= len - 1 - window_left (all for full layers), scores x sm_scale, a float32 softmax
// whose denominator also holds the head's sink logit (its value vector is zero), output in bf16.
//
// Grid (C, requests, KV heads x G), clusters of (C, 1, 1): up to G clusters a (request b, KV head g),
// of which a request busies as many as its 128-key blocks fill (the engine launches G = 1). Among the
// request's busy CTAs, CTA k takes the blocks k, k + busy CTAs, ... Each of its 4 warps owns 32 keys
// of a block (the rows its own lanes copy, so the warps pipeline their copies and sums independently,
// without CTA barriers) and keeps its own online softmax (max, sum, unnormalised output) over them for
// the GROUP query heads that share the KV head: S = q K^T and O += P V as mma.sync m16n8k16 (bf16 in, float32
// accumulate) with the heads as A's rows 0-7, K and V read from shared memory by ldmatrix (K as is,
// V transposed). The block's key rows are copied in by cp.async, 16 bytes a lane, each warp its own
// 32 rows; the 16-byte chunks of row r are stored at chunk c ^ (r & 7) so that the ldmatrix reads of
// 8 rows hit 8 distinct bank groups.
//
// Reads ahead of the PDL wait (kernels/pdl.py): the request's length, its page-table entries and the
// keys and values of the CTA's first STAGES blocks are staged before the step or cached by earlier
// steps, so they are requested before `griddepcontrol.wait` and stream while the kernel before (the
// QKV projection that writes this step's key) runs. After the wait the thread that holds the step's
// own key row (position len - 1) re-reads it, then q is read (both through L2 only). With
// DA_EARLY_LAUNCH the next kernel may launch at this kernel's start, not after its wait (kernels/pdl.py's
// exception: the output projection after it reads nothing but weights ahead of its own wait).
//
// Folding, in a fixed order whatever the timing (so a replayed graph equals the eager step bit for
// bit): the 4 warps' partials in the CTA's shared memory, then, with C > 1, the cluster's C partials
// read through distributed shared memory by the thread that owns each (head, dim) output, with the
// sink; with C = 1 (windowed layers: one block) the CTA writes its output directly. A request that
// busies several clusters folds their partials as the Triton kernel folds its splits: stored to the
// scratch, an arrival counter, and the last CTA to arrive adds them in cluster order with the sink.
//
// Macros set by the compiler call: DA_GROUP (query heads a KV head, <= 8), DA_PAGE (tokens a page),
// DA_C (CTAs a cluster), DA_STAGES (blocks a CTA holds in shared memory at once), DA_LOOK (blocks
// ahead of the copies whose page-table entries are requested), DA_EARLY_LAUNCH (1: the next kernel
// launches at this one's start), DA_TRACE (1: the timing build, whose
// last argument is a u64 buffer of TRACE_WORDS words a warp: see `Trace` below; bench/attention_trace).
// Integer arguments are 32-bit (kernels/pdl.launch_cuda passes ints so); a page's byte offset is taken
// in 64 bits, offsets inside a page in 32.

#include "cuda_common.cuh"

#define D 64
#define GROUP DA_GROUP
#define PAGE DA_PAGE
#define C DA_C
#define STAGES DA_STAGES
#define LOOK DA_LOOK                  // blocks ahead whose page-table entries a lane holds
#define BLOCK 128                     // keys a block
#define WARPS 4
#define THREADS (WARPS * 32)          // a warp copies and sums 32 key rows of a block
#define ROW_BYTES (D * 2)             // a key row: 128 bytes, 8 chunks of 16
#define SLOT_BYTES (BLOCK * ROW_BYTES)  // K (or V) of one block: 16 KB
#define OUTS (GROUP * D)              // outputs of a (request, KV head)
#define NEG_INF (-__int_as_float(0x7f800000u))  // (NVRTC has no math.h INFINITY)

#ifndef DA_TRACE
#define DA_TRACE 0
#endif
#ifndef DA_EARLY_LAUNCH
#define DA_EARLY_LAUNCH 0
#endif
#if DA_TRACE
// A warp's record (%globaltimer ns unless said): its start, its first blocks' copies issued, the PDL
// wait passed, then for each of its first TRACE_BLOCKS blocks the copies landed (the wait_group
// passed) and the sums done (the block's slot handed back to the copies), then the CTA's warps folded,
// its end, as plain numbers its SM and its blocks, and last the cluster's partials met (its first
// cluster barrier passed).
enum Trace { T_START, T_ISSUED, T_PDL, T_BLOCKS, TRACE_BLOCKS = 16, T_FOLDED = T_BLOCKS + 2 * TRACE_BLOCKS, T_END,
             T_SM, T_MY_BLOCKS, T_MET, TRACE_WORDS = 40 };
#define TRACE_PARAM , unsigned long long* __restrict__ trace
#define TRACE(w, v) do { if (lane == 0) trace_rec[w] = (v); } while (0)
#define TRACE_BLOCK(j, e) do { if ((j) < TRACE_BLOCKS) TRACE(T_BLOCKS + 2 * (j) + (e), now_ns()); } while (0)
#else
#define TRACE_PARAM
#define TRACE(w, v) do { } while (0)
#define TRACE_BLOCK(j, e) do { } while (0)
#endif

static_assert(GROUP >= 1 && GROUP <= 8, "the heads of a KV head are the mma's rows 0-7");
static_assert(LOOK >= 1, "a block's page-table entries are requested before its copies");
static_assert(BLOCK == THREADS, "each warp copies and sums its own 32 rows of a block");

// byte offset of chunk c of key row r inside a slot
__device__ __forceinline__ int swz(int r, int c) { return r * ROW_BYTES + ((c ^ (r & 7)) << 4); }

__device__ __forceinline__ void ldsm_x4(u32 addr, u32 r[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32 r[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct Shared {
  float wm[WARPS][8], wl[WARPS][8], wo[WARPS][8][D];  // the warps' partials
  float cm[8], cl[8], co[8][D];                       // the CTA's partial (read by the cluster)
  int last;                                           // this CTA is the request's last to arrive
};

// out[b, g * GROUP + h, :] for the grid's (b, g). q [T, Hq, D] (strides in elements), kv_cache
// [pages, 2, PAGE, Hkv, D] bf16 (strides of page, K/V and token in elements), block_tables int32
// [T, stride_table], seq_lens int32 [T], sinks float32 [Hq] (raw logits), out [T, Hq, D] bf16.
// qk_scale = sm_scale * log2(e); window_left < 0: every key. Used only by requests that busy several
// clusters: part_o [T, Hkv, part_splits, part_rows, D], part_m / part_l [T, Hkv, part_splits,
// part_rows] float32 (the Triton kernel's DecodeScratch) and count int32 [T * Hkv], zero between launches.
extern "C" __global__ void __launch_bounds__(THREADS, 3)  // 3 a SM: as many as the shared memory of 2 stages allows
decode_attention(const u16* __restrict__ q, int stride_qt, int stride_qh, const u16* __restrict__ kv,
                 int stride_page, int stride_kv, int stride_tok, const int* __restrict__ block_tables,
                 int stride_table, const int* __restrict__ seq_lens, const float* __restrict__ sinks,
                 u16* __restrict__ out, int stride_ot, int stride_oh, double qk_scale_d, int window_left,
                 float* __restrict__ part_o, float* __restrict__ part_m, float* __restrict__ part_l,
                 int* __restrict__ count, int part_splits, int part_rows, int num_kv_heads TRACE_PARAM) {
  if (DA_EARLY_LAUNCH) launch_dependents();  // the next kernel may be placed now (its wait still follows ours)
  extern __shared__ __align__(128) unsigned char smem[];  // STAGES x (K slot, V slot), then Shared
  Shared& sh = *reinterpret_cast<Shared*>(smem + STAGES * 2 * SLOT_BYTES);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tig = lane & 3;
  // z = KV head + Hkv x cluster group: every request's first clusters come first in launch order
  const int s = blockIdx.x, b = blockIdx.y, g = blockIdx.z % num_kv_heads, cl_group = blockIdx.z / num_kv_heads;
  const float qk_scale = (float)qk_scale_d;
#if DA_TRACE
  unsigned long long* trace_rec =
      trace + (((u64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (WARPS * TRACE_WORDS) +
      warp * TRACE_WORDS;
  TRACE(T_START, now_ns());
#endif

  // ---- ahead of the PDL wait: the request's keys, its table entries and the first STAGES blocks
  const int seq_len = load_early_s32(seq_lens + b);  // >= 1, staged before the step
  const int start = window_left >= 0 ? max(seq_len - 1 - window_left, 0) : 0;
  const int n_blocks = (seq_len - start + BLOCK - 1) / BLOCK;
  // the clusters this request needs (at most the grid's): the others leave at once
  const int groups = min((int)gridDim.z / num_kv_heads, (n_blocks + C - 1) / C);
  if (cl_group >= groups) return;  // the whole cluster: no barrier waits for it
  const int k = cl_group * C + s, ctas = groups * C;  // this CTA among the request's busy ones
  const int my_blocks = k < n_blocks ? (n_blocks - 1 - k) / ctas + 1 : 0;
  const int* table = block_tables + (i64)b * stride_table;
  const unsigned char* kv_bytes = reinterpret_cast<const unsigned char*>(kv);
  const u32 slots = smem_addr(smem);

  // Lane (warp w, lane) copies 16-byte chunk `lane & 7` of the 8 key rows w * 32 + (lane >> 3) + 4 i of a
  // block (i < 8): a warp instruction reads 4 whole 128-byte rows, and a warp copies exactly the 32
  // rows it sums over. A row's source is its page's address plus 32-bit offsets (`applies` keeps the
  // page and K/V strides and a page's token rows under 2 GB), and rows past the request's last key are
  // zero-filled by their copy (source size 0) with the last key's page as a valid address, so that a
  // block's copies take no branch and no 64-bit product a row: the copies' address arithmetic was most
  // of a warp's instructions a block (Nsight Compute, docs/kernels.md).
  const int row0 = warp * 32 + (lane >> 3), chunk = lane & 7;
  const u32 page_bytes = 2u * (u32)stride_page, tok_bytes = 2u * (u32)stride_tok, v_bytes = 2u * (u32)stride_kv;
  const u32 lane_bytes = 2u * (u32)(g * D) + 16u * (u32)chunk;
  // the page-table entries of a lane's rows in the CTA's block j (0 past the CTA's blocks)
  auto pages_of = [&](int j, int pg[8]) {
    const int key0 = start + (k + j * ctas) * BLOCK + row0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      pg[i] = j < my_blocks ? load_early_s32(table + (u32)min(key0 + 4 * i, seq_len - 1) / PAGE) : 0;
  };
  // the entries of blocks j + 1 .. j + LOOK while block j's copies are issued: ahead[0] the next
  int ahead[LOOK][8];
#pragma unroll
  for (int t = 0; t < LOOK; ++t) pages_of(t, ahead[t]);
  // copy (or zero, past the request's last key) the lane's chunks of block j into its slot, and
  // request the entries of block j + LOOK (so that a refill waits on no round trip of its own);
  // one commit group a block, empty ones included, so that group j is always the j-th committed
  auto issue = [&](int j) {
    if (j < my_blocks) {
      const int key0 = start + (k + j * ctas) * BLOCK + row0;
      const u32 kslot = slots + (j % STAGES) * 2 * SLOT_BYTES;
      int page[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) page[i] = ahead[0][i];
#pragma unroll
      for (int t = 0; t + 1 < LOOK; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) ahead[t][i] = ahead[t + 1][i];
      pages_of(j + LOOK, ahead[LOOK - 1]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int key = key0 + 4 * i;
        const u32 size = key < seq_len ? 16u : 0u;
        const unsigned char* src = kv_bytes + (u64)(u32)page[i] * page_bytes +
                                   ((u32)min(key, seq_len - 1) % PAGE * tok_bytes + lane_bytes);
        const u32 kdst = kslot + swz(row0 + 4 * i, chunk);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(kdst), "l"(src), "r"(size) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(kdst + SLOT_BYTES), "l"(src + v_bytes),
                     "r"(size) : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int j = 0; j < STAGES; ++j) issue(j);
  TRACE(T_ISSUED, now_ns());
  TRACE(T_SM, sm_id());
  TRACE(T_MY_BLOCKS, my_blocks);
  // the QKV projection before this kernel wrote q and the step's key
  if (DA_EARLY_LAUNCH) wait_pdl(); else enter_pdl();
  TRACE(T_PDL, now_ns());

  // q as A (rows = heads gq < GROUP, rows 8-15 zero): k-step ks holds dims 16 ks + 2 tig (+1) and + 8
  u32 qa0[D / 16], qa2[D / 16];
  {
    const u16* qrow = q + (i64)b * stride_qt + (i64)(g * GROUP + gq) * stride_qh;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qa0[ks] = gq < GROUP ? load_early_u32(qrow + 16 * ks + 2 * tig) : 0u;
      qa2[ks] = gq < GROUP ? load_early_u32(qrow + 16 * ks + 8 + 2 * tig) : 0u;
    }
  }

  float m = NEG_INF, l = 0.f;  // row gq of this warp's online softmax (l: this lane's share)
  float acc[D / 8][2];           // O[gq, 8 dt + 2 tig + e]
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) acc[dt][0] = acc[dt][1] = 0.f;

  for (int j = 0; j < my_blocks; ++j) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");  // block j's copies have landed
    TRACE_BLOCK(j, 0);
    const int lo = start + (k + j * ctas) * BLOCK;
    const u32 kslot = slots + (j % STAGES) * 2 * SLOT_BYTES, vslot = kslot + SLOT_BYTES;
    const int own = seq_len - 1 - lo - row0;  // the step's own key, copied before it was written
    if (j < STAGES && own >= 0 && own < 32 && (own & 3) == 0) {
      const unsigned char* src = kv_bytes + 2 * ((i64)load_early_s32(table + (seq_len - 1) / PAGE) * stride_page +
                                                 (i64)((seq_len - 1) % PAGE) * stride_tok + (i64)g * D) + 16 * chunk;
      unsigned char* kdst = smem + (j % STAGES) * 2 * SLOT_BYTES + swz(row0 + own, chunk);
      *reinterpret_cast<U4*>(kdst) = load_early(src);
      *reinterpret_cast<U4*>(kdst + SLOT_BYTES) = load_early(src + 2 * (i64)stride_kv);
    }
    __syncwarp();  // the warp's 32 rows are the ones its own lanes copied: no CTA barrier

    // S = q K^T over the warp's 32 keys: 4 tiles of 8 keys; one ldmatrix.x4 gives two k-steps' B
    float sc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
      const int r = warp * 32 + nt * 8 + (lane & 7);
#pragma unroll
      for (int kp = 0; kp < D / 32; ++kp) {
        u32 bk[4];
        ldsm_x4(kslot + swz(r, 4 * kp + (lane >> 3)), bk);
        mma_rows0_7(sc[nt], qa0[2 * kp], qa2[2 * kp], bk[0], bk[1]);
        mma_rows0_7(sc[nt], qa0[2 * kp + 1], qa2[2 * kp + 1], bk[2], bk[3]);
      }
    }
    // online softmax of row gq over these keys (masked past the request's last key)
    float x[4][2], mx = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = lo + warp * 32 + nt * 8 + 2 * tig + e;
        x[nt][e] = key < seq_len ? sc[nt][e] * qk_scale : NEG_INF;
        mx = fmaxf(mx, x[nt][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == NEG_INF ? 0.f : m_new;
    const float alpha = exp2_approx(m - m_use);
    float p[4][2], psum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[nt][e] = exp2_approx(x[nt][e] - m_use);
        psum += p[nt][e];
      }
    l = l * alpha + psum;
    m = m_new;
    // P as A: k-step kk over keys 16 kk .. 16 kk + 15 of the warp's 32
    u32 pa0[2], pa2[2];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      pa0[kk] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
      pa2[kk] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    }
    // O += P V: 8 tiles of 8 dims; one ldmatrix.x4.trans gives both k-steps' B of a tile
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      float d4[4] = {acc[dt][0] * alpha, acc[dt][1] * alpha, 0.f, 0.f};
      u32 bv[4];
      const int r = warp * 32 + (lane >> 3) * 8 + (lane & 7);
      ldsm_x4_trans(vslot + swz(r, dt), bv);
      mma_rows0_7(d4, pa0[0], pa2[0], bv[0], bv[1]);
      mma_rows0_7(d4, pa0[1], pa2[1], bv[2], bv[3]);
      acc[dt][0] = d4[0];
      acc[dt][1] = d4[1];
    }
    __syncwarp();  // the warp's reads of its rows are done before its lanes refill them
    TRACE_BLOCK(j, 1);
    issue(j + STAGES);
  }

  // ---- the warps' partials, then the CTA's
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (tig == 0) {
    sh.wm[warp][gq] = m;
    sh.wl[warp][gq] = l;
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    sh.wo[warp][gq][8 * dt + 2 * tig] = acc[dt][0];
    sh.wo[warp][gq][8 * dt + 2 * tig + 1] = acc[dt][1];
  }
  __syncthreads();
  TRACE(T_FOLDED, now_ns());
  const int h = tid >> 4, d0 = (tid & 15) * 4;  // this thread's head and 4 dims of the CTA's fold
  float cm = NEG_INF;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) cm = fmaxf(cm, sh.wm[w][h]);
  const float cu = cm == NEG_INF ? 0.f : cm;
  float cl = 0.f, co[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const float f = exp2_approx(sh.wm[w][h] - cu);
    cl += sh.wl[w][h] * f;
#pragma unroll
    for (int e = 0; e < 4; ++e) co[e] += sh.wo[w][h][d0 + e] * f;
  }

  if constexpr (C == 1) {
    if (h < GROUP) {  // the request's only CTA: fold in the sink and write
      const float sk = sinks[g * GROUP + h] * 1.4426950408889634f;
      const float mf = fmaxf(cm, sk);
      const float f = exp2_approx(cm - mf);
      const float inv = f / (cl * f + exp2_approx(sk - mf));
      u16* o = out + (i64)b * stride_ot + (i64)(g * GROUP + h) * stride_oh + d0;
      reinterpret_cast<u32*>(o)[0] = pack_bf16(co[0] * inv, co[1] * inv);
      reinterpret_cast<u32*>(o)[1] = pack_bf16(co[2] * inv, co[3] * inv);
    }
  } else {
    if ((tid & 15) == 0) {
      sh.cm[h] = cm;
      sh.cl[h] = cl;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sh.co[h][d0 + e] = co[e];
    cluster_sync();  // every CTA's partial is in its shared memory
    TRACE(T_MET, now_ns());
    // the cluster's partials, one output (head, dim) a thread: with the sink into `out` where this
    // cluster is the request's only one, else the cluster's partial into global memory
    const i64 slot = ((i64)(b * num_kv_heads + g) * part_splits + cl_group) * part_rows;
    for (int o = s * THREADS + tid; o < OUTS; o += C * THREADS) {
      const int oh = o / D, od = o % D;
      const float sk = groups == 1 ? sinks[g * GROUP + oh] * 1.4426950408889634f : NEG_INF;
      float mc[C];
      float mf = sk;
#pragma unroll
      for (int r = 0; r < C; ++r) {
        mc[r] = load_peer(&sh.cm[oh], r);
        mf = fmaxf(mf, mc[r]);
      }
      const float mu = mf == NEG_INF ? 0.f : mf;
      float den = exp2_approx(sk - mu), val = 0.f;
#pragma unroll
      for (int r = 0; r < C; ++r) {
        const float f = exp2_approx(mc[r] - mu);
        den += load_peer(&sh.cl[oh], r) * f;
        val += load_peer(&sh.co[oh][od], r) * f;
      }
      if (groups == 1) {
        out[(i64)b * stride_ot + (i64)(g * GROUP + oh) * stride_oh + od] = to_bf16(val / den);
      } else {
        part_o[(slot + oh) * D + od] = val;
        if (od == 0) {
          part_m[slot + oh] = mf;
          part_l[slot + oh] = den;
        }
      }
    }
    cluster_sync_relaxed();  // peers' shared memory stays alive until every read of it is done
    if (groups > 1) {  // long requests: the last of the request's CTAs to arrive folds the clusters' partials
      __threadfence();
      __syncthreads();
      if (tid == 0) {
        const int arrived = atomicAdd(count + b * num_kv_heads + g, 1);
        sh.last = arrived == ctas - 1;
        if (sh.last) count[b * num_kv_heads + g] = 0;  // for the next launch
        __threadfence();
      }
      __syncthreads();
      if (sh.last) {
        const i64 first = (i64)(b * num_kv_heads + g) * part_splits * part_rows;
        for (int o = tid; o < OUTS; o += THREADS) {
          const int oh = o / D, od = o % D;
          const float sk = sinks[g * GROUP + oh] * 1.4426950408889634f;
          float mf = sk;
          for (int r = 0; r < groups; ++r) mf = fmaxf(mf, load_early_f32(part_m + first + r * part_rows + oh));
          float den = exp2_approx(sk - mf), val = 0.f;
          for (int r = 0; r < groups; ++r) {  // in cluster order: the same sums whatever the arrival order
            const i64 at = first + r * part_rows + oh;
            const float f = exp2_approx(load_early_f32(part_m + at) - mf);
            den += load_early_f32(part_l + at) * f;
            val += load_early_f32(part_o + at * D + od) * f;
          }
          out[(i64)b * stride_ot + (i64)(g * GROUP + oh) * stride_oh + od] = to_bf16(val / den);
        }
      }
    }
  }
  TRACE(T_END, now_ns());
}
