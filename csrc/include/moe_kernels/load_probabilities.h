// load_probabilities logic shared by the CPU (csrc/cpu/load_probabilities.cpp) and CUDA
// (csrc/cuda/load_probabilities.cu) kernels: eq 9 of Shazeer et al. 2017, Appendix A. No torch
// headers.
#pragma once
#include <math.h>
#include "moe_kernels/common.h"

namespace moe_kernels {
namespace load_probabilities {

// z = (clean - kth_excluding) / stddev with the reference's conventions: no threshold (-inf,
// k = E) gives +inf; an infinite difference gives an infinite z of its sign without dividing
// (so that stddev does not matter there); NaN propagates.
MK_HD float z_score(float clean, float threshold, float stddev) {
  if (threshold == -INFINITY) return INFINITY;
  const float diff = clean - threshold;
  if (diff == INFINITY || diff == -INFINITY) return diff;
  return diff / stddev;
}

// erfc(x) by the Chebyshev-fitted formula of Press et al., Numerical Recipes (2nd ed., sec. 6.2),
// fractional error below 1.2e-7 for every x: one expf and a division instead of libm's erfcf,
// which is several times slower per element on CPU and dominated the kernel's time.
MK_HD float fast_erfc(float x) {
  const float ax = fabsf(x);
  const float t = 1.0f / (1.0f + 0.5f * ax);
  const float poly =
      -ax * ax - 1.26551223f +
      t * (1.00002368f +
           t * (0.37409196f +
                t * (0.09678418f +
                     t * (-0.18628806f +
                          t * (0.27886807f +
                               t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
  const float r = t * expf(poly);
  return x >= 0.0f ? r : 2.0f - r;
}

// Phi(z), the standard normal CDF, through erfc so that the lower tail keeps its relative
// precision (1 + erf(z / sqrt 2) would cancel). Infinite z gives exactly 0 or 1; NaN stays NaN.
MK_HD float normal_cdf(float z) {
  if (z == INFINITY) return 1.0f;
  if (z == -INFINITY) return 0.0f;
  return 0.5f * fast_erfc(-z * 0.70710678118654752f);
}

}  // namespace load_probabilities
}  // namespace moe_kernels
