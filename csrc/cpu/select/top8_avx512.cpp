// top8_avx512.h's selection with AVX-512 intrinsics (a byte compress and permutes place the
// candidates in registers), compiled for AVX-512 VBMI2 (isa.h); where this build or the CPU lacks
// it, rows_top8_pairs_f32 and rows_top8_renormalized_f32 return false and the caller's selection
// runs.
#include "select/top8_avx512.h"
#include "isa.h"

#include <climits>
#include <cmath>

#include "select/bitonic.h"
#include "score/exp_terms.h"
#include "moe_kernels/common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Vectors pass by value between inlined helpers only.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moe_kernels {
namespace {

#if MK_ISA_HAS_AVX512_VBMI2
MK_ISA_BEGIN(AVX512_VBMI2)

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// bitonic.h's compare-exchange step on 16 lanes with intrinsics: the partner by an in-lane or a
// 128-bit-block shuffle (1-cycle latency, where GCC's generic shuffle emits a 3-cycle two-source
// permute), the smaller, then the larger over it where the lane keeps the larger (a masked max:
// three operations a step instead of four).
template <int block, int j, bool descending>
constexpr __mmask16 keeps_larger16() {
  unsigned mask = 0;
  for (int l = 0; l < 16; ++l) mask |= (unsigned)((bitonic::keeps_larger(l, block, j) != 0) == descending) << l;
  return (__mmask16)mask;
}

struct avx512_exchange {
  template <int j>
  static inline __m512i partner(__m512i x) {
    if constexpr (j == 1) return _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0xb1);
    if constexpr (j == 2) return _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0x4e);
    if constexpr (j == 4) return _mm512_shuffle_i32x4(x, x, 0xb1);
    return _mm512_shuffle_i32x4(x, x, 0x4e);
  }
  template <int block, int j, bool descending>
  static inline i32x16 step(i32x16 v) {
    const __m512i x = (__m512i)v, y = partner<j>(x);
    return (i32x16)_mm512_mask_max_epi32(_mm512_min_epi32(x, y), keeps_larger16<block, j, descending>(), x, y);
  }
  template <int block, int j, bool descending>
  static inline f32x16 step(f32x16 v) {
    const __m512 x = (__m512)v, y = _mm512_castsi512_ps(partner<j>(_mm512_castps_si512(x)));
    return (f32x16)_mm512_mask_max_ps(_mm512_min_ps(x, y), keeps_larger16<block, j, descending>(), x, y);
  }
};

// The lanes of row[c .. c + 16) inside the row: all of them but in a last, partial step.
inline __mmask16 inside(int64_t E, int64_t c) {
  return E - c >= 16 ? (__mmask16)0xffff : E - c <= 0 ? (__mmask16)0 : (__mmask16)((1u << (E - c)) - 1);
}

// The lanes of vector q of a row (elements 16 q ..): kE > 0 is E itself (every mask known at
// compile time); kE < 0 gives the row's vector count, -kE (every mask but the last vector's known
// at compile time); kE = 0 nothing.
template <int kE>
inline __mmask16 lanes(int64_t E, int q) {
  if constexpr (kE > 0) return inside(kE, 16 * q);
  if constexpr (kE < 0) {
    if (q < -kE - 1) return (__mmask16)0xffff;
    if (q >= -kE) return (__mmask16)0;
  }
  return inside(E, 16 * q);
}

// Step 1 for R rows (row[j], E <= 64 W): the 16 lane maxima (lane l holds elements l, l + 16,
// ...; E >= 16 puts an element in every lane, the zeros past the row are masked out). A NaN may
// be dropped here or reach the floor: step 3 finds it either way.
template <int W, int R, int kE>
inline void lane_maxima(const float* const* row, int64_t E_any, __m512* max) {
  constexpr int V = kE > 0 ? kE / 16 : kE < 0 ? -kE : 4 * W;  // vectors of 16 a row
  const int64_t E = E_any;
  for (int j = 0; j < R; ++j) max[j] = _mm512_loadu_ps(row[j]);
  for (int q = 1; q < V; ++q) {
    const __mmask16 in = lanes<kE>(E, q);
    for (int j = 0; j < R; ++j) {
      max[j] = _mm512_mask_max_ps(max[j], in, max[j], _mm512_maskz_loadu_ps(in, row[j] + 16 * q));
    }
  }
}

