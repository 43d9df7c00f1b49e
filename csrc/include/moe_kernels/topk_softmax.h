// topk_softmax logic shared by the CPU (csrc/cpu/topk_softmax.cpp) and CUDA
// (csrc/cuda/topk_softmax.cu) kernels. No torch headers.
#pragma once
#include <math.h>
#include "moe_kernels/common.h"

namespace moe_kernels {
namespace topk_softmax {

// Insert `pair` into `best`, the k largest pairs seen so far in descending order (`filled` of
// them valid). Returns the new fill count. Pairs are distinct, so no tie handling is needed:
// rank_pair already put the lower index first.
MK_HD int insert_pair(int64_t* best, int filled, int k, int64_t pair) {
  if (filled == k) {
    if (pair <= best[k - 1]) return filled;  // the common case once the list is warm
    filled = k - 1;
  }
  int j = filled;
  while (j > 0 && best[j - 1] < pair) {
    best[j] = best[j - 1];
    --j;
  }
  best[j] = pair;
  return filled + 1;
}

// exp(v - vmax) / denom with the convention for rows whose largest selected logit is -inf
// (fully masked tokens): weight 0 instead of the NaN that exp(-inf - -inf) would give.
MK_HD float weight(float v, float vmax, float denom) {
  if (vmax == -INFINITY) return 0.0f;
  return expf(v - vmax) / denom;
}

// The softmax denominator term for one logit, with the same -inf convention.
MK_HD float exp_term(float v, float vmax) {
  return vmax == -INFINITY ? 0.0f : expf(v - vmax);
}

}  // namespace topk_softmax
}  // namespace moe_kernels
