// exp_terms.h's softmax terms with AVX-512 F intrinsics, compiled for AVX-512 (isa.h); where this
// build or the CPU lacks it, every function returns false and the caller's terms run.
#include "score/exp_terms.h"
#include "isa.h"

#include <algorithm>
#include <array>
#include <type_traits>
#include <cmath>
#include <bit>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Vectors pass by value between inlined helpers only.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's float shuffles start from _mm512_undefined_ps (`__m512 __Y = __Y;`), which it then
// reports as (maybe) uninitialised.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace moe_kernels {
namespace {

#if MK_ISA_HAS_AVX512
MK_ISA_BEGIN(AVX512)

// 2^(j / 32) rounded to float, j = 0 .. 31.
constexpr float kPow2Over32[32] = {
    1.0f,                1.0218971967697144f, 1.0442737340927124f, 1.0671404600143433f,
    1.0905077457427979f, 1.114386796951294f,  1.1387885808944702f, 1.1637248992919922f,
    1.1892070770263672f, 1.215247392654419f,  1.2418577671051025f, 1.2690509557724f,
    1.2968395948410034f, 1.3252366781234741f, 1.3542555570602417f, 1.3839099407196045f,
    1.4142135381698608f, 1.4451807737350464f, 1.4768261909484863f, 1.5091644525527954f,
    1.5422108173370361f, 1.5759809017181396f, 1.610490322113037f,  1.6457555294036865f,
    1.6817928552627563f, 1.7186193466186523f, 1.7562521696090698f, 1.7947090864181519f,
    1.8340080976486206f, 1.8741676807403564f, 1.9152065515518188f, 1.9571441411972046f,
};

// The table's bits less j << 18, so that adding the rounded multiple's low bits shifted up by 18
// (j in the mantissa, n in the exponent) gives 2^n 2^(j / 32) in one integer add.
constexpr uint32_t scale_bits(int j) { return std::bit_cast<uint32_t>(kPow2Over32[j]) - ((uint32_t)j << 18); }
template <int... j>
constexpr std::array<uint32_t, 32> scale_table(std::integer_sequence<int, j...>) {
  return {scale_bits(j)...};
}
alignas(64) constexpr std::array<uint32_t, 32> kScaleBits = scale_table(std::make_integer_sequence<int, 32>());

// Both tables in registers: the scale bits (exp_nonpositive16) and the plain values (exp_tail16).
struct Pow2Table {
  __m512i low, high;
  __m512 plain_low, plain_high;
};

// The shared part of the two exps below: d = (32 n + j) ln2 / 32 + r with n, j integers, j in
// [0, 32) and |r| <= ln2 / 64, so e^d = 2^n 2^(j / 32) e^r.
//  - rounded = d 32 / ln2 + 1.5 * 2^23: the integer 32 n + j lands in its low mantissa bits, j in
//    the low five (a permute's index);
//  - r = d - (32 n + j) ln2 / 32 with ln2 split in two (Cephes' 0.693359375 has 9 significant
//    bits, so its product with the <= 13-bit multiple is exact), so r keeps d's precision;
//  - e^r - 1 = r + r^2 (1/2 + r / 6): the next term, r^4 / 24 < 6e-10, is under 0.01 ulp.
struct Reduced {
  __m512 rounded, multiple, expm1;  // multiple = 32 n + j
};

inline Reduced reduce16(__m512 d) {
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 rounded = _mm512_fmadd_ps(d, _mm512_set1_ps(46.16624069213867f), shift);  // 32 / ln2
  const __m512 multiple = _mm512_sub_ps(rounded, shift);
  __m512 r = _mm512_fnmadd_ps(multiple, _mm512_set1_ps(0.693359375f / 32), d);
  r = _mm512_fnmadd_ps(multiple, _mm512_set1_ps(-2.12194440e-4f / 32), r);
  const __m512 expm1 =
      _mm512_fmadd_ps(_mm512_mul_ps(r, r), _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 6), _mm512_set1_ps(0.5f)), r);
  return {rounded, multiple, expm1};
}

