// Elementwise float32 math for the CPU row kernels (load_probabilities, noisy_topk_gate), written
// so that loops over a row auto-vectorise (SSE2 at the default -O3): no libm calls, and the
// ternaries become blends. Deterministic: a value computed by one of these in a vectorised loop
// equals the value computed by the same function on one element (IEEE arithmetic, no fast-math),
// which is what lets a backward recompute the exact noisy logits its forward ranked.
#pragma once
#include "isa_dispatch.h"
#include <cmath>
#include <cstdint>

namespace moe_kernels {
namespace vec_math {

// The ternaries are selects only if the compiler may evaluate both sides: without
// -fno-trapping-math GCC keeps them as branches and does not vectorise. fp-contract=off: an FMA
// would round differently from torch's separate multiply and add (and differently between a
// vectorised and a scalar call on targets that have FMA). Scoped to these helpers and the loops
// that call them.
#define MK_VECTORISE __attribute__((optimize("no-trapping-math", "fp-contract=off")))

// A row loop compiled three times, for AVX-512, AVX2 and the baseline (SSE2), the best one chosen
// at load time (an ifunc): the build has no -march, and these loops are compute-bound (16 lanes
// run them ~4x faster than SSE2's 4). MK_VECTORISE turns FMA contraction off (the AVX-512 target
// would allow it), so elementwise values are the same in every variant; a lane-wise reduction
// adds in the variant's lane count, so its last bits depend on the machine (not on the run). GCC on x86-64 glibc only; elsewhere the baseline build.
// Helpers called from such loops must be inlined into every variant (GCC will not inline a plain
// inline function across target options: each element would become a call).
#define MK_VEC_INLINE MK_VECTORISE inline __attribute__((always_inline))

// MOE_KERNELS_NO_CLONES builds one variant for the compiler's own target flags: the tests compile
// row_vector.cpp that way for each instruction set (python_tests/builds/test_isa_variants.py), since a
// machine runs only the clone it supports.
#if defined(MK_ISA_DISPATCH)
#define MK_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MK_ROW_CLONES
#endif

// e^x = p(r) 2^n: round-to-nearest n by the 1.5 * 2^23 trick, r = x - n ln2 in two parts, a
// degree-6 polynomial for e^r (the minimax coefficients of Cephes' expf). x must be clamped by
// the caller; returns p and writes n as a float (NaN for a NaN x).
MK_VEC_INLINE float exp_reduced_core(float x, float* n_out) {
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  *n_out = n;
  return p;
}

// exp_reduced_core with n as an integer: 0 for a NaN x (converting NaN to int is undefined, and p
// is NaN already).
MK_VEC_INLINE float exp_reduced(float x, int32_t* n_out) {
  float n;
  const float p = exp_reduced_core(x, &n);
  *n_out = (int32_t)(n == n ? n : 0.0f);
  return p;
}

MK_VEC_INLINE float pow2(int32_t n) { return __builtin_bit_cast(float, (int32_t)((n + 127) << 23)); }

// exp(x), relative error ~1e-7. Below x = -80 (e^x < 2e-35) the result is 0: in the sums of
// softmax rows those terms are noise, and their denormals would cost ~100x on x86. NaN stays NaN.
MK_VEC_INLINE float exp(float x) {
  const bool underflow = x < -80.0f;
  int32_t n;
  const float p = exp_reduced(underflow ? -80.0f : (x > 88.0f ? 88.0f : x), &n);
  const float value = p * pow2(n);
  return underflow ? 0.0f : value;
}

// exp(x) for x in [-inf, 0], never NaN (a softmax term relative to its row's finite largest
// value): exp's values with neither its NaN guard nor its upper clamp, the softmax denominator's
// ~30 vector operations per 16 terms instead of ~45.
MK_VEC_INLINE float exp_nonpositive(float x) {
  const bool underflow = x < -80.0f;
  float n;
  const float p = exp_reduced_core(underflow ? -80.0f : x, &n);
  const float value = p * pow2((int32_t)n);
  return underflow ? 0.0f : value;
}

// exp(x) with torch's tail: 2^n as 2^(n >> 1) 2^(n - (n >> 1)), both normal for n >= -150, so
// results keep exp's relative error down to float's smallest normal (x ~ -87.3) and round like
// torch's expf below it; exactly 0 below x = -104 (under the smallest denormal). Only lanes whose
// true result is denormal produce one. For values that are returned (softplus, sigmoid), where
// torch's float32 gives e.g. 1.5e-35 at x = -80 and a flushed 0 is a relative error of 1.
MK_VEC_INLINE float exp_full(float x) {
  const bool zero = x < -104.0f;
  int32_t n;
  const float p = exp_reduced(zero ? 0.0f : (x > 88.0f ? 88.0f : x), &n);
  const int32_t h = n >> 1;
  const float value = (p * pow2(h)) * pow2(n - h);
  return zero ? 0.0f : value;
}

// log(1 + y) for y in [0, 1] (the y = e^-|x| of softplus). u = 1 + y is split as 2^e m with m in
// [sqrt(1/2), sqrt(2)) (e is 0 or 1 here); log m by the polynomial of Cephes' logf (relative
// error ~1e-7); then (y - (u - 1)) / u restores what rounding 1 + y lost, so that tiny y keep
// their relative precision (log1p(y) = y there). NaN stays NaN.
MK_VEC_INLINE float log1p_unit(float y) {
  const float u = 1.0f + y;
  const bool high = u > 1.41421356f;
  const float e = high ? 1.0f : 0.0f;
  const float f = (high ? 0.5f * u : u) - 1.0f;
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  float r = p * f * z + e * -2.12194440e-4f - 0.5f * z;
  r = (f + r) + e * 0.693359375f;
  return r + (y - (u - 1.0f)) / u;
}

// Softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|): never overflows; equals torch's
// softplus (x for x > 20, else log1p(exp(x))) to about one float ulp, tails included (exp_full).
// +-inf and NaN as torch.
MK_VEC_INLINE float softplus(float x) {
  const float y = exp_full(x < 0.0f ? x : -x);
  return (x > 0.0f ? x : 0.0f) + log1p_unit(y);
}

// d Softplus / dx = sigmoid(x), from the same y = e^-|x|. Keeps the denormals down to x = -104,
// as torch's softplus backward (z / (z + 1), z = e^x) does.
MK_VEC_INLINE float sigmoid(float x) {
  const float y = exp_full(x < 0.0f ? x : -x);
  return (x >= 0.0f ? 1.0f : y) / (1.0f + y);
}

// The largest float32 x for which torch.sigmoid(x) = 1 / (1 + e^-x) is not 0: below it e^-x
// overflows float32 (-x > ln FLT_MAX = 88.7228391), so torch gives exactly 0 there (measured on
// CPU, vectorised and scalar paths alike), where sigmoid() above still has denormals down to
// -104. -0x1.62e42ep6f = -88.72283172607422f.
constexpr float kSigmoidLastNonzero = -88.72283172607422f;

// torch.sigmoid's float32 values, tail included: sigmoid() (denormals between e^-87.3 and
// e^-88.72, as torch's 1 / (1 + e^-x)), exactly 0 below kSigmoidLastNonzero. The router's scores
// (ranked with a bias or groups, where distinct denormals and torch's 0s rank differently).
MK_VEC_INLINE float sigmoid_torch(float x) { return x < kSigmoidLastNonzero ? 0.0f : sigmoid(x); }

// Phi(z) = erfc(-z / sqrt 2) / 2 with the erfc formula of load_probabilities::fast_erfc
// (Numerical Recipes, fractional error < 1.2e-7) and exp above. +-inf give exactly 1 / 0, NaN
// stays NaN.
MK_VEC_INLINE float normal_cdf(float z) {
  const float x = -z * 0.70710678118654752f;
  const float ax = x < 0.0f ? -x : x;
  const float t = 1.0f / (1.0f + 0.5f * ax);
  const float poly =
      -ax * ax - 1.26551223f +
      t * (1.00002368f +
           t * (0.37409196f +
                t * (0.09678418f +
                     t * (-0.18628806f +
                          t * (0.27886807f +
                               t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
  const float r = t * exp(poly);
  const float erfc = x >= 0.0f ? r : 2.0f - r;
  const float p = 0.5f * erfc;
  return z == INFINITY ? 1.0f : (z == -INFINITY ? 0.0f : p);
}

// z = (clean - threshold) / stddev with load_probabilities::z_score's conventions, branch-free:
// no threshold (-inf) gives +inf, an infinite difference its own sign without dividing.
MK_VEC_INLINE float z_score(float clean, float threshold, float stddev) {
  const float diff = clean - threshold;
  const float z = diff / stddev;
  const bool infinite = diff == INFINITY || diff == -INFINITY;
  return threshold == -INFINITY ? INFINITY : (infinite ? diff : z);
}

}  // namespace vec_math
}  // namespace moe_kernels
