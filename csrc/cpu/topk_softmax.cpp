// Fused top-k selection + softmax on CPU: one pass over each row keeps the k best (value, index)
// pairs, a second pass (only for renormalize=false) sums the full softmax denominator.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "moe_kernels/topk_softmax.h"

namespace moe_kernels {
namespace {

// Above this k the insertion list costs O(E*k) on adversarial (ascending) rows; a partial sort
// of all pairs is O(E log k) and wins.
constexpr int64_t kInsertionMaxK = 16;

template <typename scalar_t>
void topk_softmax_rows(const scalar_t* logits,  // [T, E], strides (stride_t, stride_e)
                       int64_t stride_t, int64_t stride_e, int64_t begin, int64_t end,
                       int64_t E, int64_t k, bool renormalize,
                       scalar_t* weights,       // [T, k] contiguous
                       int64_t* experts) {      // [T, k] contiguous
  using topk_softmax::exp_term;
  using topk_softmax::weight;
  std::vector<int64_t> best(k > kInsertionMaxK ? E : k);
  for (int64_t t = begin; t < end; ++t) {
    const scalar_t* row = logits + t * stride_t;
    if (k <= kInsertionMaxK) {
      int filled = 0;
      for (int64_t e = 0; e < E; ++e)
        filled = topk_softmax::insert_pair(best.data(), filled, (int)k,
                                           rank_pair((float)row[e * stride_e], (int32_t)e));
    } else {
      for (int64_t e = 0; e < E; ++e) best[e] = rank_pair((float)row[e * stride_e], (int32_t)e);
      std::partial_sort(best.begin(), best.begin() + k, best.end(), std::greater<int64_t>());
    }
    // Values are re-read from the row rather than decoded from the key: NaN payloads and -0
    // must come out exactly as the reference sees them.
    const float vmax = (float)row[pair_index(best[0]) * stride_e];
    float denom = 0.0f;
    if (renormalize) {
      for (int64_t s = 0; s < k; ++s) denom += exp_term((float)row[pair_index(best[s]) * stride_e], vmax);
    } else {
      for (int64_t e = 0; e < E; ++e) denom += exp_term((float)row[e * stride_e], vmax);
    }
    for (int64_t s = 0; s < k; ++s) {
      const int32_t e = pair_index(best[s]);
      experts[t * k + s] = e;
      weights[t * k + s] = (scalar_t)weight((float)row[e * stride_e], vmax, denom);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> topk_softmax_cpu(const at::Tensor& logits, int64_t k,
                                                    bool renormalize) {
  TORCH_CHECK(logits.dim() == 2, "topk_softmax: logits must be [T, E], got ", logits.sizes());
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "topk_softmax: need 1 <= k <= E, got k=", k, ", E=", E);
  TORCH_CHECK(E <= INT32_MAX, "topk_softmax: E too large");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kHalf ||
                  logits.scalar_type() == at::kBFloat16,
              "topk_softmax: logits must be float32, float16 or bfloat16, got ", logits.scalar_type());
  auto weights = at::empty({T, k}, logits.options());
  auto experts = at::empty({T, k}, logits.options().dtype(at::kLong));
  if (T == 0) return {weights, experts};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "topk_softmax", [&] {
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    scalar_t* w = weights.mutable_data_ptr<scalar_t>();
    int64_t* ex = experts.mutable_data_ptr<int64_t>();
    const int64_t st = logits.stride(0), se = logits.stride(1);
    // About 32k logits per task: small enough to balance, large enough to amortise the fork.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(E, 1));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      topk_softmax_rows<scalar_t>(x, st, se, begin, end, E, k, renormalize, w, ex);
    });
  });
  return {weights, experts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("topk_softmax(Tensor logits, int k, bool renormalize) -> (Tensor weights, Tensor experts)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("topk_softmax", &topk_softmax_cpu); }

}  // namespace moe_kernels
