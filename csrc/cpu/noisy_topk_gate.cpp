// The noisy top-k gate of Shazeer et al. 2017 (eqs 3-5, 8-10) from its logits, fused on CPU:
// per row, stddev = Softplus(raw) + eps and H = clean + noise * stddev (eq 4), the top k+1 of H,
// the gate weights Softmax(top k of H) (eq 3), and P(x, i) (eq 9) summed over the tokens into
// Load(X) (eq 10) without ever writing P. The backward recomputes stddev and the two threshold
// noisy logits from the saved inputs and writes d clean and d raw in one pass per row.
//
// The math is moe_kernels.reference.noisy_topk_gate's (the composition of softplus,
// load_probabilities and a softmax): H is rounded to the input dtype where torch's unfused ops
// round it, so the selection is the unfused path's up to Softplus, which agrees with torch's to
// about one float ulp (noisy logits tied within an ulp could select differently). P is summed
// into Load in float32, not rounded to a float16 / bfloat16 input's dtype first as the reference
// does: the low-precision load is compared at that dtype's tolerance.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <type_traits>
#include <vector>

#include "rows/float_rows.h"
#include "rows/index_check.h"
#include "score/vec_math.h"
#include "select/select.h"

namespace moe_kernels {
namespace {

// Rows per partial Load sum. Fixed, so that the summation order (float within a block, double
// across blocks in block order) does not depend on the number of threads.
constexpr int64_t kBlockRows = 64;


// x rounded to scalar_t, as torch rounds the output of each unfused op (free for float32).
template <typename scalar_t>
MK_VECTORISE MK_ALWAYS_INLINE float round_to(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) return x;
  return (float)(scalar_t)x;
}

// noise_epsilon as torch's `softplus(raw) + noise_epsilon` adds it to a float16 / bfloat16 tensor:
// the Python float rounded to the tensor's dtype first (double -> float -> scalar_t, as c10's
// conversion of the wrapped scalar). Adding the float32 eps instead gave a stddev one 16-bit ulp
// off for 0.2-0.9 % of the 16-bit raws in [-8, 8] (~8 % of a uniform grid there): ties flipped.
template <typename scalar_t>
float epsilon_as(double noise_epsilon) {
  return (float)(scalar_t)(float)noise_epsilon;
}

// noise_stddev = Softplus(raw) + eps, as torch's `softplus(raw) + eps` (eps from epsilon_as).
template <typename scalar_t>
MK_VECTORISE MK_ALWAYS_INLINE float stddev_of(float raw, float eps) {
  return round_to<scalar_t>(round_to<scalar_t>(vec_math::softplus(raw)) + eps);
}

// H = clean + noise * stddev, as torch's `clean + noise * stddev` (two roundings, no FMA).
template <typename scalar_t>
MK_VECTORISE MK_ALWAYS_INLINE float noisy_of(float clean, float noise, float stddev) {
  return round_to<scalar_t>(clean + round_to<scalar_t>(noise * stddev));
}

template <typename scalar_t>
MK_VECTORISE MK_ISA_CLONES void noisy_row(const float* __restrict clean, const float* __restrict raw, const float* __restrict noise,
                            float eps, int64_t E, float* __restrict stddev, float* __restrict noisy) {
  for (int64_t e = 0; e < E; ++e) {
    const float s = stddev_of<scalar_t>(raw[e], eps);
    stddev[e] = s;
    noisy[e] = noisy_of<scalar_t>(clean[e], noise[e], s);
  }
}

// load[e] += w[i] * Phi(z_ie) over rows i < n of a block, in row order, z_ie = (clean_ie -
// threshold_ie) / stddev_ie with threshold_ie the row's (k+1)-th largest noisy logit when e is
// selected (selected[i * E + e] = 1), else its k-th (eq 9); z [E] is scratch. One call per block: a call per row
// (through the load-time dispatch) cost as much as a 16-wide row's arithmetic.
MK_VECTORISE MK_ISA_CLONES void add_probabilities_rows(const float* const* clean, const float* __restrict stddev,
                                                       const float* __restrict selected, const float* kth,
                                                       const float* k1th, const float* w, int64_t n, int64_t E,
                                                       float* __restrict z, float* __restrict load) {
  for (int64_t i = 0; i < n; ++i) {
    const float* __restrict c = clean[i];
    const float* __restrict s = stddev + i * E;
    const float* __restrict chosen = selected + i * E;
    const float below = kth[i], above = k1th[i], weight = w[i];
    // z first, then Phi: two loops vectorise better than one.
    for (int64_t e = 0; e < E; ++e) z[e] = vec_math::z_score(c[e], chosen[e] != 0.0f ? above : below, s[e]);
    for (int64_t e = 0; e < E; ++e) load[e] += weight * vec_math::normal_cdf(z[e]);
  }
}

// Softmax over the k selected noisy logits h[0..k) (in rank order, so h[0] is the maximum), in
// float32 as torch.softmax(values.float()).
void softmax_top(const float* h, int64_t k, float* w) {
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    w[j] = std::exp(h[j] - h[0]);
    sum += w[j];
  }
  for (int64_t j = 0; j < k; ++j) w[j] /= sum;
}

