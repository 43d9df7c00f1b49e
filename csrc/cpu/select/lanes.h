// Eight lanes of GCC vector extensions for the row selections: float values, their rank keys
// (moe_kernels/common.h's rank_key, lane-wise) and rank pairs, eight int64 pairs to a 512-bit
// vector, and the reductions across lanes. Compiled per instruction set with their callers.
//
// Part of select.cpp's translation unit: its per-instruction-set entry points inline these bodies
// (MK_ALWAYS_INLINE), so the bodies have internal linkage and are included there only.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "moe_kernels/common.h"

// The lane helpers pass 256- and 512-bit vectors by value; GCC warns that the default (non-AVX)
// variant would pass them differently from an AVX one. They are always inlined, so no such call
// exists.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moe_kernels {
namespace {

constexpr int kLanes = 8;
typedef int32_t lanes_i32 __attribute__((vector_size(4 * kLanes)));
typedef float lanes_f32 __attribute__((vector_size(4 * kLanes)));

inline lanes_f32 load(const float* p) {
  lanes_f32 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// rank_key (moe_kernels/common.h), lane-wise: -0 -> +0, negative floats flip their magnitude
// bits, NaN is the largest key.
inline lanes_i32 rank_keys(lanes_f32 v) {
  v = v + 0.0f;
  lanes_i32 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const lanes_i32 key = bits < 0 ? bits ^ 0x7fffffff : bits;
  return v != v ? (lanes_i32){} + 0x7fffffff : key;
}

// Eight rank pairs (common.h) in one 512-bit vector: one int64 max compares value and index.
typedef int64_t lanes_i64 __attribute__((vector_size(8 * kLanes)));

inline lanes_i64 load_pairs(const int64_t* p) {
  lanes_i64 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// rank_pair of row[e .. e + 8), lane-wise.
inline lanes_i64 rank_pairs(lanes_f32 v, int64_t e) {
  const lanes_i64 high = __builtin_convertvector(rank_keys(v), lanes_i64) << 32;
  const lanes_i64 index = (lanes_i64){0, 1, 2, 3, 4, 5, 6, 7} + e;
  return high | (0xffffffffLL - index);
}

inline lanes_i64 max_pairs(lanes_i64 a, lanes_i64 b) { return a > b ? a : b; }

// The largest lane of x, in three shuffle + max steps.
inline int64_t max_lane(lanes_i64 x) {
  x = max_pairs(x, __builtin_shuffle(x, (lanes_i64){4, 5, 6, 7, 0, 1, 2, 3}));
  x = max_pairs(x, __builtin_shuffle(x, (lanes_i64){2, 3, 0, 1, 6, 7, 4, 5}));
  return x[0] > x[1] ? x[0] : x[1];
}

// rank pairs (common.h) of eight (key, index) lanes.
inline lanes_i64 lane_pairs(lanes_i32 key, lanes_i32 index) {
  return (__builtin_convertvector(key, lanes_i64) << 32) | (0xffffffffLL - __builtin_convertvector(index, lanes_i64));
}

// The smallest lane of x (int32 lanes), in three shuffle + min steps.
template <typename V>
inline auto min_lane(V x) {
  V y = __builtin_shuffle(x, (lanes_i32){4, 5, 6, 7, 0, 1, 2, 3});
  x = x < y ? x : y;
  y = __builtin_shuffle(x, (lanes_i32){2, 3, 0, 1, 6, 7, 4, 5});
  x = x < y ? x : y;
  return x[0] < x[1] ? x[0] : x[1];
}

// The largest lane of x, in three shuffle + max steps.
inline int32_t max_lane(lanes_i32 x) {
  x = x > __builtin_shuffle(x, (lanes_i32){4, 5, 6, 7, 0, 1, 2, 3}) ? x : __builtin_shuffle(x, (lanes_i32){4, 5, 6, 7, 0, 1, 2, 3});
  x = x > __builtin_shuffle(x, (lanes_i32){2, 3, 0, 1, 6, 7, 4, 5}) ? x : __builtin_shuffle(x, (lanes_i32){2, 3, 0, 1, 6, 7, 4, 5});
  return x[0] > x[1] ? x[0] : x[1];
}

// Whether lane-wise float sums hold a NaN: a row whose sum is not NaN holds no NaN (the sum is NaN
// also for +inf and -inf together, or an overflow meeting -inf: those rows only take the slower
// path).
inline bool any_nan(lanes_f32 sum) {
  const lanes_i32 nan = sum != sum;  // -1 in a NaN lane
  return min_lane(nan) != 0;
}

}  // namespace
}  // namespace moe_kernels
