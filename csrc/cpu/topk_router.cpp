// topk_router on CPU: one pass over each row computes what the row's router needs and nothing
// more, in float32 (double for float64 logits).
//   - no bias, one group: the experts are ranked by the logits (the reference's rule), so the
//     selection is exact and the scores are computed only where needed: softmax with
//     renormalisation reads the k selected logits only; the full softmax adds one vectorised
//     exp-sum pass; sigmoid reads the k selected logits.
//   - a bias or groups: every score (one vectorised exp pass, torch's tails kept), choice = score + bias, the groups'
//     scores, the eligible experts gathered in index order, and the top k among them.
// The weights' renormalisation and its gradient are the shared rules of topk_router.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "moe_kernels/topk_router.h"
#include "rows/float_rows.h"
#include "rows/index_check.h"
#include "score/exp_sums.h"
#include "score/exp_terms.h"
#include "score/vec_math.h"
#include "select/select.h"

namespace moe_kernels {
namespace {

using topk_router::kSigmoid;
using topk_router::kSoftmax;
using topk_router::ranks_above;

struct RouterArgs {
  int64_t k;
  int scoring;
  int group_scoring;
  int64_t num_groups, topk_groups;
  bool renormalize;
  double scaling;
  // Backward only: experts[t, 0] is row t's largest logit (the forward ranked the logits: no
  // bias, one group), so the softmax's shift is read there instead of found by a pass over the row.
  bool ranked_by_logits = false;
  bool grouped() const { return topk_groups < num_groups; }
};

// The inputs of topk_router_backward_from_weights, checked.
struct SavedWeights {
  at::Tensor w, g, ex;  // contiguous: weights float32, grad_weights as float32, experts int64
  int64_t T = 0, k = 0, E = 0;
};

// weights [T, k] float32, grad_weights [T, k] floating, experts [T, k] int64 ids in [0, E),
// 1 <= k <= E = num_experts; a RuntimeError (IndexError for an id) names op and the argument.
inline SavedWeights saved_weights(const at::Tensor& grad_weights, const at::Tensor& weights, const at::Tensor& experts,
                                  int64_t num_experts, const char* op) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat, op,
              ": weights must be a float32 [T, k] tensor");
  TORCH_CHECK(grad_weights.sizes() == weights.sizes() && experts.sizes() == weights.sizes(), op,
              ": grad_weights and experts must have the weights' shape ", weights.sizes());
  TORCH_CHECK(at::isFloatingType(grad_weights.scalar_type()), op, ": grad_weights must be floating");
  SavedWeights s;
  s.T = weights.size(0);
  s.k = weights.size(1);
  s.E = num_experts;
  TORCH_CHECK(s.k >= 1 && s.k <= s.E, op, ": need 1 <= k <= num_experts, got k=", s.k, ", num_experts=", s.E);
  s.w = weights.contiguous();
  s.g = grad_weights.to(at::kFloat).contiguous();
  s.ex = experts.contiguous();
  check_routing_ids(s.ex, s.E, s.k, op, "experts");
  return s;
}

// The gradient of n rows (out [n, E] contiguous) of renormalised weights w = scaling * r (r a
// softmax over the k selected logits; w, g [n * k] float32): each row filled, then
// grad_s = w_s (g_s - sum_j g_j (w_j / scaling)) at its k experts. A row whose weights are all 0
// (fully masked, or every selected score underflowed) stays 0 even for a non-finite g; a row whose
// first weight is NaN (its logits held NaN or +inf: every weight is then NaN) is NaN everywhere,
// as router_backward_rows has it. w / scaling is exact for scaling = 1, and exactly 1 for a
// weight of exactly scaling (whose gradient is then exactly 0). The float32 caller compiles it
// per instruction set, with GCC's rewrite of the fill loop into a memset call per row turned off
// (a call per row, as costly as the rest of the backward at small E).
template <typename out_t>
MK_VECTORISE MK_ALWAYS_INLINE void renormalized_grad_rows(const float* __restrict w, const float* __restrict g,
                                          const int64_t* __restrict experts, int64_t n, int64_t k, int64_t E,
                                          float scaling, out_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    out_t* row = out + i * E;
    const float first = w[i * k];
    const bool nan_row = first != first;
    const out_t fill = nan_row ? (out_t)NAN : (out_t)0.0f;
    for (int64_t e = 0; e < E; ++e) row[e] = fill;
    bool any = false;
    for (int64_t s = 0; s < k; ++s) any |= w[i * k + s] != 0.0f;
    if (!any || nan_row) continue;
    float dot = 0.0f;
    for (int64_t s = 0; s < k; ++s) dot += g[i * k + s] * (w[i * k + s] / scaling);
    for (int64_t s = 0; s < k; ++s) row[experts[i * k + s]] = (out_t)(w[i * k + s] * (g[i * k + s] - dot));
  }
}

int parse_scoring(const std::string& s) {
  TORCH_CHECK(s == "softmax" || s == "sigmoid", "topk_router: scoring must be 'softmax' or 'sigmoid', got '", s, "'");
  return s == "softmax" ? kSoftmax : kSigmoid;
}

int parse_group_scoring(const std::string& s) {
  TORCH_CHECK(s == "top2_sum" || s == "max", "topk_router: group_scoring must be 'top2_sum' or 'max', got '", s, "'");
  return s == "top2_sum" ? topk_router::kTop2Sum : topk_router::kMax;
}