// Rows of 16 lanes of max and min: every lane an independent row, so a network's compare-exchange
// is two instructions for 16 rows with no shuffle.
struct vertical {
  // c[i] >= c[j] after the exchange.
  static inline void exchange(__m512* c, int i, int j) {
    const __m512 hi = _mm512_max_ps(c[i], c[j]);
    c[j] = _mm512_min_ps(c[i], c[j]);
    c[i] = hi;
  }
  // c[0 .. 8) descending: the 19-exchange, depth-6 network (Knuth, TAOCP 5.3.4), written out so
  // that every c[i] stays a register.
  static inline void sort8(__m512* c) {
    exchange(c, 0, 2), exchange(c, 1, 3), exchange(c, 4, 6), exchange(c, 5, 7);
    exchange(c, 0, 4), exchange(c, 1, 5), exchange(c, 2, 6), exchange(c, 3, 7);
    exchange(c, 0, 1), exchange(c, 2, 3), exchange(c, 4, 5), exchange(c, 6, 7);
    exchange(c, 2, 4), exchange(c, 3, 5);
    exchange(c, 1, 4), exchange(c, 3, 6);
    exchange(c, 1, 2), exchange(c, 3, 4), exchange(c, 5, 6);
  }
};

// 16 vectors transposed but for the order of the results: lane r of c[i] is lane sigma(i) of m[r],
// sigma(4 q + b) = 4 b + q. Vectors s[p] holding row r's p-th value in lane r transpose back to
// row sigma(i)'s values in c[i].
inline void transpose16(const __m512* m, __m512* c) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(m[i], m[i + 1]);
  }
  // u[4 g + q]: in 128-bit block b, lane 4 b + q of m[4 g .. 4 g + 4).
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c2 = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c2));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c2));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // Block g of c[4 q + b] from u[4 g + q]'s block b: a 4 x 4 transpose of 128-bit blocks.
  for (int q = 0; q < 4; ++q) {
    const __m512 s0 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x44), s1 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xee);
    const __m512 s2 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x44), s3 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xee);
    c[4 * q] = _mm512_shuffle_f32x4(s0, s2, 0x88);
    c[4 * q + 1] = _mm512_shuffle_f32x4(s0, s2, 0xdd);
    c[4 * q + 2] = _mm512_shuffle_f32x4(s1, s3, 0x88);
    c[4 * q + 3] = _mm512_shuffle_f32x4(s1, s3, 0xdd);
  }
}
constexpr int sigma(int i) { return 4 * (i % 4) + i / 4; }

// Steps 1 and 2 for rows [0, rows) of a block of 16 (rows <= 16): each row's floor into
// floors[r].
template <int W, int kE>
inline void floors16(const float* x, int64_t stride, int64_t E_any, int rows, __m512* floors) {
  // 64-wide rows four at a time (their chains of maxima overlap; wider rows measured slower so);
  // the rows past `rows` repeat the last one.
  constexpr int R = W == 1 ? 4 : 1;
  __m512 m[16];
  for (int r0 = 0; r0 < 16; r0 += R) {
    const float* row[R];
    for (int j = 0; j < R; ++j) row[j] = x + (r0 + j < rows ? r0 + j : rows - 1) * stride;
    lane_maxima<W, R, kE>(row, E_any, m + r0);
  }
  // The 8th largest of each row's 16: both halves sorted descending, the larger of a[i] and
  // b[7 - i] are the 8 largest of the 16 (a bitonic half-cleaner), their least is it.
  __m512 c[16];
  transpose16(m, c);
  vertical::sort8(c);
  vertical::sort8(c + 8);
  __m512 floor = _mm512_max_ps(c[0], c[15]);
  for (int i = 1; i < 8; ++i) floor = _mm512_min_ps(floor, _mm512_max_ps(c[i], c[15 - i]));
  *floors = floor;
}

