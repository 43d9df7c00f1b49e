// row_vector.h's primitives: GCC vector extensions (the selections) and vec_math.h's
// auto-vectorised elementwise math (the exp sum), each compiled per instruction set by
// MK_ROW_CLONES (vec_math.h) and chosen once at load time, so the extension still runs on any
// x86-64 while machines with AVX2 / AVX-512 use them.
#include "select/select.h"

#include <algorithm>
#include <climits>
#include <functional>
#include <vector>
#include <cmath>
#include <cstring>

#include "moe_kernels/common.h"
#include "select/candidates.h"
#include "select/bitonic.h"
#include "select/top2_avx512.h"
#include "select/top8_avx512.h"
#include "score/exp_terms.h"
#include "score/vec_math.h"

// The lane helpers below pass 256-bit vectors by value; GCC warns that the default (non-AVX) clone
// would pass them differently from an AVX one. They are always inlined, so no such call exists.
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

// The selections' bodies, inlined into the per-row entry points below and into rows_top_pairs_f32
// (a call per row through the load-time dispatch, and the data dependence of one row's outputs on
// its call, cost as much as the selection at E = 64).
#define MK_ROW_BODY inline __attribute__((always_inline))

// Whether lane-wise float sums hold a NaN: a row whose sum is not NaN holds no NaN (the sum is NaN
// also for +inf and -inf together, or an overflow meeting -inf: those rows only take the slower
// path).
inline bool any_nan(lanes_f32 sum) {
  const lanes_i32 nan = sum != sum;  // -1 in a NaN lane
  return min_lane(nan) != 0;
}

