// top2_avx512.h's selection, written with AVX-512 intrinsics (mask registers turn a vector compare
// into the bits whose lowest set one is the index), compiled for AVX-512 BW (isa.h); where this
// build or the CPU lacks it, rows_top2_values_f32 returns false and the caller's selection runs.
#include "select/top2_avx512.h"
#include "isa.h"

#include <cmath>

#include "moe_kernels/common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe_kernels {
namespace {

#if MK_ISA_HAS_AVX512_BW
MK_ISA_BEGIN(AVX512_BW)

// The elements of row[0 .. E) compared with t (E <= 64; bit e: element e), four compares joined
// in mask registers (a branch per 16 elements would be mispredicted on most rows: where the
// largest sits is random).
template <int kCompare>
inline uint64_t compare_bits(const float* row, int64_t E, __m512 t) {
  if (E == 64) {
    const __mmask16 k0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(row), t, kCompare);
    const __mmask16 k1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + 16), t, kCompare);
    const __mmask16 k2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + 32), t, kCompare);
    const __mmask16 k3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + 48), t, kCompare);
    return _cvtmask64_u64(_mm512_kunpackd(_mm512_kunpackw(k3, k2), _mm512_kunpackw(k1, k0)));
  }
  uint64_t bits = 0;
  for (int64_t c = 0; c < E; c += 16) {
    const __mmask16 inside = E - c >= 16 ? 0xffff : (__mmask16)((1u << (E - c)) - 1);
    bits |= (uint64_t)_mm512_mask_cmp_ps_mask(inside, _mm512_maskz_loadu_ps(inside, row + c), t, kCompare) << c;
  }
  return bits;
}

// The two largest values t[0] >= t[1] of a row (16 <= E <= 64) counting repeats; false if its elements
// sum to NaN.
inline bool top2_values(const float* row, int64_t E, float* t) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 v1 = _mm512_loadu_ps(row), v2 = lowest, sum = v1;
  int64_t c = 16;
  for (; c + 16 <= E; c += 16) {
    const __m512 x = _mm512_loadu_ps(row + c);
    v2 = _mm512_max_ps(v2, _mm512_min_ps(v1, x));
    v1 = _mm512_max_ps(v1, x);
    sum = _mm512_add_ps(sum, x);
  }
  if (c < E) {  // the tail: -inf in the lanes past the row (the index search never looks there)
    const __mmask16 inside = (__mmask16)((1u << (E - c)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(lowest, inside, row + c);
    v2 = _mm512_max_ps(v2, _mm512_min_ps(v1, x));
    v1 = _mm512_max_ps(v1, x);
    sum = _mm512_mask_add_ps(sum, inside, sum, x);
  }
  // t1: the largest lane; t2: t1 again if two lanes hold it, else the largest of the other lanes'
  // firsts and the winning lane's second.
  const float t1 = _mm512_reduce_max_ps(v1);
  const __mmask16 at_top = _mm512_cmp_ps_mask(v1, _mm512_set1_ps(t1), _CMP_EQ_OQ);
  const float others = _mm512_reduce_max_ps(_mm512_mask_mov_ps(v1, at_top, v2));
  t[0] = t1;
  t[1] = (at_top & (at_top - 1)) ? t1 : others;
  return !_mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q);
}

// top2_indices where more than two elements are at or above t[1] (ties): the elements equal to
// t[0], and those equal to t[1].
inline void top2_indices_ties(const float* row, int64_t E, const float* t, int64_t* best) {
  const uint64_t first = compare_bits<_CMP_EQ_OQ>(row, E, _mm512_set1_ps(t[0]));
  const uint64_t second = compare_bits<_CMP_EQ_OQ>(row, E, _mm512_set1_ps(t[1])) & ~(first & -first);  // i1 only if t[1] == t[0]
  // t equal the elements themselves (as floats: -0 == +0, and rank_key does not tell them apart).
  best[0] = rank_pair(t[0], (int32_t)__builtin_ctzll(first));
  best[1] = rank_pair(t[1], (int32_t)__builtin_ctzll(second));
}

// The indices of a row's two largest values t: the lowest holding t[0], and the lowest other one
// holding t[1] (with t[1] == t[0], the second holding t[0]). Where exactly two of the row's
// elements are at or above t[1] (most rows), one compare per element finds both and one scalar
// compare tells which is which; otherwise top2_indices_ties. No branch on where they sit, which is
// random on most rows.
inline void top2_indices(const float* row, int64_t E, const float* t, int64_t* best) {
  const uint64_t bits = compare_bits<_CMP_GE_OQ>(row, E, _mm512_set1_ps(t[1]));
  if (__builtin_popcountll(bits) != 2) return top2_indices_ties(row, E, t, best);
  const int64_t a = __builtin_ctzll(bits), b = __builtin_ctzll(bits & (bits - 1));
  // Both at or above t[1], and the two largest: a holds t[0] unless it is the smaller (then b does).
  // (Arithmetic, not a select: compiled as a branch it is mispredicted on half the rows.)
  const int64_t swap = (a ^ b) & -(int64_t)(row[a] != t[0]);
  best[0] = rank_pair(t[0], (int32_t)(a ^ swap));
  best[1] = rank_pair(t[1], (int32_t)(b ^ swap));
}

// A block of rows at a time in two phases, every row's values and then every row's indices: one
// row's steps are a chain (the reductions, then compares on their result), and rows back to back
// overlap in the core.
constexpr int64_t kBlock = 16;
void rows_top2_avx512(const float* x, int64_t stride, int64_t n, int64_t E, int64_t* best, int64_t* redo,
                      int64_t* n_redo) {
  alignas(64) float t[kBlock][2];
  bool ranked[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t m = n - i0 < kBlock ? n - i0 : kBlock;
    for (int64_t j = 0; j < m; ++j) ranked[j] = top2_values(x + (i0 + j) * stride, E, t[j]);
    for (int64_t j = 0; j < m; ++j) {
      if (ranked[j]) {
        top2_indices(x + (i0 + j) * stride, E, t[j], best + 2 * (i0 + j));
      } else {
        redo[(*n_redo)++] = i0 + j;
      }
    }
  }
}
MK_ISA_END
#endif

}  // namespace

bool rows_top2_values_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t* best, int64_t* redo,
                          int64_t* n_redo) {
  *n_redo = 0;
  if (!isa::cpu_runs(isa::Set::kAvx512Bw) || E < 16 || E > 64) return false;
#if MK_ISA_HAS_AVX512_BW
  rows_top2_avx512(x, stride, n, E, best, redo, n_redo);
  return true;
#else
  (void)x, (void)stride, (void)n, (void)best, (void)redo;
  return false;
#endif
}

}  // namespace moe_kernels
