// The sampled-threshold select of batchwise_mask on CPU: column_filter.h says what and why.
#include "select/column_filter.h"
#include "isa.h"
#include "score/vec_math.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "moe_kernels/batchwise_mask.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe_kernels {
namespace column_filter {

namespace {

// S: enough sampled rows that lo lands within a few % of its target quantile, few enough that
// sampling costs little next to the row pass. Below kMinTokens a column is cheap to select whole.
constexpr int64_t kSampleRows = 512;
constexpr int64_t kMinTokens = 4096;
// Bits of the first (and usually only) radix digit of select_candidates.
constexpr int kCandidateBits = 10;

// The float whose order key is `key` (the inverse of batchwise_mask::order_key; -0 never occurs).
inline float key_float(uint32_t key) {
  const int32_t ordered = (int32_t)(key ^ 0x80000000u);
  return bits_float((uint32_t)(ordered < 0 ? ordered ^ 0x7fffffff : ordered));
}

}  // namespace

Plan plan(int64_t T, int64_t m) {
  Plan p;
  if (T < kMinTokens || m < 1) return p;
  const int64_t S = std::min<int64_t>(kSampleRows, T / 16);
  // lo is above the column's m-th largest only if the sample holds >= rank scores above it, a
  // Binomial(S, m / T) count (mean `expected`, sd <= sqrt(expected)): 3 sd above the mean (+2 for
  // small means) leaves about 1 column in 3000 short of m candidates (it is then selected whole),
  // at about twice as many candidates as an exact lo would keep.
  const double expected = (double)m * S / T;
  const int64_t rank = (int64_t)std::ceil(expected + 3.0 * std::sqrt(expected) + 2.0);
  if (rank * 4 > S) return p;  // lo would keep more than a quarter of the column
  p.use = true;
  p.sample_rows = S;
  p.rank = rank;
  const int64_t expected_candidates = (rank * T + S - 1) / S;
  p.capacity = std::min<int64_t>(T, 2 * expected_candidates + 256);
  return p;
}

namespace {
// The counts of one step of thresholds: count[j] = #{i < S: keys[i * w + j] >= probe[j]}, over
// whole rows of the sample (the compiler vectorises across columns; one clone per instruction set).
MK_ISA_CLONES
void count_at_least(const uint32_t* __restrict keys, int64_t S, int64_t w, const uint32_t* __restrict probe,
                    uint32_t* __restrict count) {
  for (int64_t j = 0; j < w; ++j) count[j] = 0;
  for (int64_t i = 0; i < S; ++i) {
    const uint32_t* row = keys + i * w;
    for (int64_t j = 0; j < w; ++j) count[j] += row[j] >= probe[j];
  }
}
}  // namespace

// Every column's rank-th largest key at once, bit by bit from the top: the largest K whose count
// of keys >= K is at least rank. 32 counting passes over the sample's keys, vectorised across
// columns, where nth_element per column (branchy, a column at a time) took several times longer.
void thresholds(const float* sample, int64_t S, int64_t w, int64_t rank, float* lo, uint32_t* lo_key) {
  std::vector<uint32_t> keys(S * w), probe(w), count(w);
  for (int64_t i = 0; i < S * w; ++i) keys[i] = order_key_f32(sample[i]);
  for (int64_t j = 0; j < w; ++j) lo_key[j] = 0;
  for (int bit = 31; bit >= 0; --bit) {
    for (int64_t j = 0; j < w; ++j) probe[j] = lo_key[j] | (1u << bit);
    count_at_least(keys.data(), S, w, probe.data(), count.data());
    for (int64_t j = 0; j < w; ++j) lo_key[j] = count[j] >= (uint64_t)rank ? probe[j] : lo_key[j];
  }
  for (int64_t j = 0; j < w; ++j) lo[j] = key_float(lo_key[j]);
}

void CandidateLists::reset(int64_t w_, int64_t capacity_) {
  w = w_;
  capacity = capacity_;
  // + one slot; then padded so that consecutive lists start one cache line apart modulo 4 KiB:
  // the rows' appends go to w lists at once, and lists a multiple of 4 KiB apart would all fall
  // in the same few L1 sets.
  ld = (capacity + 1 + 511) / 512 * 512 + 8;
  if (allocated < w * ld) {
    entries.reset(new uint64_t[w * ld]);
    allocated = w * ld;
  }
  count.assign(w, 0);
}

void CandidateLists::begin_appends() {
  cursor.resize(w);
  overflow.resize(w);
  for (int64_t j = 0; j < w; ++j) {
    cursor[j] = entries.get() + j * ld + std::min(count[j], capacity);
    overflow[j] = std::max<int64_t>(0, count[j] - capacity);
  }
}

void CandidateLists::end_appends() {
  for (int64_t j = 0; j < w; ++j) count[j] = (cursor[j] - (entries.get() + j * ld)) + overflow[j];
}

// filter_rows, once per instruction set (isa.h): each variant's namespace defines kChunk and
// chunk_mask (!(x < lo) lane-wise, true for NaN: the _NLT_UQ predicate, as a bit mask), then
// includes the row pass written once in column_filter_rows.h, which defines filter_rows_variant.
namespace {

#if MK_ISA_HAS_AVX512
MK_ISA_BEGIN(AVX512)
namespace avx512 {
constexpr int64_t kChunk = 16;
inline uint32_t chunk_mask(const float* x, const float* lo) {
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_loadu_ps(lo), _CMP_NLT_UQ);
}
#include "select/column_filter_rows.h"
}  // namespace avx512
MK_ISA_END
#endif

#if MK_ISA_HAS_AVX2
MK_ISA_BEGIN(AVX2)
namespace avx2 {
constexpr int64_t kChunk = 8;
inline uint32_t chunk_mask(const float* x, const float* lo) {
  return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(lo), _CMP_NLT_UQ));
}
#include "select/column_filter_rows.h"
}  // namespace avx2
MK_ISA_END
#endif

