// exp_sums.h's sums, each compiled per instruction set (MK_ISA_CLONES, isa.h): exp_terms.h's
// AVX-512 F terms where the CPU has them, else vec_math.h's exp in loops the compiler vectorises.
#include "score/exp_sums.h"

#include <cstring>

#include "isa.h"
#include "score/exp_terms.h"
#include "score/vec_math.h"

// lane_sum's 256-bit vectors: GCC warns that the default (non-AVX) variant would pass them
// differently from an AVX one. It is always inlined, so no such call exists.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moe_kernels {

namespace {
// The terms first (a loop with no reduction vectorises), then the sum in 8 lanes (a float sum in
// one accumulator would not: the compiler may not reorder it).
enum class Terms { kExp, kExpFull, kNonPositive };

constexpr int kLanes = 8;
typedef float lanes_f32 __attribute__((vector_size(4 * kLanes)));

inline lanes_f32 load(const float* p) {
  lanes_f32 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

MK_VECTORISE MK_ALWAYS_INLINE float lane_sum(const float* __restrict exps, int64_t E) {
  lanes_f32 sum = {};
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) sum += load(exps + e);
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += sum[l];
  for (; e < E; ++e) total += exps[e];
  return total;
}

template <Terms kTerms>
MK_VECTORISE MK_ALWAYS_INLINE float exp_sum_terms(const float* __restrict row, int64_t E, float vmax, float* __restrict exps) {
  for (int64_t e = 0; e < E; ++e) {
    const float d = row[e] - vmax;
    exps[e] = kTerms == Terms::kExpFull ? vec_math::exp_full(d)
              : kTerms == Terms::kExp   ? vec_math::exp(d)
                                        : vec_math::exp_nonpositive(d);
  }
  return lane_sum(exps, E);
}
}  // namespace

MK_VECTORISE MK_ISA_CLONES
float row_exp_sum_f32(const float* __restrict row, int64_t E, float vmax, float* __restrict exps) {
  float sum;
  if (rows_exp_terms_f32(row, E, 1, E, &vmax, 0, exps, &sum)) return sum;
  return exp_sum_terms<Terms::kExp>(row, E, vmax, exps);
}

MK_VECTORISE MK_ISA_CLONES
void rows_softmax_sums_f32(const float* __restrict x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                           int64_t vmax_stride, float* __restrict scratch, float* __restrict sums) {
  if (rows_exp_terms_f32(x, stride, n, E, vmax, vmax_stride, nullptr, sums)) return;
  float* exps = scratch;
  // A block of rows in one call, the terms first and then the sums: the rows' exp chains
  // overlap in the core (a call per row was slower).
  for (int64_t i = 0; i < n; ++i) {
    const float m = vmax[i * vmax_stride];
    const float* row = x + i * stride;
    float* out = exps + i * E;
    if (m - m == 0.0f) {  // finite: no term is NaN or above 0
      for (int64_t e = 0; e < E; ++e) out[e] = vec_math::exp_nonpositive(row[e] - m);
    } else {
      for (int64_t e = 0; e < E; ++e) out[e] = vec_math::exp(row[e] - m);
    }
  }
  for (int64_t i = 0; i < n; ++i) sums[i] = lane_sum(exps + i * E, E);
}

MK_VECTORISE MK_ISA_CLONES
void softmax_terms_f32(const float* __restrict value, const float* __restrict vmax, int64_t count,
                       float* __restrict out) {
  if (exp_terms_f32(value, vmax, count, out)) return;
  for (int64_t j = 0; j < count; ++j) out[j] = vec_math::exp(value[j] - vmax[j]);
}

MK_VECTORISE MK_ISA_CLONES
float row_exp_sum_full_f32(const float* __restrict row, int64_t E, float vmax, float* __restrict exps) {
  float sum;
  if (row_exp_terms_full_f32(row, E, vmax, exps, &sum)) return sum;
  return exp_sum_terms<Terms::kExpFull>(row, E, vmax, exps);
}

}  // namespace moe_kernels
