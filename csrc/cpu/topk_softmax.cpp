// Fused top-k selection + softmax on CPU: one pass over each row keeps the k best (value, index)
// pairs, a second pass (only for renormalize=false) sums the full softmax denominator. Both are
// the vectorised row primitives of row_vector.h on float32 rows: float16 / bfloat16 and strided
// rows are converted into a float32 row buffer first.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "moe_kernels/topk_softmax.h"
#include "index_check.h"
#include "saved_weights.h"
#include "row_exp_terms.h"
#include "row_vector.h"
#include "vec_math.h"

namespace moe_kernels {
namespace {

// A renormalised weight's exp term on CPU where renormalized_weights_f32 (AVX-512 F, k <= 16)
// does not run: exp(v - vmax) with torch's tails (vec_math::exp_full, inlined and
// vectorised where expf was a libm call per term), 0 for a row whose largest logit is -inf (fully
// masked tokens). exp_full(0) is exactly 1, so k = 1 gives weight 1 for a finite row (the k = 1
// per-row backward takes it: its weight is 1 whichever exp computed it).
MK_VEC_INLINE float renorm_term(float v, float vmax) {
  return vmax == -INFINITY ? 0.0f : vec_math::exp_full(v - vmax);
}

// The renormalised weights of n rows' k selected slots (value, vmax [n * k]) into w [n * k]: the
// exp terms in one flat loop, each row's denominator summed in slot order (as the backward sums
// it), one division per slot; 0 for a row whose largest logit is -inf. K > 0 fixes k at compile
// time (K = 0: any k), which unrolls the per-row loops; for K = 1 they vectorise across rows too.
// The elementwise values are the same for every K and instruction set.
template <int K>
MK_VEC_INLINE void renormalized_rows(const float* __restrict value, const float* __restrict vmax, int64_t n,
                                     int64_t k_any, float* __restrict w) {
  const int64_t k = K > 0 ? K : k_any;
  for (int64_t j = 0; j < n * k; ++j) w[j] = renorm_term(value[j], vmax[j]);
  for (int64_t i = 0; i < n; ++i) {
    float denom = 0.0f;
    for (int64_t s = 0; s < k; ++s) denom += w[i * k + s];
    for (int64_t s = 0; s < k; ++s) w[i * k + s] = vmax[i * k + s] == -INFINITY ? 0.0f : w[i * k + s] / denom;
  }
}

MK_VECTORISE MK_ROW_CLONES void renormalized_weights(const float* __restrict value, const float* __restrict vmax,
                                                     int64_t n, int64_t k, float* __restrict w) {
  if (renormalized_weights_f32(value, vmax, n, k, w)) return;
  switch (k) {
    case 1: return renormalized_rows<1>(value, vmax, n, k, w);
    case 2: return renormalized_rows<2>(value, vmax, n, k, w);
    case 4: return renormalized_rows<4>(value, vmax, n, k, w);
    case 8: return renormalized_rows<8>(value, vmax, n, k, w);
    default: return renormalized_rows<0>(value, vmax, n, k, w);
  }
}

// Renormalised float32 rows go in one pass (rows_top_renormalized_f32) where it runs. Otherwise
// rows are processed in blocks: the block's selections first (one call, rows_top_pairs_f32), then
// the weights of all its k * rows slots in vectorised loops.
template <typename scalar_t>
MK_VECTORISE void topk_softmax_rows(const scalar_t* logits,  // [T, E], strides (stride_t, stride_e)
                                    int64_t stride_t, int64_t stride_e, int64_t begin, int64_t end,
                                    int64_t E, int64_t k, bool renormalize,
                                    scalar_t* weights,       // [T, k] contiguous
                                    int64_t* experts) {      // [T, k] contiguous
  const bool direct = std::is_same_v<scalar_t, float> && stride_e == 1;  // float_rows: the logits themselves
  if constexpr (std::is_same_v<scalar_t, float>) {
    // Selection and weights in one pass over all the rows where that runs.
    if (direct && renormalize &&
        rows_top_renormalized_f32(logits + begin * stride_t, stride_t, end - begin, E, k, experts + begin * k,
                                  weights + begin * k)) {
      return;
    }
  }
  const int64_t block = selection_block_rows(E, k, renormalize);
  std::vector<float> rows(direct ? 0 : block * E), exps(renormalize ? 0 : block * E), sums(block);
  std::vector<int64_t> best(block * k);
  std::vector<float> value(block * k), vmax(block * k), term(block * k);
  for (int64_t t0 = begin; t0 < end; t0 += block) {
    const int64_t n = std::min(block, end - t0);
    int64_t stride;
    const float* x = float_rows(logits, stride_t, stride_e, t0, n, E, rows.data(), &stride);
    const int64_t slots = n * k;
    if (renormalize) {
      float* w = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(weights + t0 * k) : term.data();
      // From the pairs directly where it can (the same weights, without value and vmax stored).
      if (!rows_top_renormalized_f32(x, stride, n, E, k, experts + t0 * k, w)) {
        rows_top_pairs_f32(x, stride, n, E, k, best.data());
        if (!renormalized_pairs_f32(best.data(), n, k, experts + t0 * k, w)) {
          selected_slots(best.data(), n, k, experts + t0 * k, value.data(), vmax.data());
          renormalized_weights(value.data(), vmax.data(), n, k, w);
        }
      }
      if constexpr (!std::is_same_v<scalar_t, float>) {
        for (int64_t j = 0; j < slots; ++j) weights[t0 * k + j] = (scalar_t)w[j];
      }
    } else {
      rows_top_pairs_f32(x, stride, n, E, k, best.data());
      selected_slots(best.data(), n, k, experts + t0 * k, value.data(), vmax.data());
      // The selected terms are the sums' own, recomputed from the slots' values rather than
      // stored for every element (the backward recomputes them exactly too).
      rows_softmax_sums_f32(x, stride, n, E, vmax.data(), k, exps.data(), sums.data());
      softmax_terms_f32(value.data(), vmax.data(), slots, term.data());
      for (int64_t i = 0; i < n; ++i) {
        const float m = vmax[i * k];
        for (int64_t s = 0; s < k; ++s) {
          const float p = term[i * k + s] / sums[i];
          weights[(t0 + i) * k + s] = (scalar_t)(m == -INFINITY ? 0.0f : p);
        }
      }
    }
  }
}

// The renormalised backward's writes for n float32 rows (saved_weights.h's renormalized_grad_rows
// with scaling 1, NaN only at the selected experts), compiled per instruction set: the zero fill
// runs as wide stores inline, just before the row's k writes, which then hit the cache. A row's
// weights are all 0 only for a fully masked row (its first weight, its largest logit's, is
// 1 / a sum of k terms in (0, 1] otherwise).
MK_VECTORISE __attribute__((optimize("no-tree-loop-distribute-patterns"))) MK_ROW_CLONES void
renormalized_grad_rows_f32(const float* __restrict w, const float* __restrict g, const int64_t* __restrict experts,
                           int64_t n, int64_t k, int64_t E, float* __restrict out) {
  renormalized_grad_rows<false>(w, g, experts, n, k, E, 1.0f, out);
}

// The renormalised backward of rows [begin, end), a block of rows at a time: the selected logits
// gathered (prefetched kAhead rows early: scattered
// loads that miss the cache once the logits exceed it and that no hardware prefetcher predicts),
// the weights recomputed by the forward's renormalized_weights (the same values, vectorised across
// the block), then each row zeroed and grad_j = w_j (g_j - sum_s g_s w_s) written at its k
// selected j. A fully masked row (largest logit -inf) stays zero. Against the per-row loop
// (scalar exps; the zero fill as SSE2 stores), backward op alone, T=65536 E=64: k=2 1.90 ->
// 1.6 ms, k=8 4.56 -> 3.6 ms; k=1 was 10% slower, so it keeps that loop.
template <typename scalar_t, typename grad_t>
MK_VECTORISE void renormalized_backward_rows(const scalar_t* logits, int64_t stride_t, int64_t stride_e,  // [T, E]
                                const grad_t* grad_w,    // [T, k] contiguous
                                const int64_t* experts,  // [T, k] contiguous
                                int64_t begin, int64_t end, int64_t E, int64_t k,
                                scalar_t* grad) {        // [T, E] contiguous
  constexpr int64_t kBlock = 64, kAhead = 16;
  std::vector<float> value(kBlock * k), vmax(kBlock * k), w(kBlock * k), gf(kBlock * k);
  for (int64_t t0 = begin; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      if (t + kAhead < end) {
        const scalar_t* ahead = logits + (t + kAhead) * stride_t;
        for (int64_t s = 0; s < k; ++s) __builtin_prefetch(ahead + experts[(t + kAhead) * k + s] * stride_e);
      }
      const scalar_t* row = logits + t * stride_t;
      const int64_t* ex = experts + t * k;
      const float m = (float)row[ex[0] * stride_e];  // experts[t, 0] is the row max
      for (int64_t s = 0; s < k; ++s) {
        value[i * k + s] = (float)row[ex[s] * stride_e];
        vmax[i * k + s] = m;
        gf[i * k + s] = (float)grad_w[t * k + s];
      }
    }
    renormalized_weights(value.data(), vmax.data(), n, k, w.data());
    if constexpr (std::is_same_v<scalar_t, float>) {
      renormalized_grad_rows_f32(w.data(), gf.data(), experts + t0 * k, n, k, E, grad + t0 * E);
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      scalar_t* out = grad + t * E;
      // The row zeroed just before its k writes, so that they hit the cache (a memset of the whole
      // block first cost twice as much: glibc's large memsets bypass the cache on this machine).
      // +0 is all zero bits in float32, float16 and bfloat16.
      std::memset(static_cast<void*>(out), 0, sizeof(scalar_t) * E);
      if (vmax[i * k] == -INFINITY) continue;  // a fully masked token: weights 0, gradient 0
      const float* g = gf.data() + i * k;
      const float* wi = w.data() + i * k;
      float dot = 0.0f;
      for (int64_t s = 0; s < k; ++s) dot += g[s] * wi[s];
      for (int64_t s = 0; s < k; ++s) out[experts[t * k + s]] = (scalar_t)(wi[s] * (g[s] - dot));
    }
  }
}

// One row's full-softmax gradient into out [E] from its exp terms [E] and 1 / their sum:
// grad_j = [j selected] g_j p_j - p_j sum_s g_s p_s with p = terms * inv.
template <typename scalar_t, typename grad_t>
MK_VEC_INLINE void full_softmax_grad_row(const float* terms, float inv, const int64_t* ex, const grad_t* g, int64_t k,
                                         int64_t E, scalar_t* out) {
  float dot = 0.0f;
  for (int64_t s = 0; s < k; ++s) dot += (float)g[s] * (terms[ex[s]] * inv);
  const float scale = -inv * dot;
  for (int64_t e = 0; e < E; ++e) out[e] = (scalar_t)(terms[e] * scale);
  for (int64_t s = 0; s < k; ++s) {
    const float p = terms[ex[s]] * inv;
    out[ex[s]] = (scalar_t)((float)g[s] * p - p * dot);
  }
}

// The full softmax's backward of rows [begin, end), a block of rows at a time: the block's exp
// terms and sums by one rows_exp_terms_f32 call (the terms and sums row_exp_sum_f32 gives row by
// row: the same values), then each row's grad_j = [j selected] g_j p_j - p_j sum_s g_s p_s.
// Returns false, writing nothing, where rows_exp_terms_f32 does not run (no AVX-512 F). Blocks of
// ~512 terms (16 rows at E = 64 were slower than 4 to 8, and 16 at E = 256 1.4x slower than 1).
// T = 65536, one thread, fwd+bwd k = 2 against a call per row (and the forward's blocks):
// E = 64 5.2 -> 4.4 ms, E = 128 9.1 -> 7.5 ms, E = 256 unchanged (~14 ms).
template <typename scalar_t, typename grad_t>
MK_VECTORISE bool full_backward_rows(const scalar_t* logits, int64_t stride_t, int64_t stride_e,  // [T, E]
                                     const grad_t* grad_w,    // [T, k] contiguous
                                     const int64_t* experts,  // [T, k] contiguous
                                     int64_t begin, int64_t end, int64_t E, int64_t k,
                                     scalar_t* grad) {        // [T, E] contiguous
  const bool direct = std::is_same_v<scalar_t, float> && stride_e == 1;
  const int64_t block = std::clamp<int64_t>(512 / std::max<int64_t>(E, 1), 1, 16);  // ~2 KiB of terms
  std::vector<float> rows(direct ? 0 : block * E), exps(block * E), vmax(block), sums(block);
  for (int64_t t0 = begin; t0 < end; t0 += block) {
    const int64_t n = std::min(block, end - t0);
    int64_t stride;
    const float* x = float_rows(logits, stride_t, stride_e, t0, n, E, rows.data(), &stride);
    for (int64_t i = 0; i < n; ++i) vmax[i] = x[i * stride + experts[(t0 + i) * k]];  // experts[t, 0] is the row max
    if (!rows_exp_terms_f32(x, stride, n, E, vmax.data(), 1, exps.data(), sums.data())) return false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const int64_t* ex = experts + t * k;
      const grad_t* g = grad_w + t * k;
      scalar_t* out = grad + t * E;
      if (vmax[i] == -INFINITY) {  // a fully masked token: weights 0 whatever the logits, gradient 0
        std::fill_n(out, E, (scalar_t)0.0f);
        continue;
      }
      full_softmax_grad_row(exps.data() + i * E, 1.0f / sums[i], ex, g, k, E, out);
    }
  }
  return true;
}

