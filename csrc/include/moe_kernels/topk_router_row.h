// topk_router's row algorithm for the CUDA kernels (csrc/cuda/topk_router.cu), written once over a
// warp executor so that the host emulation (python_tests/ops/emulate/topk_router_cuda.cpp) runs this
// very code, reductions in the device's butterfly order, against the reference. No torch headers.
//
// One warp owns a row. Every step is either a reduction over the row (the warp's lanes take
// strided shares, then a butterfly: every lane ends with the same value) or a store spread over
// the lanes, so the control flow is uniform across the warp. Selection is k rounds of "the
// rank-largest candidate below the previous pick" (ranks_above: NaN first, ties to the lower
// index), so no sort and no per-lane state survives a round. Scores and choice values are
// recomputed from the logits in each round rather than kept: a row of any E fits.
//
// Executor `w` (device: one warp, lane = threadIdx.x % 32; host: a loop over the 32 lanes):
//   w.items(n, f)        f(i) for this lane's share of i in [0, n) (stores)
//   w.best<T>(n, f)      the better() of f(i) over [0, n)   (f returns Ranked<T>, index -1 = none)
//   w.sum<T>(n, f)       the sum of f(i) over [0, n)
//   w.top2<T>(n, f)      the Top2 of f(i) over [0, n)
//   w.leader()           true on exactly one lane;  w.sync(): the warp's stores are visible
#pragma once
#include <math.h>
#include <stdint.h>

#include "moe_kernels/topk_router.h"