// Step 3 for R rows at once (E <= 64 W; kE as for lanes),
// every operation for all R before the next (R chains of dependent operations overlap only when
// interleaved instruction by instruction: written row after row, four rows took as long as one
// row four times). floor_of(j) broadcasts row j's floor. Each row's step-4 vector into packed[j],
// its candidates' rank keys and indices into key[j] and index[j], their number into count[j]
// (INT_MAX for a row with a NaN among its first 16: finish leaves the rows past 16).
template <int W, int R, int kE, typename Floor>
inline void candidates(const float* x, int64_t stride, int64_t E_any, Floor floor_of, __m512i* packed, __m512i* key,
                       __m512i* index, int* count) {
  const int64_t E = E_any;
  auto row_vector = [&](int j, int q) { return _mm512_maskz_loadu_ps(lanes<kE>(E, q), x + j * stride + 16 * q); };
  // The elements >= floor, and NaNs (an unordered compare: a NaN the lane maxima dropped, or a
  // NaN floor, which takes every element, still marks its row): bit e of 64-element word w for
  // element 64 w + e >= floor; their indices ascending (bytes: E <= 256) by a byte compress of
  // each word's mask, the words after the first placed after the ones before by a byte expand,
  // widened; lanes past the count 0. Their values by two-source permutes of a 64-wide row's four
  // vectors, or gathered from a wider one.
  const __m512i byte_lane = _mm512_set_epi64(0x3f3e3d3c3b3a3938, 0x3736353433323130, 0x2f2e2d2c2b2a2928,
                                             0x2726252423222120, 0x1f1e1d1c1b1a1918, 0x1716151413121110,
                                             0x0f0e0d0c0b0a0908, 0x0706050403020100);
  __mmask16 used[R];
  for (int j = 0; j < R; ++j) {
    const __m512 floor = floor_of(j);
    __m512i bytes = _mm512_setzero_si512();
    count[j] = 0;
    for (int w = 0; w < W; ++w) {
      __mmask16 c[4];
      for (int q = 0; q < 4; ++q) {
        c[q] = _mm512_mask_cmp_ps_mask(lanes<kE>(E, 4 * w + q), row_vector(j, 4 * w + q), floor, _CMP_NLT_UQ);
      }
      const __mmask64 bits = _mm512_kunpackd(_mm512_kunpackw(c[3], c[2]), _mm512_kunpackw(c[1], c[0]));
      const int kept = __builtin_popcountll(_cvtmask64_u64(bits));
      if (w == 0) {
        bytes = _mm512_maskz_compress_epi8(bits, byte_lane);
      } else {
        // Lanes count .. count + kept take this word's; a row past 16 candidates is left anyway.
        const uint64_t place = count[j] >= 16 ? 0 : (kept >= 64 ? ~0ull : (1ull << kept) - 1) << count[j];
        const __m512i lanes = _mm512_add_epi8(byte_lane, _mm512_set1_epi8((char)(64 * w)));
        bytes = _mm512_mask_expand_epi8(bytes, place, _mm512_maskz_compress_epi8(bits, lanes));
      }
      count[j] += kept;
    }
    used[j] = count[j] >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count[j]) - 1);
    index[j] = _mm512_maskz_cvtepu8_epi32(used[j], _mm512_castsi512_si128(bytes));
  }
  for (int j = 0; j < R; ++j) {
    __m512 value;
    if constexpr (W == 1) {
      const __m512 low = _mm512_permutex2var_ps(row_vector(j, 0), index[j], row_vector(j, 1));
      const __m512 high = _mm512_permutex2var_ps(row_vector(j, 2), index[j], row_vector(j, 3));
      value = _mm512_mask_blend_ps(_mm512_test_epi32_mask(index[j], _mm512_set1_epi32(32)), low, high);
    } else {
      value = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), used[j], index[j], x + j * stride, 4);
    }
    // (A branch: accumulating row bits here was slower.)
    if (_mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q)) count[j] = INT_MAX;
    // rank_key (common.h): -0 as +0, negative floats' magnitude bits flipped (a NaN row is left).
    const __m512i b = _mm512_castps_si512(_mm512_add_ps(value, _mm512_setzero_ps()));
    key[j] = _mm512_ternarylogic_epi32(b, _mm512_srai_epi32(b, 31), _mm512_set1_epi32(0x7fffffff), 0x78);  // A ^ (B & C)
  }
  // What step 4 sorts: each key's top 28 bits above 15 - its lane (its candidate number: lanes
  // are in index order, so of two equal prefixes the lower index ranks first), lanes past the
  // count INT_MIN.
  const __m512i lane_code = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int j = 0; j < R; ++j) {
    const __m512i p = _mm512_ternarylogic_epi32(key[j], _mm512_set1_epi32(~15), lane_code, 0xe2);  // B ? A : C
    packed[j] = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT_MIN), used[j], p);
  }
}