template <typename scalar_t>
void forward_blocks(const Strided& clean, const Strided& raw, const Strided& noise, const float* token_weights,
                    float eps, int64_t block_begin, int64_t block_end, int64_t T, int64_t E, int64_t k,
                    scalar_t* weights,  // [T, k]
                    int64_t* top,       // [T, k+1]
                    float* partial) {   // [blocks, E]
  const int64_t kept = std::min(k + 1, E);  // pairs needed: k+1, or all E when k = E
  // A step of rows at a time: every row's noisy logits, then the step's selections in one call
  // (rows_top_pairs_f32: consecutive rows' selections overlap in the core), then the weights, then
  // the step's P summed into its block's Load (row by row, in order: the same sums whatever the
  // step). A step is a block, or fewer rows for wide rows (block_rows); buffers are sized for the
  // rows there are, and the clean rows are converted only when they are not float32 already.
  const int64_t rows_here = std::min(T, block_end * kBlockRows) - block_begin * kBlockRows;
  const int64_t step = std::min(block_rows(E, kBlockRows), rows_here);
  const bool convert = !std::is_same_v<scalar_t, float> || clean.stride_e != 1;
  std::vector<float> cbuf(convert ? step * E : 0), rbuf(E), nbuf(E), stddev(step * E), noisy(step * E),
      selected(step * E, 0.0f), kth(step), k1th(step), tw(step), h(k), w(k);
  std::vector<const float*> crow(step);
  std::vector<int64_t> best(step * kept);
  for (int64_t b = block_begin; b < block_end; ++b) {
    float* load = partial + b * E;
    std::fill_n(load, E, 0.0f);
    const int64_t block_stop = std::min(T, (b + 1) * kBlockRows);
    for (int64_t t0 = b * kBlockRows; t0 < block_stop; t0 += step) {
      const int64_t n = std::min(step, block_stop - t0);
      for (int64_t i = 0; i < n; ++i) {
        crow[i] = float_row<scalar_t>(clean, t0 + i, E, convert ? cbuf.data() + i * E : nullptr);
        noisy_row<scalar_t>(crow[i], float_row<scalar_t>(raw, t0 + i, E, rbuf.data()),
                            float_row<scalar_t>(noise, t0 + i, E, nbuf.data()), eps, E, stddev.data() + i * E,
                            noisy.data() + i * E);
      }
      rows_top_pairs_f32(noisy.data(), E, n, E, kept, best.data());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        const float* row = noisy.data() + i * E;
        int64_t* top_row = top + t * (k + 1);
        for (int64_t s = 0; s <= k; ++s) top_row[s] = s < kept ? pair_index(best[i * kept + s]) : -1;
        // The thresholds are read from the row (not decoded from the key: NaN payloads and -0).
        kth[i] = row[top_row[k - 1]];
        k1th[i] = k < E ? row[top_row[k]] : -INFINITY;
        tw[i] = token_weights ? token_weights[t] : 1.0f;
        for (int64_t j = 0; j < k; ++j) {
          h[j] = row[top_row[j]];
          selected[i * E + top_row[j]] = 1.0f;
        }
        softmax_top(h.data(), k, w.data());
        for (int64_t j = 0; j < k; ++j) weights[t * k + j] = (scalar_t)w[j];
      }
      add_probabilities_rows(crow.data(), stddev.data(), selected.data(), kth.data(), k1th.data(), tw.data(), n, E,
                             rbuf.data(), load);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < k; ++j) selected[i * E + top[(t0 + i) * (k + 1) + j]] = 0.0f;
      }
    }
  }
}

