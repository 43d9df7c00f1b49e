// Log-domain Sinkhorn balancing on CPU (rows sum to 1, columns to n / k): the same iteration as
// moe_kernels/reference/sinkhorn.py. Row potentials are computed one row per task on x [n, k],
// column potentials one column per task on a transposed copy x^T [k, n], so every reduction runs
// over contiguous memory in a fixed order: the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace moe_kernels {
namespace {

// log(sum_t exp(a[t] + b[t])) over m terms, max-shifted, with torch.logsumexp's non-finite
// semantics (the reference calls it): NaN if any term is NaN, +inf if any is +inf, -inf if every
// term is -inf. std::max would drop a NaN that is not first.
template <typename acc_t>
acc_t logsumexp_plus(const acc_t* a, const acc_t* b, int64_t m) {
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  acc_t mx = -kInf;
  bool nan = false;
  for (int64_t t = 0; t < m; ++t) {
    const acc_t x = a[t] + b[t];
    nan |= x != x;
    mx = x > mx ? x : mx;
  }
  if (nan) return std::numeric_limits<acc_t>::quiet_NaN();
  if (mx == kInf || mx == -kInf) return mx;
  acc_t sum = 0;
  for (int64_t t = 0; t < m; ++t) sum += std::exp(a[t] + b[t] - mx);
  return mx + std::log(sum);
}

template <typename acc_t>
std::tuple<int64_t, double> sinkhorn_loop(const acc_t* x, const acc_t* xt, int64_t n, int64_t k, int64_t num_iters,
                                          double tol, acc_t* u, acc_t* v) {
  const acc_t log_target = (acc_t)std::log((double)n / (double)k);
  std::vector<acc_t> log_col(k);
  int64_t iters = 0;
  double err = 0.0;
  std::fill(v, v + k, (acc_t)0);
  for (int64_t it = 0; it < num_iters; ++it) {
    iters = it + 1;
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) u[i] = -logsumexp_plus(x + i * k, v, k);
    });
    // Small problems stay on one thread: a fork per iteration costs more than the work.
    at::parallel_for(0, k, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) log_col[j] = logsumexp_plus(xt + j * n, u, n);
    });
    // NaN-propagating max, as the reference's tensor .max(): a NaN column is never "converged".
    err = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const double e = std::abs((double)std::exp(v[j] + log_col[j] - log_target) - 1.0);
      err = (e > err || e != e) ? e : err;
      if (err != err) break;
    }
    if (err <= tol) break;
    for (int64_t j = 0; j < k; ++j) v[j] = log_target - log_col[j];
  }
  return {iters, err};
}

std::tuple<at::Tensor, at::Tensor> sinkhorn_cpu(const at::Tensor& logits, int64_t num_iters, double tol) {
  TORCH_CHECK(logits.dim() == 2, "sinkhorn: logits must be [n, k], got ", logits.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(logits.scalar_type()),
                   "sinkhorn: logits must be float64, float32, float16 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(num_iters >= 1, "sinkhorn: num_iters must be >= 1, got ", num_iters);
  TORCH_CHECK_VALUE(tol >= 0, "sinkhorn: tol must be a number >= 0, got ", tol);  // false for NaN
  const int64_t n = logits.size(0), k = logits.size(1);
  TORCH_CHECK(k >= 1, "sinkhorn: need k >= 1");
  auto info = at::empty({2}, logits.options().dtype(at::kDouble));  // (iterations, column error)
  double* pinfo = info.mutable_data_ptr<double>();
  pinfo[0] = 0.0;
  pinfo[1] = 0.0;
  if (n == 0) return {at::empty({0, k}, logits.options()), info};
  const bool dbl = logits.scalar_type() == at::kDouble;
  const auto acc = dbl ? at::kDouble : at::kFloat;
  const auto x = logits.to(acc).contiguous();
  const auto xt = x.t().contiguous();
  auto u = at::empty({n}, x.options()), v = at::empty({k}, x.options());
  auto out = at::empty({n, k}, x.options());
  int64_t iters;
  double err;
  auto run = [&](auto zero) {
    using acc_t = decltype(zero);
    const acc_t* px = x.const_data_ptr<acc_t>();
    acc_t* pu = u.mutable_data_ptr<acc_t>();
    acc_t* pv = v.mutable_data_ptr<acc_t>();
    std::tie(iters, err) = sinkhorn_loop<acc_t>(px, xt.const_data_ptr<acc_t>(), n, k, num_iters, tol, pu, pv);
    acc_t* po = out.mutable_data_ptr<acc_t>();
    at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t j = 0; j < k; ++j) po[i * k + j] = std::exp(px[i * k + j] + pu[i] + pv[j]);
    });
  };
  if (dbl) run(0.0);
  else run(0.0f);
  pinfo[0] = (double)iters;
  pinfo[1] = err;
  return {out.to(logits.scalar_type()), info};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("sinkhorn(Tensor logits, int num_iters, float tol) -> (Tensor probs, Tensor info)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("sinkhorn", &sinkhorn_cpu); }

}  // namespace moe_kernels
