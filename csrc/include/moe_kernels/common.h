// Definitions shared by the C++ (CPU) and CUDA kernels. No torch headers here: this file is
// included by .cu translation units that nvcc compiles without torch.
#pragma once
#include <stdint.h>

// The one spelling of always-inline in host code: for helpers called from functions compiled with
// their own optimize or target attributes (MK_VECTORISE, the per-instruction-set variants of
// csrc/cpu/isa.h), into which GCC does not inline a plain inline function (each element would
// become a call), and for bodies that must be inlined into each of their callers.
#define MK_ALWAYS_INLINE inline __attribute__((always_inline))

// MK_HD: a function of both the CPU and the CUDA kernels. MK_HD_ALWAYS: the same, always inlined.
#if defined(__CUDACC__)
#define MK_HD __host__ __device__ __forceinline__
#define MK_HD_ALWAYS __host__ __device__ __forceinline__
#else
#define MK_HD inline
#define MK_HD_ALWAYS MK_ALWAYS_INLINE
#endif

namespace moe_kernels {

// Bit pattern of a float without aliasing problems on host and device.
MK_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  union { float f; uint32_t u; } v;
  v.f = x;
  return v.u;
#endif
}

MK_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  union { float f; uint32_t u; } v;
  v.u = u;
  return v.f;
#endif
}

// A signed integer whose order is the order the routing ops rank floats in:
//   NaN (any payload) > +inf > ... > +0 == -0 > ... > -inf.
// NaN ranks highest because torch.sort / torch.topk treat it as the largest value, and the
// reference is written with them. -0 is folded into +0 because they compare equal as floats, so
// ties between them must go to the lower index, as for any other tie.
MK_HD int32_t rank_key(float x) {
  if (x != x) return 0x7fffffff;
  uint32_t u = float_bits(x + 0.0f);  // x + 0.0f turns -0 into +0 (round to nearest)
  int32_t s = (int32_t)u;
  // Negative floats order backwards as integers: flip their magnitude bits.
  return s >= 0 ? s : (int32_t)(u ^ 0x7fffffffu);
}

// One int64 that orders (value, index) pairs the way every backend must: larger value first,
// then lower index. All keys of a row are distinct, so "the largest key" is never ambiguous and
// the k-th selection is simply "the largest key below the previous one".
MK_HD int64_t rank_pair(float x, int32_t index) {
  return ((int64_t)rank_key(x) << 32) | (int64_t)(0xffffffffu - (uint32_t)index);
}

MK_HD int32_t pair_index(int64_t pair) {
  return (int32_t)(0xffffffffu - (uint32_t)(pair & 0xffffffff));
}

// Element types a kernel launcher accepts, passed as an int across the torch-free boundary.
// float64 only where a launcher says so (MK_DISPATCH_FLOAT refuses it).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Smallest pair: below every pair that rank_pair can return.
constexpr int64_t kNoPair = (int64_t)0x8000000000000000LL;

}  // namespace moe_kernels
