// Smooth load estimator P(x, i) (eqs 8-9 of Shazeer et al. 2017, Appendix A) on CPU. One pass
// over a row of noisy logits keeps its k+1 best (value, index) pairs (rows_top_pairs_f32, a block
// of rows a call); a second pass over the row's three inputs writes P: element i is compared with the (k+1)-th largest when
// it is itself in the top k, else with the k-th (kth_excluding).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <vector>

#include "moe_kernels/load_probabilities.h"
#include "rows/float_rows.h"
#include "rows/index_check.h"
#include "score/vec_math.h"
#include "select/select.h"

namespace moe_kernels {
namespace {

using vec_math::normal_cdf;

// P = Phi(z) over rows i < n of a block, z = (clean - kth_excluding) / stddev with
// selected[i * E + e] choosing the row's threshold: the (k+1)-th largest k1th[i] for an element
// of the top k, else the k-th kth[i] (vectorised; one call per block, where a call per row
// through the load-time dispatch cost as much as a 16-wide row's arithmetic).
MK_VECTORISE MK_ISA_CLONES void probabilities_rows(const float* const* clean, const float* const* stddev,
                                                   const uint8_t* __restrict selected, const float* kth,
                                                   const float* k1th, int64_t n, int64_t E, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const float* __restrict c = clean[i];
    const float* __restrict s = stddev[i];
    const uint8_t* __restrict chosen = selected + i * E;
    float* __restrict p = out + i * E;
    const float below = kth[i], above = k1th[i];
    // z first, then Phi in place: two loops vectorise better than one.
    for (int64_t e = 0; e < E; ++e) p[e] = vec_math::z_score(c[e], chosen[e] ? above : below, s[e]);
    for (int64_t e = 0; e < E; ++e) p[e] = normal_cdf(p[e]);
  }
}

// gc[e] = g[e] phi(z[e]) / s[e], 0 where z is infinite (vectorised).
MK_VECTORISE MK_ISA_CLONES void density_row(const float* g, const float* z, const float* s, float* gc, int64_t n) {
  constexpr float kInvSqrt2Pi = 0.3989422804014327f;
  for (int64_t e = 0; e < n; ++e) {
    const bool infinite = z[e] == INFINITY || z[e] == -INFINITY;
    const float value = g[e] * kInvSqrt2Pi * vec_math::exp(-0.5f * z[e] * z[e]) / s[e];
    gc[e] = infinite ? 0.0f : value;
  }
}

template <typename scalar_t>
void load_probabilities_rows(const Strided& clean,   // [T, E]
                             const Strided& noisy,   // [T, E]
                             const Strided& stddev,  // [T, E]
                             int64_t begin, int64_t end, int64_t E, int64_t k,
                             scalar_t* probs,  // [T, E] contiguous
                             int64_t* top) {   // [T, k+1] contiguous
  const int64_t kept = std::min(k + 1, E);  // pairs needed: k+1, or all E when k = E
  // A block of rows at a time: its selections in one call (rows_top_pairs_f32: consecutive rows'
  // selections overlap in the core), then its P in one call.
  // Rows per block: block_rows, and no more than the task has; the conversion buffers only where
  // the inputs are not float32 rows.
  const int64_t rows = std::min(block_rows(E), end - begin);
  constexpr bool is_float = std::is_same_v<scalar_t, float>;
  const auto buffer = [&](bool needed) { return std::vector<float>(needed ? rows * E : 0); };
  std::vector<float> noisy_rows = buffer(!is_float || noisy.stride_e != 1), clean_rows = buffer(!is_float || clean.stride_e != 1),
                     stddev_rows = buffer(!is_float || stddev.stride_e != 1), ps = buffer(!is_float);
  std::vector<int64_t> best(rows * kept);
  std::vector<float> kth(rows), k1th(rows);
  std::vector<const float*> c(rows), sd(rows);
  std::vector<uint8_t> selected(rows * E);
  for (int64_t t0 = begin; t0 < end; t0 += rows) {
    const int64_t n = std::min(rows, end - t0);
    // The rows as contiguous float32 (themselves when they already are; float_row's conversion is
    // exact and keeps the order, -0 and NaN).
    int64_t stride;
    const float* x = float_rows(static_cast<const scalar_t*>(noisy.data), noisy.stride_t, noisy.stride_e, t0, n, E,
                                noisy_rows.data(), &stride);
    // Phase 1: the `kept` largest rank pairs of each noisy row, descending.
    rows_top_pairs_f32(x, stride, n, E, kept, best.data());
    std::fill_n(selected.begin(), n * E, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const int64_t* pairs = best.data() + i * kept;
      // The two thresholds, re-read from the row (not decoded from the key: NaN payloads and -0).
      kth[i] = x[i * stride + pair_index(pairs[k - 1])];
      k1th[i] = k < E ? x[i * stride + pair_index(pairs[k])] : -INFINITY;
      for (int64_t s = 0; s <= k; ++s) top[t * (k + 1) + s] = s < kept ? pair_index(pairs[s]) : -1;
      for (int64_t s = 0; s < k; ++s) selected[i * E + pair_index(pairs[s])] = 1;
      c[i] = float_row<scalar_t>(clean, t, E, clean_rows.empty() ? nullptr : clean_rows.data() + i * E);
      sd[i] = float_row<scalar_t>(stddev, t, E, stddev_rows.empty() ? nullptr : stddev_rows.data() + i * E);
    }
    // Phase 2: an element of the top k takes the (k+1)-th as its threshold, any other the k-th.
    float* p = is_float ? reinterpret_cast<float*>(probs + t0 * E) : ps.data();
    probabilities_rows(c.data(), sd.data(), selected.data(), kth.data(), k1th.data(), n, E, p);
    if constexpr (!std::is_same_v<scalar_t, float>) {
      for (int64_t j = 0; j < n * E; ++j) probs[t0 * E + j] = (scalar_t)ps[j];
    }
  }
}

std::tuple<at::Tensor, at::Tensor> load_probabilities_cpu(const at::Tensor& clean_logits,
                                                          const at::Tensor& noisy_logits,
                                                          const at::Tensor& noise_stddev, int64_t k) {
  TORCH_CHECK(noisy_logits.dim() == 2 && clean_logits.sizes() == noisy_logits.sizes() &&
                  noise_stddev.sizes() == noisy_logits.sizes(),
              "load_probabilities: clean_logits, noisy_logits and noise_stddev must be [T, E] of one shape");
  const int64_t T = noisy_logits.size(0), E = noisy_logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "load_probabilities: need 1 <= k <= E, got k=", k, ", E=", E);
  TORCH_CHECK(E <= INT32_MAX, "load_probabilities: E too large");
  const auto dtype = noisy_logits.scalar_type();
  TORCH_CHECK(clean_logits.scalar_type() == dtype && noise_stddev.scalar_type() == dtype,
              "load_probabilities: the three inputs must share one dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "load_probabilities: inputs must be float32, float16 or bfloat16, got ", dtype);
  auto probs = at::empty({T, E}, noisy_logits.options());
  auto top = at::empty({T, k + 1}, noisy_logits.options().dtype(at::kLong));
  if (T == 0) return {probs, top};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "load_probabilities", [&] {
    const Strided c{clean_logits.const_data_ptr(), clean_logits.stride(0), clean_logits.stride(1)};
    const Strided n{noisy_logits.const_data_ptr(), noisy_logits.stride(0), noisy_logits.stride(1)};
    const Strided s{noise_stddev.const_data_ptr(), noise_stddev.stride(0), noise_stddev.stride(1)};
    scalar_t* p = probs.mutable_data_ptr<scalar_t>();
    int64_t* tp = top.mutable_data_ptr<int64_t>();
    // About 16k elements (of three inputs) per task: balances without a costly fork per row.
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      load_probabilities_rows<scalar_t>(c, n, s, begin, end, E, k, p, tp);
    });
  });
  return {probs, top};
}