// Per-thread buffers of one row: the row in the compute type, the scores, the eligible choice
// values and their expert ids, the selection.
template <typename acc_t>
struct RowBuffers {
  std::vector<acc_t> x, p, cand;
  std::vector<int64_t> cand_id, best, group_order;
  std::vector<acc_t> group_scores;
  explicit RowBuffers(int64_t E, int64_t G)
      : x(E), p(E), cand(E), cand_id(E), best(E), group_order(G), group_scores(G) {}
};

// The row as contiguous acc_t (float rows may alias the input).
template <typename scalar_t, typename acc_t>
const acc_t* load_row(const scalar_t* row, int64_t stride_e, int64_t E, acc_t* buffer) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return float_row(row, stride_e, E, buffer);
  } else {
    for (int64_t e = 0; e < E; ++e) buffer[e] = (acc_t)row[e * stride_e];
    return buffer;
  }
}

// The k largest of v[0 .. n) in rank order into idx[0 .. k) (positions in v). idx holds n.
void select_top(const float* v, int64_t n, int64_t k, int64_t* idx) {
  row_top_pairs(v, n, k, idx);
  for (int64_t s = 0; s < k; ++s) idx[s] = pair_index(idx[s]);
}

void select_top(const double* v, int64_t n, int64_t k, int64_t* idx) {
  std::iota(idx, idx + n, 0);
  std::partial_sort(idx, idx + k, idx + n, [v](int64_t a, int64_t b) { return ranks_above(v[a], a, v[b], b); });
}

// Index of the rank-largest element (NaN first), for the softmax's shift.
int64_t row_max_index(const float* v, int64_t n) { return row_argmax_f32(v, n); }
int64_t row_max_index(const double* v, int64_t n) {
  int64_t m = 0;
  for (int64_t i = 1; i < n; ++i)
    if (ranks_above(v[i], i, v[m], m)) m = i;
  return m;
}

// exps[e] = exp(v[e] - vmax), returns their sum. float: the vectorised pass of score/exp_sums.h.
// exp_full terms: scores are ranked (bias, groups) and returned as weights, so their tails are
// torch's (row_exp_sum_full_f32).
float exp_sum(const float* v, int64_t n, float vmax, float* exps) { return row_exp_sum_full_f32(v, n, vmax, exps); }
double exp_sum(const double* v, int64_t n, double vmax, double* exps) {
  double total = 0;
  for (int64_t e = 0; e < n; ++e) total += (exps[e] = std::exp(v[e] - vmax));
  return total;
}

// The full softmax backward's terms and sum: float32 by the forward's own (row_exp_sum_f32, the
// terms of rows_softmax_sums_f32 bit for bit), so that the gradient's p is the forward's weight;
// float64 by std::exp.
float backward_exp_sum(const float* v, int64_t n, float vmax, float* exps) { return row_exp_sum_f32(v, n, vmax, exps); }
double backward_exp_sum(const double* v, int64_t n, double vmax, double* exps) { return exp_sum(v, n, vmax, exps); }

// Sigmoid scores as torch.sigmoid (the reference) gives them: 0 below x = -88.7228 in float32
// (vec_math::sigmoid_torch), 1 / (1 + e^-x) in float64.
MK_VECTORISE MK_ALWAYS_INLINE float sigmoid_of(float x) { return vec_math::sigmoid_torch(x); }
inline double sigmoid_of(double x) { return 1.0 / (1.0 + std::exp(-x)); }

MK_VECTORISE MK_ISA_CLONES void sigmoid_row(const float* __restrict x, int64_t n, float* __restrict p) {
  for (int64_t e = 0; e < n; ++e) p[e] = vec_math::sigmoid_torch(x[e]);
}
void sigmoid_row(const double* x, int64_t n, double* p) {
  for (int64_t e = 0; e < n; ++e) p[e] = sigmoid_of(x[e]);
}

// Every score of a row into p [E]. softmax: a row whose largest logit is -inf gets zeros.
template <typename acc_t>
void all_scores(const acc_t* x, int64_t E, int scoring, acc_t* p) {
  if (scoring == kSigmoid) {
    sigmoid_row(x, E, p);
    return;
  }
  const acc_t vmax = x[row_max_index(x, E)];
  if (vmax == -INFINITY) {
    std::fill_n(p, E, acc_t(0));
    return;
  }
  const acc_t inv = acc_t(1) / exp_sum(x, E, vmax, p);
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
}

// exp of a softmax term relative to the row max, the forward's and the backward's: float32 by
// vec_math::exp_full (inlined, vectorised in flat loops; torch's tails), float64 by std::exp.
MK_VECTORISE MK_ALWAYS_INLINE float term_exp(float d) { return vec_math::exp_full(d); }
inline double term_exp(double d) { return std::exp(d); }