// The float-compare selections: on a row without NaN, an ordered float compare ranks like rank_key
// (-0 == +0, and with denormals-are-zero set both treat a denormal as 0), at half the vector
// operations of building rank keys for every element. They return false on a row holding a NaN,
// which then takes the rank-key path. E >= kLanes.
MK_ROW_BODY bool argmax_row_float(const float* row, int64_t E, int32_t* arg) {
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

MK_ROW_BODY int32_t argmax_row(const float* row, int64_t E) {
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

MK_ROW_CLONES
void row_topk_f32(const float* row, int64_t E, int k, int64_t* best) {
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

namespace {

// One step of two running maxima per lane, on float values or on rank keys: v enters the first
// slot if strictly above it (the first moving down), else the second if strictly above that. Each
// lane sees its elements in ascending index order, so strict > keeps the lower index of equal
// values in both slots.
template <typename V>
MK_ROW_BODY void top2_step(V v, lanes_i32 index, V& value1, lanes_i32& index1, V& value2, lanes_i32& index2) {
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
MK_ROW_BODY void merge_top2(lanes_i64 pair1, lanes_i64 pair2, const float* row, int64_t e, int64_t E, int64_t* best) {
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
MK_ROW_BODY bool top2_lanes_float(const float* row, int64_t E, lanes_i64* pair1, lanes_i64* pair2) {
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

MK_ROW_BODY bool top2_row_float(const float* row, int64_t E, int64_t* best) {
  lanes_i64 pair1, pair2;
  if (!top2_lanes_float(row, E, &pair1, &pair2)) return false;
  merge_top2(pair1, pair2, row, E / kLanes * kLanes, E, best);
  return true;
}

MK_ROW_BODY void top2_row_keys(const float* row, int64_t E, int64_t* best) {
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

MK_ROW_BODY void top2_row(const float* row, int64_t E, int64_t* best) {
  if (E >= kLanes && top2_row_float(row, E, best)) return;
  top2_row_keys(row, E, best);
}

// top2_row for rows [0, n) of x, a block at a time in two phases: every row's lane pass, then
// every row's merge. A merge is a chain of dependent reductions that costs more than the lane pass
// at E = 64; back to back, the merges of independent rows overlap in the core, where each after its
// own row's pass did not.
constexpr int64_t kTop2Block = 16;
MK_ROW_BODY void top2_rows(const float* x, int64_t stride, int64_t n, int64_t E, int64_t* best) {
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

// The largest lane of x in every lane (a butterfly: the result feeds the next round's knockout
// without a round trip through a scalar register).
inline lanes_i64 max_all_lanes(lanes_i64 x) {
  x = max_pairs(x, __builtin_shuffle(x, (lanes_i64){4, 5, 6, 7, 0, 1, 2, 3}));
  x = max_pairs(x, __builtin_shuffle(x, (lanes_i64){2, 3, 0, 1, 6, 7, 4, 5}));
  return max_pairs(x, __builtin_shuffle(x, (lanes_i64){1, 0, 3, 2, 5, 4, 7, 6}));
}

// One round over pairs[0 .. n) (n a multiple of kLanes, padded with kNoPair): the previous round's
// winner knocked out, the largest remaining pair returned in every lane. The winner is knocked out
// lane-wise (pairs are distinct, so only its lane matches) and stored back a whole vector at a
// time: a scalar store into the array followed by the next round's vector loads of it would stall
// on store forwarding every round.
MK_ROW_BODY lanes_i64 knockout_round(int64_t* pairs, int64_t n, lanes_i64 previous) {
  const lanes_i64 none = lanes_i64{} + kNoPair;
  lanes_i64 m = none;
  for (int64_t c = 0; c < n; c += kLanes) {
    lanes_i64 v = load_pairs(pairs + c);
    v = v == previous ? none : v;
    std::memcpy(pairs + c, &v, sizeof v);
    m = max_pairs(m, v);
  }
  return max_all_lanes(m);
}

// k rounds of knockout_round: the k largest pairs, descending. Branch-free: the cost is k * n / 8
// vector maxima whatever the data, where an insertion list pays a mispredicted branch per
// candidate.
MK_ROW_BODY void rounds_on_pairs(int64_t* pairs, int64_t n, int k, int64_t* best) {
  lanes_i64 previous = lanes_i64{} + kNoPair;  // matches only padding lanes, kNoPair already
  for (int s = 0; s < k; ++s) {
    previous = knockout_round(pairs, n, previous);
    best[s] = previous[0];
  }
}

using bitonic::bitonic_step;
using bitonic::merge_into_top8;
using bitonic::sort8;

// The eight largest of pairs[0 .. n) (n a positive multiple of kLanes, padded with kNoPair),
// descending: the first vector sorted, each further one merged in (merge_into_top8). About 40
// vector operations per vector of pairs, with no data-dependent branch and a short dependence
// chain, where k knockout rounds cost k reductions.
MK_ROW_BODY lanes_i64 top8_pairs(const int64_t* pairs, int64_t n) {
  lanes_i64 top = sort8<true>(load_pairs(pairs));
  for (int64_t c = kLanes; c < n; c += kLanes) top = merge_into_top8(top, load_pairs(pairs + c));
  return top;
}

// The pairs of the candidates index[0 .. n), value[0 .. n) (row_candidates_f32) into pairs, padded
// with kNoPair to a multiple of kLanes; returns the padded count.
// (row_candidates_f32 wrote zeros past the candidates: the padding lanes read defined values, and
// without a store just before these loads, which they could not take their data from.)
MK_ROW_BODY int64_t candidate_pairs(const int32_t* index, const float* value, int64_t n, int64_t* pairs) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  const lanes_i64 none = lanes_i64{} + kNoPair;
  const lanes_i64 slot = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t c = 0; c < padded; c += kLanes) {
    lanes_i32 i;
    std::memcpy(&i, index + c, sizeof i);
    lanes_i64 p = lane_pairs(rank_keys(load(value + c)), i);
    p = slot + c < n ? p : none;
    std::memcpy(pairs + c, &p, sizeof p);
  }
  return padded;
}

// Every rank pair of row[0 .. E) into pairs, padded with kNoPair to a multiple of kLanes; returns
// the padded count.
MK_ROW_BODY int64_t row_pairs(const float* row, int64_t E, int64_t* pairs) {
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) {
    const lanes_i64 p = rank_pairs(load(row + e), e);
    std::memcpy(pairs + e, &p, sizeof p);
  }
  for (; e < E; ++e) pairs[e] = rank_pair(row[e], (int32_t)e);
  const int64_t n = (E + kLanes - 1) / kLanes * kLanes;
  for (; e < n; ++e) pairs[e] = kNoPair;
  return n;
}

// The candidates of rounds_on_pairs for the k largest of a row (E <= kRoundsMaxE) into pairs
// [kRoundsMaxE + kLanes]: row_candidates_f32 where it applies, else every pair of the row.
// Returns their count, padded with kNoPair to a multiple of kLanes.
MK_ROW_BODY int64_t round_candidates(const float* row, int64_t E, int k, int64_t* pairs) {
  if (k <= kLanes && E >= kLanes) {
    alignas(64) int32_t index[kRoundsMaxE + kCandidatePad];
    alignas(64) float value[kRoundsMaxE + kCandidatePad];
    const int64_t n = row_candidates_f32(row, E, index, value);
    if (n >= 0) return candidate_pairs(index, value, n, pairs);
  }
  return row_pairs(row, E, pairs);
}

MK_ROW_BODY void rounds_row(const float* row, int64_t E, int k, int64_t* best) {
  alignas(64) int64_t pairs[kRoundsMaxE + kLanes];
  const int64_t n = round_candidates(row, E, k, pairs);
  if (k <= kLanes) {
    const lanes_i64 top = top8_pairs(pairs, n);
    for (int s = 0; s < k; ++s) best[s] = top[s];
  } else {
    rounds_on_pairs(pairs, n, k, best);
  }
}

constexpr int kRoundRows = 4;

// rounds_row for four rows at once and k <= kLanes: the four rows' candidates, then their pairs,
// then top8_pairs on their first three vectors of pairs (kNoPair where a row has fewer) with the
// four rows' network steps interleaved, then any further vectors row by row. One row's sort is a
// single chain of dependent steps; four side by side keep the core busy. A 64-wide random row
// has 18 candidates on average, at most 24 in 86% of rows (row_candidates.h).
MK_ROW_BODY void top8_rows4(const float* x, int64_t stride, int64_t E, int k, int64_t* best) {
  alignas(64) int32_t index[kRoundRows][kRoundsMaxE + kCandidatePad];
  alignas(64) float value[kRoundRows][kRoundsMaxE + kCandidatePad];
  alignas(64) int64_t pairs[kRoundRows][kRoundsMaxE + kLanes];
  int64_t n[kRoundRows];
  for (int j = 0; j < kRoundRows; ++j) n[j] = row_candidates_f32(x + j * stride, E, index[j], value[j]);
  for (int j = 0; j < kRoundRows; ++j) {
    n[j] = n[j] >= 0 ? candidate_pairs(index[j], value[j], n[j], pairs[j]) : row_pairs(x + j * stride, E, pairs[j]);
  }
  // The first three vectors of pairs (kNoPair where a row has fewer), as top8_pairs merges them,
  // written step by step across the four rows: the same as four merge_into_top8 chains, which
  // measured 10% slower (k = 8, E = 64: GCC keeps each row's chain together).
  const lanes_i64 none = lanes_i64{} + kNoPair;
  lanes_i64 top[kRoundRows], third[kRoundRows];
  for (int j = 0; j < kRoundRows; ++j) {
    const lanes_i64 second = n[j] > kLanes ? load_pairs(pairs[j] + kLanes) : none;
    third[j] = sort8<false>(n[j] > 2 * kLanes ? load_pairs(pairs[j] + 2 * kLanes) : none);
    top[j] = max_pairs(sort8<true>(load_pairs(pairs[j])), sort8<false>(second));
  }
  for (int j = 0; j < kRoundRows; ++j) top[j] = bitonic_step<8, 4, true>(top[j]);
  for (int j = 0; j < kRoundRows; ++j) top[j] = bitonic_step<8, 2, true>(top[j]);
  for (int j = 0; j < kRoundRows; ++j) top[j] = max_pairs(bitonic_step<8, 1, true>(top[j]), third[j]);
  for (int j = 0; j < kRoundRows; ++j) top[j] = bitonic_step<8, 4, true>(top[j]);
  for (int j = 0; j < kRoundRows; ++j) top[j] = bitonic_step<8, 2, true>(top[j]);
  for (int j = 0; j < kRoundRows; ++j) top[j] = bitonic_step<8, 1, true>(top[j]);
  for (int j = 0; j < kRoundRows; ++j) {
    for (int64_t c = 3 * kLanes; c < n[j]; c += kLanes) top[j] = merge_into_top8(top[j], load_pairs(pairs[j] + c));
  }
  for (int j = 0; j < kRoundRows; ++j) {
    for (int s = 0; s < k; ++s) best[j * k + s] = top[j][s];
  }
}

// rounds_row for four rows at once, their rounds interleaved: one row's rounds are a chain (each
// knocks out the previous winner), and four independent chains keep the core busy while each
// round's reduction completes.
MK_ROW_BODY void rounds_rows4(const float* x, int64_t stride, int64_t E, int k, int64_t* best) {
  alignas(64) int64_t pairs[kRoundRows][kRoundsMaxE + kLanes];
  int64_t n[kRoundRows];
  lanes_i64 previous[kRoundRows];
  for (int j = 0; j < kRoundRows; ++j) {
    n[j] = round_candidates(x + j * stride, E, k, pairs[j]);
    previous[j] = lanes_i64{} + kNoPair;
  }
  for (int s = 0; s < k; ++s) {
    for (int j = 0; j < kRoundRows; ++j) {
      previous[j] = knockout_round(pairs[j], n[j], previous[j]);
      best[j * k + s] = previous[j][0];
    }
  }
}

}  // namespace

MK_ROW_CLONES
int32_t row_argmax_f32(const float* row, int64_t E) { return argmax_row(row, E); }

MK_ROW_CLONES
void row_top2_f32(const float* row, int64_t E, int64_t* best) { top2_row(row, E, best); }

MK_ROW_CLONES
void row_topk_rounds_f32(const float* row, int64_t E, int k, int64_t* best) { rounds_row(row, E, k, best); }

// rows_top_pairs_f32's candidate sort for rows [0, n) (E <= kRoundsMaxE, k * E <= kRoundsMaxWork),
// four at a time where it can, out of line: inlined, its buffers (~34 KB for four rows) made
// every call's frame ~39 KB, and its first stores (the arguments' spills, at the frame's far
// end) showed up in the register selection's profile (1% of topk_softmax at E = 64, k = 8).
MK_ROW_CLONES
void rows_topk_rounds_f32(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best) {
  int64_t i = 0;
  if (k > kLanes) {
    for (; i + kRoundRows <= n; i += kRoundRows) rounds_rows4(x + i * stride, stride, E, k, best + k * i);
  } else if (E >= kLanes) {
    for (; i + kRoundRows <= n; i += kRoundRows) top8_rows4(x + i * stride, stride, E, k, best + k * i);
  }
  for (; i < n; ++i) rounds_row(x + i * stride, E, k, best + k * i);
}

void row_top_pairs(const float* row, int64_t E, int64_t k, int64_t* best) {
  if (k == 1) {
    const int32_t e = row_argmax_f32(row, E);
    best[0] = rank_pair(row[e], e);
  } else if (k == 2) {
    row_top2_f32(row, E, best);
  } else if (E <= kRoundsMaxE && k * E <= kRoundsMaxWork) {
    row_topk_rounds_f32(row, E, (int)k, best);
  } else if (k <= kRowInsertionMaxK) {
    row_topk_f32(row, E, (int)k, best);
  } else {
    for (int64_t e = 0; e < E; ++e) best[e] = rank_pair(row[e], (int32_t)e);
    std::partial_sort(best, best + k, best + E, std::greater<int64_t>());
  }
}

MK_ROW_CLONES
void rows_top_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* best) {
  if (k == 1) {
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x + i * stride;
      const int32_t e = argmax_row(row, E);
      best[i] = rank_pair(row[e], e);
    }
  } else if (k == 2) {
    // By values first where row_top2.h applies (AVX-512, 16 <= E <= 64), 64 rows a call; the rows
    // it leaves (a NaN sum) by top2_row.
    constexpr int64_t kChunk = 64;
    int64_t redo[kChunk], n_redo;
    int64_t i = 0;
    for (; i < n; i += kChunk) {
      const int64_t m = std::min(kChunk, n - i);
      if (!rows_top2_values_f32(x + i * stride, stride, m, E, best + 2 * i, redo, &n_redo)) break;
      for (int64_t r = 0; r < n_redo; ++r) top2_row(x + (i + redo[r]) * stride, E, best + 2 * (i + redo[r]));
    }
    if (i < n) top2_rows(x + i * stride, stride, n - i, E, best + 2 * i);
  } else if (E <= kRoundsMaxE && k * E <= kRoundsMaxWork) {
    int64_t i = 0;
    if (k <= kLanes && E >= kLanes) {
      // In registers where row_top8.h applies (AVX-512 F/BW/VBMI2, 16 <= E <= 256), 64 rows a
      // call; the rows it leaves (a NaN, over 16 candidates, two different keys sharing a
      // 28-bit prefix) by rounds_row.
      constexpr int64_t kChunk = 64;
      int64_t redo[kChunk], n_redo;
      for (; i < n; i += kChunk) {
        const int64_t m = std::min(kChunk, n - i);
        if (!rows_top8_pairs_f32(x + i * stride, stride, m, E, (int)k, best + k * i, redo, &n_redo)) break;
        for (int64_t r = 0; r < n_redo; ++r) {
          row_topk_rounds_f32(x + (i + redo[r]) * stride, E, (int)k, best + k * (i + redo[r]));
        }
      }
    }
    if (i < n) rows_topk_rounds_f32(x + i * stride, stride, n - i, E, (int)k, best + k * i);
  } else if (k <= kRowInsertionMaxK) {
    for (int64_t i = 0; i < n; ++i) row_topk_f32(x + i * stride, E, (int)k, best + k * i);
  } else {
    std::vector<int64_t> all(E);
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x + i * stride;
      for (int64_t e = 0; e < E; ++e) all[e] = rank_pair(row[e], (int32_t)e);
      std::partial_sort(all.begin(), all.begin() + k, all.end(), std::greater<int64_t>());
      std::copy_n(all.begin(), k, best + k * i);
    }
  }
}

bool rows_top_renormalized_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* experts,
                               float* w) {
  // (k <= 2 select faster by row_top2.h and the argmax.)
  if (k < 3 || k > kLanes || E > kRoundsMaxE || k * E > kRoundsMaxWork) return false;
  constexpr int64_t kChunk = 1024;  // rows a call: its redo list's bound
  int64_t redo[kChunk], n_redo;
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    if (!rows_top8_renormalized_f32(x + i * stride, stride, m, E, (int)k, experts + k * i, w + k * i, redo, &n_redo)) {
      return false;  // (only ever on the first chunk: the CPU and E decide)
    }
    for (int64_t r = 0; r < n_redo; ++r) {
      const int64_t row = i + redo[r];
      int64_t best[kLanes];
      row_topk_rounds_f32(x + row * stride, E, (int)k, best);
      renormalized_pairs_f32(best, 1, k, experts + k * row, w + k * row);
    }
  }
  return true;
}