// Backward: d loss / d logits [T, E] from d loss / d weights [T, k], one pass per row (two for
// the full softmax), recomputing the weights in float32 from the logits.
//   renormalize: grad_j = w_j (g_j - sum_s g_s w_s) at the selected j, 0 elsewhere;
//   full softmax: grad_j = [j selected] g_j p_j - p_j sum_s g_s p_s, with the row's exp terms
//   computed once (vectorised) and kept in a row buffer for the second pass.
template <typename scalar_t, typename grad_t>
MK_VECTORISE void topk_softmax_backward_rows(const scalar_t* logits, int64_t stride_t, int64_t stride_e,
                                const grad_t* grad_w,     // [T, k] contiguous
                                const int64_t* experts,   // [T, k] contiguous
                                int64_t begin, int64_t end, int64_t E, int64_t k, bool renormalize,
                                scalar_t* grad) {         // [T, E] contiguous
  // k = 1: the weight is 1 and the gradient 0 (NaN where g or the row is): the per-row loop below,
  // with no exps to vectorise, is cheaper than the block's extra passes.
  if (renormalize && k >= 2) {
    renormalized_backward_rows(logits, stride_t, stride_e, grad_w, experts, begin, end, E, k, grad);
    return;
  }
  if (!renormalize && full_backward_rows(logits, stride_t, stride_e, grad_w, experts, begin, end, E, k, grad)) return;
  std::vector<float> w(k);
  std::vector<float> row_buffer(renormalize ? 0 : E), exps(renormalize ? 0 : E);
  // The renormalised backward reads only the k selected logits of each row: scattered loads that
  // miss the cache once the logits exceed it and that no hardware prefetcher predicts, so they are
  // prefetched kAhead rows early (E=256 k=8 at T=65536: most of the kernel's time was those misses).
  constexpr int64_t kAhead = 16;
  for (int64_t t = begin; t < end; ++t) {
    if (renormalize && t + kAhead < end) {
      const scalar_t* ahead = logits + (t + kAhead) * stride_t;
      for (int64_t s = 0; s < k; ++s) __builtin_prefetch(ahead + experts[(t + kAhead) * k + s] * stride_e);
    }
    const scalar_t* row = logits + t * stride_t;
    const int64_t* ex = experts + t * k;
    const grad_t* g = grad_w + t * k;
    scalar_t* out = grad + t * E;
    const float vmax = (float)row[ex[0] * stride_e];  // experts[t, 0] is the row max
    if (vmax == -INFINITY) {  // a fully masked token: weights 0 whatever the logits, gradient 0
      std::fill_n(out, E, (scalar_t)0.0f);
      continue;
    }
    if (renormalize) {
      float denom = 0.0f;
      for (int64_t s = 0; s < k; ++s) {
        w[s] = renorm_term((float)row[ex[s] * stride_e], vmax);
        denom += w[s];
      }
      float dot = 0.0f;
      for (int64_t s = 0; s < k; ++s) {
        w[s] /= denom;
        dot += (float)g[s] * w[s];
      }
      std::fill_n(out, E, (scalar_t)0.0f);
      for (int64_t s = 0; s < k; ++s) out[ex[s]] = (scalar_t)(w[s] * ((float)g[s] - dot));
    } else {
      const float inv = 1.0f / row_exp_sum_f32(float_row(row, stride_e, E, row_buffer.data()), E, vmax, exps.data());
      full_softmax_grad_row(exps.data(), inv, ex, g, k, E, out);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> topk_softmax_cpu(const at::Tensor& logits, int64_t k,
                                                    bool renormalize) {
  TORCH_CHECK(logits.dim() == 2, "topk_softmax: logits must be [T, E], got ", logits.sizes());
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "topk_softmax: need 1 <= k <= E, got k=", k, ", E=", E);
  TORCH_CHECK(E <= INT32_MAX, "topk_softmax: E too large");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kHalf ||
                  logits.scalar_type() == at::kBFloat16,
              "topk_softmax: logits must be float32, float16 or bfloat16, got ", logits.scalar_type());
  auto weights = at::empty({T, k}, logits.options());
  auto experts = at::empty({T, k}, logits.options().dtype(at::kLong));
  if (T == 0) return {weights, experts};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "topk_softmax", [&] {
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    scalar_t* w = weights.mutable_data_ptr<scalar_t>();
    int64_t* ex = experts.mutable_data_ptr<int64_t>();
    const int64_t st = logits.stride(0), se = logits.stride(1);
    // About 32k logits per task: small enough to balance, large enough to amortise the fork.
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(E, 1));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      topk_softmax_rows<scalar_t>(x, st, se, begin, end, E, k, renormalize, w, ex);
    });
  });
  return {weights, experts};
}