// The G group scores of one row's choice values [G * size] into out [G], float32: group_score's
// values (topk_router.h), each group's two largest kept per lane of 8 without a branch per element
// (Top2::push's data-dependent branches were most of the grouped router's time), the lanes then
// merged as Top2::merged merges, the tail pushed as Top2::push does. Only the two values matter,
// not which of two equal experts they came from.
MK_VECTORISE MK_ISA_CLONES void group_scores_f32(const float* __restrict choice, int64_t G, int64_t size,
                                                 int group_scoring, float* __restrict out) {
  typedef float lanes_f32 __attribute__((vector_size(32)));
  typedef int32_t lanes_i32 __attribute__((vector_size(32)));
  for (int64_t g = 0; g < G; ++g) {
    const float* v = choice + g * size;
    lanes_f32 first = lanes_f32{} - INFINITY, second = first;
    lanes_i32 nan = {};
    int64_t i = 0;
    for (; i + 8 <= size; i += 8) {
      lanes_f32 x;
      std::memcpy(&x, v + i, sizeof x);
      nan |= x != x;
      const lanes_i32 above1 = x > first, above2 = x > second;
      second = above1 ? first : (above2 ? x : second);
      first = above1 ? x : first;
    }
    // The lanes merged by halves (lane l with lane l ^ h): three vector steps where a loop over
    // the lanes took eight scalar merges, most of this function's time.
    for (int h = 4; h >= 1; h /= 2) {
      const lanes_i32 partner = {0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h};
      const lanes_f32 f2 = __builtin_shuffle(first, partner), s2 = __builtin_shuffle(second, partner);
      const lanes_i32 above = first > f2, above2 = second > s2;
      const lanes_f32 low = above ? f2 : first, next = above2 ? second : s2;
      first = above ? first : f2;
      second = low > next ? low : next;
      nan |= __builtin_shuffle(nan, partner);
    }
    float f = first[0], s = second[0];
    bool any_nan = nan[0] != 0;
    for (; i < size; ++i) {
      const float x = v[i];
      any_nan |= x != x;
      s = x > f ? f : (x > s ? x : s);
      f = x > f ? x : f;
    }
    out[g] = any_nan ? NAN : (group_scoring == topk_router::kMax ? f : f + s);
  }
}

// The selected slots' scores (value, vmax [n * k], selected_slots) into w [n * k] for the
// sigmoid and the renormalised softmax: one flat loop, compiled per instruction set (in
// plain_rows_f32, which is not, it ran as SSE2).
MK_VECTORISE MK_ISA_CLONES void slot_scores(const float* __restrict value, const float* __restrict vmax, int64_t slots,
                                            int scoring, float* __restrict w) {
  if (scoring == kSigmoid) {
    for (int64_t j = 0; j < slots; ++j) w[j] = vec_math::sigmoid_torch(value[j]);
  } else {
    // softmax(x)_s / sum over the selected = exp(x_s - vmax) / sum over the selected.
    for (int64_t j = 0; j < slots; ++j) w[j] = vmax[j] == -INFINITY ? 0.0f : term_exp(value[j] - vmax[j]);
  }
}

// finish_weights of n rows of k slots, k fixed at compile time for the common k (K = 0: any).
template <int K>
MK_ALWAYS_INLINE void finish_rows(float* w, int64_t n, int64_t k_any, bool renormalize,
                                                       float scaling) {
  const int64_t k = K > 0 ? K : k_any;
  for (int64_t i = 0; i < n; ++i) topk_router::finish_weights(w + i * k, k, renormalize, scaling);
}

MK_ISA_CLONES void finish_block(float* w, int64_t n, int64_t k, bool renormalize, float scaling) {
  switch (k) {
    case 1: return finish_rows<1>(w, n, k, renormalize, scaling);
    case 2: return finish_rows<2>(w, n, k, renormalize, scaling);
    case 4: return finish_rows<4>(w, n, k, renormalize, scaling);
    case 8: return finish_rows<8>(w, n, k, renormalize, scaling);
    default: return finish_rows<0>(w, n, k, renormalize, scaling);
  }
}

// Renormalised weights of n rows (w [n * k]) times the scaling, a fully masked row (first weight
// 0) left +0.
inline void scale_rows(float* w, int64_t n, int64_t k, float scaling) {
  if (scaling == 1.0f) return;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i * k] == 0.0f) continue;
    for (int64_t s = 0; s < k; ++s) w[i * k + s] = scaling * w[i * k + s];
  }
}