// The baseline: SSE2 on x86-64, the portable loop elsewhere.
#if defined(__SSE2__)
namespace baseline {
constexpr int64_t kChunk = 4;
inline uint32_t chunk_mask(const float* x, const float* lo) {
  return (uint32_t)_mm_movemask_ps(_mm_cmpnlt_ps(_mm_loadu_ps(x), _mm_loadu_ps(lo)));
}
#include "select/column_filter_rows.h"
}  // namespace baseline
#else
namespace baseline {
constexpr int64_t kChunk = 64 + 1;  // never taken: the row loop's scalar tail does every column
inline uint32_t chunk_mask(const float*, const float*) { return 0; }
#include "select/column_filter_rows.h"
}  // namespace baseline
#endif

// select_candidates' split of n candidates (entries, their keys) by bin (key - lo_key) >> shift:
// tokens of the bins above `bin` into out[0 ..) (returns their count), the bin's entries (key << 32
// | token) into bin_entries[0 .. *in_bin), both in candidate order. The portable loop writes every
// token to out's next slot and advances for those above (branch-free: which they are is
// unpredictable; fewer than m of them, so the slot stays inside out); the bin's few entries take
// a branch.
int64_t split_portable(const uint64_t* entries, const uint32_t* keys, int64_t n, uint32_t lo_key, int shift,
                       uint32_t bin, int64_t* out, uint64_t* bin_entries, int64_t* in_bin) {
  int64_t n_above = 0, k = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = (keys[i] - lo_key) >> shift;
    const uint32_t token = (uint32_t)entries[i];
    out[n_above] = token;
    n_above += b > bin;
    if (b == bin) bin_entries[k++] = (uint64_t)keys[i] << 32 | token;
  }
  *in_bin = k;
  return n_above;
}

#if MK_ISA_HAS_AVX512
MK_ISA_BEGIN(AVX512)
// 16 candidates a step: their bins by one subtract and shift, the tokens above compressed in
// registers (8 int64 lanes at a time) and stored under a mask of their count (the compress-to-
// memory form is microcoded on some cores; a full store could write past out's m slots).
int64_t split_avx512(const uint64_t* entries, const uint32_t* keys, int64_t n, uint32_t lo_key, int shift,
                     uint32_t bin, int64_t* out, uint64_t* bin_entries, int64_t* in_bin) {
  const __m512i lo = _mm512_set1_epi32((int)lo_key), bins = _mm512_set1_epi32((int)bin);
  const __m128i count = _mm_cvtsi32_si128(shift);
  const __m512i low32 = _mm512_set1_epi64(0xffffffffll);
  int64_t n_above = 0, k = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i b = _mm512_srl_epi32(_mm512_sub_epi32(_mm512_loadu_si512(keys + i), lo), count);
    const __mmask16 above = _mm512_cmpgt_epu32_mask(b, bins);
    __mmask16 in = _mm512_cmpeq_epi32_mask(b, bins);
    for (int h = 0; h < 2; ++h) {
      const __mmask8 take = (__mmask8)(above >> (8 * h));
      const __m512i tokens = _mm512_and_si512(_mm512_loadu_si512(entries + i + 8 * h), low32);
      const int c = __builtin_popcount(take);
      _mm512_mask_storeu_epi64(out + n_above, (__mmask8)((1u << c) - 1), _mm512_maskz_compress_epi64(take, tokens));
      n_above += c;
    }
    while (in) {
      const int64_t l = i + __builtin_ctz(in);
      in &= in - 1;
      bin_entries[k++] = (uint64_t)keys[l] << 32 | (uint32_t)entries[l];
    }
  }
  int64_t tail_in = 0;
  n_above += split_portable(entries + i, keys + i, n - i, lo_key, shift, bin, out + n_above, bin_entries + k, &tail_in);
  *in_bin = k + tail_in;
  return n_above;
}
MK_ISA_END
#endif

