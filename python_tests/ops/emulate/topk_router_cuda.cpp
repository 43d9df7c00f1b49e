// Host emulation of the CUDA topk_router kernels (csrc/cuda/topk_router.cu): the same row
// algorithm (moe_kernels/topk_router_row.h) with an executor that runs the 32 lanes of a warp one
// after another and combines their partial results in the device's butterfly order (lane l takes
// lane l ^ offset's value, offsets 16, 8, 4, 2, 1), so sums round exactly as on the device. A
// reduction whose lanes ended with different results (a divergent warp on the device) aborts.
// Built as a shared library and called through ctypes by
// python_tests/ops/test_topk_router_cuda_emulation.py.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "moe_kernels/topk_router_row.h"

namespace tr = moe_kernels::topk_router;

namespace {

constexpr int kLanes = 32;

struct HostWarp {
  bool leader() const { return true; }
  void sync() const {}
  template <class F>
  void items(int64_t n, F f) const {
    for (int lane = 0; lane < kLanes; ++lane)
      for (int64_t i = lane; i < n; i += kLanes) f(i);
  }
  template <typename V, class C>
  static void butterfly(V* v, C combine) {
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
      V next[kLanes];
      for (int l = 0; l < kLanes; ++l) next[l] = combine(v[l], v[l ^ offset]);
      for (int l = 0; l < kLanes; ++l) v[l] = next[l];
    }
  }
  template <typename T, class F>
  tr::Ranked<T> best(int64_t n, F f) const {
    tr::Ranked<T> v[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      v[l] = tr::no_candidate<T>();
      for (int64_t i = l; i < n; i += kLanes) v[l] = tr::better(v[l], f(i));
    }
    butterfly(v, [](const tr::Ranked<T>& a, const tr::Ranked<T>& b) { return tr::better(a, b); });
    for (int l = 1; l < kLanes; ++l)
      if (v[l].index != v[0].index) abort();
    return v[0];
  }
  template <typename T, class F>
  T sum(int64_t n, F f) const {
    T v[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      v[l] = 0;
      for (int64_t i = l; i < n; i += kLanes) v[l] += f(i);
    }
    butterfly(v, [](T a, T b) { return a + b; });
    for (int l = 1; l < kLanes; ++l)
      if (!(v[l] == v[0]) && !(v[l] != v[l] && v[0] != v[0])) abort();
    return v[0];
  }
  template <typename T, class F>
  tr::Top2<T> top2(int64_t n, F f) const {
    tr::Top2<T> v[kLanes];
    for (int l = 0; l < kLanes; ++l)
      for (int64_t i = l; i < n; i += kLanes) v[l].push(f(i));
    butterfly(v, [](const tr::Top2<T>& a, const tr::Top2<T>& b) { return a.merged(b); });
    return v[0];  // lanes may differ only in the sign of a zero, which ranks equal
  }
};

template <typename T>
int forward(const T* logits, int64_t T_, int64_t stride_t, int64_t stride_e, const T* bias, tr::RowParams a,
            T* weights, int64_t* experts) {
  if (a.grouped() && a.num_groups > tr::kMaxGroups) return 1;  // the launcher's cudaErrorInvalidValue
  T group_scores[tr::kMaxGroups];
  for (int64_t t = 0; t < T_; ++t) {
    const T* row = logits + t * stride_t;
    auto x = [&](int64_t e) { return row[e * stride_e]; };
    tr::router_row(HostWarp{}, x, bias, a, group_scores, weights + t * a.k, experts + t * a.k);
  }
  return 0;
}

template <typename T>
int backward(const T* grad_weights, const T* logits, int64_t T_, int64_t stride_t, int64_t stride_e,
             const int64_t* experts, tr::RowParams a, T* grad) {
  for (int64_t t = 0; t < T_; ++t) {
    const T* row = logits + t * stride_t;
    T* out_row = grad + t * a.E;
    auto x = [&](int64_t e) { return row[e * stride_e]; };
    auto g = [&](int64_t s) { return grad_weights[t * a.k + s]; };
    auto out = [&](int64_t e, T v) { out_row[e] = v; };
    tr::router_backward_row<T>(HostWarp{}, x, g, experts + t * a.k, a, out);
  }
  return 0;
}

}  // namespace

extern "C" {

// double_precision: 0 = float32 arrays (the device's compute type for fp32/fp16/bf16), 1 = float64.
int router_forward(int double_precision, const void* logits, int64_t T, int64_t E, int64_t stride_t,
                   int64_t stride_e, const void* bias, int64_t k, int scoring, int group_scoring, int64_t num_groups,
                   int64_t topk_groups, int renormalize, double scaling, void* weights, int64_t* experts) {
  const tr::RowParams a{E, k, scoring, group_scoring, num_groups, topk_groups, renormalize != 0, scaling};
  if (double_precision)
    return forward(static_cast<const double*>(logits), T, stride_t, stride_e, static_cast<const double*>(bias), a,
                   static_cast<double*>(weights), experts);
  return forward(static_cast<const float*>(logits), T, stride_t, stride_e, static_cast<const float*>(bias), a,
                 static_cast<float*>(weights), experts);
}

int router_backward(int double_precision, const void* grad_weights, const void* logits, int64_t T, int64_t E,
                    int64_t stride_t, int64_t stride_e, const int64_t* experts, int64_t k, int scoring,
                    int renormalize, double scaling, void* grad) {
  const tr::RowParams a{E, k, scoring, 0, 1, 1, renormalize != 0, scaling};
  if (double_precision)
    return backward(static_cast<const double*>(grad_weights), static_cast<const double*>(logits), T, stride_t,
                    stride_e, experts, a, static_cast<double*>(grad));
  return backward(static_cast<const float*>(grad_weights), static_cast<const float*>(logits), T, stride_t, stride_e,
                  experts, a, static_cast<float*>(grad));
}

}  // extern "C"
