// The sampled-threshold select of batchwise_mask on CPU (csrc/cpu/batchwise_mask.cpp), without
// torch headers so that python_tests/builds/isa/ builds and checks it for each instruction set.
//
// For a column of T scores and m << T, a radix select over the whole column costs several passes
// over T keys. Instead: a strided sample of S rows gives each column a lower bound `lo` that about
// 2m of its T scores reach (the sample's rank-th largest, rank chosen a few standard deviations
// above m S / T); one row-major pass over the scores appends every score >= lo (its token and
// order key) to its column's candidate list, in token order; the exact m-th largest is then
// selected among the candidates. If a column has at least m candidates, its m largest scores are
// all among them (all >= its m-th largest >= lo), so the result is exact; a column with fewer than
// m candidates, or more than the lists hold (ties, adversarial orders), is reported and the caller
// selects it over the whole column.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moe_kernels/common.h"  // MK_ALWAYS_INLINE

namespace moe_kernels {
namespace column_filter {

// batchwise_mask::order_key without branches (NaN by a select), so that loops of keys vectorise.
MK_ALWAYS_INLINE uint32_t order_key_f32(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x + 0.0f);  // + 0.0f: -0 becomes +0
  const uint32_t ordered = (int32_t)u >= 0 ? u : (u ^ 0x7fffffffu);
  return (x != x ? 0x7fffffffu : ordered) ^ 0x80000000u;
}

// The sample size and how many candidates a column's list holds, for one (T, m); use == false
// where the filter would keep too large a fraction of the column to pay off.
struct Plan {
  bool use = false;
  int64_t sample_rows = 0;  // S
  int64_t rank = 0;         // lo is the rank-th largest of a column's S sampled scores
  int64_t capacity = 0;     // candidates a list holds; a column with more is selected in full
};
Plan plan(int64_t T, int64_t m);

// The token of the i-th sampled row (i < S): spread evenly over [0, T).
inline int64_t sample_row(int64_t i, int64_t S, int64_t T) { return i * T / S; }

// Per column j < w, the plan's rank-th largest of sample[0..S) [j] (row-major, ld w) by order key:
// lo[j] as a float (candidates are the x with !(x < lo[j])) and lo_key[j] as an order key.
void thresholds(const float* sample, int64_t S, int64_t w, int64_t rank, float* lo, uint32_t* lo_key);

// Candidate lists of w columns: column j's candidates at entries[j * ld + i] for i < count[j],
// each (the score's float32 bits << 32 | token: select_candidates makes the order keys). Appends
// past capacity are not stored; count keeps counting.
struct CandidateLists {
  int64_t w = 0, capacity = 0, ld = 0, allocated = 0;
  std::unique_ptr<uint64_t[]> entries;  // [w * ld], not initialised: only appended entries are read
  std::vector<int64_t> count;
  // filter_rows' state between begin_appends and end_appends: column j's next entry, and its
  // appends that found the list full.
  std::vector<uint64_t*> cursor;
  std::vector<int64_t> overflow;
  void reset(int64_t w_, int64_t capacity_);
  void begin_appends();
  void end_appends();
};

// Append the candidates of rows t0 .. t0 + rows (row r at x + r * stride_t, w float32 columns)
// to lists, in row order: the score of (t, j) when !(x < lo[j]) (NaN included).
void filter_rows(const float* x, int64_t stride_t, int64_t t0, int64_t rows, const float* lo, CandidateLists& lists);

// Scratch space of select_candidates, reused across columns.
struct SelectScratch {
  std::vector<int32_t> hist;
  std::vector<uint32_t> keys, bin;  // the candidates' keys; those in the threshold's bin
  std::vector<uint64_t> bin_entries;  // the threshold bin's (key << 32 | token), in token order
  std::vector<int64_t> picked;        // those of them kept
};

// The m largest of column j's candidates (1 <= m), written as ascending tokens to out[0..m): keys
// above the m-th largest, then its first ties in token order (ties go to the lower token). false,
// writing nothing, if the column has fewer than m candidates or more than the lists hold.
bool select_candidates(const CandidateLists& lists, int64_t j, int64_t m, uint32_t lo_key, SelectScratch& s,
                       int64_t* out);

}  // namespace column_filter
}  // namespace moe_kernels