// e^d for d <= 0 (or NaN) in the lanes of live, 0 elsewhere: s + s (e^r - 1) with s = 2^n 2^(j / 32)
// made by one integer add (the table entry's bits, less j << 18, plus the rounded sum's bits
// shifted up by 18: j's bits cancel, n lands in the exponent field, and 1.5 * 2^23's own bits
// shift out); s is normal for every d >= -80 (n >= -116). Lanes below -80 (-inf among them) are
// zeroed by the mask rather than clamped; NaN lanes stay live (the compare is unordered) and give
// NaN through e^r - 1. Seven FMA-unit operations, the loop's bottleneck (the scale by a multiply
// and vscalefps, as exp_tail16 does it, would be two more).
inline __m512 exp_nonpositive16(__m512 d, __mmask16 live, const Pow2Table& table) {
  live = _mm512_mask_cmp_ps_mask(live, d, _mm512_set1_ps(-80.0f), _CMP_NLT_UQ);
  const Reduced x = reduce16(d);
  const __m512i bits = _mm512_castps_si512(x.rounded);
  const __m512 scale = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_permutex2var_epi32(table.low, bits, table.high), _mm512_slli_epi32(bits, 18)));
  return _mm512_maskz_fmadd_ps(live, scale, x.expm1, scale);
}

// e^d with torch's tails (vec_math::exp_full's range) for d <= 0 or NaN, in the lanes of live:
// the same reduction with the scale by vscalefps, which rounds a result below float's smallest
// normal (d below ~-87.3) once, as a multiply would; 0 below -104 (under the smallest denormal)
// and for -inf. Where the result is normal it equals exp_nonpositive16's: scaling by 2^n
// commutes with the rounding. Nine FMA-unit operations.
inline __m512 exp_tail16(__m512 d, __mmask16 live, const Pow2Table& table) {
  live = _mm512_mask_cmp_ps_mask(live, d, _mm512_set1_ps(-104.0f), _CMP_NLT_UQ);
  const Reduced x = reduce16(d);
  const __m512 s = _mm512_permutex2var_ps(table.plain_low, _mm512_castps_si512(x.rounded), table.plain_high);
  return _mm512_maskz_scalef_ps(live, _mm512_fmadd_ps(s, x.expm1, s), _mm512_mul_ps(x.multiple, _mm512_set1_ps(1.0f / 32)));
}

template <bool kTails>
inline __m512 exp16(__m512 d, __mmask16 live, const Pow2Table& table) {
  return kTails ? exp_tail16(d, live, table) : exp_nonpositive16(d, live, table);
}

// f(j, mask) for the 16-lane blocks of [0, count): whole ones, then the rest as a masked block.
template <typename F>
inline void for_blocks(int64_t count, F f) {
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) f(j, (__mmask16)0xffff);
  if (j < count) f(j, (__mmask16)((1u << (count - j)) - 1));
}

// One row's terms (stored when exps is not null) and their sum: the 16-lane terms added in order
// into one vector, then its lanes by a fixed tree, so a call that stores and one that does not
// give the same sum.
template <bool kStore, bool kTails = false>
inline float row_terms(const float* row, int64_t E, float vmax, float* exps, const Pow2Table& table) {
  const __m512 m = _mm512_set1_ps(vmax);
  __m512 sum = _mm512_setzero_ps();
  for_blocks(E, [&](int64_t e, __mmask16 in) {
    const __m512 t = exp16<kTails>(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, row + e), m), in, table);
    if constexpr (kStore) _mm512_mask_storeu_ps(exps + e, in, t);
    sum = _mm512_add_ps(sum, t);
  });
  // The lanes folded in halves.
  sum = _mm512_add_ps(sum, _mm512_shuffle_f32x4(sum, sum, 0x4e));
  sum = _mm512_add_ps(sum, _mm512_shuffle_f32x4(sum, sum, 0xb1));
  sum = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0x4e));
  sum = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0xb1));
  return _mm512_cvtss_f32(sum);
}

Pow2Table load_table() {
  return {_mm512_load_si512(kScaleBits.data()), _mm512_load_si512(kScaleBits.data() + 16),
          _mm512_loadu_ps(kPow2Over32), _mm512_loadu_ps(kPow2Over32 + 16)};
}

void rows_exp_terms_avx512(const float* x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                           int64_t vmax_stride, float* exps, float* sums) {
  const Pow2Table table = load_table();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * stride;
    const float m = vmax[i * vmax_stride];
    sums[i] = exps ? row_terms<true>(row, E, m, exps + i * E, table) : row_terms<false>(row, E, m, nullptr, table);
  }
}