// The common router (no bias, one group) in float32: a renormalised softmax's float32 rows in one
// pass where rows_top_renormalized_f32 runs; otherwise rows in blocks, selected by
// rows_top_pairs_f32, the selected scores of the whole block in flat loops that
// vectorise, then each row's finish_weights.
template <typename scalar_t>
MK_VECTORISE void plain_rows_f32(const scalar_t* logits, int64_t stride_t, int64_t stride_e,  // [T, E]
                                 int64_t begin, int64_t end, int64_t E, const RouterArgs& args,
                                 float* weights,      // [T, k] contiguous
                                 int64_t* experts) {  // [T, k] contiguous
  const int64_t k = args.k;
  const float scaling = (float)args.scaling;
  const bool direct = std::is_same_v<scalar_t, float> && stride_e == 1;  // float_rows: the logits themselves
  const bool renormalized_softmax = args.scoring == kSoftmax && args.renormalize;
  if constexpr (std::is_same_v<scalar_t, float>) {
    // Renormalised softmax: selection and weights in one pass over runs of rows where that runs
    // (it either runs for every run or for none), each run scaled while in the cache.
    if (direct && renormalized_softmax) {
      constexpr int64_t kRun = 1024;
      bool ran = true;
      for (int64_t t0 = begin; t0 < end && ran; t0 += kRun) {
        const int64_t n = std::min(kRun, end - t0);
        ran = rows_top_renormalized_f32(logits + t0 * stride_t, stride_t, n, E, k, experts + t0 * k, weights + t0 * k);
        if (ran) scale_rows(weights + t0 * k, n, k, scaling);
      }
      if (ran) return;
    }
  }
  const int64_t block = selection_block_rows(E, k, args.renormalize);
  std::vector<float> rows(direct ? 0 : block * E), exps(args.renormalize ? 0 : block * E), sums(block);
  std::vector<int64_t> best(block * k);
  std::vector<float> value(block * k), vmax(block * k);
  for (int64_t t0 = begin; t0 < end; t0 += block) {
    const int64_t n = std::min(block, end - t0);
    int64_t stride;
    const float* x = float_rows(logits, stride_t, stride_e, t0, n, E, rows.data(), &stride);
    const int64_t slots = n * k;
    float* w = weights + t0 * k;
    // Renormalised softmax: the weights from the pairs (renormalized_pairs_f32) where they run (AVX-512 F,
    // k <= 16; with the selection in one pass for 3 <= k <= 8 where that runs), times the scaling
    // as finish_weights multiplies it, and as there a fully masked row (its first weight 0: a
    // live row's is 1 / a sum of k terms in (0, 1]) stays +0 whatever the scaling (negative, or a
    // double that is inf as a float).
    if (renormalized_softmax && rows_top_renormalized_f32(x, stride, n, E, k, experts + t0 * k, w)) {
      scale_rows(w, n, k, scaling);
      continue;
    }
    rows_top_pairs_f32(x, stride, n, E, k, best.data());  // ranked by the logits
    if (renormalized_softmax && renormalized_pairs_f32(best.data(), n, k, experts + t0 * k, w)) {
      scale_rows(w, n, k, scaling);
      continue;
    }
    selected_slots(best.data(), n, k, experts + t0 * k, value.data(), vmax.data());
    if (args.scoring == kSoftmax && !args.renormalize) {
      // Full softmax: each selected slot's own term of its row's sum (softmax_terms_f32: the
      // sums' exp, bit for bit), divided by that sum: one rounding, and the row's weights are
      // exactly its terms over one denominator.
      rows_softmax_sums_f32(x, stride, n, E, vmax.data(), k, exps.data(), sums.data());
      softmax_terms_f32(value.data(), vmax.data(), slots, w);
      for (int64_t i = 0; i < n; ++i) {
        const bool masked = vmax[i * k] == -INFINITY;  // a fully masked row: weights 0 (its terms are NaN)
        for (int64_t s = 0; s < k; ++s) w[i * k + s] = masked ? 0.0f : w[i * k + s] / sums[i];
      }
    } else {
      slot_scores(value.data(), vmax.data(), slots, args.scoring, w);
    }
    finish_block(w, n, k, args.renormalize, scaling);
  }
}

// A row's scores into p [E] and the values its selection ranks into pool: choice = score + bias,
// and with groups only the topk_groups best groups' (rank order over group scores, lower group
// first on ties), gathered in ascending expert order so that the selection's "lower position
// first" is still "lower expert first", their experts into pool_id. Returns the pool's size.
template <typename acc_t>
int64_t scored_pool(const acc_t* x, const acc_t* bias, int64_t E, const RouterArgs& args, RowBuffers<acc_t>& buf,
                    acc_t* p, acc_t* pool, int64_t* pool_id) {
  const int64_t G = args.num_groups, size = E / G;
  all_scores(x, E, args.scoring, p);
  acc_t* choice = pool;
  for (int64_t e = 0; e < E; ++e) choice[e] = bias ? p[e] + bias[e] : p[e];
  if (!args.grouped()) return E;
  if constexpr (std::is_same_v<acc_t, float>) {
    group_scores_f32(choice, G, size, args.group_scoring, buf.group_scores.data());
  } else {
    for (int64_t g = 0; g < G; ++g) buf.group_scores[g] = topk_router::group_score(choice + g * size, size, args.group_scoring);
  }
  int64_t* order = buf.group_order.data();
  std::iota(order, order + G, 0);
  const acc_t* gs = buf.group_scores.data();
  std::partial_sort(order, order + args.topk_groups, order + G,
                    [gs](int64_t u, int64_t v) { return ranks_above(gs[u], u, gs[v], v); });
  std::sort(order, order + args.topk_groups);
  // Compacted in place: eligible groups are gathered in ascending order, never overtaking the
  // positions they read from (a group's values moved whole: an element-wise loop re-read
  // order[j] after every store, which might alias it, and was a third of the row's time for
  // DeepSeek-V3's router).
  int64_t n = 0;
  for (int64_t j = 0; j < args.topk_groups; ++j) {
    const int64_t first = order[j] * size;
    std::memmove(choice + n, choice + first, size * sizeof(acc_t));
    for (int64_t e = 0; e < size; ++e) pool_id[n + e] = first + e;
    n += size;
  }
  return n;
}

