// Capacity routing on CUDA (capacity_positions is in capacity_positions.cu): dispatch (a slot ->
// choice map, then one block per buffer row), combine (one block per token: the block owns its
// token's sum, so no atomics), and the backward pieces (weighted dispatch to the buffer, one warp
// per choice for the weight gradients). All deterministic.
#include <cuda_runtime.h>
#include <stdint.h>

#include <initializer_list>
#include <type_traits>

#include "convert.cuh"
#include "warp.cuh"
#include "moe_kernels/cuda_launchers.h"
#include "moe_kernels/dispatch.h"

namespace moe_kernels {
namespace {

constexpr int kRowThreads = 128;  // threads along d for the row kernels

// source[e * C + p] = j for every kept choice j. Valid positions name each slot once; where
// malformed ones repeat a slot (unchecked on a GPU) the largest choice naming it fills it, as the
// CPU's map (its last writer) and the Triton kernel do, whatever order the threads run in.
__global__ void slot_sources_kernel(const int64_t* __restrict__ experts, const int64_t* __restrict__ positions,
                                    int64_t n, int64_t E, int64_t C, int64_t* __restrict__ source) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t slot = dispatch::kept_slot(experts[j], positions[j], E, C);
  if (slot >= 0) atomicMax(reinterpret_cast<long long*>(source + slot), (long long)j);
}

// A row's elements kWidth at a time: 16-byte loads and stores where the rows allow them
// (kWidth = 16 / sizeof(scalar_t): d a multiple of it, 16-byte aligned bases), else one at a time.
template <typename scalar_t, int kWidth>
struct alignas(sizeof(scalar_t) * kWidth) Pack {
  scalar_t v[kWidth];
};

template <typename scalar_t, int kWidth>
__device__ __forceinline__ Pack<scalar_t, kWidth> load_pack(const scalar_t* row, int64_t i) {
  return reinterpret_cast<const Pack<scalar_t, kWidth>*>(row)[i];
}

template <typename scalar_t, int kWidth>
__device__ __forceinline__ void store_pack(scalar_t* row, int64_t i, const Pack<scalar_t, kWidth>& p) {
  reinterpret_cast<Pack<scalar_t, kWidth>*>(row)[i] = p;
}

// out[r] = w[source[r]] * x[source[r] / k] (a copy when weights is null), zero for empty slots.
template <typename scalar_t, int kWidth>
__global__ void gather_rows_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ source,
                                   const float* __restrict__ weights, int64_t d, int64_t k,
                                   scalar_t* __restrict__ out) {
  using P = Pack<scalar_t, kWidth>;
  const int64_t r = blockIdx.x, packs = d / kWidth;
  const int64_t j = source[r];
  scalar_t* o = out + r * d;
  if (j < 0) {
    P zero;
#pragma unroll
    for (int e = 0; e < kWidth; ++e) zero.v[e] = from_float<scalar_t>(0.0f);
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) store_pack(o, i, zero);
    return;
  }
  const scalar_t* row = x + (j / k) * d;
  if (weights == nullptr) {
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) store_pack(o, i, load_pack<scalar_t, kWidth>(row, i));
    return;
  }
  const float w = weights[j];
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    P p = load_pack<scalar_t, kWidth>(row, i);
#pragma unroll
    for (int e = 0; e < kWidth; ++e) p.v[e] = from_float<scalar_t>(w * to_float(p.v[e]));
    store_pack(o, i, p);
  }
}

// y[t] = sum over kept s of w[t, s] * buffer[slot(t, s)], in float32, s = 0, 1, ...
template <typename scalar_t, int kWidth>
__global__ void combine_kernel(const scalar_t* __restrict__ buffer, const int64_t* __restrict__ experts,
                               const int64_t* __restrict__ positions, const float* __restrict__ weights,
                               int64_t E, int64_t C, int64_t d, int64_t k, scalar_t* __restrict__ y) {
  using P = Pack<scalar_t, kWidth>;
  const int64_t t = blockIdx.x, packs = d / kWidth;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    float acc[kWidth];
#pragma unroll
    for (int e = 0; e < kWidth; ++e) acc[e] = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t slot = dispatch::kept_slot(experts[t * k + s], positions[t * k + s], E, C);
      if (slot < 0) continue;
      const float w = weights == nullptr ? 1.0f : weights[t * k + s];
      const P b = load_pack<scalar_t, kWidth>(buffer + slot * d, i);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) acc[e] += w * to_float(b.v[e]);
    }
    P out;
#pragma unroll
    for (int e = 0; e < kWidth; ++e) out.v[e] = from_float<scalar_t>(acc[e]);
    store_pack(y + t * d, i, out);
  }
}

