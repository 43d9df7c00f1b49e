// The two largest rank pairs of a float32 row: two running maxima per lane in one pass (float
// compares on a row holding no NaN, rank keys otherwise), the lanes merged at the end; and a block
// of rows in two phases.
//
// Part of select.cpp's translation unit: its per-instruction-set entry points inline these bodies
// (MK_ALWAYS_INLINE), so the bodies have internal linkage and are included there only.
#pragma once
#include <algorithm>

#include "select/lanes.h"

namespace moe_kernels {
namespace {

// One step of two running maxima per lane, on float values or on rank keys: v enters the first
// slot if strictly above it (the first moving down), else the second if strictly above that. Each
// lane sees its elements in ascending index order, so strict > keeps the lower index of equal
// values in both slots.
template <typename V>
MK_ALWAYS_INLINE void top2_step(V v, lanes_i32 index, V& value1, lanes_i32& index1, V& value2, lanes_i32& index2) {
  const lanes_i32 above1 = v > value1;
  const lanes_i32 above2 = v > value2;
  value2 = above1 ? value1 : (above2 ? v : value2);
  index2 = above1 ? index1 : (above2 ? index : index2);
  value1 = above1 ? v : value1;
  index1 = above1 ? index : index1;
}

// best[0 .. 2) = the two largest of the 16 lane slots (rank pairs: distinct indices, a total
// order) and of the tail row[e .. E), without a branch: the first is the largest lane-first pair,
// the second the largest of the other lanes' firsts and the winning lane's second.
MK_ALWAYS_INLINE void merge_top2(lanes_i64 pair1, lanes_i64 pair2, const float* row, int64_t e, int64_t E, int64_t* best) {
  int64_t first = max_lane(pair1);
  int64_t second = max_lane(pair1 == first ? pair2 : pair1);
  for (; e < E; ++e) {
    const int64_t pair = rank_pair(row[e], (int32_t)e);
    const int64_t low = pair > first ? first : pair;
    first = pair > first ? pair : first;
    second = low > second ? low : second;
  }
  best[0] = first;
  best[1] = second;
}

// The two largest rank pairs on a row without NaN by float compares (argmax_row_float), E >= kLanes.
// The second slots start at -inf with an index above every real one, so a real element of equal
// value always outranks them; a -inf element never enters a second slot (strict >), which matters
// only if the row has fewer than two elements above -inf, and then the first chunk's lanes hold the
// lowest-index -inf elements already.
MK_ALWAYS_INLINE bool top2_lanes_float(const float* row, int64_t E, lanes_i64* pair1, lanes_i64* pair2) {
  lanes_f32 value1 = load(row), sum = value1;
  lanes_f32 value2 = lanes_f32{} - INFINITY;
  lanes_i32 index1 = {0, 1, 2, 3, 4, 5, 6, 7};
  lanes_i32 index2 = lanes_i32{} + INT_MAX;
  lanes_i32 index = index1 + kLanes;
  int64_t e = kLanes;
  for (; e + kLanes <= E; e += kLanes) {
    const lanes_f32 v = load(row + e);
    top2_step(v, index, value1, index1, value2, index2);
    sum += v;
    index += kLanes;
  }
  if (any_nan(sum)) return false;
  *pair1 = lane_pairs(rank_keys(value1), index1);
  *pair2 = lane_pairs(rank_keys(value2), index2);
  return true;
}

MK_ALWAYS_INLINE bool top2_row_float(const float* row, int64_t E, int64_t* best) {
  lanes_i64 pair1, pair2;
  if (!top2_lanes_float(row, E, &pair1, &pair2)) return false;
  merge_top2(pair1, pair2, row, E / kLanes * kLanes, E, best);
  return true;
}

MK_ALWAYS_INLINE void top2_row_keys(const float* row, int64_t E, int64_t* best) {
  // The same on rank keys. Unfilled slots hold INT_MIN, below every rank_key (even -inf's): their
  // pairs lose to every real one, so with E >= 2 both results are real even when every element is
  // in the tail (E < 8).
  const lanes_i32 none = {INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN};
  lanes_i32 key1 = none, key2 = none;
  lanes_i32 index = {0, 1, 2, 3, 4, 5, 6, 7};
  lanes_i32 index1 = index, index2 = index;
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) {
    top2_step(rank_keys(load(row + e)), index, key1, index1, key2, index2);
    index += kLanes;
  }
  merge_top2(lane_pairs(key1, index1), lane_pairs(key2, index2), row, e, E, best);
}

MK_ALWAYS_INLINE void top2_row(const float* row, int64_t E, int64_t* best) {
  if (E >= kLanes && top2_row_float(row, E, best)) return;
  top2_row_keys(row, E, best);
}

// top2_row for rows [0, n) of x, a block at a time in two phases: every row's lane pass, then
// every row's merge. A merge is a chain of dependent reductions that costs more than the lane pass
// at E = 64; back to back, the merges of independent rows overlap in the core, where each after its
// own row's pass did not.
constexpr int64_t kTop2Block = 16;
MK_ALWAYS_INLINE void top2_rows(const float* x, int64_t stride, int64_t n, int64_t E, int64_t* best) {
  if (E < kLanes) {
    for (int64_t i = 0; i < n; ++i) top2_row_keys(x + i * stride, E, best + 2 * i);
    return;
  }
  const int64_t full = E / kLanes * kLanes;
  alignas(64) lanes_i64 pair1[kTop2Block], pair2[kTop2Block];
  bool no_nan[kTop2Block];
  for (int64_t i0 = 0; i0 < n; i0 += kTop2Block) {
    const int64_t m = std::min(kTop2Block, n - i0);
    for (int64_t j = 0; j < m; ++j) no_nan[j] = top2_lanes_float(x + (i0 + j) * stride, E, pair1 + j, pair2 + j);
    for (int64_t j = 0; j < m; ++j) {
      const float* row = x + (i0 + j) * stride;
      if (no_nan[j]) {
        merge_top2(pair1[j], pair2[j], row, full, E, best + 2 * (i0 + j));
      } else {
        top2_row_keys(row, E, best + 2 * (i0 + j));
      }
    }
  }
}

}  // namespace
}  // namespace moe_kernels