// Backward, one pass per row: with z = (clean - thr) / s and phi the normal density,
//   d clean = g phi(z) / s,  d s = -g phi(z) z / s  (0 where z is infinite),
// and -d clean accumulates into the noisy logit that is each element's threshold: the k-th of
// the row for the unselected elements, the (k+1)-th for the selected ones.
template <typename scalar_t, typename grad_t>
void load_probabilities_backward_rows(const grad_t* grad_p,  // [T, E] contiguous
                                      const Strided& clean, const Strided& noisy, const Strided& stddev,
                                      const int64_t* top,  // [T, k+1] contiguous
                                      int64_t begin, int64_t end, int64_t E, int64_t k,
                                      scalar_t* g_clean, scalar_t* g_noisy, scalar_t* g_stddev) {  // [T, E]
  using load_probabilities::z_score;
  std::vector<float> zs(E), ss(E), gs(E), gcs(E);
  std::vector<uint8_t> sel(E);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t kth_index = top[t * (k + 1) + k - 1];
    const float kth = at<scalar_t>(noisy, t, kth_index);
    const int64_t kth_pair = rank_pair(kth, (int32_t)kth_index);
    const int64_t k1th_index = k < E ? top[t * (k + 1) + k] : -1;
    const float k1th = k1th_index >= 0 ? at<scalar_t>(noisy, t, k1th_index) : -INFINITY;
    // Pass 1 (scalar): selection and z. Pass 2 (vectorised): the gradients. Pass 3: the row's
    // threshold sums, in element order.
    for (int64_t e = 0; e < E; ++e) {
      sel[e] = rank_pair(at<scalar_t>(noisy, t, e), (int32_t)e) >= kth_pair;
      ss[e] = at<scalar_t>(stddev, t, e);
      zs[e] = z_score(at<scalar_t>(clean, t, e), sel[e] ? k1th : kth, ss[e]);
    }
    const grad_t* g = grad_p + t * E;
    for (int64_t e = 0; e < E; ++e) gs[e] = (float)g[e];
    density_row(gs.data(), zs.data(), ss.data(), gcs.data(), E);
    float to_kth = 0.0f, to_k1th = 0.0f;  // threshold gradients of the row
    for (int64_t e = 0; e < E; ++e) {
      const float gc = gcs[e];
      g_clean[t * E + e] = (scalar_t)gc;
      g_stddev[t * E + e] = (scalar_t)(gc == 0.0f ? 0.0f : -gc * zs[e]);
      g_noisy[t * E + e] = (scalar_t)0.0f;
      if (sel[e]) to_k1th -= gc; else to_kth -= gc;
    }
    g_noisy[t * E + kth_index] = (scalar_t)to_kth;
    if (k1th_index >= 0) g_noisy[t * E + k1th_index] = (scalar_t)to_k1th;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> load_probabilities_backward_cpu(
    const at::Tensor& grad_p, const at::Tensor& clean_logits, const at::Tensor& noisy_logits,
    const at::Tensor& noise_stddev, const at::Tensor& top, int64_t k) {
  TORCH_CHECK(noisy_logits.dim() == 2 && clean_logits.sizes() == noisy_logits.sizes() &&
                  noise_stddev.sizes() == noisy_logits.sizes() && grad_p.sizes() == noisy_logits.sizes() &&
                  top.dim() == 2 && top.size(0) == noisy_logits.size(0) && top.size(1) == k + 1 &&
                  top.scalar_type() == at::kLong && k >= 1 && k <= noisy_logits.size(1),
              "load_probabilities_backward: bad arguments");
  const int64_t T = noisy_logits.size(0), E = noisy_logits.size(1);
  auto g_clean = at::empty({T, E}, clean_logits.options());
  auto g_noisy = at::empty({T, E}, noisy_logits.options());
  auto g_stddev = at::empty({T, E}, noise_stddev.options());
  if (T == 0) return {g_clean, g_noisy, g_stddev};
  const auto g = grad_p.contiguous();
  const auto tp = top.contiguous();
  // The forward's top: k selected ids, then the (k+1)-th (when k < E; -1 otherwise).
  check_routing_ids(tp, E, k < E ? k + 1 : k, "load_probabilities_backward", "top");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, noisy_logits.scalar_type(), "load_probabilities_backward", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "load_probabilities_backward_g", [&] {
      const Strided c{clean_logits.const_data_ptr(), clean_logits.stride(0), clean_logits.stride(1)};
      const Strided n{noisy_logits.const_data_ptr(), noisy_logits.stride(0), noisy_logits.stride(1)};
      const Strided s{noise_stddev.const_data_ptr(), noise_stddev.stride(0), noise_stddev.stride(1)};
      const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1));
      at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
        load_probabilities_backward_rows<logit_t, scalar_t>(
            g.const_data_ptr<scalar_t>(), c, n, s, tp.const_data_ptr<int64_t>(), begin, end, E, k,
            g_clean.mutable_data_ptr<logit_t>(), g_noisy.mutable_data_ptr<logit_t>(),
            g_stddev.mutable_data_ptr<logit_t>());
      });
    });
  });
  return {g_clean, g_noisy, g_stddev};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def(
      "load_probabilities(Tensor clean_logits, Tensor noisy_logits, Tensor noise_stddev, int k) -> "
      "(Tensor probabilities, Tensor top)");
  m.def(
      "load_probabilities_backward(Tensor grad_p, Tensor clean_logits, Tensor noisy_logits, Tensor noise_stddev, "
      "Tensor top, int k) -> (Tensor grad_clean, Tensor grad_noisy, Tensor grad_stddev)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("load_probabilities", &load_probabilities_cpu);
  m.impl("load_probabilities_backward", &load_probabilities_backward_cpu);
}

}  // namespace moe_kernels
