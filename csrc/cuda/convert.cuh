// Loads and stores of fp32 / fp16 / bf16 as float, for the templated CUDA kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe_kernels {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The compute type of a kernel that also takes float64: double for double, float otherwise.
template <typename T> struct acc_of { using type = float; };
template <> struct acc_of<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename acc_of<T>::type to_acc(T x) { return to_float(x); }
template <> __device__ __forceinline__ double to_acc<double>(double x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(typename acc_of<T>::type x) { return from_float<T>(x); }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// Runs `body` with `scalar_t` bound to the CUDA type of `dtype` (one template instance per dtype,
// no copied kernel bodies).
// Evaluates to cudaErrorInvalidValue for an unknown dtype (float64 included).
#define MK_DISPATCH_FLOAT(dtype, ...)                                   \
  [&]() -> cudaError_t {                                                \
    switch (dtype) {                                                    \
      case kFloat32: { using scalar_t = float; return __VA_ARGS__(); }  \
      case kFloat16: { using scalar_t = __half; return __VA_ARGS__(); } \
      case kBFloat16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); } \
      default: break;                                                   \
    }                                                                   \
    return cudaErrorInvalidValue;                                       \
  }()

// MK_DISPATCH_FLOAT plus float64 (scalar_t = double).
#define MK_DISPATCH_FLOAT_AND_DOUBLE(dtype, ...)                                             \
  [&]() -> cudaError_t {                                                                     \
    if (dtype == kFloat64) { using scalar_t = double; return __VA_ARGS__(); }                \
    return MK_DISPATCH_FLOAT(dtype, __VA_ARGS__);                                            \
  }()

}  // namespace moe_kernels