// The float32 router with a bias or groups, a block of rows at a time: each row's scores and
// pool (scored_pool), then the block's selections in one call (rows_top_pairs_f32, whose
// register selection a row at a time (select_top) does not reach), then the weights.
template <typename scalar_t>
void scored_rows_f32(const scalar_t* logits, int64_t stride_t, int64_t stride_e, const float* bias, int64_t begin,
                     int64_t end, int64_t E, const RouterArgs& args, float* weights, int64_t* experts) {
  constexpr int64_t kBlock = 16;  // rows_top8_blocks' block; larger measured no faster
  const int64_t k = args.k;
  RowBuffers<float> buf(E, args.num_groups);
  std::vector<float> scores(kBlock * E), pools(kBlock * E);
  std::vector<int64_t> ids(args.grouped() ? kBlock * E : 0), best(kBlock * k);
  for (int64_t t0 = begin; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    int64_t pool_size = E;
    for (int64_t i = 0; i < n; ++i) {
      const float* x = load_row<scalar_t, float>(logits + (t0 + i) * stride_t, stride_e, E, buf.x.data());
      pool_size = scored_pool(x, bias, E, args, buf, scores.data() + i * E, pools.data() + i * E,
                              args.grouped() ? ids.data() + i * E : nullptr);
    }
    rows_top_pairs_f32(pools.data(), E, n, pool_size, k, best.data());
    for (int64_t i = 0; i < n; ++i) {
      float* w = weights + (t0 + i) * k;
      int64_t* ex = experts + (t0 + i) * k;
      for (int64_t s = 0; s < k; ++s) {
        const int64_t pos = pair_index(best[i * k + s]);
        const int64_t e = args.grouped() ? ids[i * E + pos] : pos;
        ex[s] = e;
        w[s] = scores[i * E + e];
      }
      topk_router::finish_weights(w, k, args.renormalize, (float)args.scaling);
    }
  }
}

// Forward of rows [begin, end): float32 by plain_rows_f32 (no bias, one group) or scored_rows_f32,
// float64 a row at a time below.
template <typename scalar_t, typename acc_t>
void router_rows(const scalar_t* logits, int64_t stride_t, int64_t stride_e,  // [T, E]
                 const acc_t* bias,                                          // [E] or null
                 int64_t begin, int64_t end, int64_t E, const RouterArgs& args,
                 acc_t* weights,     // [T, k] contiguous
                 int64_t* experts) { // [T, k] contiguous
  const int64_t k = args.k, G = args.num_groups;
  const acc_t scaling = (acc_t)args.scaling;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (bias == nullptr && !args.grouped()) {
      plain_rows_f32<scalar_t>(logits, stride_t, stride_e, begin, end, E, args, weights, experts);
    } else {
      scored_rows_f32<scalar_t>(logits, stride_t, stride_e, bias, begin, end, E, args, weights, experts);
    }
    return;
  }
  RowBuffers<acc_t> buf(E, G);
  for (int64_t t = begin; t < end; ++t) {
    const acc_t* x = load_row<scalar_t, acc_t>(logits + t * stride_t, stride_e, E, buf.x.data());
    acc_t* w = weights + t * k;
    int64_t* ex = experts + t * k;
    int64_t* best = buf.best.data();
    if (bias == nullptr && !args.grouped()) {
      select_top(x, E, k, best);  // ranked by the logits
      if (args.scoring == kSigmoid) {
        for (int64_t s = 0; s < k; ++s) w[s] = sigmoid_of(x[best[s]]);
      } else {
        const acc_t vmax = x[best[0]];
        if (vmax == -INFINITY) {
          for (int64_t s = 0; s < k; ++s) w[s] = 0;
        } else if (args.renormalize) {
          // softmax(x)_s / sum over the selected = exp(x_s - vmax) / sum over the selected.
          for (int64_t s = 0; s < k; ++s) w[s] = term_exp(x[best[s]] - vmax);
        } else {
          const acc_t inv = acc_t(1) / exp_sum(x, E, vmax, buf.p.data());
          for (int64_t s = 0; s < k; ++s) w[s] = buf.p[best[s]] * inv;
        }
      }
      for (int64_t s = 0; s < k; ++s) ex[s] = best[s];
      topk_router::finish_weights(w, k, args.renormalize, scaling);
      continue;
    }
    acc_t* p = buf.p.data();
    acc_t* pool = buf.cand.data();
    const int64_t pool_size = scored_pool(x, bias, E, args, buf, p, pool, buf.cand_id.data());
    select_top(pool, pool_size, k, best);
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = args.grouped() ? buf.cand_id[best[s]] : best[s];
      ex[s] = e;
      w[s] = p[e];
    }
    topk_router::finish_weights(w, k, args.renormalize, scaling);
  }
}

// A float32 row's full-softmax gradient off the selection: out[e] = p[e] * scale, compiled per
// instruction set (in router_backward_rows, which is not, this loop ran as scalar SSE code: ~45%
// of that function's samples at E = 64, k = 8).
MK_VECTORISE MK_ISA_CLONES void scaled_row_f32(const float* __restrict p, int64_t E, float scale,
                                               float* __restrict out) {
  for (int64_t e = 0; e < E; ++e) out[e] = p[e] * scale;
}

