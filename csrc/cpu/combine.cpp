// combine on CPU: y[t] = sum over kept s of weights[t, s] * buffer[experts[t, s], positions[t, s]],
// one task per token (no atomics, fixed summation order s = 0, 1, ...). Backward: grad_buffer is
// the weighted gather grad_y[t] * weights[t, s] into each kept slot (zero elsewhere), and
// grad_weights[t, s] = <grad_y[t], buffer[experts[t, s], positions[t, s]]> (0 if not kept), both
// in one pass over the slots so each grad_y row is read once per kept choice.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rows/routing_rows.h"

namespace moe_kernels {
namespace {

void check_combine(const char* op, const at::Tensor& buffer, const at::Tensor& experts, const at::Tensor& positions,
                   const at::Tensor& weights) {
  TORCH_CHECK(buffer.dim() == 3, op, ": buffer must be [E, C, d], got ", buffer.sizes());
  TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == at::kLong, op, ": experts must be [T, k] int64, got ",
              experts.sizes(), " ", experts.scalar_type());
  TORCH_CHECK(positions.sizes() == experts.sizes() && positions.scalar_type() == at::kLong, op,
              ": positions must be int64 of the shape of experts ", experts.sizes(), ", got ", positions.sizes());
  TORCH_CHECK(weights.sizes() == experts.sizes() && at::isFloatingType(weights.scalar_type()), op,
              ": weights must be float of the shape of experts ", experts.sizes(), ", got ", weights.sizes(), " ",
              weights.scalar_type());
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor combine_cpu(const at::Tensor& buffer_in, const at::Tensor& experts_in, const at::Tensor& positions_in,
                       const at::Tensor& weights_in) {
  check_combine("combine", buffer_in, experts_in, positions_in, weights_in);
  const int64_t E = buffer_in.size(0), C = buffer_in.size(1), d = buffer_in.size(2);
  const int64_t T = experts_in.size(0), k = experts_in.size(1);
  const at::Tensor buffer = buffer_in.contiguous(), experts = experts_in.contiguous(),
                   positions = positions_in.contiguous();
  const at::Tensor w = weights_in.to(acc_type(buffer.scalar_type())).contiguous();
  auto y = at::empty({T, d}, buffer.options());
  if (y.numel() == 0) return y;
  const auto slot =
      routing_rows::kept_slots(experts.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(), T * k, E, C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "combine", [&] {
    using acc = routing_rows::acc_t<scalar_t>;
    routing_rows::gather_sum<scalar_t>(y.mutable_data_ptr<scalar_t>(), T, k, buffer.const_data_ptr<scalar_t>(),
                                       slot.data(), w.const_data_ptr<acc>(), d);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> combine_backward_cpu(const at::Tensor& grad_y_in, const at::Tensor& buffer_in,
                                                        const at::Tensor& experts_in, const at::Tensor& positions_in,
                                                        const at::Tensor& weights_in) {
  check_combine("combine_backward", buffer_in, experts_in, positions_in, weights_in);
  const int64_t E = buffer_in.size(0), C = buffer_in.size(1), d = buffer_in.size(2);
  const int64_t T = experts_in.size(0), k = experts_in.size(1);
  TORCH_CHECK(grad_y_in.dim() == 2 && grad_y_in.size(0) == T && grad_y_in.size(1) == d,
              "combine_backward: grad_y must be [T, d] = [", T, ", ", d, "], got ", grad_y_in.sizes());
  TORCH_CHECK(grad_y_in.scalar_type() == buffer_in.scalar_type(), "combine_backward: grad_y must have buffer's dtype");
  const at::Tensor g = grad_y_in.contiguous(), buffer = buffer_in.contiguous(), experts = experts_in.contiguous(),
                   positions = positions_in.contiguous();
  const at::Tensor w = weights_in.to(acc_type(buffer.scalar_type())).contiguous();
  auto grad_buffer = at::empty({E, C, d}, buffer.options());
  auto grad_weights = at::empty({T, k}, w.options());  // accumulation type; cast to weights' dtype below
  const auto slot =
      routing_rows::kept_slots(experts.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(), T * k, E, C);
  const auto source = routing_rows::invert(slot.data(), T * k, E * C);  // slot -> choice
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buffer.scalar_type(), "combine_backward", [&] {
    using acc = routing_rows::acc_t<scalar_t>;
    acc* gw = grad_weights.mutable_data_ptr<acc>();
    std::fill(gw, gw + T * k, acc(0));  // choices that own no slot (dropped, empty) get 0
    if (grad_buffer.numel())
      routing_rows::scatter_grad_and_dots<scalar_t>(grad_buffer.mutable_data_ptr<scalar_t>(), gw, E * C,
                                                    g.const_data_ptr<scalar_t>(), buffer.const_data_ptr<scalar_t>(),
                                                    source.data(), k, w.const_data_ptr<acc>(), d);
  });
  return {grad_buffer, grad_weights.to(weights_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("combine(Tensor buffer, Tensor experts, Tensor positions, Tensor weights) -> Tensor");
  m.def(
      "combine_backward(Tensor grad_y, Tensor buffer, Tensor experts, Tensor positions, Tensor weights) -> "
      "(Tensor grad_buffer, Tensor grad_weights)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("combine", &combine_cpu);
  m.impl("combine_backward", &combine_backward_cpu);
}

}  // namespace moe_kernels