namespace {
// The float a rank key was made from (rank_key's inverse): non-negative keys are the float's bits,
// negative ones had their magnitude bits flipped; NaN's key 0x7fffffff is itself a NaN's bits.
MK_VEC_INLINE float rank_value(int64_t pair) {
  const int32_t key = (int32_t)(pair >> 32);
  return __builtin_bit_cast(float, key < 0 ? key ^ 0x7fffffff : key);
}

// selected_slots with k fixed at compile time (K > 0: the compiler vectorises across rows) or any
// k (K = 0).
template <int K>
MK_VEC_INLINE void slots_k(const int64_t* __restrict best, int64_t n, int64_t k_any, int64_t* __restrict experts,
                           float* __restrict value, float* __restrict vmax) {
  const int64_t k = K > 0 ? K : k_any;
  for (int64_t i = 0; i < n; ++i) {
    const float m = rank_value(best[i * k]);
    for (int64_t s = 0; s < k; ++s) {
      experts[i * k + s] = pair_index(best[i * k + s]);
      value[i * k + s] = rank_value(best[i * k + s]);
      vmax[i * k + s] = m;
    }
  }
}
}  // namespace

MK_VECTORISE MK_ROW_CLONES
void selected_slots(const int64_t* __restrict best, int64_t n, int64_t k, int64_t* __restrict experts,
                    float* __restrict value, float* __restrict vmax) {
  switch (k) {
    case 1: return slots_k<1>(best, n, k, experts, value, vmax);
    case 2: return slots_k<2>(best, n, k, experts, value, vmax);
    case 4: return slots_k<4>(best, n, k, experts, value, vmax);
    case 8: return slots_k<8>(best, n, k, experts, value, vmax);
    default: return slots_k<0>(best, n, k, experts, value, vmax);
  }
}