void check_inputs(const char* name, const at::Tensor& clean, const at::Tensor& raw, const at::Tensor& noise,
                  const std::optional<at::Tensor>& token_weights, int64_t k) {
  TORCH_CHECK(clean.dim() == 2 && raw.sizes() == clean.sizes() && noise.sizes() == clean.sizes(), name,
              ": clean_logits, raw_noise_stddev and noise must be [T, E] of one shape");
  const auto dtype = clean.scalar_type();
  TORCH_CHECK(raw.scalar_type() == dtype && noise.scalar_type() == dtype, name,
              ": the three inputs must share one dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, name,
              ": inputs must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k >= 1 && k <= clean.size(1), name, ": need 1 <= k <= E, got k=", k, ", E=", clean.size(1));
  TORCH_CHECK(clean.size(1) <= INT32_MAX, name, ": E too large");
  if (token_weights.has_value()) {
    TORCH_CHECK(token_weights->dim() == 1 && token_weights->size(0) == clean.size(0) &&
                    token_weights->scalar_type() == at::kFloat,
                name, ": token_weights must be float32 [T]");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> noisy_topk_gate_cpu(const at::Tensor& clean_logits,
                                                                   const at::Tensor& raw_noise_stddev,
                                                                   const at::Tensor& noise, int64_t k,
                                                                   double noise_epsilon,
                                                                   const std::optional<at::Tensor>& token_weights) {
  check_inputs("noisy_topk_gate", clean_logits, raw_noise_stddev, noise, token_weights, k);
  const int64_t T = clean_logits.size(0), E = clean_logits.size(1);
  auto weights = at::empty({T, k}, clean_logits.options());
  auto top = at::empty({T, k + 1}, clean_logits.options().dtype(at::kLong));
  auto load = at::zeros({E}, clean_logits.options().dtype(at::kFloat));
  if (T == 0) return {weights, top, load};
  const auto tw = token_weights.has_value() ? token_weights->contiguous() : at::Tensor();
  const float* tw_ptr = tw.defined() ? tw.const_data_ptr<float>() : nullptr;
  const int64_t blocks = (T + kBlockRows - 1) / kBlockRows;
  std::vector<float> partial(blocks * E);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, clean_logits.scalar_type(), "noisy_topk_gate", [&] {
    const Strided c{clean_logits.const_data_ptr(), clean_logits.stride(0), clean_logits.stride(1)};
    const Strided r{raw_noise_stddev.const_data_ptr(), raw_noise_stddev.stride(0), raw_noise_stddev.stride(1)};
    const Strided n{noise.const_data_ptr(), noise.stride(0), noise.stride(1)};
    scalar_t* wp = weights.mutable_data_ptr<scalar_t>();
    int64_t* tp = top.mutable_data_ptr<int64_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      forward_blocks<scalar_t>(c, r, n, tw_ptr, epsilon_as<scalar_t>(noise_epsilon), begin, end, T, E, k, wp, tp, partial.data());
    });
  });
  std::vector<double> sum(E, 0.0);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t e = 0; e < E; ++e) sum[e] += partial[b * E + e];
  float* lp = load.mutable_data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) lp[e] = (float)sum[e];
  return {weights, top, load};
}

