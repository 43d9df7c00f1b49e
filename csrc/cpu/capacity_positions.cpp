// capacity_positions on CPU: the slot of every (token, choice) in its expert's buffer.
// The fill order is a list of choices (s-major by default, or sorted by descending priority);
// stable_column_ranks numbers each expert's choices along it in parallel, without atomics.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <vector>

#include "moe_kernels/common.h"
#include "moe_kernels/dispatch.h"
#include "rows/routing_rows.h"

namespace moe_kernels {
namespace {

// Fill order under `priority`: descending priority, ties in the default order (the default index
// i = s * T + t is the low half of the key, complemented so that lower i sorts first), NaN last
// (the reference sorts -priority, which puts NaN after every number).
template <typename scalar_t>
std::vector<int64_t> priority_order(const scalar_t* p, int64_t st, int64_t sk, int64_t T, int64_t k) {
  const int64_t n = T * k;
  std::vector<int64_t> key(n);
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / T, t = i % T;
      const float v = (float)p[t * st + s * sk];
      const int32_t high = v != v ? INT32_MIN : rank_key(v);
      key[i] = ((int64_t)high << 32) | (int64_t)(0xffffffffu - (uint32_t)i);
    }
  });
  std::sort(key.begin(), key.end(), std::greater<int64_t>());  // keys are distinct: deterministic
  for (int64_t i = 0; i < n; ++i) key[i] = (int64_t)(0xffffffffu - (uint32_t)(key[i] & 0xffffffff));
  return key;  // now the default index of the i-th choice to fill
}

std::tuple<at::Tensor, at::Tensor> capacity_positions_cpu(const at::Tensor& experts_in, int64_t num_experts,
                                                          int64_t capacity,
                                                          const std::optional<at::Tensor>& priority) {
  TORCH_CHECK(experts_in.dim() == 2 && experts_in.scalar_type() == at::kLong,
              "capacity_positions: experts must be [T, k] int64, got ", experts_in.sizes(), " ",
              experts_in.scalar_type());
  TORCH_CHECK(num_experts >= 1, "capacity_positions: num_experts must be >= 1, got ", num_experts);
  TORCH_CHECK(capacity >= 0, "capacity_positions: capacity must be >= 0, got ", capacity);
  const int64_t T = experts_in.size(0), k = experts_in.size(1), n = T * k, E = num_experts;
  TORCH_CHECK(n < ((int64_t)1 << 32), "capacity_positions: T * k must be < 2^32");
  const at::Tensor experts = experts_in.contiguous();
  auto positions = at::empty({T, k}, experts.options());
  auto counts = at::empty({E}, experts.options());
  const int64_t* ex = experts.const_data_ptr<int64_t>();
  int64_t* pos = positions.mutable_data_ptr<int64_t>();
  int64_t* cnt = counts.mutable_data_ptr<int64_t>();

  std::vector<int64_t> order;  // default index of the i-th choice to fill; empty = identity
  if (priority.has_value()) {
    const at::Tensor& p = *priority;
    TORCH_CHECK(p.dim() == 2 && p.size(0) == T && p.size(1) == k, "capacity_positions: priority must be [T, k] = [",
                T, ", ", k, "], got ", p.sizes());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "capacity_positions", [&] {
      order = priority_order<scalar_t>(p.const_data_ptr<scalar_t>(), p.stride(0), p.stride(1), T, k);
    });
  }
  const bool by_priority = priority.has_value();
  // Default index i = s * T + t is choice j = t * k + s.
  auto choice = [&](int64_t i) {
    const int64_t d = by_priority ? order[i] : i;
    return (d % T) * k + d / T;
  };
  std::fill(pos, pos + n, -1);  // empty choices stay -1; kept and dropped ones are set below
  routing_rows::stable_column_ranks(
      n, E,
      [&](int64_t i) {
        const int64_t e = ex[choice(i)];
        return e >= 0 && e < E ? e : -1;
      },
      [&](int64_t i, int64_t, int64_t rank) { pos[choice(i)] = dispatch::position_or_drop(rank, capacity); }, cnt);
  return {positions, counts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def(
      "capacity_positions(Tensor experts, int num_experts, int capacity, Tensor? priority=None) -> "
      "(Tensor positions, Tensor counts)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("capacity_positions", &capacity_positions_cpu); }

}  // namespace moe_kernels
