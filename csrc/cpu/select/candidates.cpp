// candidates.h's filter, once per instruction set (isa.h): AVX-512 compresses 16 lanes a step in
// registers, AVX2 permutes 8 lanes through a table indexed by the compare's move mask, the
// baseline appends an element at a time without a branch. Written with intrinsics rather than
// GCC's generic vectors: a vector compare's lanes reach a scalar register in one instruction
// (kmov, vmovmskps) instead of a shuffle-and-or reduction, which made the generic filter cost
// four times the pass that reads the row.
#include "select/candidates.h"
#include "isa.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe_kernels {
namespace {

// Appends the elements of row[begin .. end) at or above floor to index, value [n ..); returns the
// new count. Every element is written and the count advances for those kept: no branch.
int64_t append_at_least(const float* row, int64_t begin, int64_t end, float floor, int32_t* index, float* value,
                        int64_t n) {
  for (int64_t e = begin; e < end; ++e) {
    index[n] = (int32_t)e;
    value[n] = row[e];
    n += row[e] >= floor;
  }
  return n;
}

// The portable variant: the groups are e % 8 over the first E / 8 * 8 elements.
int64_t candidates_portable(const float* row, int64_t E, int32_t* index, float* value) {
  const int64_t full = E / 8 * 8;
  float group_max[8];
  float sum = 0.0f;
  for (int l = 0; l < 8; ++l) group_max[l] = row[l];
  for (int64_t c = 8; c < full; c += 8) {
    for (int l = 0; l < 8; ++l) group_max[l] = row[c + l] > group_max[l] ? row[c + l] : group_max[l];
  }
  for (int64_t e = 0; e < E; ++e) sum += row[e];
  if (std::isnan(sum)) return -1;
  const float floor = *std::min_element(group_max, group_max + 8);
  const int64_t n = append_at_least(row, 0, E, floor, index, value, 0);
  std::fill(index + n, index + n + 8, 0);
  std::fill(value + n, value + n + 8, 0.0f);
  return n;
}

#if MK_ISA_HAS_AVX512
MK_ISA_BEGIN(AVX512)
// Steps of 16; the groups are e % 8 over the full steps (each step's halves folded together).
int64_t candidates_avx512(const float* row, int64_t E, int32_t* index, float* value) {
  if (E < 16) return candidates_portable(row, E, index, value);
  const int64_t full = E / 16 * 16;
  __m512 group_max = _mm512_loadu_ps(row), sum = group_max;
  for (int64_t e = 16; e < full; e += 16) {
    const __m512 v = _mm512_loadu_ps(row + e);
    group_max = _mm512_max_ps(group_max, v);
    sum = _mm512_add_ps(sum, v);
  }
  for (int64_t e = full; e < E; ++e) sum[0] += row[e];
  if (_mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q)) return -1;
  const __m256 low = _mm512_castps512_ps256(group_max);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(group_max), 1));
  __m256 m = _mm256_max_ps(low, high);
  m = _mm256_min_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
  const __m512 floor = _mm512_broadcastss_ps(_mm256_castps256_ps128(m));
  __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t n = 0;
  for (int64_t e = 0; e < full; e += 16) {
    const __m512 v = _mm512_loadu_ps(row + e);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, floor, _CMP_GE_OQ);
    // The register forms: the compress-to-memory forms are microcoded on some cores.
    _mm512_storeu_ps(value + n, _mm512_maskz_compress_ps(keep, v));
    _mm512_storeu_si512(index + n, _mm512_maskz_compress_epi32(keep, lane_index));
    n += __builtin_popcount(keep);
    lane_index = _mm512_add_epi32(lane_index, step);
  }
  n = append_at_least(row, full, E, floor[0], index, value, n);
  _mm512_storeu_si512(index + n, _mm512_setzero_si512());
  _mm512_storeu_ps(value + n, _mm512_setzero_ps());
  return n;
}
MK_ISA_END
#endif

#if MK_ISA_HAS_AVX2
MK_ISA_BEGIN(AVX2)
// For each 8-bit mask: its set lanes in ascending order, then zeros.
struct CompressTable {
  int32_t lanes[256][8];
  constexpr CompressTable() : lanes() {
    for (int m = 0; m < 256; ++m) {
      int count = 0;
      for (int l = 0; l < 8; ++l) {
        if (m >> l & 1) lanes[m][count++] = l;
      }
    }
  }
};
alignas(64) constexpr CompressTable kCompress{};

// Steps of 8; the groups are e % 8.
int64_t candidates_avx2(const float* row, int64_t E, int32_t* index, float* value) {
  const int64_t full = E / 8 * 8;
  __m256 group_max = _mm256_loadu_ps(row), sum = group_max;
  for (int64_t e = 8; e < full; e += 8) {
    const __m256 v = _mm256_loadu_ps(row + e);
    group_max = _mm256_max_ps(group_max, v);
    sum = _mm256_add_ps(sum, v);
  }
  for (int64_t e = full; e < E; ++e) sum[0] += row[e];
  if (_mm256_movemask_ps(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q))) return -1;
  __m256 m = _mm256_min_ps(group_max, _mm256_permute2f128_ps(group_max, group_max, 1));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0x4e));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0xb1));
  const __m256 floor = m;  // the floor in every lane
  __m256i lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t n = 0;
  for (int64_t e = 0; e < full; e += 8) {
    const __m256 v = _mm256_loadu_ps(row + e);
    const int keep = _mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_GE_OQ));
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.lanes[keep]));
    _mm256_storeu_ps(value + n, _mm256_permutevar8x32_ps(v, order));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index + n), _mm256_permutevar8x32_epi32(lane_index, order));
    n += __builtin_popcount(keep);
    lane_index = _mm256_add_epi32(lane_index, step);
  }
  n = append_at_least(row, full, E, floor[0], index, value, n);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(index + n), _mm256_setzero_si256());
  _mm256_storeu_ps(value + n, _mm256_setzero_ps());
  return n;
}
MK_ISA_END
#endif

using CandidatesFn = int64_t (*)(const float*, int64_t, int32_t*, float*);

CandidatesFn pick_candidates() {
#if MK_ISA_HAS_AVX512
  if (isa::cpu_runs(isa::Set::kAvx512)) return candidates_avx512;
#endif
#if MK_ISA_HAS_AVX2
  if (isa::cpu_runs(isa::Set::kAvx2)) return candidates_avx2;
#endif
  return candidates_portable;
}

}  // namespace

int64_t row_candidates_f32(const float* row, int64_t E, int32_t* index, float* value) {
  static const CandidatesFn fn = pick_candidates();
  return fn(row, E, index, value);
}

}  // namespace moe_kernels