// The full softmax's backward of rows [begin, end): grad_i = p_i (gp_i - dot), dot = sum_s gp_s
// p_s, gp_s = scaling * g_s, a block of rows at a time: every row's max and exp terms (float32:
// the forward's terms, backward_exp_sum), then every row's gradient, so that one row's chain (its
// sum, the division, k dependent products, the scaled row) overlaps the next rows' instead of
// waiting between two rows' exps.
template <typename scalar_t, typename acc_t, typename grad_t>
void full_softmax_backward_rows(const scalar_t* logits, int64_t stride_t, int64_t stride_e, const grad_t* grad_w,
                                const int64_t* experts, int64_t begin, int64_t end, int64_t E, acc_t scaling,
                                int64_t k, bool ranked_by_logits, scalar_t* grad) {
  const int64_t block = std::clamp<int64_t>(512 / std::max<int64_t>(E, 1), 1, 16);  // ~2 KiB of float terms
  std::vector<acc_t> rows(block * E), exps(block * E), vmax(block), sums(block), ps(k), gp(k);
  std::vector<const acc_t*> x(block);
  for (int64_t t0 = begin; t0 < end; t0 += block) {
    const int64_t n = std::min(block, end - t0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      for (int64_t s = 0; s < k; ++s) {
        const int64_t e = experts[t * k + s];
        TORCH_CHECK_INDEX(e >= 0 && e < E, "topk_router_backward: experts[", t, ", ", s, "] = ", e,
                          " is out of range for E = ", E);
      }
    }
    int64_t stride = E;
    if constexpr (std::is_same_v<acc_t, float>) {
      const float* rows_f32 = float_rows(logits, stride_t, stride_e, t0, n, E, rows.data(), &stride);
      for (int64_t i = 0; i < n; ++i) x[i] = rows_f32 + i * stride;
    } else {
      for (int64_t i = 0; i < n; ++i) x[i] = load_row<scalar_t, acc_t>(logits + (t0 + i) * stride_t, stride_e, E, rows.data() + i * E);
    }
    for (int64_t i = 0; i < n; ++i) {
      vmax[i] = ranked_by_logits ? x[i][experts[(t0 + i) * k]] : x[i][row_max_index(x[i], E)];
    }
    // The block's terms and sums in one call where it runs (rows_exp_terms_f32, AVX-512 F: the
    // rows' exp chains overlap); elsewhere row by row. A masked, NaN or +inf row's terms are not
    // used: its gradient is a fill below.
    bool block_terms = false;
    if constexpr (std::is_same_v<acc_t, float>) {
      block_terms = rows_exp_terms_f32(x[0], stride, n, E, vmax.data(), 1, exps.data(), sums.data());
    }
    for (int64_t i = 0; i < n && !block_terms; ++i) {
      if (vmax[i] != -INFINITY && vmax[i] == vmax[i] && vmax[i] != INFINITY) {
        sums[i] = backward_exp_sum(x[i], E, vmax[i], exps.data() + i * E);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      const int64_t* ex = experts + t * k;
      scalar_t* out = grad + t * E;
      if (vmax[i] == -INFINITY) {  // a fully masked token: scores 0, gradient 0
        std::fill_n(out, E, (scalar_t)0);
        continue;
      }
      if (vmax[i] != vmax[i] || vmax[i] == INFINITY) {
        // A NaN or +inf logit makes every softmax score of the row NaN (the reference's softmax
        // over the row), so every gradient of the row is NaN (docs/reliability.md).
        std::fill_n(out, E, (scalar_t)NAN);
        continue;
      }
      const acc_t* p = exps.data() + i * E;
      const acc_t inv = acc_t(1) / sums[i];
      acc_t dot = 0;
      for (int64_t s = 0; s < k; ++s) {
        ps[s] = p[ex[s]] * inv;
        gp[s] = scaling * (acc_t)grad_w[t * k + s];
        dot += gp[s] * ps[s];
      }
      const acc_t scale = -inv * dot;
      if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
        scaled_row_f32(p, E, scale, out);
      } else {
        for (int64_t e = 0; e < E; ++e) out[e] = (scalar_t)(p[e] * scale);
      }
      // Selected entries from their own acc_t value, rounded once (experts are distinct).
      for (int64_t s = 0; s < k; ++s) out[ex[s]] = (scalar_t)(ps[s] * (gp[s] - dot));
    }
  }
}

// Backward of rows [begin, end): d loss / d logits [T, E] from d loss / d weights [T, k]. The
// gradient depends on the selected experts only, not on how they were chosen (bias, groups).
//   sigmoid: grad_e = gp_e p_e (1 - p_e) at the selected e, 0 elsewhere;
//   softmax: grad_i = p_i (gp_i - sum_j gp_j p_j), gp zero outside the selected.
template <typename scalar_t, typename acc_t, typename grad_t>
void router_backward_rows(const scalar_t* logits, int64_t stride_t, int64_t stride_e,
                          const grad_t* grad_w,    // [T, k] contiguous
                          const int64_t* experts,  // [T, k] contiguous, ids checked in [0, E)
                          int64_t begin, int64_t end, int64_t E, const RouterArgs& args,
                          scalar_t* grad) {        // [T, E] contiguous
  const int64_t k = args.k;
  const acc_t scaling = (acc_t)args.scaling;
  if (args.scoring == kSoftmax && !args.renormalize) {
    full_softmax_backward_rows(logits, stride_t, stride_e, grad_w, experts, begin, end, E, scaling, k,
                               args.ranked_by_logits, grad);
    return;
  }
  RowBuffers<acc_t> buf(E, 1);
  std::vector<acc_t> ps(k), g(k), gp(k);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t* ex = experts + t * k;
    for (int64_t s = 0; s < k; ++s)
      TORCH_CHECK_INDEX(ex[s] >= 0 && ex[s] < E, "topk_router_backward: experts[", t, ", ", s, "] = ", ex[s],
                        " is out of range for E = ", E);
    scalar_t* out = grad + t * E;
    const acc_t* x = load_row<scalar_t, acc_t>(logits + t * stride_t, stride_e, E, buf.x.data());
    if (args.scoring == kSigmoid) {
      for (int64_t s = 0; s < k; ++s) {
        ps[s] = sigmoid_of(x[ex[s]]);
        g[s] = (acc_t)grad_w[t * k + s];
      }
      topk_router::weights_backward(ps.data(), g.data(), gp.data(), k, args.renormalize, scaling);
      // Zero off the selection, except at a NaN logit: the reference's sigmoid over the whole row
      // backpropagates 0 * sigmoid'(NaN) = NaN there (docs/reliability.md: a NaN input's gradient
      // is NaN, selected or not).
      for (int64_t e = 0; e < E; ++e) out[e] = (scalar_t)(x[e] != x[e] ? (acc_t)NAN : acc_t(0));
      for (int64_t s = 0; s < k; ++s) out[ex[s]] = (scalar_t)((acc_t)out[ex[s]] + gp[s] * ps[s] * (1 - ps[s]));
      continue;
    }
    const acc_t vmax = args.ranked_by_logits ? x[ex[0]] : x[row_max_index(x, E)];
    if (vmax == -INFINITY) {  // a fully masked token: scores 0, gradient 0
      std::fill_n(out, E, (scalar_t)0);
      continue;
    }
    if (vmax != vmax || vmax == INFINITY) {
      // A NaN or +inf logit makes every softmax score of the row NaN (the reference's softmax
      // over the row), so every gradient of the row is NaN, renormalised too
      // (docs/reliability.md); the cancelling shortcut below would give 0 off the selection.
      std::fill_n(out, E, (scalar_t)NAN);
      continue;
    }
    // Renormalised softmax (the full softmax went to full_softmax_backward_rows above).
    std::fill_n(out, E, (scalar_t)0);
    // scaling * softmax(x)_s / sum over the selected = scaling * exp(x_s) / sum over the selected
    // exps: the full softmax's terms cancel, and the gradient is zero off the selection.
    for (int64_t s = 0; s < k; ++s) {
      ps[s] = term_exp(x[ex[s]] - vmax);
      g[s] = (acc_t)grad_w[t * k + s];
    }
    topk_router::weights_backward(ps.data(), g.data(), gp.data(), k, true, scaling);
    for (int64_t s = 0; s < k; ++s) out[ex[s]] = (scalar_t)((acc_t)out[ex[s]] + gp[s] * ps[s]);
  }
}

