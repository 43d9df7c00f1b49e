// Host entry points of the CUDA kernels (csrc/cuda/<op>.cu). Raw pointers, sizes and a stream:
// no torch types, so the .cu files compile with nvcc alone. Each returns the launch's error code.
// Called only from csrc/cuda_ops.cpp.
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {

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

namespace moe_kernels {

// capacity_positions (csrc/cuda/capacity_positions.cu). experts / positions: [T, k] contiguous
// int64; counts [E] int64. The segment kernels, where capacity_segments::supported(E, T k):
// order is the fill order [T k] (flat indices t*k+s) or null for the default s-major one; path: a
// capacity_segments::Path (kAuto: the launcher's choice; cudaErrorInvalidValue where it does not
// fit, capacity_segments::path_fits); table: scratch of capacity_positions_table_size int32; every
// position is written.
int64_t capacity_positions_table_size(int64_t T, int64_t k, int64_t E, bool given);
cudaError_t capacity_positions_segments_cuda(const int64_t* experts, const int64_t* order, int64_t T, int64_t k,
                                             int64_t E, int64_t C, int path, int32_t* table, int64_t* positions,
                                             int64_t* counts, cudaStream_t stream);
// Any E and n = T k: a block per expert scans the whole fill order `order` [n]; positions [n]
// must be prefilled with -1.
cudaError_t capacity_positions_cuda(const int64_t* experts, const int64_t* order, int64_t n, int64_t E, int64_t C,
                                    int64_t* positions, int64_t* counts, cudaStream_t stream);

// Capacity routing (csrc/cuda/dispatch.cu). experts / positions: [T, k] contiguous int64.
// out [E, C, d] = x rows (times weights [T*k] float32 if not null) at the kept slots, zero elsewhere;
// source: scratch of E*C int64.
cudaError_t dispatch_cuda(const void* x, DType dtype, int64_t T, int64_t d, int64_t k, const int64_t* experts,
                          const int64_t* positions, int64_t E, int64_t C, const float* weights, int64_t* source,
                          void* out, cudaStream_t stream);
// y [T, d] = sum over kept s of weights[t, s] (float32, 1 if null) * buffer [E, C, d] rows.
cudaError_t combine_cuda(const void* buffer, DType dtype, int64_t E, int64_t C, int64_t d, int64_t T, int64_t k,
                         const int64_t* experts, const int64_t* positions, const float* weights, void* y,
                         cudaStream_t stream);
// grad_weights [T*k] float32 = <grad_y [T, d] row, buffer row of the kept slot>, 0 if not kept.
cudaError_t combine_weights_grad_cuda(const void* grad_y, const void* buffer, DType dtype, int64_t E, int64_t C,
                                      int64_t d, int64_t T, int64_t k, const int64_t* experts,
                                      const int64_t* positions, float* grad_weights, cudaStream_t stream);

}  // namespace moe_kernels

namespace moe_kernels {

// Exact balanced assignment (csrc/cuda/balanced_assignment.cu). scores [n, k] contiguous;
// experts [n] int64, value 0-dim float64, distances [k, k] float64 (written only on success);
// workspace: balanced_assignment_cuda_workspace(n, k, capacity) bytes. Requires n, k < 2^31,
// capacity * k >= n, finite scores. Synchronises `stream` once per few rounds (the done flag).
// *status: kAssignmentSolved, or (outputs unwritten) kAssignmentOverflow where a token had no
// finite bid (the auction's prices overflowed: float64 scores near the float64 limit),
// kAssignmentGuard where a guard tripped (the auction's iterations or the round cap: a bug).
enum AssignmentStatus : int { kAssignmentSolved = 0, kAssignmentGuard = 1, kAssignmentOverflow = 2 };
// eps_div: the auction's eps = spread / eps_div; 0 for the default (balanced_assignment_steps.h).
size_t balanced_assignment_cuda_workspace(int64_t n, int64_t k, int64_t capacity);
// After a solve on `workspace`: profile [kBalancedProfileFields] = its ints (balanced_assignment::Int
// slots, kNumInts), its clocks (balanced_assignment::Clock slots, kNumClocks) and the device's clock
// rate in kHz (balanced_assignment.cu checks the count).
constexpr int kBalancedProfileFields = 12 + 7 + 1;
cudaError_t balanced_assignment_cuda_profile(void* workspace, int64_t n, int64_t k, int64_t capacity,
                                             int64_t* profile, cudaStream_t stream);
cudaError_t balanced_assignment_cuda(const float* scores, int64_t n, int64_t k, int64_t capacity, double eps_div,
                                     void* workspace, int64_t* experts, double* value, double* distances, int* status,
                                     cudaStream_t stream);
cudaError_t balanced_assignment_cuda(const double* scores, int64_t n, int64_t k, int64_t capacity, double eps_div,
                                     void* workspace, int64_t* experts, double* value, double* distances, int* status,
                                     cudaStream_t stream);

}  // namespace moe_kernels

#include "moe_kernels/topk_router_row.h"

namespace moe_kernels {

// topk_router (csrc/cuda/topk_router.cu). logits [T, E] strided, float32/16/bf16 or float64;
// bias [E] (or null), weights [T, k] and grad_weights [T, k] contiguous in the compute type
// (float64 for float64 logits, else float32); experts [T, k] contiguous int64; grad [T, E]
// contiguous in the logits' dtype. A grouped call needs num_groups <= topk_router::kMaxGroups.
cudaError_t topk_router_cuda(const void* logits, DType dtype, int64_t T, int64_t stride_t, int64_t stride_e,
                             const void* bias, const topk_router::RowParams& params, void* weights, int64_t* experts,
                             cudaStream_t stream);
cudaError_t topk_router_backward_cuda(const void* grad_weights, const void* logits, DType dtype, int64_t T,
                                      int64_t stride_t, int64_t stride_e, const int64_t* experts,
                                      const topk_router::RowParams& params, void* grad, cudaStream_t stream);

}  // namespace moe_kernels