using SplitFn = int64_t (*)(const uint64_t*, const uint32_t*, int64_t, uint32_t, int, uint32_t, int64_t*, uint64_t*,
                            int64_t*);

SplitFn pick_split() {
#if MK_ISA_HAS_AVX512
  if (isa::cpu_runs(isa::Set::kAvx512)) return split_avx512;
#endif
  return split_portable;
}

using RowsFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, CandidateLists&);

RowsFn pick_filter_rows() {
#if MK_ISA_HAS_AVX512
  if (isa::cpu_runs(isa::Set::kAvx512)) return avx512::filter_rows_variant;
#endif
#if MK_ISA_HAS_AVX2
  if (isa::cpu_runs(isa::Set::kAvx2)) return avx2::filter_rows_variant;
#endif
  return baseline::filter_rows_variant;
}

}  // namespace

void filter_rows(const float* x, int64_t stride_t, int64_t t0, int64_t rows, const float* lo, CandidateLists& lists) {
  static const RowsFn fn = pick_filter_rows();
  fn(x, stride_t, t0, rows, lo, lists);
}

bool select_candidates(const CandidateLists& lists, int64_t j, int64_t m, uint32_t lo_key, SelectScratch& s,
                       int64_t* out) {
  const int64_t n = lists.count[j];
  if (n < m || n > lists.capacity) return false;
  const uint64_t* entries = lists.entries.get() + j * lists.ld;
  // The order keys apart first (the row pass stored the scores' bits: a key there cost the append
  // loop a branch on NaN; here the loop vectorises), with their range above lo: one radix digit
  // over that range (not over all 32 bits: the candidates share their top bits, which would put
  // most of them in one bin).
  s.keys.resize(n);
  uint32_t* keys = s.keys.data();
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = order_key_f32(bits_float((uint32_t)(entries[i] >> 32)));
    top = std::max(top, keys[i] - lo_key);
  }
  const int width = top ? 32 - __builtin_clz(top) : 0;
  const int shift = width > kCandidateBits ? width - kCandidateBits : 0;
  const int64_t bins = (int64_t)(top >> shift) + 1;
  s.hist.assign(2 * bins, 0);
  int32_t* h0 = s.hist.data();
  int32_t* h1 = h0 + bins;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {  // two interleaved histograms: consecutive increments serialise
    ++h0[(keys[i] - lo_key) >> shift];
    ++h1[(keys[i + 1] - lo_key) >> shift];
  }
  for (; i < n; ++i) ++h0[(keys[i] - lo_key) >> shift];
  for (int64_t b = 0; b < bins; ++b) h0[b] += h1[b];
  int64_t rank = m;  // becomes the m-th largest's rank within its bin, 1-based
  const int64_t bin = batchwise_mask::select_bin(h0, (int)bins, &rank);
  // One pass: the tokens of the bins above the threshold's into out (`above` < m of them), the
  // threshold bin's entries (key, token) apart (a handful of candidates in thousands).
  s.bin_entries.resize(h0[bin]);
  uint64_t* bin_entries = s.bin_entries.data();
  static const SplitFn split = pick_split();
  int64_t in_bin = 0;
  const int64_t n_above = split(entries, keys, n, lo_key, shift, (uint32_t)bin, out, bin_entries, &in_bin);
  // The exact threshold among the bin's keys (usually a handful).
  s.bin.resize(in_bin);
  for (i = 0; i < in_bin; ++i) s.bin[i] = (uint32_t)(bin_entries[i] >> 32);
  std::nth_element(s.bin.begin(), s.bin.begin() + (rank - 1), s.bin.end(), std::greater<uint32_t>());
  const uint32_t threshold = s.bin[rank - 1];
  int64_t greater = 0;
  for (i = 0; i < in_bin; ++i) greater += s.bin[i] > threshold;
  const int64_t ties = rank - greater;  // keys equal to the threshold that are kept: the first ones
  s.picked.resize(in_bin + 1);
  int64_t kept = 0, seen = 0;
  for (i = 0; i < in_bin; ++i) {
    const uint32_t key = (uint32_t)(bin_entries[i] >> 32);
    const bool equal = key == threshold;
    s.picked[kept] = (int64_t)(uint32_t)bin_entries[i];
    kept += (key > threshold) | (equal & (seen < ties));
    seen += equal;
  }
  if (n_above + kept != m) return false;  // cannot happen; the caller would select the column whole
  // Both lists ascending by token: merged from the back, in place (the picked fill out's tail).
  int64_t a = n_above - 1, p = kept - 1;
  for (int64_t d = m - 1; p >= 0; --d) out[d] = (a >= 0 && out[a] > s.picked[p]) ? out[a--] : s.picked[p--];
  return true;
}

}  // namespace column_filter
}  // namespace moe_kernels