namespace {
// The terms first (a loop with no reduction vectorises), then the sum in 8 lanes (a float sum in
// one accumulator would not: the compiler may not reorder it).
enum class Terms { kExp, kExpFull, kNonPositive };

MK_VEC_INLINE float lane_sum(const float* __restrict exps, int64_t E) {
  lanes_f32 sum = {};
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) sum += load(exps + e);
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += sum[l];
  for (; e < E; ++e) total += exps[e];
  return total;
}

template <Terms kTerms>
MK_VEC_INLINE float exp_sum_terms(const float* __restrict row, int64_t E, float vmax, float* __restrict exps) {
  for (int64_t e = 0; e < E; ++e) {
    const float d = row[e] - vmax;
    exps[e] = kTerms == Terms::kExpFull ? vec_math::exp_full(d)
              : kTerms == Terms::kExp   ? vec_math::exp(d)
                                        : vec_math::exp_nonpositive(d);
  }
  return lane_sum(exps, E);
}
}  // namespace

MK_VECTORISE MK_ROW_CLONES
float row_exp_sum_f32(const float* __restrict row, int64_t E, float vmax, float* __restrict exps) {
  float sum;
  if (rows_exp_terms_f32(row, E, 1, E, &vmax, 0, exps, &sum)) return sum;
  return exp_sum_terms<Terms::kExp>(row, E, vmax, exps);
}

