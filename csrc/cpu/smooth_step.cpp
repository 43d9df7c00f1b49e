// Smooth-step S(t) (DSelect-k, Section 3.1.3) and its fused backward on CPU, elementwise.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "moe_kernels/dselect_k.h"

namespace moe_kernels {
namespace {

constexpr int64_t kGrain = 32768;

void check(const at::Tensor& t, double gamma, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              op, ": t must be float32, float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(gamma > 0 && std::isfinite(gamma), op, ": gamma must be positive and finite, got ", gamma);
}

at::Tensor smooth_step_cpu(const at::Tensor& t, double gamma) {
  check(t, gamma, "smooth_step");
  const auto x = t.contiguous();
  auto out = at::empty(t.sizes(), t.options());
  const auto p = dselect_k::smooth_step_params(gamma);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "smooth_step", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = (scalar_t)dselect_k::smooth_step((float)in[i], p);
    });
  });
  return out;
}

at::Tensor smooth_step_backward_cpu(const at::Tensor& grad, const at::Tensor& t, double gamma) {
  check(t, gamma, "smooth_step_backward");
  TORCH_CHECK(grad.sizes() == t.sizes(), "smooth_step_backward: grad and t must have the same shape");
  const auto x = t.contiguous();
  const auto g = grad.contiguous();
  auto out = at::empty(t.sizes(), t.options());
  const auto p = dselect_k::smooth_step_params(gamma);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "smooth_step_backward", [&] {
    using t_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "smooth_step_backward_g", [&] {
      const t_t* in = x.const_data_ptr<t_t>();
      const scalar_t* gi = g.const_data_ptr<scalar_t>();
      t_t* o = out.mutable_data_ptr<t_t>();
      at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          o[i] = (t_t)dselect_k::smooth_step_chain((float)gi[i], (float)in[i], p);
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("smooth_step(Tensor t, float gamma) -> Tensor");
  m.def("smooth_step_backward(Tensor grad, Tensor t, float gamma) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("smooth_step", &smooth_step_cpu);
  m.impl("smooth_step_backward", &smooth_step_backward_cpu);
}

}  // namespace moe_kernels
