// DSelect-k logic shared by the CPU kernels (csrc/cpu/smooth_step.cpp, csrc/cpu/dselect_k.cpp).
// No torch headers. The paper: 003_a1a58754fcb6a991.txt, Section 3.1.3 and eq 4.
#pragma once
#include <math.h>
#include "moe_kernels/common.h"

namespace moe_kernels {
namespace dselect_k {

// The smooth-step S(t) = t (c1 - c3 t^2) + 1/2 on |t| < half, 0 below, 1 above; the same
// Horner order as moe_kernels/reference/smooth_step.py. NaN falls through to the cubic (NaN).
struct SmoothStep {
  float half, c1, c3;  // gamma / 2, 3 / (2 gamma), 2 / gamma^3 (rounded once from double)
};

MK_HD SmoothStep smooth_step_params(double gamma) {
  return SmoothStep{(float)(gamma / 2), (float)(1.5 / gamma), (float)(2.0 / (gamma * gamma * gamma))};
}

MK_HD_ALWAYS float smooth_step(float t, SmoothStep p) {
  if (t <= -p.half) return 0.0f;
  if (t >= p.half) return 1.0f;
  return t * (p.c1 - p.c3 * t * t) + 0.5f;
}

// S'(t): 3 c3 t^2 subtracted from c1 inside the open interval, exactly 0 outside and on the ends.
MK_HD_ALWAYS float smooth_step_grad(float t, SmoothStep p) {
  if (t <= -p.half || t >= p.half) return 0.0f;
  return p.c1 - 3.0f * p.c3 * t * t;
}

// g * S'(t), exactly 0 where S is flat (outside the open interval) whatever g is, NaN included:
// the reference's where() passes no gradient to the discarded branch, so a NaN upstream (another
// selector bit at NaN) leaves a saturated input's gradient at 0 (docs/reliability.md).
MK_HD_ALWAYS float smooth_step_chain(float g, float t, SmoothStep p) {
  const float slope = smooth_step_grad(t, p);
  return slope == 0.0f ? 0.0f : g * slope;
}

// r(s) of eq 4 for s [m] into r [2^m]: built by doubling, bit j of the index picks s_j or
// 1 - s_j, least significant bit first.
MK_HD void selector(const float* s, int m, float* r) {
  r[0] = 1.0f;
  for (int j = 0; j < m; ++j) {
    const int half = 1 << j;
    for (int l = 0; l < half; ++l) {
      r[l + half] = r[l] * s[j];
      r[l] = r[l] * (1.0f - s[j]);
    }
  }
}

// d loss / d s_j of one selector from u_l = d loss / d r_l [2^m] and r [2^m]:
//   sum over l with bit j clear of (u_{l + 2^j} - u_l) * prod_{j' != j} factor_{j'}(l),
// and that product is r_l + r_{l + 2^j} because (1 - s_j) + s_j = 1: no division by s_j.
MK_HD void selector_grad(const float* u, const float* r, int m, float* grad_s) {
  const int size = 1 << m;
  for (int j = 0; j < m; ++j) {
    const int bit = 1 << j;
    float acc = 0.0f;
    for (int l = 0; l < size; ++l) {
      if (l & bit) continue;
      acc += (u[l + bit] - u[l]) * (r[l] + r[l + bit]);
    }
    grad_s[j] = acc;
  }
}

}  // namespace dselect_k
}  // namespace moe_kernels
