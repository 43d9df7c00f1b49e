// Dropless permute / unpermute on CPU.
// permute: stable_column_ranks numbers each expert's choices in flat order t * k + s (so rows are
// stable by token), empty choices forming a trailing column; then each output row gathers its
// token's row. unpermute: the inverse of `order` gives every choice its row, and one task per
// token sums its rows (no atomics). unpermute_backward: grad_y_sorted[r] = w[order[r]] *
// grad_y[order[r] / k] and grad_weights[t, s] = <grad_y[t], y_sorted[row of (t, s)]>.
// permute's backward is unpermute with unit weights (see moe_kernels/ops/permute.py).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rows/routing_rows.h"

namespace moe_kernels {
namespace {

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_cpu(const at::Tensor& x_in, const at::Tensor& experts_in,
                                                           int64_t num_experts) {
  TORCH_CHECK(x_in.dim() == 2, "permute: x must be [T, d], got ", x_in.sizes());
  TORCH_CHECK(experts_in.dim() == 2 && experts_in.scalar_type() == at::kLong && experts_in.size(0) == x_in.size(0),
              "permute: experts must be [T, k] int64 with T = ", x_in.size(0), ", got ", experts_in.sizes(), " ",
              experts_in.scalar_type());
  TORCH_CHECK(num_experts >= 1, "permute: num_experts must be >= 1, got ", num_experts);
  const int64_t T = x_in.size(0), d = x_in.size(1), k = experts_in.size(1), n = T * k, E = num_experts;
  const at::Tensor x = x_in.contiguous(), experts = experts_in.contiguous();
  auto x_sorted = at::empty({n, d}, x.options());
  auto offsets = at::empty({E + 1}, experts.options());
  auto order = at::empty({n}, experts.options());
  const int64_t* ex = experts.const_data_ptr<int64_t>();
  int64_t* off = offsets.mutable_data_ptr<int64_t>();
  int64_t* ord = order.mutable_data_ptr<int64_t>();
  // Column E collects the empty choices (and, defensively, out-of-range experts): trailing rows.
  std::vector<int64_t> counts(E + 1), start(E + 1);
  std::vector<int64_t> rank(n);
  routing_rows::stable_column_ranks(
      n, E + 1,
      [&](int64_t j) {
        const int64_t e = ex[j];
        return e >= 0 && e < E ? e : E;
      },
      [&](int64_t j, int64_t, int64_t r) { rank[j] = r; }, counts.data());
  int64_t running = 0;
  for (int64_t e = 0; e <= E; ++e) {
    start[e] = running;
    off[e] = running;
    running += counts[e];
  }
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t e = ex[j];
      const bool valid = e >= 0 && e < E;
      ord[start[valid ? e : E] + rank[j]] = valid ? j : -1;
    }
  });
  if (x_sorted.numel())
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "permute", [&] {
      routing_rows::gather_rows<scalar_t>(x_sorted.mutable_data_ptr<scalar_t>(), n, x.const_data_ptr<scalar_t>(), ord,
                                          k, nullptr, d);
    });
  return {x_sorted, offsets, order};
}

void check_unpermute(const char* op, const at::Tensor& y_sorted, const at::Tensor& order, const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 2 && at::isFloatingType(weights.scalar_type()), op,
              ": weights must be [T, k] float, got ", weights.sizes(), " ", weights.scalar_type());
  const int64_t n = weights.size(0) * weights.size(1);
  TORCH_CHECK(order.dim() == 1 && order.size(0) == n && order.scalar_type() == at::kLong, op,
              ": order must be [T*k] = [", n, "] int64, got ", order.sizes(), " ", order.scalar_type());
  TORCH_CHECK(y_sorted.dim() == 2 && y_sorted.size(0) == n, op, ": y_sorted must be [T*k, d] with T*k = ", n,
              ", got ", y_sorted.sizes());
}

