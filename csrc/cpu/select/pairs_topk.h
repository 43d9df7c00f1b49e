// The k largest of a row's rank pairs by fixed vector steps, for rows of up to kRoundsMaxE
// elements: for k <= 8 the pairs (of the row's candidates, select/candidates.h, where the row has
// no NaN) sorted by a bitonic network and merged into a running top eight; for larger k, k rounds
// of a vectorised max, each knocking out the previous round's winner. No data-dependent branch:
// the cost is the same whatever the row holds, where an insertion list pays a mispredicted branch
// per candidate. Four rows at a time where it can, their chains of steps interleaved.
//
// Part of select.cpp's translation unit: its per-instruction-set entry points inline these bodies
// (MK_ALWAYS_INLINE), so the bodies have internal linkage and are included there only.
#pragma once
#include "select/bitonic.h"
#include "select/candidates.h"
#include "select/lanes.h"
#include "select/select.h"

namespace moe_kernels {
namespace {

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
MK_ALWAYS_INLINE lanes_i64 knockout_round(int64_t* pairs, int64_t n, lanes_i64 previous) {
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
MK_ALWAYS_INLINE void rounds_on_pairs(int64_t* pairs, int64_t n, int k, int64_t* best) {
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
MK_ALWAYS_INLINE lanes_i64 top8_pairs(const int64_t* pairs, int64_t n) {
  lanes_i64 top = sort8<true>(load_pairs(pairs));
  for (int64_t c = kLanes; c < n; c += kLanes) top = merge_into_top8(top, load_pairs(pairs + c));
  return top;
}

// The pairs of the candidates index[0 .. n), value[0 .. n) (row_candidates_f32) into pairs, padded
// with kNoPair to a multiple of kLanes; returns the padded count.
// (row_candidates_f32 wrote zeros past the candidates: the padding lanes read defined values, and
// without a store just before these loads, which they could not take their data from.)
MK_ALWAYS_INLINE int64_t candidate_pairs(const int32_t* index, const float* value, int64_t n, int64_t* pairs) {
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
MK_ALWAYS_INLINE int64_t row_pairs(const float* row, int64_t E, int64_t* pairs) {
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
MK_ALWAYS_INLINE int64_t round_candidates(const float* row, int64_t E, int k, int64_t* pairs) {
  if (k <= kLanes && E >= kLanes) {
    alignas(64) int32_t index[kRoundsMaxE + kCandidatePad];
    alignas(64) float value[kRoundsMaxE + kCandidatePad];
    const int64_t n = row_candidates_f32(row, E, index, value);
    if (n >= 0) return candidate_pairs(index, value, n, pairs);
  }
  return row_pairs(row, E, pairs);
}

MK_ALWAYS_INLINE void rounds_row(const float* row, int64_t E, int k, int64_t* best) {
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
// has 18 candidates on average, at most 24 in 86% of rows (candidates.h).
MK_ALWAYS_INLINE void top8_rows4(const float* x, int64_t stride, int64_t E, int k, int64_t* best) {
  alignas(64) int32_t index[kRoundRows][kRoundsMaxE + kCandidatePad];
  alignas(64) float value[kRoundRows][kRoundsMaxE + kCandidatePad];
  alignas(64) int64_t pairs[kRoundRows][kRoundsMaxE + kLanes];
  int64_t n[kRoundRows];
  for (int j = 0; j < kRoundRows; ++j) n[j] = row_candidates_f32(x + j * stride, E, index[j], value[j]);
  for (int j = 0; j < kRoundRows; ++j) {
    n[j] = n[j] >= 0 ? candidate_pairs(index[j], value[j], n[j], pairs[j]) : row_pairs(x + j * stride, E, pairs[j]);
  }
  // The first three vectors of pairs (kNoPair where a row has fewer), as top8_pairs merges them,
  // written step by step across the four rows: the same as four merge_into_top8 chains, which were
  // slower (GCC keeps each row's chain together).
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
MK_ALWAYS_INLINE void rounds_rows4(const float* x, int64_t stride, int64_t E, int k, int64_t* best) {
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
}  // namespace moe_kernels
