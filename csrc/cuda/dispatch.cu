// Capacity routing on CUDA: capacity_positions (one block per expert scanning the fill order),
// dispatch (a slot -> choice map, then one block per buffer row), combine (one block per token:
// the block owns its token's sum, so no atomics), and the backward pieces (weighted dispatch to
// the buffer, one warp per choice for the weight gradients). All deterministic.
#include <cuda_runtime.h>

#include "convert.cuh"
#include "warp.cuh"
#include "moe_kernels/cuda_launchers.h"
#include "moe_kernels/dispatch.h"

namespace moe_kernels {
namespace {

constexpr int kScanThreads = 1024;  // choices per scan step of capacity_positions
constexpr int kRowThreads = 128;    // threads along d for the row kernels

// Rank of every hit among the block's hits (exclusive), and the block's total, by warp ballots.
__device__ __forceinline__ int block_exclusive_rank(bool hit, int* warp_totals, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const unsigned ballot = __ballot_sync(0xffffffffu, hit);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_totals[warp] = __popc(ballot);
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x / kWarp;
    int v = lane < n_warps ? warp_totals[lane] : 0;
    int inclusive = v;
    for (int offset = 1; offset < kWarp; offset *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane < n_warps) warp_totals[lane] = inclusive - v;  // exclusive prefix over warps
    if (lane == kWarp - 1) *total = inclusive;
  }
  __syncthreads();
  const int rank = warp_totals[warp] + in_warp;
  return rank;
}

__global__ void capacity_positions_kernel(const int64_t* __restrict__ experts,  // [n] flat t*k+s
                                          const int64_t* __restrict__ order,    // [n] fill order
                                          int64_t n, int64_t C,
                                          int64_t* __restrict__ positions,  // [n], prefilled -1
                                          int64_t* __restrict__ counts) {   // [E]
  __shared__ int warp_totals[kScanThreads / kWarp];
  __shared__ int total;
  const int64_t e = blockIdx.x;
  int64_t running = 0;
  for (int64_t start = 0; start < n; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int64_t j = i < n ? order[i] : -1;
    const bool hit = j >= 0 && experts[j] == e;
    const int rank = block_exclusive_rank(hit, warp_totals, &total);
    if (hit) positions[j] = dispatch::position_or_drop(running + rank, C);
    running += total;
    __syncthreads();  // warp_totals / total are rewritten by the next step
  }
  if (threadIdx.x == 0) counts[e] = running;
}

// source[e * C + p] = j for every kept choice j (slots are unique: one writer each).
__global__ void slot_sources_kernel(const int64_t* __restrict__ experts, const int64_t* __restrict__ positions,
                                    int64_t n, int64_t E, int64_t C, int64_t* __restrict__ source) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t slot = dispatch::kept_slot(experts[j], positions[j], E, C);
  if (slot >= 0) source[slot] = j;
}

// out[r] = w[source[r]] * x[source[r] / k] (w = 1 when null), zero for empty slots.
template <typename scalar_t>
__global__ void gather_rows_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ source,
                                   const float* __restrict__ weights, int64_t d, int64_t k,
                                   scalar_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const int64_t j = source[r];
  scalar_t* o = out + r * d;
  if (j < 0) {
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) o[i] = from_float<scalar_t>(0.0f);
    return;
  }
  const scalar_t* row = x + (j / k) * d;
  const float w = weights == nullptr ? 1.0f : weights[j];
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) o[i] = from_float<scalar_t>(w * to_float(row[i]));
}

// y[t] = sum over kept s of w[t, s] * buffer[slot(t, s)], in float32, s = 0, 1, ...
template <typename scalar_t>
__global__ void combine_kernel(const scalar_t* __restrict__ buffer, const int64_t* __restrict__ experts,
                               const int64_t* __restrict__ positions, const float* __restrict__ weights,
                               int64_t E, int64_t C, int64_t d, int64_t k, scalar_t* __restrict__ y) {
  const int64_t t = blockIdx.x;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t slot = dispatch::kept_slot(experts[t * k + s], positions[t * k + s], E, C);
      if (slot < 0) continue;
      const float w = weights == nullptr ? 1.0f : weights[t * k + s];
      acc += w * to_float(buffer[slot * d + i]);
    }
    y[t * d + i] = from_float<scalar_t>(acc);
  }
}

// grad_weights[j] = <grad_y[j / k], buffer[slot(j)]>, one warp per choice (fixed reduction order).
template <typename scalar_t>
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
    for (int64_t i = lane; i < d; i += kWarp) acc += to_float(g[i]) * to_float(b[i]);
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (lane == 0) grad_weights[j] = acc;
}

}  // namespace

cudaError_t capacity_positions_cuda(const int64_t* experts, const int64_t* order, int64_t n, int64_t E, int64_t C,
                                    int64_t* positions, int64_t* counts, cudaStream_t stream) {
  if (E == 0) return cudaSuccess;
  capacity_positions_kernel<<<(unsigned)E, kScanThreads, 0, stream>>>(experts, order, n, C, positions, counts);
  return cudaGetLastError();
}

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
    gather_rows_kernel<scalar_t><<<(unsigned)S, kRowThreads, 0, stream>>>(
        static_cast<const scalar_t*>(x), source, weights, d, k, static_cast<scalar_t*>(out));
    return cudaGetLastError();
  });
}

cudaError_t combine_cuda(const void* buffer, DType dtype, int64_t E, int64_t C, int64_t d, int64_t T, int64_t k,
                         const int64_t* experts, const int64_t* positions, const float* weights, void* y,
                         cudaStream_t stream) {
  if (T == 0 || d == 0) return cudaSuccess;
  return MK_DISPATCH_FLOAT(dtype, [&] {
    combine_kernel<scalar_t><<<(unsigned)T, kRowThreads, 0, stream>>>(
        static_cast<const scalar_t*>(buffer), experts, positions, weights, E, C, d, k, static_cast<scalar_t*>(y));
    return cudaGetLastError();
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
    row_dots_kernel<scalar_t><<<blocks, kWarpsPerBlock * kWarp, 0, stream>>>(
        static_cast<const scalar_t*>(grad_y), static_cast<const scalar_t*>(buffer), experts, positions, n, E, C, d, k,
        grad_weights);
    return cudaGetLastError();
  });
}

}  // namespace moe_kernels
