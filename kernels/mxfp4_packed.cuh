// The packed MXFP4 word layout of kernels/mxfp4.py, on the device: its masks come from the compiler call
// (MX_LOW_MASK, MX_HIGH_SHL_MASK, MX_HIGH_SHR_MASK), so every decode has one source.
#pragma once

// A packed word's e4m3 bytes: values 0..3 in `low`, 4..7 in `high`, each e2m1 * 2^-6 as e4m3.
__device__ __forceinline__ void e4m3_words(u32 w, u32& low, u32& high) {
  low = w & MX_LOW_MASK;
  high = ((w << 2) & MX_HIGH_SHL_MASK) | ((w >> 2) & MX_HIGH_SHR_MASK);
}

// The four f16x2 pairs of a packed word: values 2q, 2q + 1 of the word in pair q, as e2m1 * 2^-6 (Hopper's
// e4m3 -> f16 conversion; needs cuda_common.cuh first).
__device__ __forceinline__ void decode_word(u32 w, u32 p[4]) {
  u32 low, high;
  e4m3_words(w, low, high);
  e4m3x4_f16x2(low, p[0], p[1]);
  e4m3x4_f16x2(high, p[2], p[3]);
}

// The f16 fold's factor of scale byte s, in both halves: 2^(s - 121) (decode_word's 2^-6 undone), normal from
// s = 107, subnormal below; s is clamped to 97 .. 136, where the factor is an f16: bytes outside only scale
// groups of zeros (MxExperts.fold_f16_exact), which must not turn into 0 * inf.
__device__ __forceinline__ u32 fold_factor_f16(u32 s) {
  s = min(max(s & 0xFFu, 97u), 136u);
  const u32 h = s >= 107u ? (s - 106u) << 10 : 1u << (s - 97u);
  return h | (h << 16);
}
