// Vectorised primitives over one contiguous float32 row, for the row-per-token routing kernels
// (topk_softmax). Their scalar loops spend their time on data-dependent branches (the argmax) and
// libm expf calls (the softmax denominators); these bodies have neither.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moe_kernels/common.h"

namespace moe_kernels {

// A [T, E] input of any float dtype and strides, read element-wise as float32.
struct Strided {
  const void* data;
  int64_t stride_t, stride_e;
};

template <typename scalar_t>
float at(const Strided& s, int64_t t, int64_t e) {
  return (float)static_cast<const scalar_t*>(s.data)[t * s.stride_t + e * s.stride_e];
}

// The row as contiguous float32: itself when it already is, else converted into `buffer` [E].
// The conversion is exact and keeps the order, -0 and NaN, so selecting on it selects on the row.
template <typename scalar_t>
const float* float_row(const scalar_t* row, int64_t stride_e, int64_t E, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (stride_e == 1) return row;
  }
  for (int64_t e = 0; e < E; ++e) buffer[e] = (float)row[e * stride_e];
  return buffer;
}

// Row t of a Strided input as contiguous float32 (float_row).
template <typename scalar_t>
const float* float_row(const Strided& s, int64_t t, int64_t E, float* buffer) {
  return float_row(static_cast<const scalar_t*>(s.data) + t * s.stride_t, s.stride_e, E, buffer);
}

// Rows per block of the row kernels that take a block of rows at a time (noisy_topk_gate,
// load_probabilities): up to `most`, fewer for wide rows so that each of a block's [rows, E]
// float32 buffers stays within 256 KiB.
inline int64_t block_rows(int64_t E, int64_t most = 64) {
  return std::clamp<int64_t>(65536 / std::max<int64_t>(E, 1), 1, most);
}

// Rows per block of topk_softmax's and topk_router's loops, which select a block
// (rows_top_pairs_f32) and then compute its weights, or its softmax sums from its logits again
// (renormalised float32 rows that rows_top_renormalized_f32 takes go in one pass instead).
// Up to 64 rows, but for E <= 128 with 3 <= k <= 8 or the full softmax, blocks of ~2048 elements
// (~1024 for the full softmax with k >= 3), a multiple of 16 rows (the register selection's
// block). T = 65536, one thread, one process alternating block sizes: renormalised k = 8 at
// E = 64 1.70 -> 1.49 ms (64 -> 32 rows), E = 96 3.03 -> 2.62, E = 128 4.8 -> 3.9 (-> 16); the
// full softmax at E = 64: k = 2 2.06 -> 1.81 ms (32 rows), k = 8 3.2 -> 2.6 ms (16 rows). Where
// the full softmax reads a block's logits twice, a smaller block keeps them in L1. The
// renormalised selection does not, and gains too: a C++ driver computing the weights inside the
// selection per 16 rows still ran 256-row calls 1.2x slower than 32-row ones, so most likely it
// is the selection's pairs buffer (64 B a row) that a smaller block keeps in L1. Renormalised
// k <= 2 keep 64 rows (32 were 2-5% slower at E <= 64), and E > 128 too (16 rows: the full
// softmax k = 2 at E = 256 6.8 -> 7.9 ms).
inline int64_t selection_block_rows(int64_t E, int64_t k, bool renormalize) {
  E = std::max<int64_t>(E, 1);
  if ((k <= 2 && renormalize) || E > 128) return std::clamp<int64_t>(16384 / E, 1, 64);
  const int64_t elements = !renormalize && k >= 3 ? 1024 : 2048;
  return std::clamp<int64_t>(elements / E / 16 * 16, 16, 64);
}