// The softmax renormalised backward from the forward's float32 weights w = scaling * r (autograd
// saves a copy of them instead of the logits, ops/topk_router.py): renormalized_grad_rows,
// router_backward_rows' gradient without reading the logits, its rows
// apart told by the weights (all 0: gradient 0; a NaN first weight: NaN everywhere). All k weights
// are tested for 0, not the first alone: a bias can rank first an expert whose score is 0 (a
// masked or underflowing logit) while the others' are not. float32 rows compiled per instruction
// set, the fill loop kept inline.
MK_VECTORISE __attribute__((optimize("no-tree-loop-distribute-patterns"))) MK_ISA_CLONES void
router_grad_from_weights_f32(const float* __restrict w, const float* __restrict g, const int64_t* __restrict experts,
                             int64_t n, int64_t k, int64_t E, float scaling, float* __restrict out) {
  renormalized_grad_rows(w, g, experts, n, k, E, scaling, out);
}

template <typename out_t>
void router_grad_from_weights(const float* w, const float* g, const int64_t* experts, int64_t n, int64_t k, int64_t E,
                              float scaling, out_t* out) {
  renormalized_grad_rows(w, g, experts, n, k, E, scaling, out);
}

void router_grad_from_weights(const float* w, const float* g, const int64_t* experts, int64_t n, int64_t k, int64_t E,
                              float scaling, float* out) {
  router_grad_from_weights_f32(w, g, experts, n, k, E, scaling, out);
}

void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [T, E], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) <= INT32_MAX, op, ": need 1 <= E <= 2^31 - 1, got E = ",
              logits.size(1));
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble, op,
              ": logits must be float32, float16, bfloat16 or float64, got ", dt);
}

at::ScalarType compute_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

int64_t row_grain(int64_t E) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(E, 1)); }

std::tuple<at::Tensor, at::Tensor> topk_router_cpu(const at::Tensor& logits, int64_t k, std::string scoring,
                                                   const std::optional<at::Tensor>& bias, int64_t num_groups,
                                                   int64_t topk_groups, std::string group_scoring, bool renormalize,
                                                   double scaling_factor) {
  check_logits(logits, "topk_router");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(num_groups >= 1 && E % num_groups == 0, "topk_router: num_groups must divide E = ", E, ", got ",
              num_groups);
  TORCH_CHECK(topk_groups >= 1 && topk_groups <= num_groups, "topk_router: need 1 <= topk_groups <= num_groups = ",
              num_groups, ", got ", topk_groups);
  const int64_t eligible = topk_groups * (E / num_groups);
  TORCH_CHECK(k >= 1 && k <= eligible, "topk_router: need 1 <= k <= topk_groups * E / num_groups = ", eligible,
              ", got k = ", k);
  RouterArgs args{k, parse_scoring(scoring), parse_group_scoring(group_scoring), num_groups, topk_groups, renormalize,
               scaling_factor};
  TORCH_CHECK(!args.grouped() || args.group_scoring == topk_router::kMax || E / num_groups >= 2,
              "topk_router: group_scoring 'top2_sum' needs groups of >= 2 experts");
  const auto acc = compute_type(logits);
  at::Tensor bias_acc;  // [E] in the compute type
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == E, "topk_router: bias must be [E] = [", E, "], got ",
                bias->sizes());
    TORCH_CHECK(bias->device() == logits.device(), "topk_router: bias is on ", bias->device(), " but logits are on ",
                logits.device());
    TORCH_CHECK(at::isFloatingType(bias->scalar_type()), "topk_router: bias must be floating, got ",
                bias->scalar_type());
    bias_acc = bias->to(acc).contiguous();
  }
  auto weights = at::empty({T, k}, logits.options().dtype(acc));
  auto experts = at::empty({T, k}, logits.options().dtype(at::kLong));
  if (T == 0) return {weights, experts};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "topk_router", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(acc, "topk_router_acc", [&] {
      using acc_t = scalar_t;
      const acc_t* bias_ptr = bias_acc.defined() ? bias_acc.const_data_ptr<acc_t>() : nullptr;
      at::parallel_for(0, T, row_grain(E), [&](int64_t begin, int64_t end) {
        router_rows<logit_t, acc_t>(logits.const_data_ptr<logit_t>(), logits.stride(0), logits.stride(1), bias_ptr,
                                    begin, end, E, args, weights.mutable_data_ptr<acc_t>(),
                                    experts.mutable_data_ptr<int64_t>());
      });
    });
  });
  return {weights, experts};
}

