// Exact balanced assignment on CPU: an auction warm start, then cycle cancelling
// with Floyd-Warshall over the k experts (+ one node for the free slots when capacity * k > n).
// Same algorithm, visiting order, tie rules and float64 arithmetic as the reference
// (moe_kernels/reference/balanced_assignment.py); docs/balanced_assignment.md explains it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include "moe_kernels/balanced_assignment.h"

namespace moe_kernels {
namespace {

namespace ba = balanced_assignment;

// Keep in sync with the reference's EPS_* and TOL_REL constants.
constexpr double kEpsDiv = 32768.0;
constexpr double kBidBudget = 4.0;  // bids per token before restarting from column-mean prices
constexpr double kTolRel = ba::kTolRel;
// Element operations (token x expert) below which the d rows are computed on one thread.
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

using Holder = std::pair<double, int64_t>;  // (bid, -token): a min-heap evicts the lowest bid,
                                            // the higher token index on equal bids.

// ba::top2_of written branch-free so that it vectorises, with the same values and expert: v1 =
// the max of s[j] - price[j], j1 = its first index, v2 = the max over j != j1 (a max is exact in
// any order; a -0.0 / +0.0 tie changes no bid). `values` is [k] scratch.
template <typename scalar_t>
void best_two(const scalar_t* row, const double* prices, int64_t k, double* values, int64_t* j1, double* v1,
              double* v2) {
  double best = -ba::inf();
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < k; ++j) {
    const double v = (double)row[j] - prices[j];
    values[j] = v;
    best = v > best ? v : best;
  }
  int64_t first = 0;
  while (values[first] != best) ++first;
  values[first] = -ba::inf();
  double second = -ba::inf();
#pragma omp simd reduction(max : second)
  for (int64_t j = 0; j < k; ++j) second = values[j] > second ? values[j] : second;
  *j1 = first;
  *v1 = best;
  *v2 = second;
}

// Replaces the top (lowest) bid of the min-heap h by x >= it and restores the heap.
void replace_lowest(std::vector<Holder>& h, const Holder& x) {
  const size_t size = h.size();
  size_t i = 0;
  while (true) {
    size_t c = 2 * i + 1;
    if (c >= size) break;
    if (c + 1 < size && h[c + 1] < h[c]) ++c;
    if (!(h[c] < x)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = x;
}

// min and max of the scores (exact: in their own type), false if one is NaN or inf (x - x is 0,
// or NaN for NaN and inf). Every reduction here is independent of the order, so simd is exact.
template <typename scalar_t>
bool score_range(const scalar_t* s, int64_t len, double* lo, double* hi) {
  scalar_t mn = s[0], mx = s[0], nf = 0;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : nf)
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t x = s[t];
    mn = x < mn ? x : mn;  // not std::min: its reference return keeps GCC from vectorising
    mx = x > mx ? x : mx;
    nf += x - x;
  }
  *lo = (double)mn;
  *hi = (double)mx;
  return nf == 0 && std::isfinite(*lo) && std::isfinite(*hi);
}

// prices[j] = mean over i of s[i][j], summed in token order in float64 (as the reference does).
template <typename scalar_t>
void column_means(const scalar_t* s, int64_t n, int64_t k, double* prices) {
  std::fill(prices, prices + k, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) prices[j] += (double)s[i * k + j];
  for (int64_t j = 0; j < k; ++j) prices[j] /= (double)n;
}

template <typename scalar_t>
struct Solver {
  const scalar_t* s;  // [n, k] contiguous
  int64_t n, k, capacity;
  double tol;
  std::vector<int64_t> z;

  // The auction from `prices`; see reference.auction. False (z incomplete) after `budget` bids.
  bool auction(std::vector<double>& prices, double eps, double budget) {
    std::vector<std::vector<Holder>> holders(k);
    // An expert never holds more than n tokens; capacity may be far above n ("no limit").
    for (auto& h : holders) h.reserve(std::min(capacity, n));
    std::vector<int64_t> queue(n);
    queue.reserve(5 * n);
    for (int64_t i = 0; i < n; ++i) queue[i] = i;
    std::fill(z.begin(), z.end(), -1);
    std::vector<double> values(k);
    for (size_t head = 0; head < queue.size(); ++head) {
      if ((double)head >= budget) return false;
      const int64_t i = queue[head];
      int64_t j1;
      double v1, v2;
      best_two(s + i * k, prices.data(), k, values.data(), &j1, &v1, &v2);
      const Holder bid{ba::bid(prices[j1], v1, v2, k, eps), -i};
      auto& h = holders[j1];
      if ((int64_t)h.size() < capacity) {
        h.push_back(bid);
        std::push_heap(h.begin(), h.end(), std::greater<Holder>());
        z[i] = j1;
        if ((int64_t)h.size() == capacity) prices[j1] = h.front().first;
        continue;
      }
      // Full: of the capacity + 1 bids the lowest leaves, as a push and a pop would decide, but
      // with one sift-down. The new bid is >= the price, so it is the one leaving only when it
      // equals the price (float64 rounding) and its token index is higher.
      if (bid < h.front()) {
        queue.push_back(i);
        continue;
      }
      const int64_t out = -h.front().second;
      replace_lowest(h, bid);
      z[i] = j1;
      z[out] = -1;
      queue.push_back(out);
      prices[j1] = h.front().first;
    }
    return true;
  }

