// Vectorised primitives over one contiguous float32 row, for the row-per-token routing kernels
// (topk_softmax). Their scalar loops spend their time on data-dependent branches (the argmax) and
// libm expf calls (the softmax denominators); these bodies have neither.
#pragma once
#include <cstdint>

namespace moe_kernels {

// Index of the largest element of row[0 .. E) in the routing ops' rank order (rank_key in
// moe_kernels/common.h: NaN highest, -0 == +0, ties to the lower index). E >= 1.
int32_t row_argmax_f32(const float* row, int64_t E);

// The k largest (value, index) rank pairs of row[0 .. E) into best[0 .. k), descending (rank_pair
// of common.h), for 1 <= k <= E. Chunks of 8 are compared against the k-th key in one vector
// compare; only chunks holding a larger key go through the insertion list (topk_softmax.h).
void row_topk_f32(const float* row, int64_t E, int k, int64_t* best);

// Above this k an insertion list costs O(E k) on adversarial (ascending) rows; a partial sort of
// all pairs is O(E log k) and wins.
constexpr int64_t kRowInsertionMaxK = 16;

// The k largest rank pairs of row[0 .. E) into best, descending, 1 <= k <= E: row_argmax_f32
// (k = 1), row_topk_f32 (k <= kRowInsertionMaxK), else a partial sort (best must then hold E
// pairs). topk_softmax and noisy_topk_gate select through here (load_probabilities still has its own
// scalar insertion list).
void row_top_pairs(const float* row, int64_t E, int64_t k, int64_t* best);

// sum over e of exp(row[e] - vmax), each term also stored to exps[e] (exps [E], not aliasing
// row). vmax is the row's largest value (every argument is <= 0), finite or NaN (NaN terms and
// sum). vec_math::exp: terms below e^-80 (including those of -inf logits) are 0; a few ulp each.
float row_exp_sum_f32(const float* row, int64_t E, float vmax, float* exps);

}  // namespace moe_kernels
