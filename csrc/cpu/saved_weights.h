// The inputs of a backward that runs from a forward's saved float32 routing weights
// (topk_softmax_backward_from_weights, topk_router_backward_from_weights), checked once for both.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "index_check.h"

namespace moe_kernels {

struct SavedWeights {
  at::Tensor w, g, ex;  // contiguous: weights float32, grad_weights as float32, experts int64
  int64_t T = 0, k = 0, E = 0;
};

// weights [T, k] float32, grad_weights [T, k] floating, experts [T, k] int64 ids in [0, E),
// 1 <= k <= E = num_experts; a RuntimeError (IndexError for an id) names op and the argument.
inline SavedWeights saved_weights(const at::Tensor& grad_weights, const at::Tensor& weights, const at::Tensor& experts,
                                  int64_t num_experts, const char* op) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat, op,
              ": weights must be a float32 [T, k] tensor");
  TORCH_CHECK(grad_weights.sizes() == weights.sizes() && experts.sizes() == weights.sizes(), op,
              ": grad_weights and experts must have the weights' shape ", weights.sizes());
  TORCH_CHECK(at::isFloatingType(grad_weights.scalar_type()), op, ": grad_weights must be floating");
  SavedWeights s;
  s.T = weights.size(0);
  s.k = weights.size(1);
  s.E = num_experts;
  TORCH_CHECK(s.k >= 1 && s.k <= s.E, op, ": need 1 <= k <= num_experts, got k=", s.k, ", num_experts=", s.E);
  s.w = weights.contiguous();
  s.g = grad_weights.to(at::kFloat).contiguous();
  s.ex = experts.contiguous();
  check_routing_ids(s.ex, s.E, s.k, op, "experts");
  return s;
}

}  // namespace moe_kernels
