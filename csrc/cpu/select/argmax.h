// The largest element of a float32 row in rank order (rank_key: NaN highest, -0 == +0, ties to
// the lower index): float compares on a row holding no NaN, rank keys otherwise.
//
// Part of select.cpp's translation unit: its per-instruction-set entry points inline these bodies
// (MK_ALWAYS_INLINE), so the bodies have internal linkage and are included there only.
#pragma once
#include "select/lanes.h"

namespace moe_kernels {
namespace {

// The float-compare selections: on a row without NaN, an ordered float compare ranks like rank_key
// (-0 == +0, and with denormals-are-zero set both treat a denormal as 0), at half the vector
// operations of building rank keys for every element. They return false on a row holding a NaN,
// which then takes the rank-key path. E >= kLanes.
MK_ALWAYS_INLINE bool argmax_row_float(const float* row, int64_t E, int32_t* arg) {
  lanes_f32 best = load(row), sum = best;
  lanes_i32 best_index = {0, 1, 2, 3, 4, 5, 6, 7};
  lanes_i32 index = best_index + kLanes;
  int64_t e = kLanes;
  for (; e + kLanes <= E; e += kLanes) {
    const lanes_f32 v = load(row + e);
    const lanes_i32 better = v > best;
    best = better ? v : best;
    best_index = better ? index : best_index;
    sum += v;
    index += kLanes;
  }
  if (any_nan(sum)) return false;
  const lanes_i32 keys = rank_keys(best);
  int32_t key = max_lane(keys);
  *arg = min_lane(keys == key ? best_index : (lanes_i32{} + INT_MAX));
  for (; e < E; ++e) {  // the tail: later indices than every lane's, so strict > keeps ties right
    const int32_t k = rank_key(row[e]);
    if (k > key) {
      key = k;
      *arg = (int32_t)e;
    }
  }
  return true;
}

MK_ALWAYS_INLINE int32_t argmax_row(const float* row, int64_t E) {
  int32_t fast;
  if (E >= kLanes && argmax_row_float(row, E, &fast)) return fast;
  // Lane l sees the elements l, l + 8, l + 16, ... in order and keeps the first of its largest
  // keys (strict >); the lanes are merged by key, then by the lower index.
  lanes_i32 best_key = {INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN};
  lanes_i32 best_index = {0, 1, 2, 3, 4, 5, 6, 7};
  lanes_i32 index = best_index;
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) {
    const lanes_i32 key = rank_keys(load(row + e));
    const lanes_i32 better = key > best_key;
    best_key = better ? key : best_key;
    best_index = better ? index : best_index;
    index += kLanes;
  }
  // The lanes merged without a branch (a data-dependent one per lane mispredicted on most rows and
  // cost more than the whole pass at E = 64): the largest key, then the lowest index holding it.
  int32_t key = INT_MIN, arg = 0;
  if (e > 0) {
    key = max_lane(best_key);
    arg = min_lane(best_key == key ? best_index : (lanes_i32{} + INT_MAX));
  }
  for (; e < E; ++e) {  // the tail: later indices than every lane's, so strict > keeps ties right
    const int32_t k = rank_key(row[e]);
    if (k > key) {  // every key is above INT_MIN (-inf's is not INT_MIN), so e = 0 always enters
      key = k;
      arg = (int32_t)e;
    }
  }
  return arg;
}

}  // namespace
}  // namespace moe_kernels
