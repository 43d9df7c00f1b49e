// Warp-level reductions shared by the warp-per-row CUDA kernels.
#pragma once
#include <stdint.h>

namespace moe_kernels {

constexpr int kWarp = 32;

// Max over the 32 lanes of an int64 rank pair (every lane gets the result).
__device__ __forceinline__ int64_t warp_max(int64_t v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = max(v, (int64_t)__shfl_xor_sync(0xffffffffu, (long long)v, offset));
  return v;
}

// Sum over the 32 lanes (every lane gets the result).
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace moe_kernels
