// The packed MXFP4 word layout of kernels/mxfp4.py, on the device: its masks come from the compiler call
// (MX_LOW_MASK, MX_HIGH_SHL_MASK, MX_HIGH_SHR_MASK), so every decode has one source.
#pragma once

// A packed word's e4m3 bytes: values 0..3 in `low`, 4..7 in `high`, each e2m1 * 2^-6 as e4m3.
__device__ __forceinline__ void e4m3_words(u32 w, u32& low, u32& high) {
  low = w & MX_LOW_MASK;
  high = ((w << 2) & MX_HIGH_SHL_MASK) | ((w >> 2) & MX_HIGH_SHR_MASK);
}