// Step 4 for 16 rows: packed[r] sorted descending, into sorted[sigma(r)] (transpose16), by
// Batcher's odd-even merge sort (63 exchanges, depth 10) on the transposed vectors.
inline void sort16_rows(const __m512i* packed, __m512i* sorted) {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(packed[i]);
  __m512 t[16];
  transpose16(f, t);
  __m512i c[16];
  for (int i = 0; i < 16; ++i) c[i] = _mm512_castps_si512(t[i]);
  auto exchange = [&](int i, int j) {
    const __m512i hi = _mm512_max_epi32(c[i], c[j]);
    c[j] = _mm512_min_epi32(c[i], c[j]);
    c[i] = hi;
  };
  for (int i = 0; i < 16; i += 2) exchange(i, i + 1);
  for (int i = 0; i < 16; i += 4) exchange(i, i + 2), exchange(i + 1, i + 3);
  for (int i = 0; i < 16; i += 4) exchange(i + 1, i + 2);
  for (int i = 0; i < 16; i += 8) exchange(i, i + 4), exchange(i + 3, i + 7);
  for (int i = 0; i < 16; i += 8) exchange(i + 2, i + 6), exchange(i + 1, i + 5);
  for (int i = 0; i < 16; i += 8) exchange(i + 2, i + 4), exchange(i + 3, i + 5);
  for (int i = 0; i < 16; i += 8) exchange(i + 1, i + 2), exchange(i + 3, i + 4), exchange(i + 5, i + 6);
  exchange(0, 8), exchange(7, 15);
  exchange(4, 12), exchange(2, 10), exchange(6, 14), exchange(1, 9), exchange(5, 13), exchange(3, 11);
  exchange(4, 8), exchange(6, 10), exchange(5, 9), exchange(7, 11);
  exchange(2, 4), exchange(6, 8), exchange(10, 12), exchange(3, 5), exchange(7, 9), exchange(11, 13);
  for (int i = 1; i < 15; i += 2) exchange(i, i + 1);
  for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(c[i]);
  transpose16(f, t);
  for (int i = 0; i < 16; ++i) sorted[i] = _mm512_castps_si512(t[i]);
}

