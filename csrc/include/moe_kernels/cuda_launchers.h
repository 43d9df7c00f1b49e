// Host entry points of the CUDA kernels (csrc/cuda/<op>.cu). Raw pointers, sizes and a stream:
// no torch types, so the .cu files compile with nvcc alone. Each returns the launch's error code.
// Called only from csrc/cuda_ops.cpp.
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {

// logits [T, E] with strides (stride_t, stride_e); weights [T, k] contiguous, same dtype;
// experts [T, k] contiguous int64.
cudaError_t topk_softmax_cuda(const void* logits, DType dtype, int64_t T, int64_t E, int64_t stride_t,
                              int64_t stride_e, int64_t k, bool renormalize, void* weights,
                              int64_t* experts, cudaStream_t stream);

// grad_weights [T, k] contiguous and grad [T, E] contiguous, both in the logits' dtype.
cudaError_t topk_softmax_backward_cuda(const void* grad_weights, const void* logits, DType dtype, int64_t T,
                                       int64_t E, int64_t stride_t, int64_t stride_e, const int64_t* experts,
                                       int64_t k, bool renormalize, void* grad, cudaStream_t stream);

// scores [T, E] with strides (stride_t, stride_e); mask [T, E] contiguous bool, zero-initialised
// by the caller; expert_tokens [E, m] contiguous int64. 1 <= m <= T for a launch (m = 0: no-op).
cudaError_t batchwise_mask_cuda(const void* scores, DType dtype, int64_t T, int64_t E, int64_t stride_t,
                                int64_t stride_e, int64_t m, bool* mask, int64_t* expert_tokens,
                                cudaStream_t stream);

}  // namespace moe_kernels

namespace moe_kernels {

// Element strides (token, expert) of the three [T, E] inputs of load_probabilities.
struct LoadProbabilitiesStrides {
  int64_t clean_t, clean_e, noisy_t, noisy_e, stddev_t, stddev_e;
};

// clean / noisy / stddev [T, E] strided, one dtype; probs [T, E] contiguous, same dtype;
// top [T, k+1] contiguous int64 (indices of the k+1 largest noisy logits, -1 past E).
cudaError_t load_probabilities_cuda(const void* clean, const void* noisy, const void* stddev, DType dtype,
                                    LoadProbabilitiesStrides strides, int64_t T, int64_t E, int64_t k, void* probs,
                                    int64_t* top, cudaStream_t stream);

}  // namespace moe_kernels
