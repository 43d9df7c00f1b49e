// topk_router on CUDA: one warp per row, any E, forward and fused backward. The row algorithm is
// moe_kernels/topk_router_row.h (shared with the host emulation that tests it); this file binds
// it to a warp: strided lane shares and butterfly shuffles. Computes in float32 (float64 for
// float64 logits), like the CPU kernel.
#include <cuda_runtime.h>

#include "convert.cuh"
#include "warp.cuh"
#include "moe_kernels/cuda_launchers.h"
#include "moe_kernels/topk_router_row.h"

namespace moe_kernels {
namespace {

using topk_router::Ranked;
using topk_router::RowParams;
using topk_router::Top2;

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float shfl(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
__device__ __forceinline__ double shfl(double v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
__device__ __forceinline__ int64_t shfl(int64_t v, int offset) {
  return (int64_t)__shfl_xor_sync(0xffffffffu, (long long)v, offset);
}

// The executor of topk_router_row.h on one warp.
struct WarpExec {
  int lane;
  __device__ bool leader() const { return lane == 0; }
  __device__ void sync() const { __syncwarp(); }
  template <class F>
  __device__ void items(int64_t n, F f) const {
    for (int64_t i = lane; i < n; i += kWarp) f(i);
  }
  template <typename T, class F>
  __device__ Ranked<T> best(int64_t n, F f) const {
    Ranked<T> r = topk_router::no_candidate<T>();
    for (int64_t i = lane; i < n; i += kWarp) r = topk_router::better(r, f(i));
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
      r = topk_router::better(r, Ranked<T>{shfl(r.value, offset), shfl(r.index, offset)});
    return r;
  }
  template <typename T, class F>
  __device__ T sum(int64_t n, F f) const {
    T v = 0;
    for (int64_t i = lane; i < n; i += kWarp) v += f(i);
    for (int offset = kWarp / 2; offset > 0; offset /= 2) v += shfl(v, offset);
    return v;
  }
  template <typename T, class F>
  __device__ Top2<T> top2(int64_t n, F f) const {
    Top2<T> r;
    for (int64_t i = lane; i < n; i += kWarp) r.push(f(i));
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      Top2<T> o;
      o.first = shfl(r.first, offset);
      o.second = shfl(r.second, offset);
      o.nan = __shfl_xor_sync(0xffffffffu, (int)r.nan, offset) != 0;
      r = r.merged(o);
    }
    return r;
  }
};

template <typename scalar_t>
__global__ void topk_router_kernel(const scalar_t* __restrict__ logits,  // [T, E] strided
                                   int64_t T, int64_t stride_t, int64_t stride_e,
                                   const typename acc_of<scalar_t>::type* __restrict__ bias,  // [E] or null
                                   RowParams a,
                                   typename acc_of<scalar_t>::type* __restrict__ weights,  // [T, k]
                                   int64_t* __restrict__ experts) {                        // [T, k]
  using acc_t = typename acc_of<scalar_t>::type;
  __shared__ acc_t group_scores[kWarpsPerBlock][topk_router::kMaxGroups];
  const int warp = threadIdx.x / kWarp;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + warp;
  if (row >= T) return;  // whole warps exit together: row is uniform across a warp
  const scalar_t* x_row = logits + row * stride_t;
  auto x = [&](int64_t e) { return to_acc(x_row[e * stride_e]); };
  topk_router::router_row(WarpExec{(int)(threadIdx.x % kWarp)}, x, bias, a, group_scores[warp], weights + row * a.k,
                          experts + row * a.k);
}

template <typename scalar_t>
__global__ void topk_router_backward_kernel(const typename acc_of<scalar_t>::type* __restrict__ grad_weights,  // [T, k]
                                            const scalar_t* __restrict__ logits,  // [T, E] strided
                                            const int64_t* __restrict__ experts,  // [T, k]
                                            int64_t T, int64_t stride_t, int64_t stride_e, RowParams a,
                                            scalar_t* __restrict__ grad) {  // [T, E] contiguous
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= T) return;
  const scalar_t* x_row = logits + row * stride_t;
  const auto* g_row = grad_weights + row * a.k;
  scalar_t* out_row = grad + row * a.E;
  auto x = [&](int64_t e) { return to_acc(x_row[e * stride_e]); };
  auto g = [&](int64_t s) { return g_row[s]; };
  auto out = [&](int64_t e, typename acc_of<scalar_t>::type v) { out_row[e] = from_acc<scalar_t>(v); };
  topk_router::router_backward_row<typename acc_of<scalar_t>::type>(WarpExec{(int)(threadIdx.x % kWarp)}, x, g, experts + row * a.k, a, out);
}

dim3 grid_for(int64_t T) { return dim3((unsigned)((T + kWarpsPerBlock - 1) / kWarpsPerBlock)); }

}  // namespace

cudaError_t topk_router_cuda(const void* logits, DType dtype, int64_t T, int64_t stride_t, int64_t stride_e,
                             const void* bias, const topk_router::RowParams& params, void* weights, int64_t* experts,
                             cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  if (params.grouped() && params.num_groups > topk_router::kMaxGroups) return cudaErrorInvalidValue;
  return MK_DISPATCH_FLOAT_AND_DOUBLE(dtype, [&] {
    using acc_t = typename acc_of<scalar_t>::type;
    topk_router_kernel<scalar_t><<<grid_for(T), kWarp * kWarpsPerBlock, 0, stream>>>(
        static_cast<const scalar_t*>(logits), T, stride_t, stride_e, static_cast<const acc_t*>(bias), params,
        static_cast<acc_t*>(weights), experts);
    return cudaGetLastError();
  });
}

cudaError_t topk_router_backward_cuda(const void* grad_weights, const void* logits, DType dtype, int64_t T,
                                      int64_t stride_t, int64_t stride_e, const int64_t* experts,
                                      const topk_router::RowParams& params, void* grad, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  return MK_DISPATCH_FLOAT_AND_DOUBLE(dtype, [&] {
    using acc_t = typename acc_of<scalar_t>::type;
    topk_router_backward_kernel<scalar_t><<<grid_for(T), kWarp * kWarpsPerBlock, 0, stream>>>(
        static_cast<const acc_t*>(grad_weights), static_cast<const scalar_t*>(logits), experts, T, stride_t,
        stride_e, params, static_cast<scalar_t*>(grad));
    return cudaGetLastError();
  });
}

}  // namespace moe_kernels