// Rows [t0, t0 + n) of a [T, E] input as contiguous float32 rows: the input itself when it is
// float32 with stride_e = 1, else converted into buffer [n, E] (float_row's exact conversion).
// Returns the first row and sets *stride to the result's row stride.
template <typename scalar_t>
const float* float_rows(const scalar_t* data, int64_t stride_t, int64_t stride_e, int64_t t0, int64_t n, int64_t E,
                        float* buffer, int64_t* stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (stride_e == 1) {
      *stride = stride_t;
      return data + t0 * stride_t;
    }
  }
  for (int64_t i = 0; i < n; ++i) float_row(data + (t0 + i) * stride_t, stride_e, E, buffer + i * E);
  *stride = E;
  return buffer;
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
// compare; only chunks holding a larger key go through the insertion list (topk_softmax.h).
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
// or above the smallest of 8 group maxima (row_candidates.h: at least k elements are, and no
// element below it can be in the top k).
constexpr int64_t kRoundsMaxE = 512;
constexpr int64_t kRoundsMaxWork = 8 * 512;
void row_topk_rounds_f32(const float* row, int64_t E, int k, int64_t* best);

// Above this k an insertion list costs O(E k) on adversarial (ascending) rows; a partial sort of
// all pairs is O(E log k) and wins.
constexpr int64_t kRowInsertionMaxK = 16;

// The k largest rank pairs of row[0 .. E) into best, descending, 1 <= k <= E: row_argmax_f32
// (k = 1), row_top2_f32 (k = 2), row_topk_rounds_f32 (small k * E), row_topk_f32
// (k <= kRowInsertionMaxK), else a partial sort (best must then hold E pairs). topk_softmax,
// topk_router, noisy_topk_gate and load_probabilities select through here (or the block form,
// rows_top_pairs_f32).
void row_top_pairs(const float* row, int64_t E, int64_t k, int64_t* best);

// row_top_pairs for each of the n rows x[i * stride .. i * stride + E), into best[i * k .. i * k + k):
// one call for a block of rows, so that consecutive rows' selections overlap in the core.
void rows_top_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* best);

// rows_top_pairs_f32's selection of each row's k experts (by descending logit) and its
// renormalised softmax weights (row_exp_terms.h's renormalized_pairs_f32 on those pairs), bit for
// bit, into experts and w [n * k], in one pass over the rows where row_top8.h's
// rows_top8_renormalized_f32 runs (AVX-512 VBMI2, 16 <= E <= 128) for 3 <= k <= 8; the rows it
// leaves are selected and weighted one by one after. Returns false, writing nothing, elsewhere
// (the caller then selects and weights a block at a time); true for n = 0.
bool rows_top_renormalized_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* experts,
                               float* w);

// sum over e of exp(row[e] - vmax), each term also stored to exps[e] (exps [E], not aliasing
// row). vmax is the row's largest value (every argument is <= 0), finite or NaN (NaN terms and
// sum). Terms below e^-80 (including those of -inf logits) are 0; a few ulp each: row_exp_terms.h's
// with AVX-512 F, vec_math::exp's elsewhere.
float row_exp_sum_f32(const float* row, int64_t E, float vmax, float* exps);

// row_exp_sum_f32's sum for a block of n rows x[i * stride ..] (a forward's softmax): the sum of
// row i's terms relative to vmax[i * vmax_stride], its largest value as its selection found it,
// to sums[i] (in row_exp_sum_f32's order and with its values). scratch [n * E] is overwritten.
// With AVX-512 F the terms are row_exp_terms.h's (not stored: a forward that needs some takes
// softmax_terms_f32); elsewhere a finite vmax (every term in [-inf, 0]) takes
// vec_math::exp_nonpositive, a third fewer vector operations than exp, and a row with an infinite
// or NaN vmax takes exp.
void rows_softmax_sums_f32(const float* x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                           int64_t vmax_stride, float* scratch, float* sums);

// out[j] = the term row_exp_sum_f32 and rows_softmax_sums_f32 compute for an element value[j] of a
// row whose largest value is vmax[j], bit for bit (j < count): a forward's selected experts'
// softmax numerators.
void softmax_terms_f32(const float* value, const float* vmax, int64_t count, float* out);

// The same with torch's tails: the terms keep denormals below e^-87.3 (down to e^-104) where
// they are compared rather than only summed (topk_router ranks softmax scores when it has a bias
// or groups, and a flushed 0 would tie with an expert torch ranks above it). row_exp_terms.h's
// row_exp_terms_full_f32 with AVX-512 F, vec_math::exp_full elsewhere.
float row_exp_sum_full_f32(const float* row, int64_t E, float vmax, float* exps);

}  // namespace moe_kernels