// Backward of one row, with z_e = (clean_e - thr_e) / s_e and G_e = w_t d loss / d Load_e:
//   d clean_e = G_e phi(z_e) / s_e,  d s_e = -d clean_e z_e  (0 where z is infinite),
// -d clean_e accumulates into thr_e's noisy logit (the k-th or the (k+1)-th of the row), the
// softmax sends d weights to the k selected noisy logits, and a noisy logit's gradient goes to
// clean (d H / d clean = 1), to s (d H / d s = noise) and to noise (d H / d noise = s). Finally
// d raw = d s * sigmoid(raw).

// stddev = Softplus(raw) + eps exactly as the forward computed it, and sigmoid(raw), for rows i < n
// of a block (raw row i at raw + i * stride; the results [n, E] contiguous).
template <typename scalar_t>
MK_VECTORISE MK_ISA_CLONES void stddev_sigmoid_rows(const float* __restrict raw, int64_t stride, int64_t n, float eps,
                                                    int64_t E, float* __restrict stddev, float* __restrict sigmoid) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t e = 0; e < E; ++e) {
      stddev[i * E + e] = stddev_of<scalar_t>(raw[i * stride + e], eps);
      sigmoid[i * E + e] = vec_math::sigmoid(raw[i * stride + e]);
    }
  }
}

// For rows i < n of a block: gc = d clean and gs = d s of the load term for every element, and
// the sums of gc over the row's unselected (unselected[i]) and selected elements
// (selected_sum[i]), whose negatives are the gradients of the two threshold noisy logits. The sums
// are vector reductions (omp simd: the lanes' partial sums are added at the end, an order fixed
// by the build).
MK_VECTORISE MK_ISA_CLONES void load_gradient_rows(const float* const* clean, const float* __restrict stddev,
                                                   const float* __restrict selected, const float* __restrict grad_load,
                                                   const float* w, const float* kth, const float* k1th, int64_t n,
                                                   int64_t E, float* __restrict gc, float* __restrict gs,
                                                   float* unselected, float* selected_sum) {
  constexpr float kInvSqrt2Pi = 0.3989422804014327f;
  for (int64_t i = 0; i < n; ++i) {
    const float* __restrict c = clean[i];
    const float* __restrict sd = stddev + i * E;
    const float* __restrict chosen = selected + i * E;
    float* __restrict gc_row = gc + i * E;
    float* __restrict gs_row = gs + i * E;
    const float weight = w[i], below = kth[i], above = k1th[i];
    float out = 0.0f, in = 0.0f;
#pragma omp simd reduction(+ : out, in)
    for (int64_t e = 0; e < E; ++e) {
      const float s = sd[e];
      const bool sel = chosen[e] != 0.0f;
      const float z = vec_math::z_score(c[e], sel ? above : below, s);
      const float g = grad_load[e] * weight * kInvSqrt2Pi * vec_math::exp(-0.5f * z * z) / s;
      // 0 where z is infinite, by a bit mask: GCC does not vectorise this loop with a select here.
      const uint32_t finite = 0u - (uint32_t)((z < 0.0f ? -z : z) != INFINITY);
      const float d = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, g) & finite);
      gc_row[e] = d;
      gs_row[e] = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, -g * z) & finite);
      out += sel ? 0.0f : d;
      in += sel ? d : 0.0f;
    }
    unselected[i] = out;
    selected_sum[i] = in;
  }
}

template <typename scalar_t>
MK_VECTORISE MK_ISA_CLONES void write_gradients(const float* __restrict gc, const float* __restrict gs,
                                                const float* __restrict sigmoid, int64_t n,
                                                scalar_t* __restrict g_clean, scalar_t* __restrict g_raw) {
  for (int64_t j = 0; j < n; ++j) {
    g_clean[j] = (scalar_t)gc[j];
    g_raw[j] = (scalar_t)(gs[j] * sigmoid[j]);
  }
}