// After the sort, R rows at once: each row's k pairs into best + k j (garbage for a row it does
// not finish); returns the rows it does not finish as bits. Each row's store is all 8 pairs
// (512-bit masked stores cost more than plain ones on Zen 4) where they end by best_end, the
// end of the caller's output or of the block's buffer (WeightsOut, 8 pairs longer than its 16
// rows): past k they land on the next rows' slots, which are written after.
template <int R>
inline uint32_t finish(const __m512i* sorted_of, const __m512i* key, const __m512i* index, const int* count, int k,
                       int64_t* best, const int64_t* best_end) {
  uint32_t failed = 0;
  const __mmask8 slots = (__mmask8)((1u << k) - 1);
  for (int j = 0; j < R; ++j) {
    const __m512i sorted = sorted_of[j];
    // The candidates' full keys in sorted order. Equal keys share a prefix and come in index
    // order, as rank pairs rank them; two different keys with one prefix may be misordered, and
    // if any are, two such neighbours are (a run of one prefix is contiguous once sorted).
    const __m512i number = _mm512_andnot_si512(sorted, _mm512_set1_epi32(15));  // 15 - the low 4 bits
    const __m512i sorted_key = _mm512_permutexvar_epi32(number, key[j]);
    const __m512i prefix = _mm512_srai_epi32(sorted, 4);
    const __mmask16 same_prefix = _mm512_mask_cmpeq_epi32_mask(0x7fff, prefix, _mm512_alignr_epi32(prefix, prefix, 1));
    const bool misordered =
        _mm512_mask_cmpneq_epi32_mask(same_prefix, sorted_key, _mm512_alignr_epi32(sorted_key, sorted_key, 1)) != 0;
    failed |= (uint32_t)(misordered || count[j] > 16) << j;
    // The top eight's rank pairs (key << 32 | 0xffffffff - index): 32-bit lanes 2 s and 2 s + 1
    // from the complemented indices and the keys.
    const __m512i top_index = _mm512_permutexvar_epi32(number, index[j]);
    const __m512i interleave = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i pairs =
        _mm512_permutex2var_epi32(_mm512_xor_si512(top_index, _mm512_set1_epi32(-1)), interleave, sorted_key);
    if (best + k * j + 8 <= best_end) {
      _mm512_storeu_si512(best + k * j, pairs);
    } else {
      _mm512_mask_storeu_epi64(best + k * j, slots, pairs);
    }
  }
  return failed;
}

// Where a block's pairs go: the caller's array (rows_top8_pairs_f32) ...
struct PairsOut {
  int64_t* best;
  int k;
  int64_t n;
  int64_t* block(int64_t i0) const { return best + k * i0; }
  const int64_t* end() const { return best + k * n; }
  void done(int64_t, int) const {}
};

// ... or a buffer of one block's, turned into experts and renormalised weights after each block
// (rows_top8_renormalized_f32). The buffer's 8 spare pairs let every row's store be a whole one.
struct WeightsOut {
  int64_t* pairs;  // [16 * k + 8]
  int k;
  int64_t* experts;
  float* w;
  int64_t* block(int64_t) const { return pairs; }
  const int64_t* end() const { return pairs + 16 * k + 8; }
  void done(int64_t i0, int rows) const { renormalized_pairs_f32(pairs, rows, k, experts + k * i0, w + k * i0); }
};