float row_terms_full_avx512(const float* row, int64_t E, float vmax, float* exps) {
  return row_terms<true, true>(row, E, vmax, exps, load_table());
}

void exp_terms_avx512(const float* v, const float* vmax, int64_t count, float* out) {
  const Pow2Table table = load_table();
  for_blocks(count, [&](int64_t j, __mmask16 in) {
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, v + j), _mm512_maskz_loadu_ps(in, vmax + j));
    _mm512_mask_storeu_ps(out + j, in, exp_nonpositive16(d, in, table));
  });
}

// Each K-lane group's sum in all of its lanes (K divides 16): halves folded onto each other, so
// lane l and its partner add the same two values.
template <int K>
inline __m512 group_sums(__m512 t) {
  if constexpr (K >= 16) t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0x4e));
  if constexpr (K >= 8) t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xb1));
  if constexpr (K >= 4) t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e));
  if constexpr (K >= 2) t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));
  return t;
}

// 16 / G rows' slots a vector, each row a G-lane group whose slots are the lanes of `slots`:
// terms (0 in the other lanes), their row's sum, one division; 0 where vmax is -inf.
template <int G>
inline __m512 renormalized16(__m512 v, __m512 m, __mmask16 slots, const Pow2Table& table) {
  const __m512 t = exp_tail16(_mm512_sub_ps(v, m), slots, table);
  const __mmask16 live = _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
  return _mm512_maskz_div_ps(live, t, group_sums<G>(t));
}

// A k that does not divide 16 takes the group of the next power of two, its last lanes empty:
// 16 / G rows a vector, their k slots each at the start of a G-lane group.
template <int K>
constexpr int group_of() {
  return K <= 1 ? 1 : K <= 2 ? 2 : K <= 4 ? 4 : K <= 8 ? 8 : 16;
}

// The lanes holding slots when the vector's first `rows` rows are present.
template <int K>
constexpr __mmask16 slot_lanes(int64_t rows) {
  constexpr int G = group_of<K>();
  unsigned mask = 0;
  for (int l = 0; l < 16; ++l) mask |= (unsigned)(l % G < K && l / G < rows) << l;
  return (__mmask16)mask;
}

// K dividing 16: whole rows in each block, the lanes past them hold d = 0 and are not stored.
// Otherwise a vector's rows' slots are expanded into their groups' first lanes, and their weights
// compressed back.
template <int K>
void renormalized_avx512(const float* value, const float* vmax, int64_t n, float* w) {
  const Pow2Table table = load_table();
  constexpr int G = group_of<K>();
  if constexpr (G == K) {
    for_blocks(n * K, [&](int64_t j, __mmask16 in) {
      const __m512 v = _mm512_maskz_loadu_ps(in, value + j), m = _mm512_maskz_loadu_ps(in, vmax + j);
      _mm512_mask_storeu_ps(w + j, in, renormalized16<K>(v, m, 0xffff, table));
    });
  } else {
    constexpr int64_t kRows = 16 / G;
    int64_t i = 0;
    // Whole-vector loads and stores while they stay inside the arrays, as renormalized_pairs_avx512.
    for (; i * K + 16 <= n * K; i += kRows) {
      constexpr __mmask16 slots = slot_lanes<K>(kRows);
      const __m512 v = _mm512_maskz_expand_ps(slots, _mm512_loadu_ps(value + i * K));
      const __m512 m = _mm512_maskz_expand_ps(slots, _mm512_loadu_ps(vmax + i * K));
      _mm512_storeu_ps(w + i * K, _mm512_maskz_compress_ps(slots, renormalized16<G>(v, m, slots, table)));
    }
    for (; i < n; i += kRows) {
      const __mmask16 slots = slot_lanes<K>(n - i), first = (__mmask16)((1u << __builtin_popcount(slots)) - 1);
      const __m512 v = _mm512_maskz_expand_ps(slots, _mm512_maskz_loadu_ps(first, value + i * K));
      const __m512 m = _mm512_maskz_expand_ps(slots, _mm512_maskz_loadu_ps(first, vmax + i * K));
      _mm512_mask_storeu_ps(w + i * K, first, _mm512_maskz_compress_ps(slots, renormalized16<G>(v, m, slots, table)));
    }
  }
}