namespace moe_kernels {
namespace topk_router {

// The CUDA kernels keep the eligible groups in a 64-bit mask and the group scores in 64 slots of
// shared memory; more groups go to the reference (moe_kernels/ops/topk_router.py).
constexpr int64_t kMaxGroups = 64;

// The arguments of one call, as the kernels see them.
struct RowParams {
  int64_t E, k;
  int scoring, group_scoring;
  int64_t num_groups, topk_groups;
  bool renormalize;
  double scaling;
  MK_HD bool grouped() const { return topk_groups < num_groups; }
};

template <typename T>
struct Ranked {
  T value;
  int64_t index;  // -1: no candidate
};

template <typename T>
MK_HD Ranked<T> no_candidate() {
  return Ranked<T>{T(0), -1};
}

// The rank-larger of two candidates (a total order on distinct indices: the reduction's result
// does not depend on the order the lanes combine in).
template <typename T>
MK_HD Ranked<T> better(const Ranked<T>& a, const Ranked<T>& b) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  return ranks_above(a.value, a.index, b.value, b.index) ? a : b;
}

MK_HD float exp_of(float x) { return expf(x); }
MK_HD double exp_of(double x) { return exp(x); }
// torch.sigmoid's formula; below -88.72283172607422f (where e^-x overflows float32 and torch gives
// exactly 0) 0 explicitly, so that an expf a rounding away from overflow there cannot leave a
// denormal score the CPU reference does not have (docs/reliability.md, "Tails").
MK_HD float sigmoid_of(float x) { return x < -88.72283172607422f ? 0.0f : 1.0f / (1.0f + expf(-x)); }
MK_HD double sigmoid_of(double x) { return 1.0 / (1.0 + exp(-x)); }

// The row's scores: sigmoid, or the softmax with its shift and normaliser found by two reductions
// (a row whose largest logit is -inf scores 0 everywhere, as on the CPU).
template <class Exec, typename T, class X>
struct RowScores {
  const Exec& w;
  const X& x;
  int scoring;
  T vmax = 0, inv = 0;
  MK_HD RowScores(const Exec& w_, const X& x_, int64_t E, int scoring_) : w(w_), x(x_), scoring(scoring_) {
    if (scoring == kSigmoid) return;
    vmax = w.template best<T>(E, [&](int64_t e) { return Ranked<T>{x(e), e}; }).value;
    if (vmax != -INFINITY) inv = T(1) / w.template sum<T>(E, [&](int64_t e) { return exp_of(x(e) - vmax); });
  }
  MK_HD T operator()(int64_t e) const {
    if (scoring == kSigmoid) return sigmoid_of(x(e));
    return vmax == -INFINITY ? T(0) : exp_of(x(e) - vmax) * inv;
  }
};

// Forward of one row: experts [k] and weights [k] (finish_weights applied), x(e) the logit of
// expert e as T, bias [E] or null, group_scores: kMaxGroups slots of scratch the warp shares.
template <class Exec, typename T, class X>
MK_HD void router_row(const Exec& w, const X& x, const T* bias, const RowParams& a, T* group_scores, T* weights,
                      int64_t* experts) {
  const int64_t E = a.E, k = a.k;
  Ranked<T> prev = no_candidate<T>();
  auto below_prev = [&](const Ranked<T>& c) {
    return prev.index < 0 || ranks_above(prev.value, prev.index, c.value, c.index);
  };
  if (bias == nullptr && !a.grouped()) {
    // Ranked by the logits (the reference's rule); the scores only where the weights need them.
    T vmax = 0, inv = 1;
    for (int64_t s = 0; s < k; ++s) {
      const Ranked<T> top = w.template best<T>(E, [&](int64_t e) {
        const Ranked<T> c{x(e), e};
        return below_prev(c) ? c : no_candidate<T>();
      });
      prev = top;
      T p;
      if (a.scoring == kSigmoid) {
        p = sigmoid_of(top.value);
      } else {
        if (s == 0) {
          vmax = top.value;
          if (!a.renormalize && vmax != -INFINITY)
            inv = T(1) / w.template sum<T>(E, [&](int64_t e) { return exp_of(x(e) - vmax); });
        }
        // renormalize: exp(x_s - vmax) / their sum, the full softmax's normaliser cancels.
        p = vmax == -INFINITY ? T(0) : exp_of(top.value - vmax) * (a.renormalize ? T(1) : inv);
      }
      if (w.leader()) {
        experts[s] = top.index;
        weights[s] = p;
      }
    }
    if (w.leader()) finish_weights(weights, k, a.renormalize, (T)a.scaling);
    return;
  }
  const RowScores<Exec, T, X> score(w, x, E, a.scoring);
  auto choice = [&](int64_t e) { return bias ? score(e) + bias[e] : score(e); };
  const int64_t size = E / a.num_groups;
  uint64_t eligible = ~uint64_t(0);
  if (a.grouped()) {
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const T gs = w.template top2<T>(size, [&](int64_t i) { return choice(g * size + i); }).score(a.group_scoring);
      if (w.leader()) group_scores[g] = gs;
    }
    w.sync();
    eligible = 0;
    Ranked<T> prev_group = no_candidate<T>();
    for (int64_t j = 0; j < a.topk_groups; ++j) {
      const Ranked<T> top = w.template best<T>(a.num_groups, [&](int64_t g) {
        const Ranked<T> c{group_scores[g], g};
        return prev_group.index < 0 || ranks_above(prev_group.value, prev_group.index, c.value, c.index)
                   ? c
                   : no_candidate<T>();
      });
      prev_group = top;
      eligible |= uint64_t(1) << top.index;
    }
  }
  for (int64_t s = 0; s < k; ++s) {
    const Ranked<T> top = w.template best<T>(E, [&](int64_t e) {
      if (!((eligible >> (a.grouped() ? e / size : 0)) & 1)) return no_candidate<T>();
      const Ranked<T> c{choice(e), e};
      return below_prev(c) ? c : no_candidate<T>();
    });
    prev = top;
    const T p = score(top.index);  // the weight is the score, never the bias
    if (w.leader()) {
      experts[s] = top.index;
      weights[s] = p;
    }
  }
  if (w.leader()) finish_weights(weights, k, a.renormalize, (T)a.scaling);
}

