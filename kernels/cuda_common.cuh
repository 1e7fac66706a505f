// What the CUDA kernels of this folder share (each .cu includes it; kernels/nvrtc.py puts this folder
// on NVRTC's include path): integer types, a 16-byte vector, bf16 / f16 / e4m3 conversions, the L2 loads (16 bytes
// or one 32-bit value) and entry of a PDL kernel, a shared-memory address, the bf16 / f16 mma (also with A's
// upper rows zero), and the thread-block cluster's sync and distributed shared memory reads.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ float from_bf16(u16 b) { return __int_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// 16 bytes through L2 only, in program order with `griddepcontrol.wait` (ptxas may sink non-coherent
// `ld.global.nc` loads past it): what a kernel reads before its PDL wait, or may have been written by
// the kernel just before it
__device__ __forceinline__ U4 load_early(const void* p) {
  U4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The same for one 32-bit value
__device__ __forceinline__ int load_early_s32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 load_early_u32(const void* p) {
  u32 v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float load_early_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Bytes 0-1 (lo) and 2-3 (hi) of w (e4m3) as f16x2 each, exactly: one instruction a pair (F2FP, which
// takes either half of its register)
__device__ __forceinline__ void e4m3x4_f16x2(u32 w, u32& lo, u32& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

// f rounded to f16 (nearest even), as its bits
__device__ __forceinline__ u16 to_f16(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// (a, b) as f16x2 (a in the low half), rounded to nearest even
__device__ __forceinline__ u32 f16x2(float a, float b) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}

// 16 bytes read once (weights streamed through: not kept in L1; the data must predate the kernel)
__device__ __forceinline__ U4 load_stream(const U4* p) {
  U4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The largest |value| of 8 bf16 (16 bytes), as float bits (magnitudes compare as integers)
__device__ __forceinline__ u32 max_bits(U4 v) {
  const u32 m = __vmaxu2(__vmaxu2(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu), __vmaxu2(v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu));
  return max(m & 0xFFFFu, m >> 16) << 16;
}

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// d += A B (mma.sync m16n8k16, bf16 in (F16: f16 in), float32 accumulate): a0 / a2 the lane's
// registers of A's row g, a1 / a3 of row g + 8, b0, b1 its two of B (column g)
template <bool F16 = false>
__device__ __forceinline__ void mma(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if constexpr (F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with A's rows 8-15 zero
template <bool F16 = false>
__device__ __forceinline__ void mma_rows0_7(float d[4], u32 a0, u32 a2, u32 b0, u32 b1) {
  mma<F16>(d, a0, 0u, a2, 0u, b0, b1);
}

// %globaltimer in ns (the timing builds' traces: MX_TRACE, DA_TRACE)
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u32 sm_id() {
  u32 sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}

// This CTA's share (by its linear index in the grid) of `bytes` bytes at p (16-byte aligned, bytes a multiple
// of 16) requested into L2 by one bulk prefetch from the calling thread: bytes a later kernel will read.
__device__ __forceinline__ void prefetch_l2_share(const void* p, unsigned bytes) {
  const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
  const unsigned id = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned share = ((bytes + ctas - 1) / ctas + 15u) & ~15u, begin = id * share;
  if (begin >= bytes) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(p) + begin),
               "r"(min(share, bytes - begin))
               : "memory");
}

// The two halves of PDL: the wait for the kernel before (and its memory), and the next kernel's launch
__device__ __forceinline__ void wait_pdl() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// A PDL kernel's wait for the kernel before it, then the next one's launch (kernels/pdl.py's contract;
// launch_dependents first, then wait_pdl, is its exception: only where every dependent reads nothing but
// weights ahead of its own wait)
__device__ __forceinline__ void enter_pdl() {
  wait_pdl();
  launch_dependents();
}

// Every thread of the cluster arrives, then waits for all: shared-memory writes before it are
// visible to the cluster's CTAs after it (release / acquire; ptxas fences at GPU scope for it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The same without ordering: for a CTA's last sync, after which it only exits (its reads of its
// peers' shared memory are done: their values are used before it)
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// *p in the shared memory of the cluster's CTA `rank` (p: an address of this CTA's shared memory)
__device__ __forceinline__ float load_peer(const float* p, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
