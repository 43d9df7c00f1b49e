// The k largest rank pairs of a float32 row by an insertion list, for k up to kRowInsertionMaxK
// on rows too long for the fixed steps of pairs_topk.h: chunks of 8 elements compared against the
// k-th key in one vector compare, and only chunks holding a larger key go through the list.
//
// Part of select.cpp's translation unit: its per-instruction-set entry points inline these bodies
// (MK_ALWAYS_INLINE), so the bodies have internal linkage and are included there only.
#pragma once
#include <algorithm>
#include <climits>
#include <functional>

#include "select/lanes.h"

namespace moe_kernels {

// Insert `pair` into `best`, the k largest pairs seen so far in descending order (`filled` of
// them valid). Returns the new fill count. Pairs are distinct, so no tie handling is needed:
// rank_pair already put the lower index first.
inline int insert_pair(int64_t* best, int filled, int k, int64_t pair) {
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

namespace {

// The k largest rank pairs of row[0 .. E) into best[0 .. k), descending, 1 <= k <= E.
MK_ALWAYS_INLINE void topk_insertion(const float* row, int64_t E, int k, int64_t* best) {
  int filled = 0;
  int64_t e = 0;
  for (; e < k; ++e) filled = insert_pair(best, filled, k, rank_pair(row[e], (int32_t)e));
  // A floor for the k-th largest key, from one vector pass: lane l's maximum over the elements
  // l, l + 8, l + 16, ... of the full chunks. The lanes are disjoint, so the k-th largest lane
  // maximum has k distinct elements at or above it, and no element below it can be in the top k.
  // It starts the filter near its final value instead of at the first k elements' minimum.
  int32_t floor = INT_MIN;
  const int64_t full = k <= kLanes ? (E - k) / kLanes * kLanes : 0;
  if (full > 0) {
    lanes_i32 lane_max = rank_keys(load(row + k));
    for (int64_t c = k + kLanes; c < k + full; c += kLanes) {
      const lanes_i32 key = rank_keys(load(row + c));
      lane_max = key > lane_max ? key : lane_max;
    }
    int32_t sorted[kLanes];
    for (int l = 0; l < kLanes; ++l) sorted[l] = lane_max[l];
    std::nth_element(sorted, sorted + (k - 1), sorted + kLanes, std::greater<int32_t>());
    floor = sorted[k - 1];
  }
  // Every later element has a higher index than the list's, so only a strictly larger key can
  // enter: an equal key loses its tie. Keys equal to the floor may still belong to the top k.
  const int32_t below_floor = floor == INT_MIN ? INT_MIN : floor - 1;
  int32_t threshold = std::max((int32_t)(best[k - 1] >> 32), below_floor);
  for (; e + kLanes <= E; e += kLanes) {
    const lanes_i32 key = rank_keys(load(row + e));
    if (max_lane(key) <= threshold) continue;  // the common case
    for (int l = 0; l < kLanes; ++l) {
      if (key[l] > threshold) {
        insert_pair(best, k, k, rank_pair(row[e + l], (int32_t)(e + l)));
        threshold = std::max((int32_t)(best[k - 1] >> 32), below_floor);
      }
    }
  }
  for (; e < E; ++e) insert_pair(best, k, k, rank_pair(row[e], (int32_t)e));
}

}  // namespace
}  // namespace moe_kernels