MK_VECTORISE MK_ROW_CLONES
void rows_softmax_sums_f32(const float* __restrict x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                           int64_t vmax_stride, float* __restrict scratch, float* __restrict sums) {
  if (rows_exp_terms_f32(x, stride, n, E, vmax, vmax_stride, nullptr, sums)) return;
  float* exps = scratch;
  // A block of rows in one call, the terms first and then the sums: the rows' exp chains
  // overlap in the core (a call per row measured ~10% slower at E = 64).
  for (int64_t i = 0; i < n; ++i) {
    const float m = vmax[i * vmax_stride];
    const float* row = x + i * stride;
    float* out = exps + i * E;
    if (m - m == 0.0f) {  // finite: no term is NaN or above 0
      for (int64_t e = 0; e < E; ++e) out[e] = vec_math::exp_nonpositive(row[e] - m);
    } else {
      for (int64_t e = 0; e < E; ++e) out[e] = vec_math::exp(row[e] - m);
    }
  }
  for (int64_t i = 0; i < n; ++i) sums[i] = lane_sum(exps + i * E, E);
}

MK_VECTORISE MK_ROW_CLONES
void softmax_terms_f32(const float* __restrict value, const float* __restrict vmax, int64_t count,
                       float* __restrict out) {
  if (exp_terms_f32(value, vmax, count, out)) return;
  for (int64_t j = 0; j < count; ++j) out[j] = vec_math::exp(value[j] - vmax[j]);
}

MK_VECTORISE MK_ROW_CLONES
float row_exp_sum_full_f32(const float* __restrict row, int64_t E, float vmax, float* __restrict exps) {
  float sum;
  if (row_exp_terms_full_f32(row, E, vmax, exps, &sum)) return sum;
  return exp_sum_terms<Terms::kExpFull>(row, E, vmax, exps);
}

}  // namespace moe_kernels
