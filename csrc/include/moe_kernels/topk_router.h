// topk_router rules shared by the CPU kernel (csrc/cpu/topk_router.cpp) and any device kernel:
// the rank order, the group score, the weights' renormalisation and its gradient. No torch
// headers. The specification is moe_kernels/reference/topk_router.py.
#pragma once
#include <math.h>
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace topk_router {

enum Scoring : int { kSoftmax = 0, kSigmoid = 1 };
enum GroupScoring : int { kTop2Sum = 0, kMax = 1 };

// The routing ops' rank order on (value, index): NaN above every number, -0 == +0, equal values
// to the lower index. For float this is the order of rank_pair (common.h).
template <typename T>
MK_HD bool ranks_above(T a, int64_t ia, T b, int64_t ib) {
  const bool na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

// The two largest values of a set, pushed one at a time or merged from two partial sets (a warp
// reduction); a NaN is remembered apart, since it compares false with everything.
template <typename T>
struct Top2 {
  T first = -INFINITY, second = -INFINITY;
  bool nan = false;
  MK_HD void push(T x) {
    nan |= x != x;
    if (x > first) {
      second = first;
      first = x;
    } else if (x > second) {
      second = x;
    }
  }
  MK_HD Top2 merged(const Top2& o) const {
    Top2 r;
    r.first = first > o.first ? first : o.first;
    const T low = first > o.first ? o.first : first;
    const T next = second > o.second ? second : o.second;
    r.second = low > next ? low : next;
    r.nan = nan || o.nan;
    return r;
  }
  // The group score: the largest ("max", DeepSeek-V2) or the sum of the two largest ("top2_sum",
  // DeepSeek-V3; n >= 2). Only values matter (which of two equal experts ranks first changes
  // neither); a NaN ranks above every number, so any NaN gives NaN.
  MK_HD T score(int group_scoring) const {
    if (nan) return T(NAN);
    return group_scoring == kMax ? first : first + second;
  }
};

// A group's score from the choice values v[0 .. n) of its experts, in one pass.
template <typename T>
MK_HD T group_score(const T* v, int64_t n, int group_scoring) {
  Top2<T> top;
  for (int64_t i = 0; i < n; ++i) top.push(v[i]);
  return top.score(group_scoring);
}

// weights[s] = scaling * p[s] / sum(p) (renormalize; a zero sum gives zeros) or scaling * p[s].
// Returns the divisor used (1 without renormalisation, 0 for a zero sum) for the backward.
template <typename T>
MK_HD T finish_weights(T* w, int64_t k, bool renormalize, T scaling) {
  T total = 1;
  if (renormalize) {
    total = 0;
    for (int64_t s = 0; s < k; ++s) total += w[s];
  }
  for (int64_t s = 0; s < k; ++s) w[s] = total == 0 ? T(0) : scaling * (w[s] / total);
  return total;
}

// d loss / d p[s] of the selected scores p [k] from d loss / d weights g [k] (finish_weights'
// backward), into gp [k]: renormalize: scaling / S (g_s - sum_j g_j p_j / S), S = sum(p), 0 when
// S == 0; else scaling * g_s.
template <typename T>
MK_HD void weights_backward(const T* p, const T* g, T* gp, int64_t k, bool renormalize, T scaling) {
  if (!renormalize) {
    for (int64_t s = 0; s < k; ++s) gp[s] = scaling * g[s];
    return;
  }
  T total = 0;
  for (int64_t s = 0; s < k; ++s) total += p[s];
  if (total == 0) {
    for (int64_t s = 0; s < k; ++s) gp[s] = 0;
    return;
  }
  T dot = 0;
  for (int64_t s = 0; s < k; ++s) dot += g[s] * (p[s] / total);
  for (int64_t s = 0; s < k; ++s) gp[s] = scaling / total * (g[s] - dot);
}

}  // namespace topk_router
}  // namespace moe_kernels