// Rows of up to 128 in blocks of 16: the floors (floors16) and the candidates' sort (sort16_rows)
// on transposed vectors; each block's pairs to to.block(i0), then to.done(i0, rows).
template <int W, int kE, typename Out>
void rows_top8_blocks(const float* x, int64_t stride, int64_t n, int64_t E, int k, const Out& to, int64_t* redo,
                      int64_t* n_redo) {
  constexpr int R = 16;
  int64_t left = 0;
  __m512i packed[16], key[16], index[16], sorted[16];
  int count[16];
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int rows = (int)(n - i0 < 16 ? n - i0 : 16);
    const float* block = x + i0 * stride;
    __m512 floors;
    floors16<W, kE>(block, stride, E, rows, &floors);
    int j = 0;
    for (; j + R <= rows; j += R) {
      auto floor_of = [&](int r) { return _mm512_permutexvar_ps(_mm512_set1_epi32(j + r), floors); };
      candidates<W, R, kE>(block + j * stride, stride, E, floor_of, packed + j, key + j, index + j, count + j);
    }
    for (; j < rows; ++j) {
      auto floor_of = [&](int) { return _mm512_permutexvar_ps(_mm512_set1_epi32(j), floors); };
      candidates<W, 1, kE>(block + j * stride, stride, E, floor_of, packed + j, key + j, index + j, count + j);
    }
    for (; j < 16; ++j) packed[j] = _mm512_set1_epi32(INT_MIN);
    __m512i out[16];
    sort16_rows(packed, out);
    for (int r = 0; r < 16; ++r) sorted[r] = out[sigma(r)];
    uint32_t failed = 0;
    int64_t* best = to.block(i0);
    for (j = 0; j + R <= rows; j += R) {
      failed |= finish<R>(sorted + j, key + j, index + j, count + j, k, best + k * j, to.end()) << j;
    }
    for (; j < rows; ++j) {
      failed |= finish<1>(sorted + j, key + j, index + j, count + j, k, best + k * j, to.end()) << j;
    }
    for (; failed; failed &= failed - 1) redo[left++] = i0 + __builtin_ctz(failed);
    to.done(i0, rows);
  }
  *n_redo = left;
}

// Rows of up to 256, R at once, each row's floor and sort on its own vector (bitonic.h's
// networks across lanes): for E = 129 to 256, where the blocks above are slower or no faster.
template <int W, int R, int kE>
inline uint32_t top8_rows(const float* x, int64_t stride, int64_t E_any, int k, int64_t* best, const int64_t* best_end) {
  const float* row[R];
  for (int j = 0; j < R; ++j) row[j] = x + j * stride;
  __m512 max[R];
  lane_maxima<W, R, kE>(row, E_any, max);
  f32x16 m[R];
  for (int j = 0; j < R; ++j) m[j] = (f32x16)max[j];
  // The floor: sorted by blocks of 8 (lanes 0-7 descending, 8-15 ascending), the half-cleaner's
  // larger halves are the 8 largest lane maxima; their smallest is it.
  bitonic::sort8_each<true, R, avx512_exchange>(m);
  bitonic::bitonic_steps<16, 8, true, R, avx512_exchange>(m);
  __m512 floor[R];
  for (int j = 0; j < R; ++j) floor[j] = _mm512_min_ps((__m512)m[j], _mm512_shuffle_f32x4((__m512)m[j], (__m512)m[j], 0xb1));
  for (int j = 0; j < R; ++j) floor[j] = _mm512_min_ps(floor[j], _mm512_permute_ps(floor[j], 0x4e));
  for (int j = 0; j < R; ++j) floor[j] = _mm512_min_ps(floor[j], _mm512_permute_ps(floor[j], 0xb1));
  for (int j = 0; j < R; ++j) floor[j] = _mm512_broadcastss_ps(_mm512_castps512_ps128(floor[j]));
  __m512i packed[R], key[R], index[R];
  int count[R];
  candidates<W, R, kE>(x, stride, E_any, [&](int j) { return floor[j]; }, packed, key, index, count);
  i32x16 sorted[R];
  for (int j = 0; j < R; ++j) sorted[j] = (i32x16)packed[j];
  bitonic::sort16_each<true, R, avx512_exchange>(sorted);
  return finish<R>((const __m512i*)sorted, key, index, count, k, best, best_end);
}

template <int W, int kE>
void rows_top8_each(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best, int64_t* redo,
                    int64_t* n_redo) {
  constexpr int R = 4;
  int64_t left = 0, i = 0;
  for (; i + R <= n; i += R) {
    uint32_t failed = top8_rows<W, R, kE>(x + i * stride, stride, E, k, best + k * i, best + k * n);
    for (; failed; failed &= failed - 1) redo[left++] = i + __builtin_ctz(failed);
  }
  for (; i < n; ++i) {
    if (top8_rows<W, 1, kE>(x + i * stride, stride, E, k, best + k * i, best + k * n)) redo[left++] = i;
  }
  *n_redo = left;
}

