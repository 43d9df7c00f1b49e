// Balanced assignment (Kool et al., 004_62bca7777c830867.txt, Appendix D.2): the pieces of the
// auction + cycle-cancelling solver that do not depend on where they run (the CPU kernel
// csrc/cpu/balanced_assignment.cpp calls them; there is no CUDA kernel yet, see
// docs/balanced_assignment.md). All arithmetic is float64 so the results match the reference
// (moe_kernels/reference/balanced_assignment.py) exactly.
#pragma once
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace balanced_assignment {

// +inf without <limits> (usable in device code).
MK_HD double inf() { return __builtin_huge_val(); }

// The auction's bidding step for one token: over the experts, the best value s[j] - price[j]
// (ties to the lower j), its expert, and the second best value (-inf when k = 1).
template <typename scalar_t>
MK_HD void best_two(const scalar_t* row, const double* prices, int64_t k, int64_t* j1, double* v1,
                    double* v2) {
  int64_t best = -1;
  double b1 = -inf(), b2 = -inf();
  for (int64_t j = 0; j < k; ++j) {
    const double v = (double)row[j] - prices[j];
    if (v > b1) {
      best = j;
      b2 = b1;
      b1 = v;
    } else if (v > b2) {
      b2 = v;
    }
  }
  *j1 = best;
  *v1 = b1;
  *v2 = b2;
}

// The bid of a token whose best value is v1 and second best v2 for an expert priced `price`.
MK_HD double bid(double price, double v1, double v2, int64_t k, double eps) {
  const double gap = k > 1 ? v1 - v2 : 0.0;
  return price + gap + eps;
}

// Cost of moving a token from expert j to j' (it loses s[i, j] and gains s[i, j']).
MK_HD double move_cost(double s_from, double s_to) { return s_from - s_to; }

// Does u close a negative cycle through m (before relaxing through m, all distances use
// intermediates < m and are exact shortest paths)?
MK_HD bool closes_negative_cycle(const double* dist, int64_t N, int64_t u, int64_t m, double tol) {
  return dist[u * N + m] + dist[m * N + u] < -tol;
}

}  // namespace balanced_assignment
}  // namespace moe_kernels