// grad_weights[j] = <grad_y[j / k], buffer[slot(j)]>, one warp per choice (fixed reduction order:
// each lane's packs in turn, then the lanes' butterfly).
template <typename scalar_t, int kWidth>
__global__ void row_dots_kernel(const scalar_t* __restrict__ grad_y, const scalar_t* __restrict__ buffer,
                                const int64_t* __restrict__ experts, const int64_t* __restrict__ positions,
                                int64_t n, int64_t E, int64_t C, int64_t d, int64_t k,
                                float* __restrict__ grad_weights) {
  const int64_t j = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (j >= n) return;  // uniform per warp
  const int64_t slot = dispatch::kept_slot(experts[j], positions[j], E, C);
  float acc = 0.0f;
  if (slot >= 0) {
    const scalar_t* g = grad_y + (j / k) * d;
    const scalar_t* b = buffer + slot * d;
    for (int64_t i = lane; i < d / kWidth; i += kWarp) {
      const Pack<scalar_t, kWidth> gp = load_pack<scalar_t, kWidth>(g, i), bp = load_pack<scalar_t, kWidth>(b, i);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) acc += to_float(gp.v[e]) * to_float(bp.v[e]);
    }
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (lane == 0) grad_weights[j] = acc;
}

// Runs launch(std::integral_constant<int, W>) with W = 16 / sizeof(scalar_t) where rows of d
// elements starting at every pointer in `rows` are 16-byte aligned, else W = 1.
template <typename scalar_t, class Launch>
cudaError_t by_width(int64_t d, std::initializer_list<const void*> rows, Launch launch) {
  constexpr int kWide = 16 / sizeof(scalar_t);
  bool wide = d % kWide == 0;
  for (const void* p : rows) wide = wide && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return wide ? launch(std::integral_constant<int, kWide>{}) : launch(std::integral_constant<int, 1>{});
}

}  // namespace

cudaError_t dispatch_cuda(const void* x, DType dtype, int64_t T, int64_t d, int64_t k, const int64_t* experts,
                          const int64_t* positions, int64_t E, int64_t C, const float* weights, int64_t* source,
                          void* out, cudaStream_t stream) {
  const int64_t S = E * C;
  if (S == 0 || d == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(source, 0xff, S * sizeof(int64_t), stream);  // all -1
  if (err != cudaSuccess) return err;
  const int64_t n = T * k;
  if (n > 0) {
    slot_sources_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(experts, positions, n, E, C, source);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return MK_DISPATCH_FLOAT(dtype, [&] {
    return by_width<scalar_t>(d, {x, out}, [&](auto width) {
      gather_rows_kernel<scalar_t, width.value><<<(unsigned)S, kRowThreads, 0, stream>>>(
          static_cast<const scalar_t*>(x), source, weights, d, k, static_cast<scalar_t*>(out));
      return cudaGetLastError();
    });
  });
}

cudaError_t combine_cuda(const void* buffer, DType dtype, int64_t E, int64_t C, int64_t d, int64_t T, int64_t k,
                         const int64_t* experts, const int64_t* positions, const float* weights, void* y,
                         cudaStream_t stream) {
  if (T == 0 || d == 0) return cudaSuccess;
  return MK_DISPATCH_FLOAT(dtype, [&] {
    return by_width<scalar_t>(d, {buffer, y}, [&](auto width) {
      combine_kernel<scalar_t, width.value><<<(unsigned)T, kRowThreads, 0, stream>>>(
          static_cast<const scalar_t*>(buffer), experts, positions, weights, E, C, d, k, static_cast<scalar_t*>(y));
      return cudaGetLastError();
    });
  });
}

cudaError_t combine_weights_grad_cuda(const void* grad_y, const void* buffer, DType dtype, int64_t E, int64_t C,
                                      int64_t d, int64_t T, int64_t k, const int64_t* experts,
                                      const int64_t* positions, float* grad_weights, cudaStream_t stream) {
  const int64_t n = T * k;
  if (n == 0) return cudaSuccess;
  constexpr int kWarpsPerBlock = 4;
  const unsigned blocks = (unsigned)((n + kWarpsPerBlock - 1) / kWarpsPerBlock);
  return MK_DISPATCH_FLOAT(dtype, [&] {
    return by_width<scalar_t>(d, {grad_y, buffer}, [&](auto width) {
      row_dots_kernel<scalar_t, width.value><<<blocks, kWarpsPerBlock * kWarp, 0, stream>>>(
          static_cast<const scalar_t*>(grad_y), static_cast<const scalar_t*>(buffer), experts, positions, n, E, C,
          d, k, grad_weights);
      return cudaGetLastError();
    });
  });
}

}  // namespace moe_kernels
