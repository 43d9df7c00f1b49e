// row_top8.h's selection with AVX-512 intrinsics (a byte compress and permutes place the
// candidates in registers), compiled under a target pragma in the dispatch build, or where the
// compiler's flags allow AVX-512 F, BW and VBMI2; elsewhere rows_top8_pairs_f32 returns false and
// the caller's selection runs.
#include "row_top8.h"
#include "isa_dispatch.h"

#include <climits>
#include <cmath>

#include "bitonic.h"
#include "moe_kernels/common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Vectors pass by value between inlined helpers only.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moe_kernels {
namespace {

#if defined(MK_ISA_DISPATCH)
#define MK_TOP8_DISPATCH 1
#define MK_TOP8_AVX512 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__)
#define MK_TOP8_AVX512 1
#endif

#if defined(MK_TOP8_AVX512)
#if defined(MK_TOP8_DISPATCH)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vbmi2,popcnt")
#endif

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

// R rows at once (E <= 64 W; kFull: E = 64 W, every mask known at compile time), every operation for
// all R before the next: one row is a chain of ~170 cycles of dependent vector operations, and R
// chains overlap only when interleaved instruction by instruction (bitonic.h's *_each; written
// row after row, four rows took as long as one row four times). Writes each row's k pairs (garbage
// for the rows it does not finish) and returns the rows it does not finish as bits.
template <int W, int R, bool kFull>
inline uint32_t top8_rows(const float* x, int64_t stride, int64_t E_any, int k, int64_t* best) {
  constexpr int V = 4 * W;  // vectors of 16 a row
  const int64_t E = kFull ? 64 * W : E_any;
  // A 64-wide row stays in registers (its values are looked up there); wider rows are read again.
  __m512 v[R][4];
  auto load = [&](int j, int q) { return _mm512_maskz_loadu_ps(inside(E, 16 * q), x + j * stride + 16 * q); };
  if constexpr (W == 1) {
    for (int q = 0; q < 4; ++q) {
      for (int j = 0; j < R; ++j) v[j][q] = load(j, q);
    }
  }
  auto row_vector = [&](int j, int q) { return W == 1 ? v[j][q] : load(j, q); };
  // 1. The 16 lane maxima (E >= 16 puts an element in every lane; the zeros past the row are
  // masked out) and the NaN check.
  f32x16 m[R];
  __m512 sum[R];
  for (int j = 0; j < R; ++j) m[j] = (f32x16)row_vector(j, 0), sum[j] = (__m512)m[j];
  for (int q = 1; q < V; ++q) {
    const __mmask16 in = inside(E, 16 * q);
    for (int j = 0; j < R; ++j) {
      const __m512 x_q = row_vector(j, q);
      m[j] = (f32x16)_mm512_mask_max_ps((__m512)m[j], in, (__m512)m[j], x_q);
      sum[j] = _mm512_mask_add_ps(sum[j], in, sum[j], x_q);
    }
  }
  // 2. The floor: the 8th largest lane maximum. Sorted by blocks of 8 (lanes 0-7 descending,
  // 8-15 ascending), the half-cleaner's larger halves are the 8 largest; their smallest is it.
  bitonic::sort8_each<true, R, avx512_exchange>(m);
  bitonic::bitonic_steps<16, 8, true, R, avx512_exchange>(m);
  __m512 floor[R];
  for (int j = 0; j < R; ++j) floor[j] = _mm512_min_ps((__m512)m[j], _mm512_shuffle_f32x4((__m512)m[j], (__m512)m[j], 0xb1));
  for (int j = 0; j < R; ++j) floor[j] = _mm512_min_ps(floor[j], _mm512_permute_ps(floor[j], 0x4e));
  for (int j = 0; j < R; ++j) floor[j] = _mm512_min_ps(floor[j], _mm512_permute_ps(floor[j], 0xb1));
  for (int j = 0; j < R; ++j) floor[j] = _mm512_broadcastss_ps(_mm512_castps512_ps128(floor[j]));
  // 3. The candidates: bit e of 64-element word w for element 64 w + e >= floor; their indices
  // ascending (bytes: E <= 256) by a byte compress of each word's mask, the words after the first
  // placed after the ones before by a byte expand, widened; lanes past the count 0. Their values
  // by two-source permutes of a 64-wide row's four vectors, or gathered from a wider one.
  const __m512i byte_lane = _mm512_set_epi64(0x3f3e3d3c3b3a3938, 0x3736353433323130, 0x2f2e2d2c2b2a2928,
                                             0x2726252423222120, 0x1f1e1d1c1b1a1918, 0x1716151413121110,
                                             0x0f0e0d0c0b0a0908, 0x0706050403020100);
  int count[R];
  __mmask16 used[R];
  __m512i index[R], key[R];
  for (int j = 0; j < R; ++j) {
    __m512i bytes = _mm512_setzero_si512();
    count[j] = 0;
    for (int w = 0; w < W; ++w) {
      __mmask16 c[4];
      for (int q = 0; q < 4; ++q) {
        c[q] = _mm512_mask_cmp_ps_mask(inside(E, 64 * w + 16 * q), row_vector(j, 4 * w + q), floor[j], _CMP_GE_OQ);
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
      const __m512 low = _mm512_permutex2var_ps(v[j][0], index[j], v[j][1]);
      const __m512 high = _mm512_permutex2var_ps(v[j][2], index[j], v[j][3]);
      value = _mm512_mask_blend_ps(_mm512_test_epi32_mask(index[j], _mm512_set1_epi32(32)), low, high);
    } else {
      value = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), used[j], index[j], x + j * stride, 4);
    }
    // rank_key (common.h): -0 as +0, negative floats' magnitude bits flipped (no NaN here).
    const __m512i b = _mm512_castps_si512(_mm512_add_ps(value, _mm512_setzero_ps()));
    key[j] = _mm512_xor_si512(b, _mm512_srli_epi32(_mm512_srai_epi32(b, 31), 1));
  }
  // 4. The candidates sorted as one vector of int32: each key's top 28 bits above 15 - its lane
  // (its candidate number: lanes are in index order, so of two equal prefixes the lower index
  // ranks first), lanes past the count INT_MIN. Exact unless two different keys share a prefix
  // (values a few ulp apart; the caller redoes those rows). Equal keys are exact ties, ranked
  // by index as rank pairs rank them.
  const __m512i lane_code = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  i32x16 packed[R];
  for (int j = 0; j < R; ++j) {
    const __m512i p = _mm512_ternarylogic_epi32(key[j], _mm512_set1_epi32(~15), lane_code, 0xe2);  // B ? A : C
    packed[j] = (i32x16)_mm512_mask_mov_epi32(_mm512_set1_epi32(INT_MIN), used[j], p);
  }
  bitonic::sort16_each<true, R, avx512_exchange>(packed);
  uint32_t failed = 0;
  const __mmask8 slots = (__mmask8)((1u << k) - 1);
  for (int j = 0; j < R; ++j) {
    const __m512i sorted = (__m512i)packed[j];
    // The candidates' full keys in sorted order. Equal keys share a prefix and come in index
    // order, as rank pairs rank them; two different keys with one prefix may be misordered, and
    // if any are, two such neighbours are (a run of one prefix is contiguous once sorted).
    const __m512i number = _mm512_sub_epi32(_mm512_set1_epi32(15), _mm512_and_si512(sorted, _mm512_set1_epi32(15)));
    const __m512i sorted_key = _mm512_permutexvar_epi32(number, key[j]);
    const __m512i prefix = _mm512_srai_epi32(sorted, 4);
    const __mmask16 same_prefix = _mm512_mask_cmpeq_epi32_mask(0x7fff, prefix, _mm512_alignr_epi32(prefix, prefix, 1));
    const bool misordered =
        _mm512_mask_cmpneq_epi32_mask(same_prefix, sorted_key, _mm512_alignr_epi32(sorted_key, sorted_key, 1)) != 0;
    const bool fine = !_mm512_cmp_ps_mask(sum[j], sum[j], _CMP_UNORD_Q) && count[j] <= 16;
    failed |= (uint32_t)(misordered || !fine) << j;
    // The top eight's rank pairs (key << 32 | 0xffffffff - index).
    const __m256i top_index = _mm512_castsi512_si256(_mm512_permutexvar_epi32(number, index[j]));
    const __m256i top_key = _mm512_castsi512_si256(sorted_key);
    const __m512i pairs = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepi32_epi64(top_key), 32),
                                          _mm512_cvtepu32_epi64(_mm256_xor_si256(top_index, _mm256_set1_epi32(-1))));
    _mm512_mask_storeu_epi64(best + k * j, slots, pairs);
  }
  return failed;
}

