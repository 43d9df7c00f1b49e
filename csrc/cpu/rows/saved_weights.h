// The backwards that run from a forward's saved float32 routing weights
// (topk_softmax_backward_from_weights, topk_router_backward_from_weights): their inputs, checked
// once for both, and the rows of their gradient, written by one body.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "rows/index_check.h"
#include "score/vec_math.h"

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

// The gradient of n rows (out [n, E] contiguous) of renormalised weights w = scaling * r (r a
// softmax over the k selected logits; w, g [n * k] float32): each row filled, then
// grad_s = w_s (g_s - sum_j g_j (w_j / scaling)) at its k experts. A row whose weights are all 0
// (fully masked, or every selected score underflowed) stays 0 even for a non-finite g. kNanRows:
// a row whose first weight is NaN (its logits held NaN or +inf: every weight is then NaN) is NaN
// everywhere, as topk_router's logits backward has it; otherwise NaN only at its k experts, as
// topk_softmax's. w / scaling is exact for scaling = 1, and exactly 1 for a weight of exactly
// scaling (whose gradient is then exactly 0). The caller compiles it per instruction set, with
// GCC's rewrite of the fill loop into a memset call per row turned off (that call cost as much as
// the rest of the backward).
template <bool kNanRows, typename out_t>
MK_VECTORISE MK_ALWAYS_INLINE void renormalized_grad_rows(const float* __restrict w, const float* __restrict g,
                                          const int64_t* __restrict experts, int64_t n, int64_t k, int64_t E,
                                          float scaling, out_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    out_t* row = out + i * E;
    const float first = w[i * k];
    const bool nan_row = kNanRows && first != first;
    const out_t fill = nan_row ? (out_t)NAN : (out_t)0.0f;
    for (int64_t e = 0; e < E; ++e) row[e] = fill;
    bool any = false;
    for (int64_t s = 0; s < k; ++s) any |= w[i * k + s] != 0.0f;
    if (!any || nan_row) continue;
    float dot = 0.0f;
    for (int64_t s = 0; s < k; ++s) dot += g[i * k + s] * (w[i * k + s] / scaling);
    for (int64_t s = 0; s < k; ++s) row[experts[i * k + s]] = (out_t)(w[i * k + s] * (g[i * k + s] - dot));
  }
}

}  // namespace moe_kernels