  // d[j][j'] = min over the tokens of j of s[i][j] - s[i][j'], one expert per task. Only the rows
  // of the experts in `rows` are recomputed: the others' token sets did not change. The argmin
  // token is looked up only for the edges of the cycles (argmin_token), so this loop is a plain
  // vectorisable min.
  void move_costs(std::vector<double>& d, const std::vector<int64_t>& start, const std::vector<int64_t>& tokens,
                  const std::vector<int64_t>& rows) {
    // Split only work worth a fork (~0.1 ms): waiting for a second thread costs far more on a busy machine.
    const int64_t grain = std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, capacity * k));
    at::parallel_for(0, (int64_t)rows.size(), grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int64_t j = rows[r];
        double* dj = d.data() + j * k;
        std::fill(dj, dj + k, ba::inf());
        for (int64_t t = start[j]; t < start[j + 1]; ++t) {
          const scalar_t* row = s + tokens[t] * k;
          const double sj = (double)row[j];
          for (int64_t jp = 0; jp < k; ++jp) dj[jp] = std::min(dj[jp], ba::move_cost(sj, (double)row[jp]));
        }
        dj[j] = 0.0;
      }
    });
  }

  // The token of expert a that attains d[a][b]: the first in increasing token order (the
  // reference's strict-< scan), found by recomputing the same float64 costs.
  int64_t argmin_token(const std::vector<double>& d, const std::vector<int64_t>& start,
                       const std::vector<int64_t>& tokens, int64_t a, int64_t b) const {
    for (int64_t t = start[a]; t < start[a + 1]; ++t) {
      const scalar_t* row = s + tokens[t] * k;
      if (ba::move_cost((double)row[a], (double)row[b]) == d[a * k + b]) return tokens[t];
    }
    return -1;  // unreachable: d[a][b] is finite on a cycle, so some token attains it
  }
};

// See reference.floyd_warshall_cycles. dist / nxt are filled in place from w.
void floyd_warshall_cycles(const std::vector<double>& w, int64_t N, double tol, std::vector<double>& dist,
                           std::vector<int32_t>& nxt, std::vector<std::vector<int64_t>>& cycles) {
  dist = w;
  nxt.assign(N * N, -1);
  for (int64_t u = 0; u < N; ++u)
    for (int64_t v = 0; v < N; ++v)
      if (w[u * N + v] < ba::inf()) nxt[u * N + v] = (int32_t)v;
  std::vector<char> blocked(N, 0);
  std::vector<int32_t> walk(2 * N), stack(N), pos(N), cyc(N);
  for (int64_t m = 0; m < N; ++m) {
    if (blocked[m]) continue;
    const int64_t len = ba::cycle_through(m, N, dist.data(), nxt.data(), w.data(), tol, blocked.data(), walk.data(),
                                          stack.data(), pos.data(), cyc.data());
    if (len >= 0) {  // m closes a negative cycle: take it if usable, never relax through m
      for (int64_t q = 0; q < len; ++q) blocked[cyc[q]] = 1;
      if (len > 0) cycles.emplace_back(cyc.begin(), cyc.begin() + len);
      blocked[m] = 1;
      continue;
    }
    // Relax every cell of row u through m (strict <: ties keep the earlier path), branch-free.
    const double* dm = dist.data() + m * N;
    for (int64_t u = 0; u < N; ++u) {
      const double dum = dist[u * N + m];
      if (dum == ba::inf()) continue;
      double* du = dist.data() + u * N;
      int32_t* nu = nxt.data() + u * N;
      const int32_t num = nu[m];
      // Two single-width loops vectorise where one mixed double/int32 loop does not.
      for (int64_t v = 0; v < N; ++v) nu[v] = ba::improves(dum, dm[v], du[v]) ? num : nu[v];
      for (int64_t v = 0; v < N; ++v) du[v] = std::min(du[v], dum + dm[v]);
    }
  }
}