template <int W, bool kFull>
void rows_top8_avx512(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best, int64_t* redo,
                      int64_t* n_redo) {
  constexpr int R = 4;
  int64_t left = 0, i = 0;
  for (; i + R <= n; i += R) {
    uint32_t failed = top8_rows<W, R, kFull>(x + i * stride, stride, E, k, best + k * i);
    for (; failed; failed &= failed - 1) redo[left++] = i + __builtin_ctz(failed);
  }
  for (; i < n; ++i) {
    if (top8_rows<W, 1, kFull>(x + i * stride, stride, E, k, best + k * i)) redo[left++] = i;
  }
  *n_redo = left;
}

// The instance for E: the 64-element words a row needs, and whether it fills them.
void rows_top8_any(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best, int64_t* redo,
                   int64_t* n_redo) {
  if (E == 64) return rows_top8_avx512<1, true>(x, stride, n, E, k, best, redo, n_redo);
  if (E < 64) return rows_top8_avx512<1, false>(x, stride, n, E, k, best, redo, n_redo);
  if (E == 128) return rows_top8_avx512<2, true>(x, stride, n, E, k, best, redo, n_redo);
  if (E < 128) return rows_top8_avx512<2, false>(x, stride, n, E, k, best, redo, n_redo);
  if (E == 256) return rows_top8_avx512<4, true>(x, stride, n, E, k, best, redo, n_redo);
  return rows_top8_avx512<4, false>(x, stride, n, E, k, best, redo, n_redo);
}

#if defined(MK_TOP8_DISPATCH)
#pragma GCC pop_options
#endif
#endif

#if defined(MK_TOP8_AVX512)
// Whether this CPU runs the variant: AVX-512 F, BW and VBMI2 (the byte compress), popcnt.
bool cpu_supported() {
#if defined(MK_TOP8_DISPATCH)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt");
#else
  return true;
#endif
}
#endif

}  // namespace

#if defined(MK_TOP8_AVX512)
bool rows_top8_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best,
                         int64_t* redo, int64_t* n_redo) {
  *n_redo = 0;
  static const bool supported = cpu_supported();
  if (!supported || E < 16 || E > 256 || k < 1 || k > 8) return false;
  rows_top8_any(x, stride, n, E, k, best, redo, n_redo);
  return true;
}
#else
// No AVX-512 VBMI2 in this build: the caller's selection runs.
bool rows_top8_pairs_f32(const float*, int64_t, int64_t, int64_t, int, int64_t*, int64_t*, int64_t* n_redo) {
  *n_redo = 0;
  return false;
}
#endif

}  // namespace moe_kernels
