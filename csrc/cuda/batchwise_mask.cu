// Batchwise top-m mask (eq 18, Shazeer et al. 2017 Appendix F) on CUDA: one block per expert.
// Radix select of the m-th largest order key of the expert's column (8 bits per pass, MSB first;
// each pass builds a shared-memory histogram of the keys that share the digits found so far, and
// one thread picks the next digit with the logic shared with the CPU kernel), then one pass over
// the column in token order: a block-wide prefix sum ranks the ties (the first `remaining` are
// kept: ties go to the lower index) and compacts the kept tokens into the expert's list.
#include <cuda_runtime.h>

#include "convert.cuh"
#include "warp.cuh"
#include "moe_kernels/batchwise_mask.h"
#include "moe_kernels/cuda_launchers.h"

namespace moe_kernels {
namespace {

using batchwise_mask::digit;
using batchwise_mask::kRadixBins;
using batchwise_mask::kRadixBits;
using batchwise_mask::kRadixPasses;
using batchwise_mask::order_key;

constexpr int kThreads = 256;

// Exclusive prefix sum over the block of two counters packed in one int64 (high: ties, low:
// kept), plus the block total. `scratch` holds one value per warp.
__device__ __forceinline__ long long block_exclusive_scan(long long v, long long* scratch, long long* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  long long inclusive = v;
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const long long n = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += n;
  }
  if (lane == kWarp - 1) scratch[warp] = inclusive;
  __syncthreads();
  long long warp_offset = 0, sum = 0;
  for (int w = 0; w < kThreads / kWarp; ++w) {
    if (w < warp) warp_offset += scratch[w];
    sum += scratch[w];
  }
  __syncthreads();  // scratch is reused by the next call
  *total = sum;
  return warp_offset + inclusive - v;
}

template <typename scalar_t>
__global__ void batchwise_mask_kernel(
    const scalar_t* __restrict__ scores,  // [T, E] strided
    int64_t T, int64_t E, int64_t stride_t, int64_t stride_e, int64_t m,
    bool* __restrict__ mask,         // [T, E] contiguous, zero-initialised
    int64_t* __restrict__ tokens) {  // [E, m] contiguous
  __shared__ int64_t hist[kRadixBins];
  __shared__ uint32_t prefix_shared;
  __shared__ int64_t remaining_shared;
  __shared__ long long scratch[kThreads / kWarp];
  const int64_t e = blockIdx.x;
  const scalar_t* column = scores + e * stride_e;
  if (threadIdx.x == 0) {
    prefix_shared = 0;
    remaining_shared = m;
  }
  for (int pass = 0; pass < kRadixPasses; ++pass) {
    for (int b = threadIdx.x; b < kRadixBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_shared;
    const int high = kRadixBits * pass;  // leading bits already fixed
    for (int64_t t = threadIdx.x; t < T; t += kThreads) {
      const uint32_t key = order_key(to_float(column[t * stride_t]));
      const bool match = high == 0 || (key >> (32 - high)) == (prefix >> (32 - high));
      // Histogram counts do not depend on the order of the atomics: the result is deterministic.
      if (match) atomicAdd(reinterpret_cast<unsigned long long*>(&hist[digit(key, pass)]), 1ull);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t remaining = remaining_shared;
      const uint32_t d = batchwise_mask::select_digit(hist, &remaining);
      remaining_shared = remaining;
      prefix_shared = prefix | (d << (32 - kRadixBits * (pass + 1)));
    }
    __syncthreads();
  }
  const uint32_t threshold = prefix_shared;
  const int64_t remaining = remaining_shared;
  int64_t ties_before = 0, kept_before = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kThreads) {
    const int64_t t = t0 + threadIdx.x;
    uint32_t key = 0;
    if (t < T) key = order_key(to_float(column[t * stride_t]));
    const bool tie = t < T && key == threshold;
    long long total = 0;
    const long long tie_rank = ties_before + block_exclusive_scan(tie ? 1 : 0, scratch, &total);
    ties_before += total;
    const bool keep = t < T && (key > threshold || (tie && tie_rank < remaining));
    const long long pos = kept_before + block_exclusive_scan(keep ? 1 : 0, scratch, &total);
    kept_before += total;
    if (keep) {
      mask[t * E + e] = true;
      tokens[e * m + pos] = t;
    }
  }
}

}  // namespace

cudaError_t batchwise_mask_cuda(const void* scores, DType dtype, int64_t T, int64_t E, int64_t stride_t,
                                int64_t stride_e, int64_t m, bool* mask, int64_t* expert_tokens,
                                cudaStream_t stream) {
  if (m == 0 || E == 0) return cudaSuccess;
  return MK_DISPATCH_FLOAT(dtype, [&] {
    batchwise_mask_kernel<scalar_t><<<(unsigned)E, kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(scores), T, E, stride_t, stride_e, m, mask, expert_tokens);
    return cudaGetLastError();
  });
}

}  // namespace moe_kernels
