// Fused top-k + softmax on CUDA: one warp per row, any E. Round s of k: every lane takes the
// largest (value, index) pair of its strided share of the row that ranks below round s-1's pick,
// and a warp max-reduction picks the row's s-th expert. Pairs are unique, so no tie handling.
#include <cuda_runtime.h>

#include "convert.cuh"
#include "warp.cuh"
#include "moe_kernels/cuda_launchers.h"
#include "moe_kernels/topk_softmax.h"

namespace moe_kernels {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename scalar_t>
__global__ void topk_softmax_kernel(const scalar_t* __restrict__ logits,  // [T, E] strided
                                    int64_t T, int64_t E, int64_t stride_t, int64_t stride_e,
                                    int64_t k, bool renormalize,
                                    scalar_t* __restrict__ weights,  // [T, k]
                                    int64_t* __restrict__ experts) {  // [T, k]
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= T) return;  // whole warps exit together: row is uniform across a warp
  const scalar_t* x = logits + row * stride_t;
  int64_t* out_experts = experts + row * k;

  // Phase 1: select, write experts, accumulate the renormalised denominator.
  int64_t prev = 0;
  float vmax = 0.0f, denom = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    int64_t best = kNoPair;
    for (int64_t e = lane; e < E; e += kWarp) {
      const int64_t p = rank_pair(to_float(x[e * stride_e]), (int32_t)e);
      if ((s == 0 || p < prev) && p > best) best = p;
    }
    best = warp_max(best);
    prev = best;
    const int32_t idx = pair_index(best);
    const float v = to_float(x[idx * stride_e]);
    if (s == 0) vmax = v;
    if (renormalize) denom += topk_softmax::exp_term(v, vmax);
    if (lane == 0) out_experts[s] = idx;
  }
  if (!renormalize) {
    float partial = 0.0f;
    for (int64_t e = lane; e < E; e += kWarp) partial += topk_softmax::exp_term(to_float(x[e * stride_e]), vmax);
    denom = warp_sum(partial);
  }
  __syncwarp();  // lane 0's expert writes are visible to the whole warp after this

  // Phase 2: weights, the k slots spread over the lanes.
  for (int64_t s = lane; s < k; s += kWarp) {
    const float v = to_float(x[out_experts[s] * stride_e]);
    weights[row * k + s] = from_float<scalar_t>(topk_softmax::weight(v, vmax, denom));
  }
}

// Backward, one warp per row: grad [T, E] from grad_weights [T, k] (same dtype as logits),
// recomputing the selected weights in float32 (see csrc/cpu/topk_softmax.cpp for the formulas).
template <typename scalar_t>
__global__ void topk_softmax_backward_kernel(const scalar_t* __restrict__ grad_weights,  // [T, k]
                                             const scalar_t* __restrict__ logits,  // [T, E] strided
                                             const int64_t* __restrict__ experts,  // [T, k]
                                             int64_t T, int64_t E, int64_t stride_t, int64_t stride_e,
                                             int64_t k, bool renormalize,
                                             scalar_t* __restrict__ grad) {  // [T, E]
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= T) return;
  const scalar_t* x = logits + row * stride_t;
  const int64_t* ex = experts + row * k;
  const scalar_t* g = grad_weights + row * k;
  scalar_t* out = grad + row * E;
  // Ids come from the caller: a row holding one outside [0, E) gets a zero gradient and no
  // memory is touched through it (the device cannot raise; the CPU kernel raises an IndexError).
  bool bad = false;
  for (int64_t s = lane; s < k; s += kWarp) bad |= ex[s] < 0 || ex[s] >= E;
  if (__any_sync(0xffffffffu, bad)) {
    for (int64_t e = lane; e < E; e += kWarp) out[e] = from_float<scalar_t>(0.0f);
    return;
  }
  const float vmax = to_float(x[ex[0] * stride_e]);  // experts[t, 0] is the row max
  float partial = 0.0f;
  if (renormalize) {
    for (int64_t s = lane; s < k; s += kWarp) partial += topk_softmax::exp_term(to_float(x[ex[s] * stride_e]), vmax);
  } else {
    for (int64_t e = lane; e < E; e += kWarp) partial += topk_softmax::exp_term(to_float(x[e * stride_e]), vmax);
  }
  const float denom = warp_sum(partial);
  float dot_part = 0.0f;
  for (int64_t s = lane; s < k; s += kWarp)
    dot_part += to_float(g[s]) * topk_softmax::weight(to_float(x[ex[s] * stride_e]), vmax, denom);
  const float dot = warp_sum(dot_part);
  const bool masked = vmax == -INFINITY;
  for (int64_t e = lane; e < E; e += kWarp) {
    // Off the selection the renormalised softmax (and a masked row) does not depend on the logit:
    // exactly 0, also when dot is NaN (a NaN row), as the reference's autograd gives.
    const bool off = renormalize || masked;
    const float p = off ? 0.0f : topk_softmax::weight(to_float(x[e * stride_e]), vmax, denom);
    out[e] = from_float<scalar_t>(off ? 0.0f : -p * dot);
  }
  __syncwarp();  // the selected entries below overwrite / add to the row written above
  for (int64_t s = lane; s < k; s += kWarp) {
    const float w = topk_softmax::weight(to_float(x[ex[s] * stride_e]), vmax, denom);
    const float base = renormalize ? -w * dot : to_float(out[ex[s]]);
    out[ex[s]] = from_float<scalar_t>(base + to_float(g[s]) * w);
  }
}

}  // namespace

cudaError_t topk_softmax_backward_cuda(const void* grad_weights, const void* logits, DType dtype, int64_t T,
                                       int64_t E, int64_t stride_t, int64_t stride_e, const int64_t* experts,
                                       int64_t k, bool renormalize, void* grad, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  const dim3 block(kWarp * kWarpsPerBlock);
  const dim3 grid((unsigned)((T + kWarpsPerBlock - 1) / kWarpsPerBlock));
  return MK_DISPATCH_FLOAT(dtype, [&] {
    topk_softmax_backward_kernel<scalar_t><<<grid, block, 0, stream>>>(
        static_cast<const scalar_t*>(grad_weights), static_cast<const scalar_t*>(logits), experts, T, E,
        stride_t, stride_e, k, renormalize, static_cast<scalar_t*>(grad));
    return cudaGetLastError();
  });
}

cudaError_t topk_softmax_cuda(const void* logits, DType dtype, int64_t T, int64_t E, int64_t stride_t,
                              int64_t stride_e, int64_t k, bool renormalize, void* weights,
                              int64_t* experts, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  const dim3 block(kWarp * kWarpsPerBlock);
  const dim3 grid((unsigned)((T + kWarpsPerBlock - 1) / kWarpsPerBlock));
  return MK_DISPATCH_FLOAT(dtype, [&] {
    topk_softmax_kernel<scalar_t><<<grid, block, 0, stream>>>(
        static_cast<const scalar_t*>(logits), T, E, stride_t, stride_e, k, renormalize,
        static_cast<scalar_t*>(weights), experts);
    return cudaGetLastError();
  });
}

}  // namespace moe_kernels