// Backward of one row: d loss / d logits, stored through out(e, value), from g(s) = d loss / d
// weights[s]. Selected experts outside [0, E) are skipped (no memory is touched for them): the
// public op never produces them, and the CPU kernel raises an IndexError for them.
template <typename T, class Exec, class X, class G, class Out>
MK_HD void router_backward_row(const Exec& w, const X& x, const G& g, const int64_t* experts, const RowParams& a,
                               const Out& out) {
  const int64_t E = a.E, k = a.k;
  const T scaling = (T)a.scaling;
  auto valid = [&](int64_t s) { return experts[s] >= 0 && experts[s] < E; };
  T vmax = 0;
  if (a.scoring == kSoftmax) {
    vmax = w.template best<T>(E, [&](int64_t e) { return Ranked<T>{x(e), e}; }).value;
    if (vmax == -INFINITY) {  // a fully masked token: scores 0, gradient 0
      w.items(E, [&](int64_t e) { out(e, T(0)); });
      return;
    }
    if (vmax != vmax || vmax == INFINITY) {
      // A NaN or +inf logit makes every softmax score of the row NaN (the reference's softmax
      // over the row), so every gradient of the row is NaN, renormalised or not
      // (docs/reliability.md); the cancelling shortcut below would give 0 off the selection.
      w.items(E, [&](int64_t e) { out(e, T(NAN)); });
      return;
    }
  }
  if (a.scoring == kSigmoid || a.renormalize) {
    // The gradient is zero off the selection: p_s = sigmoid(x_s), or exp(x_s - vmax) whose
    // renormalised ratio is the softmax's (its normaliser cancels). finish_weights' backward:
    // gp_s = scaling / S (g_s - sum_j g_j p_j / S), S = sum(p) (0 when S == 0), or scaling * g_s.
    auto p = [&](int64_t s) -> T {
      if (!valid(s)) return T(0);
      const T v = x(experts[s]);
      return a.scoring == kSigmoid ? sigmoid_of(v) : exp_of(v - vmax);
    };
    T total = 1, dot = 0;
    if (a.renormalize) {
      total = 0;
      for (int64_t s = 0; s < k; ++s) total += p(s);
      for (int64_t s = 0; s < k; ++s) dot += g(s) * (p(s) / total);
    }
    // Zero off the selection, except at a NaN logit (sigmoid: the reference backpropagates
    // 0 * sigmoid'(NaN) = NaN there; a softmax row with a NaN returned above).
    w.items(E, [&](int64_t e) {
      const T v = x(e);
      out(e, v != v ? T(NAN) : T(0));
    });
    w.sync();
    w.items(k, [&](int64_t s) {
      if (!valid(s)) return;
      const T ps = p(s);
      T gp = scaling * g(s);
      if (a.renormalize) gp = total == 0 ? T(0) : scaling / total * (g(s) - dot);
      out(experts[s], a.scoring == kSigmoid ? gp * ps * (1 - ps) : gp * ps);
    });
    return;
  }
  // Full softmax: grad_i = p_i (gp_i - dot), dot = sum_s gp_s p_s, gp_s = scaling * g_s.
  const T inv = T(1) / w.template sum<T>(E, [&](int64_t e) { return exp_of(x(e) - vmax); });
  auto p = [&](int64_t s) { return valid(s) ? exp_of(x(experts[s]) - vmax) * inv : T(0); };
  T dot = 0;
  for (int64_t s = 0; s < k; ++s) dot += scaling * g(s) * p(s);
  const T scale = -inv * dot;
  w.items(E, [&](int64_t e) { out(e, exp_of(x(e) - vmax) * scale); });
  w.sync();
  w.items(k, [&](int64_t s) {
    if (valid(s)) out(experts[s], p(s) * (scaling * g(s) - dot));
  });
}

}  // namespace topk_router
}  // namespace moe_kernels
