// The selections of the routing ops: the k largest (value, index) rank pairs of float32 rows
// (rank_pair, moe_kernels/common.h: larger value first, then the lower index; NaN highest, -0 ==
// +0), a row or a block of rows at a time, and the selection decoded into slots. topk_router,
// noisy_topk_gate and load_probabilities select through here. select.cpp picks among the paths
// by k, E and the CPU; each path's file says how it works.
#pragma once
#include <algorithm>
#include <cstdint>

#include "moe_kernels/common.h"

namespace moe_kernels {

// Rows per block of topk_router's loop, which selects a block (rows_top_pairs_f32) and then
// computes its weights, or its softmax sums from its logits again (renormalised float32 rows that
// rows_top_renormalized_f32 takes go in one pass instead). Up to 64 rows, but for E <= 128 with
// 3 <= k <= 8 or the full softmax, blocks of ~2048 elements (~1024 for the full softmax with
// k >= 3), a multiple of 16 rows (the register selection's block): where the full softmax reads a
// block's logits twice, a smaller block keeps them in L1, and the selection's pairs buffer (64 B a
// row) stays there too. Renormalised k <= 2 and E > 128 keep 64 rows (smaller blocks were slower
// there; docs/topk_softmax.md has the timings).
inline int64_t selection_block_rows(int64_t E, int64_t k, bool renormalize) {
  E = std::max<int64_t>(E, 1);
  if ((k <= 2 && renormalize) || E > 128) return std::clamp<int64_t>(16384 / E, 1, 64);
  const int64_t elements = !renormalize && k >= 3 ? 1024 : 2048;
  return std::clamp<int64_t>(elements / E / 16 * 16, 16, 64);
}

// The slots of a block's selection (best: k rank pairs per row, from rows_top_pairs_f32): for row
// i and slot s, the expert into experts[i * k + s], its value into value[i * k + s] and the row's
// largest selected value into vmax[i * k + s]. Values are decoded from the pairs' rank keys
// (rank_value), not re-read from the rows: no load depends on a selected index, and the loops
// vectorise. The decoded value is the logit with -0 as +0 and any NaN as one NaN, which the
// weights computed from it cannot tell apart (exp(v - vmax), sigmoid(v)).
void selected_slots(const int64_t* best, int64_t n, int64_t k, int64_t* experts, float* value, float* vmax);

// Index of the largest element of row[0 .. E) in the routing ops' rank order (rank_key in
// moe_kernels/common.h: NaN highest, -0 == +0, ties to the lower index). E >= 1. A row holding no
// NaN is ranked by float compares (the same order there), any other by rank keys.
int32_t row_argmax_f32(const float* row, int64_t E);

// The k largest (value, index) rank pairs of row[0 .. E) into best[0 .. k), descending (rank_pair
// of common.h), for 1 <= k <= E. Chunks of 8 are compared against the k-th key in one vector
// compare; only chunks holding a larger key go through the insertion list (insertion.h).
void row_topk_f32(const float* row, int64_t E, int k, int64_t* best);

// The two largest rank pairs of row[0 .. E) into best[0 .. 2), descending, for E >= 2: one pass
// with two running maxima per lane (no insertion list), the lanes merged at the end; float
// compares on a row holding no NaN, as row_argmax_f32.
void row_top2_f32(const float* row, int64_t E, int64_t* best);

// The k largest rank pairs of row[0 .. E), for 1 <= k <= E <= kRoundsMaxE: row_top_pairs uses it
// while k * E <= kRoundsMaxWork, where its fixed vector steps beat an insertion list's
// data-dependent branches. For k <= 8 the pairs, eight to a vector, are sorted by a bitonic network
// and merged into a running top eight; for larger k, k rounds of a vectorised max knock out each
// round's winner. For k <= 8 on a row holding no NaN only candidates are sorted: the elements at
// or above the smallest of 8 group maxima (candidates.h: at least k elements are, and no
// element below it can be in the top k).
constexpr int64_t kRoundsMaxE = 512;
constexpr int64_t kRoundsMaxWork = 8 * 512;
void row_topk_rounds_f32(const float* row, int64_t E, int k, int64_t* best);

// Above this k an insertion list costs O(E k) on adversarial (ascending) rows; a partial sort of
// all pairs is O(E log k) and wins.
constexpr int64_t kRowInsertionMaxK = 16;

// The k largest rank pairs of row[0 .. E) into best, descending, 1 <= k <= E: row_argmax_f32
// (k = 1), row_top2_f32 (k = 2), row_topk_rounds_f32 (small k * E), row_topk_f32
// (k <= kRowInsertionMaxK), else a partial sort (best must then hold E pairs).
void row_top_pairs(const float* row, int64_t E, int64_t k, int64_t* best);

// row_top_pairs for each of the n rows x[i * stride .. i * stride + E), into best[i * k .. i * k + k):
// one call for a block of rows, so that consecutive rows' selections overlap in the core.
void rows_top_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* best);

// rows_top_pairs_f32's selection of each row's k experts (by descending logit) and its
// renormalised softmax weights (score/exp_terms.h's renormalized_pairs_f32 on those pairs), bit for
// bit, into experts and w [n * k], in one pass over the rows where top8_avx512.h's
// rows_top8_renormalized_f32 runs (AVX-512 VBMI2, 16 <= E <= 128) for 3 <= k <= 8; the rows it
// leaves are selected and weighted one by one after. Returns false, writing nothing, elsewhere
// (the caller then selects and weights a block at a time); true for n = 0.
bool rows_top_renormalized_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* experts,
                               float* w);

}  // namespace moe_kernels