at::Tensor topk_softmax_backward_cpu(const at::Tensor& grad_weights, const at::Tensor& logits,
                                     const at::Tensor& experts, bool renormalize) {
  TORCH_CHECK(logits.dim() == 2 && experts.dim() == 2 && grad_weights.sizes() == experts.sizes() &&
                  experts.size(0) == logits.size(0) && experts.scalar_type() == at::kLong,
              "topk_softmax_backward: bad shapes");
  const int64_t T = logits.size(0), E = logits.size(1), k = experts.size(1);
  TORCH_CHECK(k >= 1, "topk_softmax_backward: experts must have k >= 1 columns, got ", k);
  auto grad = at::empty({T, E}, logits.options());
  if (T == 0) return grad;
  const auto g = grad_weights.contiguous();
  const auto ex = experts.contiguous();
  check_routing_ids(ex, E, k, "topk_softmax_backward", "experts");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "topk_softmax_backward", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "topk_softmax_backward_g", [&] {
      const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(E, 1));
      at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
        topk_softmax_backward_rows<logit_t, scalar_t>(
            logits.const_data_ptr<logit_t>(), logits.stride(0), logits.stride(1), g.const_data_ptr<scalar_t>(),
            ex.const_data_ptr<int64_t>(), begin, end, E, k, renormalize, grad.mutable_data_ptr<logit_t>());
      });
    });
  });
  return grad;
}