at::Tensor unpermute_cpu(const at::Tensor& y_sorted_in, const at::Tensor& order_in, const at::Tensor& weights_in,
                         int64_t num_tokens) {
  check_unpermute("unpermute", y_sorted_in, order_in, weights_in);
  TORCH_CHECK(weights_in.size(0) == num_tokens, "unpermute: weights must be [T, k] with T = num_tokens = ", num_tokens,
              ", got ", weights_in.sizes());
  const int64_t T = num_tokens, k = weights_in.size(1), n = T * k, d = y_sorted_in.size(1);
  const at::Tensor y_sorted = y_sorted_in.contiguous(), order = order_in.contiguous();
  const at::Tensor w = weights_in.to(acc_type(y_sorted.scalar_type())).contiguous();
  auto y = at::empty({T, d}, y_sorted.options());
  if (y.numel() == 0) return y;
  const auto row = routing_rows::invert(order.const_data_ptr<int64_t>(), n, n);  // choice -> row
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_sorted.scalar_type(), "unpermute", [&] {
    using acc = routing_rows::acc_t<scalar_t>;
    routing_rows::gather_sum<scalar_t>(y.mutable_data_ptr<scalar_t>(), T, k, y_sorted.const_data_ptr<scalar_t>(),
                                       row.data(), w.const_data_ptr<acc>(), d);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> unpermute_backward_cpu(const at::Tensor& grad_y_in, const at::Tensor& y_sorted_in,
                                                          const at::Tensor& order_in, const at::Tensor& weights_in) {
  check_unpermute("unpermute_backward", y_sorted_in, order_in, weights_in);
  const int64_t T = weights_in.size(0), k = weights_in.size(1), n = T * k, d = y_sorted_in.size(1);
  TORCH_CHECK(grad_y_in.dim() == 2 && grad_y_in.size(0) == T && grad_y_in.size(1) == d &&
                  grad_y_in.scalar_type() == y_sorted_in.scalar_type(),
              "unpermute_backward: grad_y must be [T, d] = [", T, ", ", d, "] of y_sorted's dtype, got ",
              grad_y_in.sizes(), " ", grad_y_in.scalar_type());
  const at::Tensor g = grad_y_in.contiguous(), y_sorted = y_sorted_in.contiguous(), order = order_in.contiguous();
  const at::Tensor w = weights_in.to(acc_type(y_sorted.scalar_type())).contiguous();
  auto grad_y_sorted = at::empty({n, d}, y_sorted.options());
  auto grad_weights = at::empty({T, k}, w.options());
  const int64_t* ord = order.const_data_ptr<int64_t>();
  const auto row = routing_rows::invert(ord, n, n);  // choice -> row
  // Rows whose order entry is out of range contribute nothing (and get a zero gradient).
  std::vector<int64_t> choice(ord, ord + n);
  for (auto& j : choice)
    if (j >= n) j = -1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y_sorted.scalar_type(), "unpermute_backward", [&] {
    using acc = routing_rows::acc_t<scalar_t>;
    if (grad_y_sorted.numel())
      routing_rows::gather_rows<scalar_t>(grad_y_sorted.mutable_data_ptr<scalar_t>(), n, g.const_data_ptr<scalar_t>(),
                                          choice.data(), k, w.const_data_ptr<acc>(), d);
    if (n)
      routing_rows::row_dots<scalar_t, acc>(grad_weights.mutable_data_ptr<acc>(), n, k, g.const_data_ptr<scalar_t>(),
                                            y_sorted.const_data_ptr<scalar_t>(), row.data(), d);
  });
  return {grad_y_sorted, grad_weights.to(weights_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("permute(Tensor x, Tensor experts, int num_experts) -> (Tensor x_sorted, Tensor expert_offsets, Tensor order)");
  m.def("unpermute(Tensor y_sorted, Tensor order, Tensor weights, int num_tokens) -> Tensor");
  m.def(
      "unpermute_backward(Tensor grad_y, Tensor y_sorted, Tensor order, Tensor weights) -> "
      "(Tensor grad_y_sorted, Tensor grad_weights)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("permute", &permute_cpu);
  m.impl("unpermute", &unpermute_cpu);
  m.impl("unpermute_backward", &unpermute_backward_cpu);
}

}  // namespace moe_kernels
