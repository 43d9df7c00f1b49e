// The linear layers of the chosen experts at a few tokens (decode) on CPU:
//   out[r, o] = sum_i rows[r, i] * W_e[o, i]   for the rows r of each span (e, begin, end),
// in float32, rounded once to the rows' dtype. W_e is weight[e] ([E, out, in], contiguous along
// in), or weight[e]^T with `transposed` ([E, in, out], contiguous along out: GPT-OSS's layout).
// At decode an expert gets one to a few rows, so each weight element feeds one to a few products:
// bound by reading the weights, where a GEMM's packing and blocking for a few rows cost more than
// they save. Here each task takes a span and a block of output features and reads each weight
// element once per block of four rows (linear/chosen_rows.h: the order of the sums, the same bits
// on every instruction set and thread count); the tasks run on torch's intra-op threads across
// experts and features. Spans sort the rows by expert (moe_kernels/integrations/
// transformers_experts.py's chosen-experts path builds them on the host).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear/chosen_rows.h"

namespace moe_kernels {
namespace {

// Output features per task (two 8-float vectors of the axpy layout; eight pairs of weight rows of
// the dot layout).
constexpr int64_t kFeatures = 16;
// About this many multiply-adds per parallel chunk: enough to amortise the fork.
constexpr int64_t kWorkPerChunk = 1 << 16;

// One task's block: `n` rows (float32) times the weight block at `w` (feature f0's first element)
// into out (float32, row stride out_stride); 16-bit weights by their bits, widened in the kernel.
template <typename scalar_t>
void block(const float* x, int64_t n, int64_t in, const scalar_t* w, int64_t stride, int64_t F, bool transposed,
           float* out, int64_t out_stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    (transposed ? chosen_axpy_rows_f32 : chosen_dot_rows_f32)(x, n, in, w, stride, F, out, out_stride);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    (transposed ? chosen_axpy_rows_bf16 : chosen_dot_rows_bf16)(x, n, in, reinterpret_cast<const uint16_t*>(w),
                                                                stride, F, out, out_stride);
  } else {
    (transposed ? chosen_axpy_rows_f16 : chosen_dot_rows_f16)(x, n, in, reinterpret_cast<const f16_bits*>(w), stride,
                                                              F, out, out_stride);
  }
}

at::Tensor chosen_linear_cpu(const at::Tensor& rows_in, const at::Tensor& weight, const at::Tensor& spans_in,
                             bool transposed) {
  TORCH_CHECK(rows_in.dim() == 2, "chosen_linear: rows must be [R, in], got ", rows_in.sizes());
  const int64_t in_dim = transposed ? 1 : 2, out_dim = transposed ? 2 : 1;
  TORCH_CHECK(weight.dim() == 3 && weight.size(in_dim) == rows_in.size(1), "chosen_linear: weight must be ",
              transposed ? "[E, in, out]" : "[E, out, in]", " with in = ", rows_in.size(1), ", got ", weight.sizes());
  // Both layouts read the last dimension contiguously.
  TORCH_CHECK(weight.stride(2) == 1 || weight.size(2) <= 1, "chosen_linear: weight must be contiguous along ",
              transposed ? "out" : "in");
  const auto dtype = rows_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "chosen_linear: rows must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, "chosen_linear: weight must have the rows' dtype ", dtype, ", got ",
              weight.scalar_type());
  TORCH_CHECK(spans_in.dim() == 2 && spans_in.size(1) == 3 && spans_in.scalar_type() == at::kLong,
              "chosen_linear: spans must be [S, 3] int64 (expert, begin, end), got ", spans_in.sizes(), " ",
              spans_in.scalar_type());
  const int64_t R = rows_in.size(0), in = rows_in.size(1), E = weight.size(0), out_features = weight.size(out_dim);
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
  // Rows in no span are zero. The sums are float32, rounded once to a 16-bit dtype at the end.
  auto sums = at::zeros({R, out_features}, rows_in.options().dtype(at::kFloat));
  if (R == 0 || out_features == 0 || n_spans == 0) return sums.to(dtype);
  // The rows in float32, once: each is read by every output feature of its expert.
  const auto x_t = rows_in.to(at::kFloat).contiguous();
  const float* x = x_t.const_data_ptr<float>();
  float* o = sums.mutable_data_ptr<float>();
  const int64_t blocks = (out_features + kFeatures - 1) / kFeatures;
  const int64_t rows_per_span = std::max<int64_t>(1, R / n_spans);
  const int64_t grain = std::max<int64_t>(1, kWorkPerChunk / std::max<int64_t>(1, kFeatures * in * rows_per_span));
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    // The stride between output features and between input elements, in elements.
    const int64_t stride_e = weight.stride(0), stride_f = weight.stride(out_dim), stride_i = weight.stride(in_dim);
    at::parallel_for(0, n_spans * blocks, grain, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t s = task / blocks, f0 = (task % blocks) * kFeatures;
        const int64_t e = spans[3 * s], begin = spans[3 * s + 1], end = spans[3 * s + 2];
        const int64_t F = std::min(kFeatures, out_features - f0);
        block(x + begin * in, end - begin, in, w + e * stride_e + f0 * stride_f, transposed ? stride_i : stride_f, F,
              transposed, o + begin * out_features + f0, out_features);
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
  return dtype == at::kFloat ? sums : sums.to(dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("chosen_linear(Tensor rows, Tensor weight, Tensor spans, bool transposed=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("chosen_linear", &chosen_linear_cpu); }

}  // namespace moe_kernels
