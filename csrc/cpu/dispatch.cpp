// dispatch on CPU: scatter tokens into the [E, C, d] expert buffers. Each token's row is read once
// and copied to the slots its kept choices own; every buffer row (filled or zero) is written by one
// task, so no atomics are needed. Backward: the gather-sum grad_x[t] = sum over kept s of grad_buffer[experts[t, s], positions[t, s]].
#include <ATen/Dispatch.h>
#include <algorithm>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rows/routing_rows.h"

namespace moe_kernels {
namespace {

void check_routing(const char* op, const at::Tensor& experts, const at::Tensor& positions, int64_t T) {
  TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == at::kLong, op, ": experts must be [T, k] int64, got ",
              experts.sizes(), " ", experts.scalar_type());
  TORCH_CHECK(positions.sizes() == experts.sizes() && positions.scalar_type() == at::kLong, op,
              ": positions must be int64 of the shape of experts ", experts.sizes(), ", got ", positions.sizes(), " ",
              positions.scalar_type());
  TORCH_CHECK(experts.size(0) == T, op, ": experts must have T = ", T, " rows, got ", experts.size(0));
}

at::Tensor dispatch_cpu(const at::Tensor& x_in, const at::Tensor& experts_in, const at::Tensor& positions_in,
                        int64_t num_experts, int64_t capacity) {
  TORCH_CHECK(x_in.dim() == 2, "dispatch: x must be [T, d], got ", x_in.sizes());
  TORCH_CHECK(num_experts >= 1 && capacity >= 0, "dispatch: need num_experts >= 1 and capacity >= 0");
  const int64_t T = x_in.size(0), d = x_in.size(1), E = num_experts, C = capacity;
  check_routing("dispatch", experts_in, positions_in, T);
  const int64_t k = experts_in.size(1);
  const at::Tensor x = x_in.contiguous(), experts = experts_in.contiguous(), positions = positions_in.contiguous();
  auto buffer = at::empty({E, C, d}, x.options());
  if (buffer.numel() == 0) return buffer;
  const auto slot =
      routing_rows::kept_slots(experts.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(), T * k, E, C);
  const auto source = routing_rows::invert(slot.data(), T * k, E * C);  // slot -> choice
  // Two kept choices on one slot would leave one of them silently unrouted: refused (a ValueError
  // in Python). Counting costs one pass over the ids and one over the slots, no sort.
  const int64_t kept = std::count_if(slot.begin(), slot.end(), [](int64_t r) { return r >= 0; });
  const int64_t filled = std::count_if(source.begin(), source.end(), [](int64_t j) { return j >= 0; });
  TORCH_CHECK_VALUE(kept == filled, "dispatch: positions put ", kept - filled,
                    " kept choice(s) on a slot another choice of the same expert already holds; positions must be "
                    "unique per expert (as capacity_positions returns them)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dispatch", [&] {
    routing_rows::scatter_rows<scalar_t>(buffer.mutable_data_ptr<scalar_t>(), E * C, x.const_data_ptr<scalar_t>(), T,
                                         k, slot.data(), source.data(), d);
  });
  return buffer;
}

at::Tensor dispatch_backward_cpu(const at::Tensor& grad_buffer_in, const at::Tensor& experts_in,
                                 const at::Tensor& positions_in) {
  TORCH_CHECK(grad_buffer_in.dim() == 3, "dispatch_backward: grad_buffer must be [E, C, d], got ",
              grad_buffer_in.sizes());
  const int64_t E = grad_buffer_in.size(0), C = grad_buffer_in.size(1), d = grad_buffer_in.size(2);
  const int64_t T = experts_in.size(0);
  check_routing("dispatch_backward", experts_in, positions_in, T);
  const int64_t k = experts_in.size(1);
  const at::Tensor g = grad_buffer_in.contiguous(), experts = experts_in.contiguous(),
                   positions = positions_in.contiguous();
  auto grad_x = at::empty({T, d}, g.options());
  if (grad_x.numel() == 0) return grad_x;
  const auto slot =
      routing_rows::kept_slots(experts.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(), T * k, E, C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "dispatch_backward", [&] {
    routing_rows::gather_sum<scalar_t>(grad_x.mutable_data_ptr<scalar_t>(), T, k, g.const_data_ptr<scalar_t>(),
                                       slot.data(), nullptr, d);
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("dispatch(Tensor x, Tensor experts, Tensor positions, int num_experts, int capacity) -> Tensor");
  m.def("dispatch_backward(Tensor grad_buffer, Tensor experts, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("dispatch", &dispatch_cpu);
  m.impl("dispatch_backward", &dispatch_backward_cpu);
}

}  // namespace moe_kernels
