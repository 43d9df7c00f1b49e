// Batchwise top-m mask (eq 18 of Shazeer et al. 2017, Appendix F) on CPU: parallel over experts.
// Each expert's column is read once into 32-bit order keys (a group of experts at a time, so the
// row-major scores are read a cache line at a time), a radix select finds the m-th largest key
// (one full pass, then passes over the few candidates that share its leading digits), and a last
// pass in token order keeps every key above it and the first ties: ties go to the lower index.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "moe_kernels/batchwise_mask.h"

namespace moe_kernels {
namespace {

using batchwise_mask::digit;
using batchwise_mask::kRadixBins;
using batchwise_mask::kRadixPasses;
using batchwise_mask::order_key;
using batchwise_mask::select_digit;

// At most this many experts' columns are gathered together: 16 floats are one 64-byte cache line
// of a row. Fewer when there are few experts, so that every thread still gets a group.
constexpr int64_t kMaxGroup = 16;

// Select the m largest keys of one column (m >= 1) and write its mask column and token list.
void select_column(const uint32_t* keys, int64_t T, int64_t m, int64_t e, int64_t E,
                   std::vector<uint32_t>& candidates, bool* mask, int64_t* tokens) {
  int64_t hist[kRadixBins];
  int64_t remaining = m;
  uint32_t threshold = 0;
  // Pass 0 over every key; later passes over the keys whose leading digits match so far.
  std::fill(hist, hist + kRadixBins, 0);
  for (int64_t t = 0; t < T; ++t) ++hist[digit(keys[t], 0)];
  uint32_t d = select_digit(hist, &remaining);
  threshold = d << (32 - batchwise_mask::kRadixBits);
  candidates.clear();
  for (int64_t t = 0; t < T; ++t)
    if (digit(keys[t], 0) == d) candidates.push_back(keys[t]);
  for (int pass = 1; pass < kRadixPasses; ++pass) {
    std::fill(hist, hist + kRadixBins, 0);
    for (uint32_t k : candidates) ++hist[digit(k, pass)];
    d = select_digit(hist, &remaining);
    threshold |= d << (32 - batchwise_mask::kRadixBits * (pass + 1));
    size_t kept = 0;
    for (uint32_t k : candidates)
      if (digit(k, pass) == d) candidates[kept++] = k;
    candidates.resize(kept);
  }
  // `remaining` keys equal to `threshold` are kept: the first ones in token order.
  int64_t pos = 0;
  for (int64_t t = 0; t < T; ++t) {
    const uint32_t k = keys[t];
    if (k > threshold || (k == threshold && remaining-- > 0)) {
      mask[t * E + e] = true;
      tokens[e * m + pos++] = t;
    }
  }
}

template <typename scalar_t>
void batchwise_experts(const scalar_t* scores, int64_t stride_t, int64_t stride_e, int64_t T,
                       int64_t E, int64_t m, int64_t begin, int64_t end, int64_t group,
                       bool* mask, int64_t* tokens) {
  std::vector<uint32_t> keys(std::min(group, end - begin) * T);
  std::vector<uint32_t> candidates;
  candidates.reserve(T);
  for (int64_t e0 = begin; e0 < end; e0 += group) {
    const int64_t g = std::min(group, end - e0);
    for (int64_t t = 0; t < T; ++t) {
      const scalar_t* row = scores + t * stride_t + e0 * stride_e;
      for (int64_t j = 0; j < g; ++j) keys[j * T + t] = order_key((float)row[j * stride_e]);
    }
    for (int64_t j = 0; j < g; ++j)
      select_column(keys.data() + j * T, T, m, e0 + j, E, candidates, mask, tokens);
  }
}

std::tuple<at::Tensor, at::Tensor> batchwise_mask_cpu(const at::Tensor& scores, int64_t m) {
  TORCH_CHECK(scores.dim() == 2, "batchwise_mask: scores must be [T, E], got ", scores.sizes());
  const int64_t T = scores.size(0), E = scores.size(1);
  TORCH_CHECK(m >= 0 && m <= T, "batchwise_mask: need 0 <= m <= T, got m=", m, ", T=", T);
  TORCH_CHECK(T <= INT32_MAX, "batchwise_mask: T too large");
  TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kHalf ||
                  scores.scalar_type() == at::kBFloat16,
              "batchwise_mask: scores must be float32, float16 or bfloat16, got ", scores.scalar_type());
  auto mask = at::zeros({T, E}, scores.options().dtype(at::kBool));
  auto tokens = at::empty({E, m}, scores.options().dtype(at::kLong));
  if (m == 0 || E == 0) return {mask, tokens};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "batchwise_mask", [&] {
    const scalar_t* x = scores.const_data_ptr<scalar_t>();
    bool* mk = mask.mutable_data_ptr<bool>();
    int64_t* tk = tokens.mutable_data_ptr<int64_t>();
    const int64_t st = scores.stride(0), se = scores.stride(1);
    // Experts are independent; each task takes whole groups so that rows are read by cache line.
    // Tasks write disjoint bytes of the mask and disjoint rows of the token lists.
    const int64_t threads = at::get_num_threads();
    const int64_t group = std::clamp<int64_t>(E / threads, 1, kMaxGroup);
    const int64_t groups = (E + group - 1) / group;
    const int64_t per_task = std::max<int64_t>(1, (groups + threads - 1) / threads);
    at::parallel_for(0, groups, per_task, [&](int64_t gb, int64_t ge) {
      batchwise_experts<scalar_t>(x, st, se, T, E, m, gb * group, std::min(E, ge * group), group, mk, tk);
    });
  });
  return {mask, tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("batchwise_mask(Tensor scores, int m) -> (Tensor mask, Tensor expert_tokens)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("batchwise_mask", &batchwise_mask_cpu); }

}  // namespace moe_kernels
