// select.h's selections, each entry point compiled per instruction set (MK_ISA_CLONES, isa.h)
// with the bodies it picks among inlined: argmax.h (k = 1), top2.h (k = 2), pairs_topk.h (the
// candidate sort and knockout rounds), insertion.h (larger rows, k <= kRowInsertionMaxK), a
// partial sort (larger k); and, where the CPU has them, the AVX-512 selections of
// top2_avx512.h and top8_avx512.h, which leave the rows they cannot rank to these.
#include "select/select.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "isa.h"
#include "moe_kernels/common.h"
#include "score/exp_terms.h"
#include "select/argmax.h"
#include "select/insertion.h"
#include "select/pairs_topk.h"
#include "select/top2.h"
#include "select/top2_avx512.h"
#include "select/top8_avx512.h"

namespace moe_kernels {

MK_ISA_CLONES
int32_t row_argmax_f32(const float* row, int64_t E) { return argmax_row(row, E); }

MK_ISA_CLONES
void row_top2_f32(const float* row, int64_t E, int64_t* best) { top2_row(row, E, best); }

MK_ISA_CLONES
void row_topk_f32(const float* row, int64_t E, int k, int64_t* best) { topk_insertion(row, E, k, best); }

MK_ISA_CLONES
void row_topk_rounds_f32(const float* row, int64_t E, int k, int64_t* best) { rounds_row(row, E, k, best); }

// rows_top_pairs_f32's candidate sort for rows [0, n) (E <= kRoundsMaxE, k * E <= kRoundsMaxWork),
// four at a time where it can, out of line: inlined, its buffers (~34 KB for four rows) made
// every call's frame ~39 KB, and its first stores (the arguments' spills, at the frame's far
// end) showed up in the register selection's profile.
MK_ISA_CLONES
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

MK_ISA_CLONES
void rows_top_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t k, int64_t* best) {
  if (k == 1) {
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x + i * stride;
      const int32_t e = argmax_row(row, E);
      best[i] = rank_pair(row[e], e);
    }
  } else if (k == 2) {
    // By values first where top2_avx512.h applies (AVX-512, 16 <= E <= 64), 64 rows a call; the rows
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
      // In registers where top8_avx512.h applies (AVX-512 F/BW/VBMI2, 16 <= E <= 256), 64 rows a
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
  // (k <= 2 select faster by top2.h, top2_avx512.h and the argmax.)
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
MK_VECTORISE MK_ALWAYS_INLINE float rank_value(int64_t pair) {
  const int32_t key = (int32_t)(pair >> 32);
  return __builtin_bit_cast(float, key < 0 ? key ^ 0x7fffffff : key);
}

// selected_slots with k fixed at compile time (K > 0: the compiler vectorises across rows) or any
// k (K = 0).
template <int K>
MK_VECTORISE MK_ALWAYS_INLINE void slots_k(const int64_t* __restrict best, int64_t n, int64_t k_any, int64_t* __restrict experts,
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

MK_VECTORISE MK_ISA_CLONES
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

}  // namespace moe_kernels
