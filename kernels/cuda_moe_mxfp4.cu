// MXFP4 expert GEMV for decode batches on the tensor cores (mma.sync m16n8k16, f16 in (bf16 in launches
// folded in bf16), float32 accumulate). Compiled at run time by NVRTC (kernels/cuda_moe_mxfp4.py).
//
// Kernels: mx_gate_up and mx_down (a CTA a tile), and with MX_RESIDENT mx_gate_up_resident (one token's gate/up
// on a grid the SMs hold at once, each CTA streaming several tiles; below mx_gate_up).
//
// Macros set by the compiler call: MX_KG (32-groups along K), MX_NW (warps per CTA), MX_KSPLIT (warps
// that split one 16-row tile's K), MX_D (K steps per register batch), MX_MIN_CTAS (0, or CTAs an SM
// must hold at once: a register bound), MX_SLOTS (most (token, expert) pairs
// one CTA serves: they share the expert), MX_TRACE (1: each kernel takes a last argument, a u64
// buffer of 4 words per CTA that gets its start / sums done / end %globaltimer and its SM; for
// bench/moe_trace.py, never in the engine), MX_RESIDENT (1: also mx_gate_up_resident), MX_ZERO_ROW (use_batch),
// MX_EVICT_FIRST (load_weights),
// MX_SHARED_BYTES (the launch's dynamic
// shared memory, checked against the staging layout), and the packed word layout of kernels/mxfp4.py
// (one source for every decode): MX_LOW_MASK, MX_HIGH_SHL_MASK, MX_HIGH_SHR_MASK.
//
// A CTA computes ROWS weight rows [ROWS * blockIdx.x, +ROWS) of one expert for the up-to-MX_SLOTS pairs of
// its item (blockIdx.y): a pair (per-pair launches) or a block of the routing layout (pairs grouped
// by expert). The rows are the mma's M; its N = 8 columns are (token t of 2, group slot q of 4):
// a K step of 4 groups puts group G + q in the 16 k of each mma that come from the quad's thread
// q (each thread of a quad loads one whole 16-byte group of two rows), so column (t, q) sees only
// group G + q of token t (the B operand is zero elsewhere) and the mma keeps every group's sum apart
// in float32: each is multiplied by its own scale afterwards, and the quad's columns are added at
// the end. Weights decode from the packed word layout (kernels/mxfp4.py: a mask, or two shifts and
// masks, give four e4m3 bytes, which Hopper's `cvt.rn.f16x2.e4m3x2` turns into f16 pairs of e2m1 *
// 2^-6, exactly) straight into the mma's A registers: 9 instructions a word of 8 values, where the
// bf16 pairs of the earlier layout took 13 integer ones (tests/gpu/test_moe_mxfp4_mma_gpu.py checks
// every code at the scale extremes). The activations are staged in f16, each group of 32 times the
// power of two that takes its largest |x| into [2^14, 2^15) (stage_rows), so every product is exact in
// float32 and a group's sum times 2^(e - 141) (the activations' factor undone) times 2^(s - 121) is
// its value.
//
// Both kernels take `enter_pdl()`: launched with programmatic dependent launch (kernels/pdl.py), a
// CTA may be placed while the kernel before it still runs; it waits there until that kernel is done,
// then lets the next kernel launch. gate/up takes it first, except that with MX_EARLY_X a per-pair
// launch (SLOTS 1) stages its token's row ahead of it: the caller vouches that the row was written
// before the routing (the launch before gate/up), so by kernels/pdl.py's contract it is final. down
// reads only what was written before gate/up ran ahead of the wait (with MX_EARLY_DOWN: its
// routing, from L2, and its first batch of weights; with MX_EARLY_BIAS also its routing weights
// and bias), then waits before it stages gate/up's activations. MX_EARLY_BIAS: each kernel's
// epilogue bias is requested with its weights, not after its sums.
//
// Each warp owns a 16-row tile (or a share of its K steps) and streams its weights in batches of D
// K steps, double-buffered in registers: one batch loads while the other feeds the mmas. The token
// rows are staged in shared memory once per CTA; the K shares are added in a fixed order
// (deterministic).
//
// MX_FOLD (grouped launches, SLOTS a multiple of 8): each decoded pair is multiplied by its group's
// factor 2^(s - 1) in bf16 before the mma (exact while the factor is a bf16 and every product a
// normal one: scale bytes 2 .. 128, MxExperts.fold_exact), so the mma's N = 8 columns are 8 pairs of
// the item instead of (token pair, group slot): one mma per packed word serves 8 pairs, not 2, no
// per-K-step float32 rescale is left, and the activations need no scaling: each thread reads its
// pair's bf16 values straight from global memory (L1) as the mma's B, nothing is staged, and no shared
// memory bounds how many CTAs an SM holds. So these launches take the weights as bf16 pairs of e2m1 *
// 2^-126 (the e4m3 bytes spread into bf16 halves: 21 instructions a word) and mma in bf16.
// MX_FOLD 2: the same in f16, for experts whose scale bytes all lie in 104 .. 136
// (MxExperts.fold_f16_exact): the unfolded decode (Hopper's e4m3 -> f16 conversion, 9 instructions a
// word) times 2^(s - 121) in f16 gives e2m1 * 2^(s - 127), an f16 for those s (subnormal down to
// 2^-24). B must then be f16 too: gate/up reads its tokens as the routing launch writes them in f16
// (kernels/triton_moe.py align_routing's x_f16: each row times
// the power of two that takes its largest |x| into [2^14, 2^15), undone on the sums), down reads the
// f16 activations times 2^act_shift that gate/up writes for unfolded launches.

#include "cuda_common.cuh"
#include "mxfp4_packed.cuh"

#define KG MX_KG
#define NW MX_NW
#define SLOTS MX_SLOTS
#define TP ((SLOTS + 1) / 2)          // token pairs per item
#define CHUNKS ((KG + 3) / 4)         // K steps of 4 groups
#define KSPLIT MX_KSPLIT                // warps that share a 16-row tile, splitting its K steps
#define D MX_D                          // K steps a warp loads at a time (two such batches in flight)
#define ROWS (16 * NW / KSPLIT)         // weight rows per CTA
#define SCALE_WORDS (((KG + 15) / 16) * 4)  // a row's scale bytes, padded to 16 groups, as words
#define XROW (CHUNKS * 64 + 4)        // a staged token row in words: whole K steps, zero past group KG
                                      // (+4: fewer bank conflicts)
#define XF_WORDS (CHUNKS * 4)         // the staged groups' factors (floats; zero past group KG)
// MX_ZERO_ROW: threads whose B operand is zero read it from a row of zeros (use_batch)
#ifndef MX_ZERO_ROW
#define MX_ZERO_ROW 0
#endif
#define XZERO_AT (((SLOTS * XROW + XF_WORDS) + 31) / 32 * 32)  // the row of zeros, at bank 0
#define XZERO_WORDS (MX_ZERO_ROW ? CHUNKS * 64 + 32 : 0)

__device__ __forceinline__ U4 load_cached(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}


// MX_EVICT_FIRST: the expert weights' lines are the first L2 gives up for room. A step reads them once, so
// kept they only push out what a later kernel will read (the next layer's weights requested into L2 ahead
// of it, the KV cache); the loads are the same otherwise.
#ifndef MX_EVICT_FIRST
#define MX_EVICT_FIRST 0
#endif