// The renormalised backward from the forward's own float32 weights (autograd saves a copy of them
// instead of the logits, ops/topk_softmax.py): the same values renormalized_backward_rows would
// recompute from the logits (renormalized_weights, bit for bit), without the gather of the k
// selected logits (scattered loads, most of what that backward spent beside its writes) or the
// exps; and the graph keeps [T, k] weights alive rather than the [T, E] logits.
at::Tensor topk_softmax_backward_from_weights_cpu(const at::Tensor& grad_weights, const at::Tensor& weights,
                                                  const at::Tensor& experts, int64_t num_experts) {
  const SavedWeights in =
      saved_weights(grad_weights, weights, experts, num_experts, "topk_softmax_backward_from_weights");
  const int64_t k = in.k, E = in.E;
  auto grad = at::empty({in.T, E}, weights.options());
  const float* wp = in.w.const_data_ptr<float>();
  const float* gp = in.g.const_data_ptr<float>();
  const int64_t* ep = in.ex.const_data_ptr<int64_t>();
  float* out = grad.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / E);
  at::parallel_for(0, in.T, grain, [&](int64_t begin, int64_t end) {
    renormalized_grad_rows_f32(wp + begin * k, gp + begin * k, ep + begin * k, end - begin, k, E, out + begin * E);
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("topk_softmax(Tensor logits, int k, bool renormalize) -> (Tensor weights, Tensor experts)");
  m.def("topk_softmax_backward(Tensor grad_weights, Tensor logits, Tensor experts, bool renormalize) -> Tensor");
  m.def(
      "topk_softmax_backward_from_weights(Tensor grad_weights, Tensor weights, Tensor experts, int num_experts) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("topk_softmax", &topk_softmax_cpu);
  m.impl("topk_softmax_backward", &topk_softmax_backward_cpu);
  m.impl("topk_softmax_backward_from_weights", &topk_softmax_backward_from_weights_cpu);
}

}  // namespace moe_kernels
