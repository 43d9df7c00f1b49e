// The linear layers of the chosen experts at a few tokens (decode) on CPU:
//   out[r, o] = sum_i rows[r, i] * weight[e, o, i]   for the rows r of each span (e, begin, end),
// in float32, rounded once to the rows' dtype. At decode an expert gets one or two rows, so each
// of its weight rows feeds one or two dot products: a matrix-vector product, bound by reading the
// weights. torch.mm of one row by a weight view reads them at a fraction of the memory bandwidth
// (a GEMM kernel's packing and blocking for one row); here each task takes a span and a block of
// output features, reads each weight row once, contiguous, and the tasks run on torch's
// intra-op threads across experts and features. Spans sort the rows by expert
// (moe_kernels/integrations/transformers_experts.py's chosen-experts path builds them on the host).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace {

// float32 of a weight element, exactly: bfloat16 by its bits (a shift, which the compiler
// vectorises), float16 by c10's conversion.
MK_ALWAYS_INLINE float widen(float x) { return x; }
MK_ALWAYS_INLINE float widen(c10::BFloat16 x) { return bits_float(uint32_t(x.x) << 16); }
MK_ALWAYS_INLINE float widen(c10::Half x) { return static_cast<float>(x); }

// <x, w> over n elements in float32. Eight partial sums in a fixed order: the compiler vectorises
// the reduction without -ffast-math, and the result does not depend on the vector width.
template <typename scalar_t>
float dot(const float* __restrict x, const scalar_t* __restrict w, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += x[i + l] * widen(w[i + l]);
  for (; i < n; ++i) part[0] += x[i] * widen(w[i]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Output features per task: a task reads this many weight rows of one expert.
constexpr int64_t kFeatures = 16;
// About this many multiply-adds per parallel chunk: enough to amortise the fork.
constexpr int64_t kWorkPerChunk = 1 << 16;

at::Tensor chosen_linear_cpu(const at::Tensor& rows_in, const at::Tensor& weight, const at::Tensor& spans_in) {
  TORCH_CHECK(rows_in.dim() == 2, "chosen_linear: rows must be [R, in], got ", rows_in.sizes());
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == rows_in.size(1),
              "chosen_linear: weight must be [E, out, in] with in = ", rows_in.size(1), ", got ", weight.sizes());
  TORCH_CHECK(weight.stride(2) == 1 || weight.size(2) <= 1, "chosen_linear: weight must be contiguous along in");
  const auto dtype = rows_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "chosen_linear: rows must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, "chosen_linear: weight must have the rows' dtype ", dtype, ", got ",
              weight.scalar_type());
  TORCH_CHECK(spans_in.dim() == 2 && spans_in.size(1) == 3 && spans_in.scalar_type() == at::kLong,
              "chosen_linear: spans must be [S, 3] int64 (expert, begin, end), got ", spans_in.sizes(), " ",
              spans_in.scalar_type());
  const int64_t R = rows_in.size(0), in = rows_in.size(1), E = weight.size(0), out_features = weight.size(1);
  const auto spans_t = spans_in.contiguous();
  const int64_t* spans = spans_t.const_data_ptr<int64_t>();
  const int64_t n_spans = spans_t.size(0);
  std::vector<uint8_t> covered(R, 0);
  for (int64_t s = 0; s < n_spans; ++s) {
    const int64_t e = spans[3 * s], begin = spans[3 * s + 1], end = spans[3 * s + 2];
    TORCH_CHECK(e >= 0 && e < E, "chosen_linear: span ", s, " names expert ", e, ", outside [0, ", E, ")");
    TORCH_CHECK(begin >= 0 && begin <= end && end <= R, "chosen_linear: span ", s, " has rows [", begin, ", ", end,
                "), outside [0, ", R, "]");
    for (int64_t r = begin; r < end; ++r) {
      TORCH_CHECK(!covered[r], "chosen_linear: row ", r, " is in two spans");
      covered[r] = 1;
    }
  }
  // Rows in no span are zero.
  auto out = at::zeros({R, out_features}, rows_in.options());
  if (R == 0 || out_features == 0 || n_spans == 0) return out;
  const auto rows = rows_in.contiguous();
  const int64_t blocks = (out_features + kFeatures - 1) / kFeatures;
  const int64_t rows_per_span = std::max<int64_t>(1, R / n_spans);
  const int64_t grain = std::max<int64_t>(1, kWorkPerChunk / std::max<int64_t>(1, kFeatures * in * rows_per_span));
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    // The rows in float32, once: each is read by every output feature of its expert.
    std::vector<float> x(static_cast<size_t>(R * in));
    const scalar_t* src = rows.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < R * in; ++i) x[i] = widen(src[i]);
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const int64_t stride_e = weight.stride(0), stride_o = weight.stride(1);
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n_spans * blocks, grain, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t s = task / blocks, f0 = (task % blocks) * kFeatures;
        const int64_t e = spans[3 * s], begin = spans[3 * s + 1], end = spans[3 * s + 2];
        const int64_t f1 = std::min(f0 + kFeatures, out_features);
        for (int64_t f = f0; f < f1; ++f) {
          const scalar_t* weight_row = w + e * stride_e + f * stride_o;
          for (int64_t r = begin; r < end; ++r) o[r * out_features + f] = scalar_t(dot(&x[r * in], weight_row, in));
        }
      }
    });
  };
  if (dtype == at::kFloat) {
    run(float(0));
  } else if (dtype == at::kBFloat16) {
    run(c10::BFloat16(0));
  } else {
    run(c10::Half(0));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) { m.def("chosen_linear(Tensor rows, Tensor weight, Tensor spans) -> Tensor"); }

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("chosen_linear", &chosen_linear_cpu); }

}  // namespace moe_kernels