// 16 bytes of a weight stream: load_early ahead of the PDL wait (EARLY), else load_stream, either with
// the L2 evict-first policy under MX_EVICT_FIRST
template <bool EARLY>
__device__ __forceinline__ U4 load_weights(const U4* p) {
#if MX_EVICT_FIRST
  u64 policy;  // not volatile: one createpolicy serves every load of the thread
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  U4 v;
  if constexpr (EARLY)
    asm volatile("ld.global.cg.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
  return v;
#else
  return EARLY ? load_early(p) : load_stream(p);
#endif
}

// l2_bytes > 0: the grid requests l2_next's l2_bytes (weights a later kernel reads: never written during the
// step, so ahead of the PDL wait) into L2, one bulk prefetch of its share from each CTA's first thread
__device__ __forceinline__ void request_l2(const void* l2_next, int l2_bytes) {
  if (l2_bytes > 0 && threadIdx.x == 0) prefetch_l2_share(l2_next, (unsigned)l2_bytes);
}

// Bytes (sel) of an e4m3 word as a bf16x2 of e2m1 * 2^-126: the bytes into the high byte of each half
// (sign at bit 15, magnitude at 12..10), the magnitude moved down to 8..6.
__device__ __forceinline__ u32 bf16_pair(u32 e4m3, u32 sel) {
  const u32 x = __byte_perm(e4m3, 0u, sel);
  return (x & 0x80008000u) | ((x >> 4) & 0x01C001C0u);
}

// The same pairs as decode_word as bf16x2 of e2m1 * 2^-126 (the folded launches, which scale them in
// bf16; +-0.5 are bf16 subnormals, which the tensor cores take exactly).
__device__ __forceinline__ void decode_word_bf16(u32 w, u32 p[4]) {
  u32 low, high;
  e4m3_words(w, low, high);
  p[0] = bf16_pair(low, 0x1404u);  // bytes 0, 1
  p[1] = bf16_pair(low, 0x3424u);  // bytes 2, 3
  p[2] = bf16_pair(high, 0x1404u);
  p[3] = bf16_pair(high, 0x3424u);
}

// Scale byte s -> its group's factor 2^(s - 121) (the decode's 2^-6 undone): float bits
// (s + 6) << 23, a normal float for every s <= 192 the packed layout allows.
__device__ __forceinline__ float group_scale(u32 s) { return __int_as_float(((s & 0xFFu) + 6u) << 23); }

// bf16x2 b times up (a power of two), as f16x2
__device__ __forceinline__ u32 f16x2_scaled(u32 b, float up) {
  return f16x2(__int_as_float(b << 16) * up, __int_as_float(b & 0xFFFF0000u) * up);
}

#ifndef MX_TRACE
#define MX_TRACE 0
#endif
#ifndef MX_EARLY_DOWN
#define MX_EARLY_DOWN 0
#endif
#ifndef MX_EARLY_X
#define MX_EARLY_X 0
#endif
// MX_EARLY_BIAS: each kernel requests its epilogue's bias (and down its routing weights) with its
// weights, not after its sums (one memory round trip less at each CTA's end)
#ifndef MX_EARLY_BIAS
#define MX_EARLY_BIAS 0
#endif
// MX_MIN_CTAS > 0: ptxas keeps registers low enough for that many CTAs per SM (one wave of a
// one-token launch instead of a second, near-empty one)
#ifndef MX_MIN_CTAS
#define MX_MIN_CTAS 0
#endif
#if MX_MIN_CTAS > 0
#define MX_BOUNDS __launch_bounds__(NW * 32, MX_MIN_CTAS)
#else
#define MX_BOUNDS __launch_bounds__(NW * 32)
#endif
#define GATE_UP_EARLY_X (MX_EARLY_X && SLOTS == 1)  // per-pair gate/up: its token row before the wait
// MX_CLUSTER_SUM (per-pair launches only): down is launched in clusters of one token's top_k pairs
// (cluster dims (1, top_k, 1)); the CTAs of a cluster add their rows through distributed shared
// memory instead of float32 partials in global memory, a fence and an arrival counter
#ifndef MX_CLUSTER_SUM
#define MX_CLUSTER_SUM 0
#endif
static_assert(!MX_CLUSTER_SUM || SLOTS == 1, "the cluster sum serves per-pair launches");
static_assert((NW * 32) % ROWS == 0, "a thread's epilogue row must be the same for every pair");
#if MX_TRACE
#define TRACE_PARAM , unsigned long long* __restrict__ trace
// word w (0 start, 1 sums done, 2 end, 3 SM) of this CTA's trace record
__device__ __forceinline__ void trace_mark(unsigned long long* trace, int w) {
  if (threadIdx.x == 0) {
    const unsigned long long v = w == 3 ? sm_id() : now_ns();
    trace[(blockIdx.y * (unsigned long long)gridDim.x + blockIdx.x) * 4 + w] = v;
  }
}
#define TRACE(w) trace_mark(trace, w)
#define TRACE_END() do { __syncthreads(); trace_mark(trace, 2); } while (0)  // the CTA's last store issued
#else
#define TRACE_PARAM
#define TRACE(w)
#define TRACE_END()
#endif

static_assert(SLOTS <= 32, "an item's pairs are read by the first warp");
struct Item {
  int expert;
  int n;             // pairs in the item
  int slot[SLOTS];   // their pair ids (token * top_k + k)
  const U4* row[SLOTS];  // their activation rows
  u16 weight[SLOTS];     // their routing weights (bf16), where read_item was given them
};

// The item's expert and pairs: per-pair launches (item_expert null) have one pair, blockIdx.y;
// grouped launches read the routing layout (kernels/triton_moe.py align_routing: an expert's pairs
// first in its blocks, -1 after them; block_expert -1 for unused blocks). A pair's activation row
// is row slot / row_div of `in` (row stride stride_in elements). Read from L2 (`ld.global.cg`): down
// may read them before its PDL wait, when no line of this SM's L1 may stand in for them.
__device__ void read_item(Item& it, const i64* pair_expert, const int* item_expert, const int* item_slots,
                          const u16* in, int stride_in, int row_div, const u16* route_weight = nullptr) {
  const int b = blockIdx.y;
  if (threadIdx.x < SLOTS) {
    int slot;
    if (item_expert == nullptr) {
      slot = threadIdx.x == 0 ? b : -1;
      if (threadIdx.x == 0) it.expert = (int)__ldcg(pair_expert + b);
    } else {
      slot = __ldcg(item_slots + b * SLOTS + threadIdx.x);
      if (threadIdx.x == 0) it.expert = __ldcg(item_expert + b);
    }
    it.slot[threadIdx.x] = slot;
    if (route_weight != nullptr) it.weight[threadIdx.x] = slot < 0 ? (u16)0 : __ldcg(route_weight + slot);
    it.row[threadIdx.x] = reinterpret_cast<const U4*>(in + (i64)(slot < 0 ? 0 : slot / row_div) * stride_in);
    // pairs come first in a block: the count is the number of non-negative slots
    const unsigned live = __ballot_sync(SLOTS == 32 ? 0xFFFFFFFFu : (1u << SLOTS) - 1u, slot >= 0);
    if (threadIdx.x == 0) it.n = __popc(live);
  }
  __syncthreads();
}

// Staged rows: SLOTS rows of XROW words (f16 pairs), then the groups' factors (XF_WORDS floats), then
// XZERO_WORDS zeros at XZERO_AT: what a thread reads as its B operand where that is zero (use_batch).
__device__ __forceinline__ float* group_factors(u32* xs) { return reinterpret_cast<float*>(xs + SLOTS * XROW); }
__device__ __forceinline__ const float* group_factors(const u32* xs) {
  return reinterpret_cast<const float*>(xs + SLOTS * XROW);
}


// Values staged in f16 at one power of two: e, the biased exponent of their largest |x| (m: its float
// bits), at least 15 so that both factors are normal floats; 2^(141 - e) takes that |x| into
// [2^14, 2^15), 2^(e - 141) undoes it.
__device__ __forceinline__ u32 staged_exponent(u32 m) { return max(m >> 23, 15u); }
__device__ __forceinline__ float stage_factor(u32 e) { return __int_as_float((268u - e) << 23); }
__device__ __forceinline__ float unstage_factor(u32 e) { return __int_as_float((e - 14u) << 23); }
// e of a group whose 16-byte chunks sit in 4 consecutive lanes, from each lane's max_bits: two shuffles
__device__ __forceinline__ u32 group_exponent(u32 m) {
  m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
  m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
  return staged_exponent(m);
}
// a chunk of 8 bf16 values times `up` (stage_factor) as f16 pairs
__device__ __forceinline__ U4 staged_chunk(U4 v, float up) {
  return U4{f16x2_scaled(v.x, up), f16x2_scaled(v.y, up), f16x2_scaled(v.z, up), f16x2_scaled(v.w, up)};
}

// The item's activation rows (KG * 32 values each) into shared memory as f16, with the factor that
// multiplies each group's sums (use_batch). bf16 rows (gate/up's tokens): each group of 32 values
// times one power of two for all the rows, 2^(141 - e) with e the biased exponent of the group's
// largest |x| over the rows (at least 15, so that the factor is a float): that |x| lands in
// [2^14, 2^15), every bf16 of the group down to 2^-31 of it stays exact (8 significant bits; f16 is
// normal from 2^-14), and every product with a weight is exact in float32; the group's factor is
// 2^(e - 141). A group's 4 chunks of 16 bytes sit in 4 consecutive lanes (NW * 32 is a multiple of
// 4), which share e by two shuffles; with several rows a second pass converts the chunks it reads
// again (from L1). F16 rows (down's activations, which gate/up wrote as f16 times 2^act_shift) are
// copied as they are, every group's factor 2^-act_shift. The rows end in zeros up to whole K steps
// (groups KG .. 4 CHUNKS, whose factors are finite), so the K loop reads them without a test. EARLY:
// read before the CTA's PDL wait (load_early). Ends with the CTA synchronised.
template <bool EARLY, bool F16>
__device__ __forceinline__ void stage_rows(u32* xs, const U4* const* rows, int n, int act_shift = 0) {
  constexpr int per_row = CHUNKS * 16, in_row = KG * 4;  // 16-byte chunks, staged and in the row
  float* fx = group_factors(xs);
  const U4 zero = U4{0u, 0u, 0u, 0u};
  if constexpr (F16) {
    for (int c = threadIdx.x; c < per_row; c += NW * 32)
      for (int i = 0; i < n; i++)
        *reinterpret_cast<U4*>(xs + i * XROW + 4 * c) =
            c >= in_row ? zero : EARLY ? load_early(rows[i] + c) : load_cached(rows[i] + c);
    const float f = __int_as_float((127 - act_shift) << 23);
    for (int g = threadIdx.x; g < XF_WORDS; g += NW * 32) fx[g] = f;
  } else {
    for (int c0 = 0; c0 < per_row; c0 += NW * 32) {  // the same trip count in every lane: they shuffle
      const int c = c0 + (int)threadIdx.x;
      const bool in = c < per_row;
      U4 first = U4{0u, 0u, 0u, 0u};
      u32 m = 0u;
      for (int i = 0; i < n; i++) {
        if (c >= in_row) break;
        const U4 v = EARLY ? load_early(rows[i] + c) : load_cached(rows[i] + c);
        m = max(m, max_bits(v));
        if (i == 0) first = v;
      }
      const u32 e = group_exponent(m);
      const float up = stage_factor(e);
      if (!in) continue;
      if ((c & 3) == 0) fx[c >> 2] = unstage_factor(e);
      for (int i = 0; i < n; i++) {
        const U4 v = i == 0 || c >= in_row ? first : (EARLY ? load_early(rows[i] + c) : load_cached(rows[i] + c));
        *reinterpret_cast<U4*>(xs + i * XROW + 4 * c) = staged_chunk(v, up);
      }
    }
  }
  if constexpr (XZERO_WORDS > 0)
    for (int w = threadIdx.x; w < XZERO_WORDS; w += NW * 32) xs[XZERO_AT + w] = 0u;
  __syncthreads();
}

// A warp's K steps, loaded D at a time into one of two register buffers while the other is used.
struct Batch {
  U4 wa[D], wb[D];  // rows row0 / row0 + 8: the thread's group (4c + tig) of each K step c
  u32 sa[D], sb[D];  // their rows' scale words (groups 4c .. 4c + 3)
};

// The packed layout stores each 16-row tile's groups tile-major (kernels/mxfp4.py TILE_ROWS): K step c is the
// 16 rows' 4 groups one after the other (row r's at 4 r, so a warp's step is 1 KB in one piece); where K is no
// multiple of 4 groups, the last step holds q = KG % 4 groups a row, row r's at 2 q (r % 8) + q (r / 8). A
// thread reads rows g (its lane's group of four) and g + 8: `tile_rows` is row g's group tig of step 0.
__device__ __forceinline__ const U4* tile_rows(const u32* tile, int g, int tig) {
  return reinterpret_cast<const U4*>(tile) + 4 * g + tig;
}

// EARLY: the batch is read before the CTA's PDL wait (load_early). s0, s1: rows g and g + 8's scale rows.
template <bool EARLY>
__device__ __forceinline__ void load_batch(Batch& b, const U4* rows, const u32* s0, const u32* s1, int first, int tig) {
#pragma unroll
  for (int j = 0; j < D; j++) {
    const int c = first + j * KSPLIT, grp = 4 * c + tig;
    b.wa[j] = b.wb[j] = U4{0u, 0u, 0u, 0u};
    b.sa[j] = b.sb[j] = 0u;
    if (c < CHUNKS) {
      if (grp < KG) {
        const bool part = KG % 4 != 0 && c == KG / 4;
        // the partial step: row g's groups at 2 (KG % 4) g, not 4 g (none to add at gpt-oss' KG % 4 = 2), row
        // g + 8's KG % 4 groups after them
        const U4* at = rows + 64 * c + (part ? (2 * (KG % 4) - 4) * (int)((threadIdx.x & 31) >> 2) : 0);
        b.wa[j] = load_weights<EARLY>(at);
        b.wb[j] = load_weights<EARLY>(at + (part ? KG % 4 : 32));
      }
      b.sa[j] = EARLY ? __ldcg(s0 + c) : __ldg(s0 + c);
      b.sb[j] = EARLY ? __ldcg(s1 + c) : __ldg(s1 + c);
    }
  }
}

// v, which the compiler may not rebuild from what it was made of: it stays in a register where ptxas
// would rather recompute it from the thread index at every use
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Where a thread reads its B operand for token pair p (token xi = 2 p + g / 4 of the item, group slot
// q = g % 4) and its columns' group factors (groups 4 c + 2 (tig % 2) + {0, 1}), as words into xs at
// the K step c the loop is at (advance moves them on). The B operand is nonzero only where q == tig
// (k runs over the thread's own group) and xi < n, and there it is the staged row at the thread's
// group. Elsewhere it is zero: without MX_ZERO_ROW the load is skipped (a predicate a step, and
// ptxas rebuilds the offsets from the thread index at every step rather than hold them); with it the
// thread reads the row of zeros, at word (4 xi + 8) % 32 of each 64 (a bank that the live threads of
// its quarter warp, row xi at banks 4 xi + {0, 16} + 4 v mod 32, do not read, and one word for all
// of them), and the offsets stay in registers: no per-step work, two registers more.
struct BRows {
  int at[TP];
  int fx;
  int n, g;  // the item's pairs and the thread's mma column (without MX_ZERO_ROW)
};

// zero_at: the row of zeros' word offset from the xs the batches read (the resident grid's token regions
// each read it at their own offset).
__device__ __forceinline__ BRows b_rows(int n, int g, int tig, int c, int zero_at = XZERO_AT) {
  BRows r;
  r.n = n, r.g = g;
#pragma unroll
  for (int p = 0; p < TP; p++) {
    const int xi = 2 * p + (g >> 2);
    const bool live = (g & 3) == tig && xi < n;
    r.at[p] = MX_ZERO_ROW ? opaque((live ? xi * XROW + 16 * tig : zero_at + ((4 * xi + 8) & 31)) + 64 * c) : 0;
  }
  r.fx = MX_ZERO_ROW ? opaque(SLOTS * XROW + 2 * (tig & 1) + 4 * c) : 0;
  return r;
}

__device__ __forceinline__ void advance(BRows& r, int steps) {
  if (!MX_ZERO_ROW) return;
#pragma unroll
  for (int p = 0; p < TP; p++) r.at[p] += 64 * steps;
  r.fx += 4 * steps;
}

// The mmas of one batch (its first K step `first`, where br points): acc[p][0 / 1] += this thread's
// share of rows row0 / row0 + 8 for token pair p (columns (t = tig / 2, q = 2 (tig % 2) + {0, 1}),
// each group times its scale).
__device__ __forceinline__ void use_batch(const Batch& b, int first, const u32* xs, const BRows& br, int ntp,
                                          int tig, float acc[TP][2]) {
#pragma unroll
  for (int j = 0; j < D; j++) {
    const int c = first + j * KSPLIT;
    if (c >= CHUNKS) break;
    const u32 ha = b.sa[j] >> (16 * (tig & 1)), hb = b.sb[j] >> (16 * (tig & 1));
    // this thread's columns are groups 4 c + 2 (tig % 2) + {0, 1}: their scales times the activations'
    // factors (zero past group KG)
    const float2 fx = *reinterpret_cast<const float2*>(
        MX_ZERO_ROW ? xs + br.fx + 4 * KSPLIT * j : xs + SLOTS * XROW + 4 * c + 2 * (tig & 1));
    const float fa0 = group_scale(ha) * fx.x, fa1 = group_scale(ha >> 8) * fx.y;
    const float fb0 = group_scale(hb) * fx.x, fb1 = group_scale(hb >> 8) * fx.y;
    u32 pa[4][4], pb[4][4];  // word w's pairs, decoded once for every token pair
    decode_word(b.wa[j].x, pa[0]); decode_word(b.wa[j].y, pa[1]); decode_word(b.wa[j].z, pa[2]); decode_word(b.wa[j].w, pa[3]);
    decode_word(b.wb[j].x, pb[0]); decode_word(b.wb[j].y, pb[1]); decode_word(b.wb[j].z, pb[2]); decode_word(b.wb[j].w, pb[3]);
#pragma unroll
    for (int p = 0; p < TP; p++) {
      if (p >= ntp) break;
      const int xi = 2 * p + (br.g >> 2);
      const u32* xp = MX_ZERO_ROW ? xs + br.at[p] + 64 * KSPLIT * j : xs + xi * XROW + (4 * c + tig) * 16;
      const bool live = MX_ZERO_ROW || ((br.g & 3) == tig && xi < br.n);
      U4 xv[4];
#pragma unroll
      for (int v = 0; v < 4; v++) xv[v] = live ? *reinterpret_cast<const U4*>(xp + 4 * v) : U4{0u, 0u, 0u, 0u};
      // word w = values 8w .. 8w + 7 of the group: pairs 0, 1 (k 2tig + {0, 1}, 2tig + 8 + {0, 1}),
      // then pairs 2, 3; the activation words in the same order. Two accumulator chains (words 0-1,
      // words 2-3): each mma waits on the one before it in its chain, not on all eight.
      float da[4] = {0.f, 0.f, 0.f, 0.f}, db[4] = {0.f, 0.f, 0.f, 0.f};
      mma<true>(da, pa[0][0], pb[0][0], pa[0][1], pb[0][1], xv[0].x, xv[0].y);
      mma<true>(db, pa[2][0], pb[2][0], pa[2][1], pb[2][1], xv[2].x, xv[2].y);
      mma<true>(da, pa[0][2], pb[0][2], pa[0][3], pb[0][3], xv[0].z, xv[0].w);
      mma<true>(db, pa[2][2], pb[2][2], pa[2][3], pb[2][3], xv[2].z, xv[2].w);
      mma<true>(da, pa[1][0], pb[1][0], pa[1][1], pb[1][1], xv[1].x, xv[1].y);
      mma<true>(db, pa[3][0], pb[3][0], pa[3][1], pb[3][1], xv[3].x, xv[3].y);
      mma<true>(da, pa[1][2], pb[1][2], pa[1][3], pb[1][3], xv[1].z, xv[1].w);
      mma<true>(db, pa[3][2], pb[3][2], pa[3][3], pb[3][3], xv[3].z, xv[3].w);
      acc[p][0] = fmaf(da[1] + db[1], fa1, fmaf(da[0] + db[0], fa0, acc[p][0]));
      acc[p][1] = fmaf(da[3] + db[3], fb1, fmaf(da[2] + db[2], fb0, acc[p][1]));
    }
  }
}

#ifndef MX_FOLD
#define MX_FOLD 0
#endif
#ifndef MX_RESIDENT
#define MX_RESIDENT 0
#endif
// the dynamic shared memory the launch gives (MX_SHARED_BYTES, kernels/cuda_moe_mxfp4.py) is this layout's
// (the resident gate/up's, below, is its own)
static_assert(MX_FOLD || MX_RESIDENT ||
                  (MX_ZERO_ROW ? XZERO_AT + XZERO_WORDS : SLOTS * XROW + XF_WORDS) * 4 == MX_SHARED_BYTES,
              "the host's dynamic shared memory size differs from the staging layout");
static_assert(!MX_FOLD || SLOTS % 8 == 0, "folded launches take the item's pairs in mma columns of 8");
#define NT ((SLOTS + 7) / 8)  // MX_FOLD: the item's pairs in groups of 8 (one mma's columns)

// Scale byte s -> the factor of its group's decoded pairs, in both halves. bf16 (MX_FOLD 1): 2^(s - 1) (the
// bf16 decode's 2^-126 undone), a bf16 for s <= 128. f16 (MX_FOLD 2): fold_factor_f16 (mxfp4_packed.cuh).
__device__ __forceinline__ u32 fold_factor(u32 s) {
#if MX_FOLD == 2
  return fold_factor_f16(s);
#else
  const u32 h = ((s & 0xFFu) + 126u) << 7;
  return h | (h << 16);
#endif
}

// A packed word's pairs in the fold's type, and a pair times its factor
__device__ __forceinline__ void decode_fold(u32 w, u32 p[4]) {
  if (MX_FOLD == 2) decode_word(w, p); else decode_word_bf16(w, p);
}

#if MX_FOLD == 2
#define MX_FOLD_MUL "mul.rn.f16x2 %0, %1, %2;"
#else
#define MX_FOLD_MUL "mul.rn.bf16x2 %0, %1, %2;"
#endif
__device__ __forceinline__ u32 mul_fold(u32 a, u32 b) {
  u32 d;
  asm(MX_FOLD_MUL : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// MX_FOLD's mmas of one batch: acc[n][chain] += rows row0 / row0 + 8 x pairs 8n .. 8n + 7 of the
// item (the thread's columns 2 tig, 2 tig + 1); the thread's A values are its own group's, so it
// scales them by its own scale byte and supplies B for pair 8n + g over the same k, read from the
// pair's activation row xrow[n] (null past the item's pairs; written before this kernel's PDL wait,
// which the caller has passed). nt: the column groups that hold pairs.
__device__ __forceinline__ void use_batch_fold(const Batch& b, int first, const U4* const xrow[NT], int nt, int tig,
                                               float acc[NT][2][4]) {
#pragma unroll
  for (int j = 0; j < D; j++) {
    const int c = first + j * KSPLIT;
    if (c >= CHUNKS) break;
    const int grp = 4 * c + tig;
    const u32 fa = fold_factor(b.sa[j] >> (8 * tig)), fb = fold_factor(b.sb[j] >> (8 * tig));
    u32 pa[4][4], pb[4][4];
    decode_fold(b.wa[j].x, pa[0]); decode_fold(b.wa[j].y, pa[1]); decode_fold(b.wa[j].z, pa[2]);
    decode_fold(b.wa[j].w, pa[3]);
    decode_fold(b.wb[j].x, pb[0]); decode_fold(b.wb[j].y, pb[1]); decode_fold(b.wb[j].z, pb[2]);
    decode_fold(b.wb[j].w, pb[3]);
#pragma unroll
    for (int v = 0; v < 4; v++) {
#pragma unroll
      for (int q = 0; q < 4; q++) pa[v][q] = mul_fold(pa[v][q], fa), pb[v][q] = mul_fold(pb[v][q], fb);
    }
#pragma unroll
    for (int n = 0; n < NT; n++) {
      if (n >= nt) break;
      // past the row's last group the weights are zero and the row ends: B zero, nothing read
      const bool live = xrow[n] != nullptr && grp < KG;
      U4 xv[4];
#pragma unroll
      for (int v = 0; v < 4; v++) xv[v] = live ? load_cached(xrow[n] + grp * 4 + v) : U4{0u, 0u, 0u, 0u};
      // the same k order as use_batch; two accumulator chains (words 0-1, words 2-3)
      mma<MX_FOLD == 2>(acc[n][0], pa[0][0], pb[0][0], pa[0][1], pb[0][1], xv[0].x, xv[0].y);
      mma<MX_FOLD == 2>(acc[n][1], pa[2][0], pb[2][0], pa[2][1], pb[2][1], xv[2].x, xv[2].y);
      mma<MX_FOLD == 2>(acc[n][0], pa[0][2], pb[0][2], pa[0][3], pb[0][3], xv[0].z, xv[0].w);
      mma<MX_FOLD == 2>(acc[n][1], pa[2][2], pb[2][2], pa[2][3], pb[2][3], xv[2].z, xv[2].w);
      mma<MX_FOLD == 2>(acc[n][0], pa[1][0], pb[1][0], pa[1][1], pb[1][1], xv[1].x, xv[1].y);
      mma<MX_FOLD == 2>(acc[n][1], pa[3][0], pb[3][0], pa[3][1], pb[3][1], xv[3].x, xv[3].y);
      mma<MX_FOLD == 2>(acc[n][0], pa[1][2], pb[1][2], pa[1][3], pb[1][3], xv[1].z, xv[1].w);
      mma<MX_FOLD == 2>(acc[n][1], pa[3][2], pb[3][2], pa[3][3], pb[3][3], xv[3].z, xv[3].w);
    }
  }
}

// sum over K of W[row] * x[slot] for the CTA's ROWS rows and the item's pairs: warp w takes rows
// 16 (w / KSPLIT) .. +16 and K steps w % KSPLIT, + KSPLIT, ...; its sums for pair i, row r of its
// tile go to red[(w * SLOTS + i) * 16 + r]. The first weights are requested before the activation
// rows are staged (in flight together); with EARLY, the PDL wait comes between the two. STAGED: the
// rows are in xs already (gate/up's MX_EARLY_X).
template <bool EARLY, bool STAGED = false, bool F16_ROWS = false>
__device__ void tile_dot(const u32* __restrict__ words, const u32* __restrict__ scales, u32* xs,
                         const Item& it, float* red, int act_shift = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int ks = warp % KSPLIT;
  const int tile_row = blockIdx.x * ROWS + (warp / KSPLIT) * 16;  // the warp's 16-row tile
  const int row0 = tile_row + g;  // and row0 + 8
  const U4* rows = tile_rows(words + (i64)tile_row * (KG * 4), g, tig);
  const u32* s0 = scales + (i64)row0 * SCALE_WORDS;
  const u32* s1 = scales + (i64)(row0 + 8) * SCALE_WORDS;

  Batch b0, b1;
  load_batch<EARLY>(b0, rows, s0, s1, ks, tig);
  if (EARLY) enter_pdl();
#if MX_FOLD
  static_assert(!STAGED, "folded launches stage no rows");
  float acc[NT][2][4];
  const U4* xrow[NT];  // the thread's B rows, pair 8n + g, in registers for the whole K loop
#pragma unroll
  for (int n = 0; n < NT; n++) {
    xrow[n] = 8 * n + g < it.n ? it.row[8 * n + g] : nullptr;
#pragma unroll
    for (int i = 0; i < 8; i++) acc[n][i / 4][i % 4] = 0.f;
  }
  const int nt = (it.n + 7) / 8;
#define USE_BATCH(b, first) use_batch_fold(b, first, xrow, nt, tig, acc)
#define ADVANCE()
#else
  if (!STAGED) stage_rows<false, F16_ROWS>(xs, it.row, it.n, act_shift);
  const int ntp = (it.n + 1) / 2;
  BRows br = b_rows(it.n, g, tig, ks);
  float acc[TP][2];
#pragma unroll
  for (int p = 0; p < TP; p++) acc[p][0] = acc[p][1] = 0.f;
#define USE_BATCH(b, first) use_batch(b, first, xs, br, ntp, tig, acc)
#define ADVANCE() advance(br, STEP)
#endif
  constexpr int STEP = D * KSPLIT;  // K steps a batch advances
#pragma unroll 1
  for (int first = ks; first < CHUNKS; first += 2 * STEP) {
    if (first + STEP < CHUNKS) load_batch<false>(b1, rows, s0, s1, first + STEP, tig);
    USE_BATCH(b0, first);
    if (first + STEP >= CHUNKS) break;
    if (first + 2 * STEP < CHUNKS) load_batch<false>(b0, rows, s0, s1, first + 2 * STEP, tig);
    ADVANCE();
    USE_BATCH(b1, first + STEP);
    ADVANCE();
  }
#undef USE_BATCH
#undef ADVANCE
#if MX_FOLD
  // c0, c1: row g, pairs 8n + 2 tig (+1); c2, c3: row g + 8
#pragma unroll
  for (int n = 0; n < NT; n++) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int xi = 8 * n + 2 * tig + h;
      if (xi < it.n) {
        red[(warp * SLOTS + xi) * 16 + g] = acc[n][0][h] + acc[n][1][h];
        red[(warp * SLOTS + xi) * 16 + g + 8] = acc[n][0][2 + h] + acc[n][1][2 + h];
      }
    }
  }
#else
#pragma unroll
  for (int p = 0; p < TP; p++) {
    if (p >= ntp) break;
    const float v0 = acc[p][0] + __shfl_xor_sync(0xFFFFFFFFu, acc[p][0], 1);
    const float v1 = acc[p][1] + __shfl_xor_sync(0xFFFFFFFFu, acc[p][1], 1);
    const int xi = 2 * p + (tig >> 1);
    if ((tig & 1) == 0 && xi < it.n) {
      red[(warp * SLOTS + xi) * 16 + g] = v0;
      red[(warp * SLOTS + xi) * 16 + g + 8] = v1;
    }
  }
#endif
  __syncthreads();
}

// Row r (0 .. ROWS) of the CTA for pair i: its K shares added in order.
__device__ __forceinline__ float row_sum(const float* red, int i, int r) {
  const int w0 = (r >> 4) * KSPLIT;
  float v = 0.f;
#pragma unroll
  for (int k = 0; k < KSPLIT; k++) v += red[((w0 + k) * SLOTS + i) * 16 + (r & 15)];
  return v;
}

// gpt-oss' clamped SwiGLU of a row pair's sums (biases added), as gate/up stores it: f16 times
// 2^act_shift, or bf16 in bf16-folded launches
__device__ __forceinline__ u16 swiglu_out(float glu, float lin, float limit, float alpha, int act_shift) {
  glu = fminf(glu, limit);
  lin = fminf(fmaxf(lin, -limit), limit);
  const float out = glu / (1.f + expf(-alpha * glu)) * (lin + 1.f);
  return MX_FOLD == 1 ? to_bf16(out) : to_f16(out * __int_as_float((127 + act_shift) << 23));
}

// gate/up + bias + gpt-oss' clamped SwiGLU: act[pair, (ROWS bx + 2j) / 2] for the item's pairs, as
// f16 times 2^act_shift (down stages them as they are; the caller picks act_shift so that the clamped
// SwiGLU's range stays below 2^15), or as bf16 in bf16-folded launches (down's B operand, read directly).
// x: the tokens [T, K] bf16 (row stride stride_x); rows of W interleave glu (even) and linear (odd).
// MX_FOLD 2: x is the routing launch's f16 copy of the tokens, each token's sums times x_inv[token].
// l2_next / l2_bytes: request_l2, first thing (while the router still runs).
extern "C" __global__ void MX_BOUNDS
mx_gate_up(const u32* __restrict__ words, const u32* __restrict__ scales, const float* __restrict__ bias,
           const u16* __restrict__ x, int stride_x, const float* __restrict__ x_inv, const i64* __restrict__ pair_expert,
           const int* __restrict__ item_expert, const int* __restrict__ item_slots, int has_items, int top_k,
           int n_rows, u16* __restrict__ act, double limit_d, double alpha_d, int act_shift,
           const void* __restrict__ l2_next, int l2_bytes TRACE_PARAM) {
  request_l2(l2_next, l2_bytes);
  extern __shared__ __align__(16) u32 xs[];
  __shared__ float red[NW * SLOTS * 16];
  __shared__ Item it;
  // a per-pair CTA serves pair blockIdx.y, of token blockIdx.y / top_k: its row needs no routing
  if (GATE_UP_EARLY_X) {
    const U4* row = reinterpret_cast<const U4*>(x + (i64)(blockIdx.y / top_k) * stride_x);
    stage_rows<true, false>(xs, &row, 1);
  }
  enter_pdl();
  TRACE(0);
  TRACE(3);
  read_item(it, pair_expert, has_items ? item_expert : nullptr, item_slots, x, stride_x, top_k);  // syncs the CTA
  if (it.expert < 0) return;
  const i64 e = it.expert;
  // a thread's output column j is the same for every pair (NW * 32 is a multiple of ROWS / 2)
  const int row_j = blockIdx.x * ROWS + 2 * (threadIdx.x % (ROWS / 2));
  float bias_glu = 0.f, bias_lin = 0.f;
  if (MX_EARLY_BIAS) bias_glu = bias[e * n_rows + row_j], bias_lin = bias[e * n_rows + row_j + 1];
#if MX_FOLD == 2
  __shared__ float row_inv[SLOTS];  // the pairs' tokens' x_inv (tile_dot's last barrier publishes them)
  if (threadIdx.x < it.n) row_inv[threadIdx.x] = __ldcg(x_inv + it.slot[threadIdx.x] / top_k);
#endif
  tile_dot<false, GATE_UP_EARLY_X>(words + e * n_rows * (KG * 4), scales + e * n_rows * SCALE_WORDS, xs, it, red);
  TRACE(1);
  if (!MX_EARLY_BIAS) bias_glu = bias[e * n_rows + row_j], bias_lin = bias[e * n_rows + row_j + 1];
  const float limit = (float)limit_d, alpha = (float)alpha_d;
  for (int t = threadIdx.x; t < it.n * (ROWS / 2); t += NW * 32) {
    const int i = t / (ROWS / 2), j = t % (ROWS / 2);
    const int row = blockIdx.x * ROWS + 2 * j;
#if MX_FOLD == 2
    float glu = row_sum(red, i, 2 * j) * row_inv[i] + bias_glu;
    float lin = row_sum(red, i, 2 * j + 1) * row_inv[i] + bias_lin;
#else
    float glu = row_sum(red, i, 2 * j) + bias_glu;
    float lin = row_sum(red, i, 2 * j + 1) + bias_lin;
#endif
    act[(i64)it.slot[i] * (n_rows / 2) + row / 2] = swiglu_out(glu, lin, limit, alpha, act_shift);
  }
  TRACE_END();
}

#if MX_RESIDENT
#ifndef MX_RESIDENT_TOKENS
#define MX_RESIDENT_TOKENS 1
#endif
static_assert(SLOTS == 1 && !MX_FOLD && !MX_TRACE && MX_RESIDENT_TOKENS >= 1,
              "the resident gate/up serves the per-pair launch of a few tokens");
#define TILE_BATCHES ((CHUNKS + D * KSPLIT - 1) / (D * KSPLIT))  // register batches of a warp's K share
// Shared memory: each token's region (its staged row, then its groups' factors: a per-pair CTA's layout),
// TOKEN_WORDS apart (a multiple of 32, so every region's words sit in the banks of the per-pair layout's),
// then the row of zeros.
#define TOKEN_WORDS ((XROW + XF_WORDS + 31) / 32 * 32)
#define RESIDENT_ZERO_AT (MX_RESIDENT_TOKENS * TOKEN_WORDS)
static_assert((RESIDENT_ZERO_AT + XZERO_WORDS) * 4 == MX_SHARED_BYTES,
              "the host's dynamic shared memory size differs from the resident staging layout");

// The tokens' rows (n <= MX_RESIDENT_TOKENS, contiguous, KG * 32 bf16 values each), each into its own region
// exactly as stage_rows stages a per-pair CTA's one row (its groups' powers of two from that row alone, so the
// sums are the per-pair launch's), with every row's loads in flight together; then the row of zeros. EARLY:
// read before the CTA's PDL wait. Ends with the CTA synchronised.
template <bool EARLY>
__device__ __forceinline__ void stage_token_rows(u32* xs, const U4* x, int n) {
  constexpr int per_row = CHUNKS * 16, in_row = KG * 4;  // 16-byte chunks, staged and in a row
  const U4 zero = U4{0u, 0u, 0u, 0u};
  for (int c0 = 0; c0 < per_row; c0 += NW * 32) {  // the same trip count in every lane: they shuffle
    const int c = c0 + (int)threadIdx.x;
    U4 v[MX_RESIDENT_TOKENS];
#pragma unroll
    for (int i = 0; i < MX_RESIDENT_TOKENS; i++)
      v[i] = i < n && c < in_row ? (EARLY ? load_early(x + i * in_row + c) : load_cached(x + i * in_row + c)) : zero;
#pragma unroll
    for (int i = 0; i < MX_RESIDENT_TOKENS; i++) {
      if (i >= n) break;
      const u32 e = group_exponent(max_bits(v[i]));
      if (c >= per_row) continue;
      u32* region = xs + i * TOKEN_WORDS;
      if ((c & 3) == 0) group_factors(region)[c >> 2] = unstage_factor(e);
      *reinterpret_cast<U4*>(region + 4 * c) = staged_chunk(v[i], stage_factor(e));
    }
  }
  if constexpr (XZERO_WORDS > 0)
    for (int w = threadIdx.x; w < XZERO_WORDS; w += NW * 32) xs[RESIDENT_ZERO_AT + w] = 0u;
  __syncthreads();
}

// A few tokens' gate/up as a resident grid (MX_RESIDENT): CTA b takes tiles b, b + G, b + 2G, ... (G =
// gridDim.x, what the SMs hold at once) of the (live pair, 16-row tile) list, and each warp streams its
// K share of one tile after the other through the same two register batches: the next tile's weights are
// requested as soon as a batch is summed, so they are in flight while this tile's sums meet across the
// warps and its epilogue runs. mx_gate_up's launch of one CTA a tile comes in waves (2.2 of them at one
// token, 4.4 at two): a wave's CTAs request their bytes together and then sum them, with nothing of the
// next wave in flight. Every CTA stages all the tokens' rows, each as the per-pair launch stages its pair's
// one row; same K shares, order of sums and epilogue as mx_gate_up's per-pair launch: bit-identical.
// l2_next / l2_bytes: request_l2, first thing.
// x: the n_tokens rows; pair_expert: each token's top_k experts (negative: not here, nothing written).
extern "C" __global__ void MX_BOUNDS
mx_gate_up_resident(const u32* __restrict__ words, const u32* __restrict__ scales, const float* __restrict__ bias,
                    const u16* __restrict__ x, const i64* __restrict__ pair_expert, int n_tokens, int top_k,
                    int n_rows, u16* __restrict__ act, double limit_d, double alpha_d, int act_shift,
                    const void* __restrict__ l2_next, int l2_bytes) {
  request_l2(l2_next, l2_bytes);
  extern __shared__ __align__(16) u32 xs[];
  __shared__ float red[2][NW * 16];  // a tile's K shares, by tile parity (one barrier a tile keeps them apart)
  __shared__ int live_expert[32], live_pair[32], live_region[32], n_live;
  const U4* rows = reinterpret_cast<const U4*>(x);
  if (GATE_UP_EARLY_X) stage_token_rows<true>(xs, rows, n_tokens);
  enter_pdl();
  if (!GATE_UP_EARLY_X) stage_token_rows<false>(xs, rows, n_tokens);
  if (threadIdx.x < 32) {  // the pairs with an expert here, in pair order
    const int p = threadIdx.x;
    const int e = p < n_tokens * top_k ? (int)__ldcg(pair_expert + p) : -1;
    const unsigned live = __ballot_sync(0xFFFFFFFFu, e >= 0);
    const int at = __popc(live & ((1u << p) - 1u));  // live pairs before this one
    if (e >= 0) live_expert[at] = e, live_pair[at] = p, live_region[at] = p / top_k * TOKEN_WORDS;
    if (p == 0) n_live = __popc(live);
  }
  __syncthreads();
  const int row_tiles = n_rows / ROWS, tiles = n_live * row_tiles, G = gridDim.x;
  if ((int)blockIdx.x >= tiles) return;
  const int my_tiles = (tiles - (int)blockIdx.x + G - 1) / G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3, ks = warp % KSPLIT;
  const int warp_rows = (warp / KSPLIT) * 16;  // the warp's 16-row tile within a CTA tile; its rows g, g + 8
  constexpr int NB = TILE_BATCHES, STEP = D * KSPLIT;
  const int units = my_tiles * NB;  // (tile, batch) in stream order
  // this CTA's tile i: its live pair and first weight row (expert e's rows start at e * n_rows)
  auto tile_at = [&](int i, int& live, i64& first_row) {
    const int tile = (int)blockIdx.x + i * G;
    live = tile / row_tiles;
    first_row = (i64)live_expert[live] * n_rows + (tile - live * row_tiles) * ROWS;
  };
  auto load_unit = [&](Batch& b, int u) {
    int live;
    i64 r0;
    tile_at(u / NB, live, r0);
    r0 += warp_rows;
    load_batch<false>(b, tile_rows(words + r0 * (KG * 4), g, tig), scales + (r0 + g) * SCALE_WORDS,
                      scales + (r0 + g + 8) * SCALE_WORDS, ks + (u % NB) * STEP, tig);
  };
  // threads < ROWS / 2 write output column j = threadIdx.x of each tile: its biases, a tile ahead
  float bias_glu = 0.f, bias_lin = 0.f;
  auto load_bias = [&](int i) {
    int live;
    i64 r0;
    tile_at(i, live, r0);
    bias_glu = bias[r0 + 2 * threadIdx.x], bias_lin = bias[r0 + 2 * threadIdx.x + 1];
  };
  Batch b0, b1;
  load_unit(b0, 0);
  if (units > 1) load_unit(b1, 1);
  if (threadIdx.x < ROWS / 2) load_bias(0);
  float acc[1][2] = {{0.f, 0.f}};
  const float limit = (float)limit_d, alpha = (float)alpha_d;
  // the token region of the tile being summed (one token: always the first), moved on at each tile's end
  auto region_of = [&](int i) { return live_region[((int)blockIdx.x + i * G) / row_tiles]; };
  int region = MX_RESIDENT_TOKENS == 1 ? 0 : region_of(0);
  auto sum_unit = [&](const Batch& b, int u) {
    const int first = ks + (u % NB) * STEP;
    use_batch(b, first, xs + region, b_rows(1, g, tig, first, RESIDENT_ZERO_AT - region), 1, tig, acc);
  };
  // after unit u: where it was its tile's last batch, the K shares meet and the epilogue stores the tile
  auto end_unit = [&](int u) {
    if (u % NB != NB - 1) return;
    const int i = u / NB;
    float* r = red[i & 1];
    const float v0 = acc[0][0] + __shfl_xor_sync(0xFFFFFFFFu, acc[0][0], 1);
    const float v1 = acc[0][1] + __shfl_xor_sync(0xFFFFFFFFu, acc[0][1], 1);
    if (tig == 0) r[warp * 16 + g] = v0, r[warp * 16 + g + 8] = v1;
    acc[0][0] = acc[0][1] = 0.f;
    if (MX_RESIDENT_TOKENS > 1 && i + 1 < my_tiles) region = region_of(i + 1);
    __syncthreads();
    if (threadIdx.x < ROWS / 2) {
      const int j = threadIdx.x;
      int live;
      i64 r0;
      tile_at(i, live, r0);
      const float glu = row_sum(r, 0, 2 * j) + bias_glu, lin = row_sum(r, 0, 2 * j + 1) + bias_lin;
      if (i + 1 < my_tiles) load_bias(i + 1);
      const int out_row = (int)(r0 - (i64)live_expert[live] * n_rows) + 2 * j;
      act[(i64)live_pair[live] * (n_rows / 2) + out_row / 2] = swiglu_out(glu, lin, limit, alpha, act_shift);
    }
  };
#pragma unroll 1
  for (int u = 0;;) {
    sum_unit(b0, u);
    if (u + 2 < units) load_unit(b0, u + 2);
    end_unit(u);
    if (++u >= units) break;
    sum_unit(b1, u);
    if (u + 2 < units) load_unit(b1, u + 2);
    end_unit(u);
    if (++u >= units) break;
  }
}
#endif

#if MX_CLUSTER_SUM
// The cluster's top_k CTAs (one token's pairs, rank = the pair's k; the same row tile) each hold
// their weighted rows in y, the same shared array in each; CTA `rank` adds rows rank, rank + top_k,
// ... over the pairs in slot order (the counter path's order and float operations: bit-identical)
// and stores them. The second sync keeps every CTA's y alive until its peers have read it.
__device__ __forceinline__ void cluster_sum(const float* y, int top_k, u16* __restrict__ out, int stride_out) {
  cluster_sync();
  const u32 rank = cluster_rank();
  const int token = blockIdx.y / top_k;
  for (int r = (int)rank + top_k * threadIdx.x; r < ROWS; r += top_k * NW * 32) {
    float v = 0.f;
    for (int k = 0; k < top_k; k++) v += load_peer(y + r, (u32)k);
    out[(i64)token * stride_out + blockIdx.x * ROWS + r] = to_bf16(v);
  }
  cluster_sync_relaxed();
}
#endif

// down + bias, times the routing weight, summed over each token's top_k pairs in slot order: each
// CTA writes its pairs' float32 partials; the last CTA of a (token, row tile) to arrive (a counter,
// reset by it) sums the token's partials and stores the bf16 rows (deterministic, no float atomics).
// l2_next / l2_bytes: request_l2, first thing.
extern "C" __global__ void MX_BOUNDS
mx_down(const u32* __restrict__ words, const u32* __restrict__ scales, const float* __restrict__ bias,
        const u16* __restrict__ act, const i64* __restrict__ pair_expert, const int* __restrict__ item_expert,
        const int* __restrict__ item_slots, int has_items, int top_k, int n_rows, int has_bias,
        const u16* __restrict__ route_weight, float* __restrict__ part, int* __restrict__ counters,
        u16* __restrict__ out, int stride_out, int act_shift, const void* __restrict__ l2_next,
        int l2_bytes TRACE_PARAM) {
  request_l2(l2_next, l2_bytes);
  extern __shared__ __align__(16) u32 xs[];
  __shared__ float red[NW * SLOTS * 16];
  __shared__ Item it;
#if MX_CLUSTER_SUM
  __shared__ float y_sum[ROWS];  // this pair's weighted rows, read by the cluster (cluster_sum)
#else
  __shared__ int last[SLOTS];
#endif
  if (!MX_EARLY_DOWN) enter_pdl();
  TRACE(0);
  TRACE(3);
  read_item(it, pair_expert, has_items ? item_expert : nullptr, item_slots, act, KG * 32, 1,
            MX_EARLY_BIAS ? route_weight : nullptr);
#if MX_CLUSTER_SUM
  if (it.expert < 0) {  // no expert here (another rank's): the pair adds zeros, the cluster still syncs
    if (MX_EARLY_DOWN) enter_pdl();  // the cluster's sum below stores rows: never ahead of the wait
    for (int r = threadIdx.x; r < ROWS; r += NW * 32) y_sum[r] = 0.f;
    cluster_sum(y_sum, top_k, out, stride_out);
    return;
  }
#else
  if (it.expert < 0) return;
#endif
  const i64 e = it.expert;
  const int tile = blockIdx.x;
  // a thread's row r is the same for every pair (NW * 32 is a multiple of ROWS)
  const int row_r = tile * ROWS + threadIdx.x % ROWS;
  float bias_r = 0.f;
  if (MX_EARLY_BIAS && has_bias) bias_r = bias[e * n_rows + row_r];
  tile_dot<MX_EARLY_DOWN != 0, false, !MX_FOLD>(words + e * n_rows * (KG * 4), scales + e * n_rows * SCALE_WORDS, xs,
                                               it, red, act_shift);
  TRACE(1);
  if (!MX_EARLY_BIAS && has_bias) bias_r = bias[e * n_rows + row_r];
#if MX_CLUSTER_SUM
  for (int r = threadIdx.x; r < ROWS; r += NW * 32)
    y_sum[r] = (row_sum(red, 0, r) + bias_r) * from_bf16(MX_EARLY_BIAS ? it.weight[0] : route_weight[it.slot[0]]);
  cluster_sum(y_sum, top_k, out, stride_out);
#else
  for (int t = threadIdx.x; t < it.n * ROWS; t += NW * 32) {
    const int i = t / ROWS, r = t % ROWS;
    const int row = tile * ROWS + r;
    // MX_FOLD 2: B was the activations times 2^act_shift
    const float y = (MX_FOLD == 2 ? row_sum(red, i, r) * __int_as_float((127 - act_shift) << 23) : row_sum(red, i, r))
                    + bias_r;
    const int pair = it.slot[i];
    part[(i64)pair * n_rows + row] = y * from_bf16(MX_EARLY_BIAS ? it.weight[i] : route_weight[pair]);
  }
  __threadfence();
  __syncthreads();
  const int tiles = gridDim.x;
  if (threadIdx.x < it.n) {
    const int token = it.slot[threadIdx.x] / top_k;
    last[threadIdx.x] = atomicAdd(counters + (i64)token * tiles + tile, 1) == top_k - 1;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < it.n * ROWS; t += NW * 32) {
    const int i = t / ROWS, r = t % ROWS;
    if (!last[i]) continue;
    __threadfence();
    const int token = it.slot[i] / top_k;
    const int row = tile * ROWS + r;
    float y = 0.f;
    for (int k = 0; k < top_k; k++) y += __ldcg(part + ((i64)token * top_k + k) * n_rows + row);
    out[(i64)token * stride_out + row] = to_bf16(y);
    if (r == 0) counters[(i64)token * tiles + tile] = 0;
  }
#endif
  TRACE_END();
}