// The backward of rows [begin, end), a block of rows at a time (block_rows; the backward has no sum
// across rows, so any block gives the same values): each step is
// one call over the block, where a call per row (three through the load-time dispatch) cost as
// much as a 16-wide row's arithmetic.
template <typename scalar_t>
void backward_rows(const float* grad_weights,  // [T, k] float32
                   const float* grad_load,     // [E] float32
                   const float* token_weights, const Strided& clean, const Strided& raw, const Strided& noise,
                   const int64_t* top,  // [T, k+1]
                   float eps, int64_t begin, int64_t end, int64_t E, int64_t k,
                   scalar_t* g_clean, scalar_t* g_raw,  // [T, E] contiguous
                   float* g_noise_top) {                // [T, k+1]: d noise at top's elements
  const int64_t kept = std::min(k + 1, E);
  const int64_t rows = std::min(block_rows(E), end - begin);
  const bool convert_clean = !std::is_same_v<scalar_t, float> || clean.stride_e != 1;
  const bool convert_raw = !std::is_same_v<scalar_t, float> || raw.stride_e != 1;
  std::vector<float> cbuf(convert_clean ? rows * E : 0), rbuf(convert_raw ? rows * E : 0), stddev(rows * E), sigmoid(rows * E), selected(rows * E, 0.0f),
      gc(rows * E), gs(rows * E), h(rows * (k + 1)), kth(rows), k1th(rows), tw(rows), unselected(rows),
      selected_sum(rows), w(k), gh(k + 1);
  std::vector<const float*> crow(rows);
  for (int64_t t0 = begin; t0 < end; t0 += rows) {
    const int64_t n = std::min(rows, end - t0);
    int64_t raw_stride;
    const float* r = float_rows(static_cast<const scalar_t*>(raw.data), raw.stride_t, raw.stride_e, t0, n, E,
                                rbuf.data(), &raw_stride);
    stddev_sigmoid_rows<scalar_t>(r, raw_stride, n, eps, E, stddev.data(), sigmoid.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const int64_t* top_row = top + t * (k + 1);
      crow[i] = float_row<scalar_t>(clean, t, E, convert_clean ? cbuf.data() + i * E : nullptr);
      // The noisy logits of the kept elements, as the forward computed them.
      float* hi = h.data() + i * (k + 1);
      for (int64_t j = 0; j < kept; ++j) {
        const int64_t e = top_row[j];
        hi[j] = noisy_of<scalar_t>(crow[i][e], at<scalar_t>(noise, t, e), stddev[i * E + e]);
      }
      kth[i] = hi[k - 1];
      k1th[i] = k < E ? hi[k] : -INFINITY;
      tw[i] = token_weights ? token_weights[t] : 1.0f;
      for (int64_t j = 0; j < k; ++j) selected[i * E + top_row[j]] = 1.0f;
    }
    load_gradient_rows(crow.data(), stddev.data(), selected.data(), grad_load, tw.data(), kth.data(), k1th.data(), n,
                       E, gc.data(), gs.data(), unselected.data(), selected_sum.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const int64_t* top_row = top + t * (k + 1);
      for (int64_t j = 0; j < k; ++j) selected[i * E + top_row[j]] = 0.0f;
      // d h at the kept elements: the softmax backward w (g - <w, g>), plus the threshold sums.
      softmax_top(h.data() + i * (k + 1), k, w.data());
      const float* gw = grad_weights + t * k;
      float dot = 0.0f;
      for (int64_t j = 0; j < k; ++j) dot += w[j] * gw[j];
      for (int64_t j = 0; j < k; ++j) gh[j] = w[j] * (gw[j] - dot);
      if (k < E) gh[k] = 0.0f;
      gh[k - 1] -= unselected[i];
      if (k < E) gh[k] -= selected_sum[i];
      for (int64_t j = 0; j <= k; ++j) {
        if (j >= kept) {
          g_noise_top[t * (k + 1) + j] = 0.0f;
          continue;
        }
        const int64_t e = top_row[j];
        const float z = at<scalar_t>(noise, t, e), s = stddev[i * E + e];
        // noise * stddev = -inf (an infinite stddev, negative noise): H = -inf for every large
        // stddev, a constant, so noise and stddev get the limit 0 through H, not gh * inf (NaN
        // at gh = 0), as the reference's noise term (docs/reliability.md).
        const bool constant = s == INFINITY && z < 0.0f;
        gc[i * E + e] += gh[j];
        gs[i * E + e] += constant ? 0.0f : gh[j] * z;
        g_noise_top[t * (k + 1) + j] = constant ? 0.0f : gh[j] * s;
      }
    }
    write_gradients<scalar_t>(gc.data(), gs.data(), sigmoid.data(), n * E, g_clean + t0 * E, g_raw + t0 * E);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> noisy_topk_gate_backward_cpu(
    const at::Tensor& grad_weights, const at::Tensor& grad_load, const at::Tensor& clean_logits,
    const at::Tensor& raw_noise_stddev, const at::Tensor& noise, const std::optional<at::Tensor>& token_weights,
    const at::Tensor& top, int64_t k, double noise_epsilon) {
  check_inputs("noisy_topk_gate_backward", clean_logits, raw_noise_stddev, noise, token_weights, k);
  const int64_t T = clean_logits.size(0), E = clean_logits.size(1);
  TORCH_CHECK(grad_weights.dim() == 2 && grad_weights.size(0) == T && grad_weights.size(1) == k &&
                  grad_load.dim() == 1 && grad_load.size(0) == E && top.dim() == 2 && top.size(0) == T &&
                  top.size(1) == k + 1 && top.scalar_type() == at::kLong,
              "noisy_topk_gate_backward: bad arguments");
  auto g_clean = at::empty({T, E}, clean_logits.options());
  auto g_raw = at::empty({T, E}, raw_noise_stddev.options());
  auto g_noise_top = at::empty({T, k + 1}, clean_logits.options().dtype(at::kFloat));
  if (T == 0) return {g_clean, g_raw, g_noise_top};
  const auto gw = grad_weights.to(at::kFloat).contiguous();
  const auto gl = grad_load.to(at::kFloat).contiguous();
  const auto tp = top.contiguous();
  // The forward's top: k selected ids, then the (k+1)-th (when k < E; -1 otherwise).
  check_routing_ids(tp, E, k < E ? k + 1 : k, "noisy_topk_gate_backward", "top");
  const auto tw = token_weights.has_value() ? token_weights->contiguous() : at::Tensor();
  const float* tw_ptr = tw.defined() ? tw.const_data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, clean_logits.scalar_type(), "noisy_topk_gate_backward", [&] {
    const Strided c{clean_logits.const_data_ptr(), clean_logits.stride(0), clean_logits.stride(1)};
    const Strided r{raw_noise_stddev.const_data_ptr(), raw_noise_stddev.stride(0), raw_noise_stddev.stride(1)};
    const Strided n{noise.const_data_ptr(), noise.stride(0), noise.stride(1)};
    // About 16k elements per task: balances without a costly fork per row.
    const int64_t grain = std::max<int64_t>(1, 16384 / E);
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      backward_rows<scalar_t>(gw.const_data_ptr<float>(), gl.const_data_ptr<float>(), tw_ptr, c, r, n,
                              tp.const_data_ptr<int64_t>(), epsilon_as<scalar_t>(noise_epsilon), begin, end, E, k,
                              g_clean.mutable_data_ptr<scalar_t>(), g_raw.mutable_data_ptr<scalar_t>(),
                              g_noise_top.mutable_data_ptr<float>());
    });
  });
  return {g_clean, g_raw, g_noise_top};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def(
      "noisy_topk_gate(Tensor clean_logits, Tensor raw_noise_stddev, Tensor noise, int k, float noise_epsilon, "
      "Tensor? token_weights) -> (Tensor weights, Tensor top, Tensor load)");
  m.def(
      "noisy_topk_gate_backward(Tensor grad_weights, Tensor grad_load, Tensor clean_logits, Tensor raw_noise_stddev, "
      "Tensor noise, Tensor? token_weights, Tensor top, int k, float noise_epsilon) -> "
      "(Tensor grad_clean, Tensor grad_raw, Tensor grad_noise_top)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("noisy_topk_gate", &noisy_topk_gate_cpu);
  m.impl("noisy_topk_gate_backward", &noisy_topk_gate_backward_cpu);
}

}  // namespace moe_kernels