at::Tensor topk_router_backward_cpu(const at::Tensor& grad_weights, const at::Tensor& logits,
                                    const at::Tensor& experts, std::string scoring, bool renormalize,
                                    double scaling_factor, bool ranked_by_logits) {
  check_logits(logits, "topk_router_backward");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == T && experts.scalar_type() == at::kLong,
              "topk_router_backward: experts must be int64 [T, k] with T = ", T, ", got ", experts.scalar_type(), " ",
              experts.sizes());
  TORCH_CHECK(grad_weights.sizes() == experts.sizes(), "topk_router_backward: grad_weights must be ", experts.sizes(),
              ", got ", grad_weights.sizes());
  TORCH_CHECK(at::isFloatingType(grad_weights.scalar_type()), "topk_router_backward: grad_weights must be floating");
  TORCH_CHECK(grad_weights.device() == logits.device() && experts.device() == logits.device(),
              "topk_router_backward: grad_weights, logits and experts must be on one device");
  const int64_t k = experts.size(1);
  TORCH_CHECK(k >= 1, "topk_router_backward: experts must have k >= 1 columns");
  RouterArgs args{k, parse_scoring(scoring), topk_router::kTop2Sum, 1, 1, renormalize, scaling_factor,
                  ranked_by_logits};
  auto grad = at::empty({T, E}, logits.options());
  if (T == 0) return grad;
  const auto g = grad_weights.contiguous();
  const auto ex = experts.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "topk_router_backward", [&] {
    using logit_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "topk_router_backward_g", [&] {
      using grad_t = scalar_t;
      auto run = [&](auto acc_tag) {
        using acc_t = decltype(acc_tag);
        at::parallel_for(0, T, row_grain(E), [&](int64_t begin, int64_t end) {
          router_backward_rows<logit_t, acc_t, grad_t>(logits.const_data_ptr<logit_t>(), logits.stride(0),
                                                       logits.stride(1), g.const_data_ptr<grad_t>(),
                                                       ex.const_data_ptr<int64_t>(), begin, end, E, args,
                                                       grad.mutable_data_ptr<logit_t>());
        });
      };
      if (compute_type(logits) == at::kDouble) run(double{}); else run(float{});
    });
  });
  return grad;
}

at::Tensor topk_router_backward_from_weights_cpu(const at::Tensor& grad_weights, const at::Tensor& weights,
                                                 const at::Tensor& experts, int64_t num_experts, double scaling_factor,
                                                 at::ScalarType dtype) {
  const char* op = "topk_router_backward_from_weights";
  const SavedWeights in = saved_weights(grad_weights, weights, experts, num_experts, op);
  const int64_t k = in.k, E = in.E;
  TORCH_CHECK(scaling_factor != 0.0, op, ": scaling_factor must not be 0 (the weights then say nothing of the scores)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
  auto grad_logits = at::empty({in.T, E}, weights.options().dtype(dtype));
  const float* weights_TK = in.w.const_data_ptr<float>();
  const float* grad_weights_TK = in.g.const_data_ptr<float>();
  const int64_t* experts_TK = in.ex.const_data_ptr<int64_t>();
  const float scaling = (float)scaling_factor;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "topk_router_backward_from_weights", [&] {
    scalar_t* grad_logits_TE = grad_logits.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, in.T, row_grain(E), [&](int64_t begin, int64_t end) {
      router_grad_from_weights(weights_TK + begin * k, grad_weights_TK + begin * k, experts_TK + begin * k,
                               end - begin, k, E, scaling, grad_logits_TE + begin * E);
    });
  });
  return grad_logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def(
      "topk_router(Tensor logits, int k, str scoring, Tensor? bias, int num_groups, int topk_groups, "
      "str group_scoring, bool renormalize, float scaling_factor) -> (Tensor weights, Tensor experts)");
  m.def(
      "topk_router_backward(Tensor grad_weights, Tensor logits, Tensor experts, str scoring, bool renormalize, "
      "float scaling_factor, bool ranked_by_logits) -> Tensor");
  m.def(
      "topk_router_backward_from_weights(Tensor grad_weights, Tensor weights, Tensor experts, int num_experts, "
      "float scaling_factor, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("topk_router", &topk_router_cpu);
  m.impl("topk_router_backward", &topk_router_backward_cpu);
  m.impl("topk_router_backward_from_weights", &topk_router_backward_from_weights_cpu);
}

}  // namespace moe_kernels