// renormalized_avx512 on the selection's rank pairs (16 slots, two vectors of pairs, at a time):
// the experts written (pair_index), the values decoded from the keys (rank_key's inverse, as
// selected_slots decodes them) and vmax each row's first value, in the lanes renormalized_avx512
// gives them, so the weights are its weights on selected_slots' value and vmax, bit for bit;
// without those two arrays' stores and loads.
template <int K>
void renormalized_pairs_avx512(const int64_t* best, int64_t n, int64_t* experts, float* w) {
  const Pow2Table table = load_table();
  constexpr int G = group_of<K>();
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i first = _mm512_setr_epi32(0, 1 / G * G, 2 / G * G, 3 / G * G, 4 / G * G, 5 / G * G, 6 / G * G,
                                          7 / G * G, 8 / G * G, 9 / G * G, 10 / G * G, 11 / G * G, 12 / G * G,
                                          13 / G * G, 14 / G * G, 15 / G * G);
  const __m512i low32 = _mm512_set1_epi64(0xffffffffll);
  // pair_index: 0xffffffff less the low half, which is its complement.
  auto expert = [&](__m512i p) { return _mm512_andnot_si512(p, low32); };
  // The 16 lanes' values (0 where a pair is 0) and their rows' weights.
  auto weights = [&](__m512i p0, __m512i p1, __mmask16 slots) {
    const __m512i key = _mm512_permutex2var_epi32(p0, odd, p1);
    const __mmask16 negative = _mm512_cmplt_epi32_mask(key, _mm512_setzero_si512());
    const __m512 v = _mm512_castsi512_ps(_mm512_mask_xor_epi32(key, negative, key, _mm512_set1_epi32(0x7fffffff)));
    return renormalized16<G>(v, _mm512_permutexvar_ps(first, v), slots, table);
  };
  if constexpr (G == K) {
    const int64_t count = n * K;
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) {
      const __m512i p0 = _mm512_loadu_si512(best + j), p1 = _mm512_loadu_si512(best + j + 8);
      _mm512_storeu_si512(experts + j, expert(p0));
      _mm512_storeu_si512(experts + j + 8, expert(p1));
      _mm512_storeu_ps(w + j, weights(p0, p1, 0xffff));
    }
    if (j < count) {  // whole rows; the lanes past them decode to 0 and are not stored
      const int64_t left = count - j;
      const __mmask8 in0 = (__mmask8)((1u << std::min<int64_t>(left, 8)) - 1);
      const __mmask8 in1 = (__mmask8)(left > 8 ? (1u << (left - 8)) - 1 : 0);
      const __m512i p0 = _mm512_maskz_loadu_epi64(in0, best + j), p1 = _mm512_maskz_loadu_epi64(in1, best + j + 8);
      _mm512_mask_storeu_epi64(experts + j, in0, expert(p0));
      _mm512_mask_storeu_epi64(experts + j + 8, in1, expert(p1));
      _mm512_mask_storeu_ps(w + j, (__mmask16)((1u << left) - 1), weights(p0, p1, 0xffff));
    }
  } else {
    // As renormalized_avx512: each half's pairs expanded into its groups, the results compressed.
    // While a vector's 16 slots' worth lies inside the arrays, by whole-vector loads and stores
    // (masked 512-bit loads and stores cost more than plain ones on Zen 4): the stores' lanes
    // past the vector's slots land on the next vector's, which are written after.
    constexpr int64_t kRows = 16 / G;
    constexpr __mmask8 lo = (__mmask8)slot_lanes<K>(kRows), hi = (__mmask8)(slot_lanes<K>(kRows) >> 8);
    constexpr int c0 = std::popcount((unsigned)lo);  // the first half's slots
    int64_t i = 0;
    for (; i * K + 16 <= n * K; i += kRows) {  // (then i + kRows <= n: K <= G)
      const int64_t* pairs = best + i * K;
      __m512i p0, p1;
      if constexpr (G == 8) {  // one row a half, at its start: no expand
        p0 = _mm512_maskz_mov_epi64(lo, _mm512_loadu_si512(pairs));
        p1 = _mm512_maskz_mov_epi64(hi, _mm512_loadu_si512(pairs + c0));
        _mm512_storeu_si512(experts + i * K, expert(p0));
        _mm512_storeu_si512(experts + i * K + c0, expert(p1));
      } else {
        p0 = _mm512_maskz_expand_epi64(lo, _mm512_loadu_si512(pairs));
        p1 = _mm512_maskz_expand_epi64(hi, _mm512_loadu_si512(pairs + c0));
        _mm512_storeu_si512(experts + i * K, _mm512_maskz_compress_epi64(lo, expert(p0)));
        _mm512_storeu_si512(experts + i * K + c0, _mm512_maskz_compress_epi64(hi, expert(p1)));
      }
      const __mmask16 slots = (__mmask16)(lo | (hi << 8));
      _mm512_storeu_ps(w + i * K, _mm512_maskz_compress_ps(slots, weights(p0, p1, slots)));
    }
    for (; i < n; i += kRows) {
      const __mmask16 slots = slot_lanes<K>(n - i);
      const __mmask8 lo = (__mmask8)slots, hi = (__mmask8)(slots >> 8);
      const int c0 = __builtin_popcount(lo), c1 = __builtin_popcount(hi);
      const __mmask8 first0 = (__mmask8)((1u << c0) - 1), first1 = (__mmask8)((1u << c1) - 1);
      const int64_t* pairs = best + i * K;
      const __m512i p0 = _mm512_maskz_expand_epi64(lo, _mm512_maskz_loadu_epi64(first0, pairs));
      const __m512i p1 = _mm512_maskz_expand_epi64(hi, _mm512_maskz_loadu_epi64(first1, pairs + c0));
      _mm512_mask_storeu_epi64(experts + i * K, first0, _mm512_maskz_compress_epi64(lo, expert(p0)));
      _mm512_mask_storeu_epi64(experts + i * K + c0, first1, _mm512_maskz_compress_epi64(hi, expert(p1)));
      _mm512_mask_storeu_ps(w + i * K, (__mmask16)((1u << (c0 + c1)) - 1),
                            _mm512_maskz_compress_ps(slots, weights(p0, p1, slots)));
    }
  }
}

