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

// Phi(z), the standard normal CDF, through erfc so that the lower tail keeps its relative
// precision (1 + erf(z / sqrt 2) would cancel).
MK_HD float normal_cdf(float z) { return 0.5f * erfcf(-z * 0.70710678118654752f); }

}  // namespace load_probabilities
}  // namespace moe_kernels
