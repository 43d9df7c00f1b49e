// Smooth load estimator P(x, i) (eqs 8-9 of Shazeer et al. 2017, Appendix A) on CUDA: one warp
// per row, any E. k+1 rounds of a warp max over the row's (value, index) pairs find the k-th and
// (k+1)-th largest noisy logits (round s takes the largest pair below round s-1's pick); then every
// lane writes P for its strided share of the row. Pairs are unique, so no tie handling.
#include <cuda_runtime.h>

#include "convert.cuh"
#include "warp.cuh"
#include "moe_kernels/cuda_launchers.h"
#include "moe_kernels/load_probabilities.h"

namespace moe_kernels {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename scalar_t>
__global__ void load_probabilities_kernel(const scalar_t* __restrict__ clean,   // [T, E] strided
                                          const scalar_t* __restrict__ noisy,   // [T, E] strided
                                          const scalar_t* __restrict__ stddev,  // [T, E] strided
                                          LoadProbabilitiesStrides st, int64_t T, int64_t E, int64_t k,
                                          scalar_t* __restrict__ probs,  // [T, E] contiguous
                                          int64_t* __restrict__ top) {   // [T, k+1] contiguous
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= T) return;  // whole warps exit together: row is uniform across a warp
  const scalar_t* n = noisy + row * st.noisy_t;

  // Phase 1: the k+1 largest pairs (all E when k = E); keep the k-th pair and value, the (k+1)-th value.
  const int64_t kept = k < E ? k + 1 : E;
  int64_t prev = 0, kth_pair = kNoPair;
  float kth = 0.0f, k1th = -INFINITY;
  for (int64_t s = 0; s < kept; ++s) {
    int64_t best = kNoPair;
    for (int64_t e = lane; e < E; e += kWarp) {
      const int64_t p = rank_pair(to_float(n[e * st.noisy_e]), (int32_t)e);
      if ((s == 0 || p < prev) && p > best) best = p;
    }
    best = warp_max(best);
    prev = best;
    const int32_t idx = pair_index(best);
    const float v = to_float(n[idx * st.noisy_e]);  // re-read: NaN payloads and -0 as stored
    if (s == k - 1) {
      kth_pair = best;
      kth = v;
    }
    if (s == k) k1th = v;
    if (lane == 0) top[row * (k + 1) + s] = idx;
  }
  if (lane == 0 && kept == k) top[row * (k + 1) + k] = -1;

  // Phase 2: P = Phi((clean - kth_excluding) / stddev) for the lane's share of the row.
  for (int64_t e = lane; e < E; e += kWarp) {
    const bool selected = rank_pair(to_float(n[e * st.noisy_e]), (int32_t)e) >= kth_pair;
    const float z = load_probabilities::z_score(to_float(clean[row * st.clean_t + e * st.clean_e]),
                                                selected ? k1th : kth,
                                                to_float(stddev[row * st.stddev_t + e * st.stddev_e]));
    probs[row * E + e] = from_float<scalar_t>(load_probabilities::normal_cdf(z));
  }
}

}  // namespace

cudaError_t load_probabilities_cuda(const void* clean, const void* noisy, const void* stddev, DType dtype,
                                    LoadProbabilitiesStrides strides, int64_t T, int64_t E, int64_t k, void* probs,
                                    int64_t* top, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  const dim3 block(kWarp * kWarpsPerBlock);
  const dim3 grid((unsigned)((T + kWarpsPerBlock - 1) / kWarpsPerBlock));
  return MK_DISPATCH_FLOAT(dtype, [&] {
    load_probabilities_kernel<scalar_t><<<grid, block, 0, stream>>>(
        static_cast<const scalar_t*>(clean), static_cast<const scalar_t*>(noisy), static_cast<const scalar_t*>(stddev),
        strides, T, E, k, static_cast<scalar_t*>(probs), top);
    return cudaGetLastError();
  });
}

}  // namespace moe_kernels