// The instance for E <= 128: the 64-element words a row needs, and for E <= 64 the masks known at
// compile time (lanes: E itself at 16, 32, 48 and 64, else the row's vector count), which are
// faster there; E = 65 to 127 keep their masks at run time (with the weights in one pass, known
// masks were slower at E = 96; docs/topk_softmax.md has the timings).
template <typename Out>
void rows_top8_narrow(const float* x, int64_t stride, int64_t n, int64_t E, int k, const Out& out, int64_t* redo,
                      int64_t* n_redo) {
  if (E == 64) return rows_top8_blocks<1, 64>(x, stride, n, E, k, out, redo, n_redo);
  if (E == 32) return rows_top8_blocks<1, 32>(x, stride, n, E, k, out, redo, n_redo);
  if (E == 16) return rows_top8_blocks<1, 16>(x, stride, n, E, k, out, redo, n_redo);
  if (E == 48) return rows_top8_blocks<1, 48>(x, stride, n, E, k, out, redo, n_redo);
  if (E > 48 && E < 64) return rows_top8_blocks<1, -4>(x, stride, n, E, k, out, redo, n_redo);
  if (E > 32 && E < 64) return rows_top8_blocks<1, -3>(x, stride, n, E, k, out, redo, n_redo);
  if (E < 64) return rows_top8_blocks<1, -2>(x, stride, n, E, k, out, redo, n_redo);  // 16 < E < 32
  if (E == 128) return rows_top8_blocks<2, 128>(x, stride, n, E, k, out, redo, n_redo);
  return rows_top8_blocks<2, 0>(x, stride, n, E, k, out, redo, n_redo);
}

// The instance for E.
void rows_top8_any(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best, int64_t* redo,
                   int64_t* n_redo) {
  if (E <= 128) return rows_top8_narrow(x, stride, n, E, k, PairsOut{best, k, n}, redo, n_redo);
  if (E == 256) return rows_top8_each<4, 256>(x, stride, n, E, k, best, redo, n_redo);
  return rows_top8_each<4, 0>(x, stride, n, E, k, best, redo, n_redo);
}

MK_ISA_END
#endif

}  // namespace

#if MK_ISA_HAS_AVX512_VBMI2
bool rows_top8_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best,
                         int64_t* redo, int64_t* n_redo) {
  *n_redo = 0;
  if (!isa::cpu_runs(isa::Set::kAvx512Vbmi2) || E < 16 || E > 256 || k < 1 || k > 8) return false;
  rows_top8_any(x, stride, n, E, k, best, redo, n_redo);
  return true;
}

bool rows_top8_renormalized_f32(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* experts,
                                float* w, int64_t* redo, int64_t* n_redo) {
  *n_redo = 0;
  static const bool supported =
      isa::cpu_runs(isa::Set::kAvx512Vbmi2) && renormalized_pairs_f32(nullptr, 0, 1, nullptr, nullptr);
  if (!supported || E < 16 || E > 128 || k < 1 || k > 8) return false;
  alignas(64) int64_t pairs[16 * 8 + 8];
  rows_top8_narrow(x, stride, n, E, k, WeightsOut{pairs, k, experts, w}, redo, n_redo);
  return true;
}
#else
// No AVX-512 VBMI2 in this build: the caller's selection runs.
bool rows_top8_pairs_f32(const float*, int64_t, int64_t, int64_t, int, int64_t*, int64_t*, int64_t* n_redo) {
  *n_redo = 0;
  return false;
}
bool rows_top8_renormalized_f32(const float*, int64_t, int64_t, int64_t, int, int64_t*, float*, int64_t*,
                                int64_t* n_redo) {
  *n_redo = 0;
  return false;
}
#endif

}  // namespace moe_kernels