template <typename scalar_t>
double solve(const scalar_t* s, int64_t n, int64_t k, int64_t capacity, int64_t* z_out, double* dist_out) {
  Solver<scalar_t> S{s, n, k, capacity, 0.0, std::vector<int64_t>(n, -1)};
  double lo, hi;
  TORCH_CHECK_VALUE(score_range(s, n * k, &lo, &hi), "balanced_assignment: scores must be finite (no NaN or inf)");
  const double amax = std::max(std::abs(lo), std::abs(hi));
  double spread = hi - lo;
  if (!(spread > 0)) spread = 1.0;
  S.tol = kTolRel * std::max(1.0, amax);
  std::vector<double> prices(k, 0.0);
  const double eps = ba::auction_epsilon(spread / kEpsDiv, S.tol);
  if (!S.auction(prices, eps, kBidBudget * (double)n)) {
    column_means(s, n, k, prices.data());
    S.auction(prices, eps, ba::inf());
  }
  const bool slack = n < capacity * k;
  const int64_t N = slack ? k + 1 : k;
  std::vector<double> d(k * k), w(N * N), dist;
  std::vector<std::pair<int64_t, int64_t>> moves;
  std::vector<int64_t> counts(k), start(k + 1), tokens(n), fill(k);
  std::vector<int32_t> nxt;
  std::vector<std::vector<int64_t>> cycles;
  std::vector<int64_t> rows(k);
  for (int64_t j = 0; j < k; ++j) rows[j] = j;
  while (true) {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++counts[S.z[i]];
    start[0] = 0;
    for (int64_t j = 0; j < k; ++j) start[j + 1] = start[j] + counts[j];
    std::copy(start.begin(), start.end() - 1, fill.begin());
    for (int64_t i = 0; i < n; ++i) tokens[fill[S.z[i]]++] = i;
    S.move_costs(d, start, tokens, rows);
    for (int64_t a = 0; a < N; ++a)
      for (int64_t b = 0; b < N; ++b) w[a * N + b] = ba::residual_weight(a, b, k, d.data(), counts.data(), capacity);
    cycles.clear();
    floyd_warshall_cycles(w, N, S.tol, dist, nxt, cycles);
    if (cycles.empty()) break;
    // All movers are looked up before any move: the token lists describe the assignment the
    // costs were computed on.
    rows.clear();
    moves.clear();
    for (const auto& cyc : cycles) {
      for (int64_t v : cyc)
        if (v < k) rows.push_back(v);
      for (size_t t = 0; t < cyc.size(); ++t) {
        const int64_t a = cyc[t], b = cyc[(t + 1) % cyc.size()];
        if (a < k && b < k) moves.emplace_back(S.argmin_token(d, start, tokens, a, b), b);
      }
    }
    for (const auto& mv : moves) S.z[mv.first] = mv.second;
  }
  double value = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    z_out[i] = S.z[i];
    value += (double)s[i * k + S.z[i]];
  }
  for (int64_t a = 0; a < k; ++a)
    for (int64_t b = 0; b < k; ++b) dist_out[a * k + b] = dist[a * N + b];
  return value;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> balanced_assignment_cpu(const at::Tensor& scores,
                                                                       int64_t capacity) {
  TORCH_CHECK(scores.dim() == 2, "balanced_assignment: scores must be [n, k], got ", scores.sizes());
  const int64_t n = scores.size(0), k = scores.size(1);
  TORCH_CHECK(k >= 1, "balanced_assignment: need k >= 1 experts");
  TORCH_CHECK(capacity >= 1 && capacity * k >= n, "balanced_assignment: need capacity * k >= n, got capacity=",
              capacity, ", k=", k, ", n=", n);
  TORCH_CHECK(k < INT32_MAX, "balanced_assignment: k too large");
  auto experts = at::empty({n}, scores.options().dtype(at::kLong));
  auto dist = at::empty({k, k}, scores.options().dtype(at::kDouble));
  if (n == 0) {
    double* d = dist.mutable_data_ptr<double>();
    for (int64_t t = 0; t < k * k; ++t) d[t] = t % (k + 1) == 0 ? 0.0 : ba::inf();
    return {experts, at::scalar_tensor(0.0, scores.options().dtype(at::kDouble)), dist};
  }
  double value;
  if (scores.scalar_type() == at::kDouble) {
    const auto x = scores.contiguous();
    value = solve<double>(x.const_data_ptr<double>(), n, k, capacity, experts.mutable_data_ptr<int64_t>(),
                          dist.mutable_data_ptr<double>());
  } else {
    TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kHalf ||
                    scores.scalar_type() == at::kBFloat16,
                "balanced_assignment: scores must be float64, float32, float16 or bfloat16, got ",
                scores.scalar_type());
    const auto x = scores.to(at::kFloat).contiguous();  // exact for float16 / bfloat16
    value = solve<float>(x.const_data_ptr<float>(), n, k, capacity, experts.mutable_data_ptr<int64_t>(),
                         dist.mutable_data_ptr<double>());
  }
  return {experts, at::scalar_tensor(value, scores.options().dtype(at::kDouble)), dist};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("balanced_assignment(Tensor scores, int capacity) -> (Tensor experts, Tensor value, Tensor distances)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("balanced_assignment", &balanced_assignment_cpu); }

}  // namespace moe_kernels