MK_ISA_END
#endif

}  // namespace

#if MK_ISA_HAS_AVX512
namespace {
bool supported() { return isa::cpu_runs(isa::Set::kAvx512); }

// f(std::integral_constant<int, k>()) for 1 <= k <= 16; false otherwise.
template <int K = 1, typename F>
bool with_group(int64_t k, F f) {
  if constexpr (K > 16) {
    return false;
  } else {
    return k == K ? (f(std::integral_constant<int, K>()), true) : with_group<K + 1>(k, f);
  }
}
}  // namespace

bool rows_exp_terms_f32(const float* x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                        int64_t vmax_stride, float* exps, float* sums) {
  if (supported()) rows_exp_terms_avx512(x, stride, n, E, vmax, vmax_stride, exps, sums);
  return supported();
}

bool exp_terms_f32(const float* v, const float* vmax, int64_t count, float* out) {
  if (supported()) exp_terms_avx512(v, vmax, count, out);
  return supported();
}

bool row_exp_terms_full_f32(const float* row, int64_t E, float vmax, float* exps, float* sum) {
  if (supported()) *sum = row_terms_full_avx512(row, E, vmax, exps);
  return supported();
}

bool renormalized_weights_f32(const float* value, const float* vmax, int64_t n, int64_t k, float* w) {
  return supported() && with_group(k, [&](auto K) { renormalized_avx512<K()>(value, vmax, n, w); });
}

bool renormalized_pairs_f32(const int64_t* best, int64_t n, int64_t k, int64_t* experts, float* w) {
  return supported() && with_group(k, [&](auto K) { renormalized_pairs_avx512<K()>(best, n, experts, w); });
}
#else
// No AVX-512 F in this build: the caller's terms run.
bool rows_exp_terms_f32(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*) {
  return false;
}
bool exp_terms_f32(const float*, const float*, int64_t, float*) { return false; }
bool renormalized_pairs_f32(const int64_t*, int64_t, int64_t, int64_t*, float*) { return false; }
bool row_exp_terms_full_f32(const float*, int64_t, float, float*, float*) { return false; }
bool renormalized_weights_f32(const float*, const float*, int64_t, int64_t, float*) { return false; }
#endif

}  // namespace moe_kernels
