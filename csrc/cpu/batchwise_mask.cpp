// Batchwise top-m mask (eq 18 of Shazeer et al. 2017, Appendix F) on CPU: parallel over experts.
// Each expert's column is read once into 32-bit order keys (a group of experts at a time, so the
// row-major scores are read a cache line at a time). A radix select finds the m-th largest key:
// one pass over the column histograms the first 8-bit digit and splits the tokens into certainly
// kept ones and boundary ones (the threshold's first digit); the remaining passes run over the
// boundary keys only. The boundary tokens above the threshold and its first ties (ties go to the
// lower token index) are merged with the certain ones into an ascending token list, and the mask
// is written from the lists at the end.
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
constexpr int64_t kMinTaskElements = 1 << 18;

// Scratch space of one thread, reused across its experts.
struct Scratch {
  std::vector<uint32_t> keys;     // [group, ld] the group's order keys, column by column
  std::vector<int32_t> above;     // tokens whose first digit is above the threshold's
  std::vector<int32_t> boundary;  // tokens whose first digit equals the threshold's
  std::vector<uint32_t> boundary_keys, work;
  std::vector<int32_t> picked;
};

// Select the m largest keys of one column (1 <= m <= T) and write its token list (ascending).
// Pass 0 (first digit) runs over all T keys and splits them into tokens certainly kept (digit
// above the threshold's digit) and boundary tokens; passes 1-3 run over the boundary keys only.
void select_column(const uint32_t* keys, int64_t T, int64_t m, Scratch& s, int64_t* tokens) {
  constexpr int kBits = batchwise_mask::kRadixBits;
  // Four interleaved histograms: consecutive increments of one counter would serialise.
  int64_t hist4[4 * kRadixBins] = {};
  int64_t t = 0;
  for (; t + 4 <= T; t += 4)
    for (int u = 0; u < 4; ++u) ++hist4[u * kRadixBins + digit(keys[t + u], 0)];
  for (; t < T; ++t) ++hist4[digit(keys[t], 0)];
  int64_t hist[kRadixBins];
  for (int b = 0; b < kRadixBins; ++b)
    hist[b] = hist4[b] + hist4[kRadixBins + b] + hist4[2 * kRadixBins + b] + hist4[3 * kRadixBins + b];
  int64_t remaining = m;
  uint32_t d = select_digit(hist, &remaining);
  uint32_t threshold = d << (32 - kBits);
  s.above.clear();
  s.boundary.clear();
  s.boundary_keys.clear();
  for (int64_t j = 0; j < T; ++j) {
    const uint32_t dj = digit(keys[j], 0);
    if (dj > d) {
      s.above.push_back((int32_t)j);
    } else if (dj == d) {
      s.boundary.push_back((int32_t)j);
      s.boundary_keys.push_back(keys[j]);
    }
  }
  s.work.assign(s.boundary_keys.begin(), s.boundary_keys.end());
  for (int pass = 1; pass < kRadixPasses; ++pass) {
    std::fill(hist, hist + kRadixBins, 0);
    for (uint32_t k : s.work) ++hist[digit(k, pass)];
    d = select_digit(hist, &remaining);
    threshold |= d << (32 - kBits * (pass + 1));
    size_t kept = 0;
    for (uint32_t k : s.work)
      if (digit(k, pass) == d) s.work[kept++] = k;
    s.work.resize(kept);
  }
  // Among the boundary tokens keep the keys above the threshold and its first `remaining` ties
  // in token order (ties go to the lower index); then merge with the certain ones.
  s.picked.clear();
  int64_t ties = 0;
  for (size_t i = 0; i < s.boundary.size(); ++i) {
    const uint32_t k = s.boundary_keys[i];
    if (k > threshold || (k == threshold && ties++ < remaining)) s.picked.push_back(s.boundary[i]);
  }
  // Never write past the expert's m slots, whatever happened above.
  TORCH_CHECK((int64_t)(s.above.size() + s.picked.size()) == m, "batchwise_mask: internal error, selected ",
              s.above.size() + s.picked.size(), " tokens instead of m=", m);
  std::merge(s.above.begin(), s.above.end(), s.picked.begin(), s.picked.end(), tokens);
}

// Order keys of `g` consecutive experts' columns, a row (cache line) at a time.
template <typename scalar_t>
void gather_keys(const scalar_t* scores, int64_t stride_t, int64_t stride_e, int64_t T, int64_t g,
                 uint32_t* keys, int64_t ld) {
  if (stride_e == 1 && g == kMaxGroup) {  // the common case, with a constant trip count
    for (int64_t t = 0; t < T; ++t) {
      const scalar_t* row = scores + t * stride_t;
      for (int64_t j = 0; j < kMaxGroup; ++j) keys[j * ld + t] = order_key((float)row[j]);
    }
    return;
  }
  for (int64_t t = 0; t < T; ++t) {
    const scalar_t* row = scores + t * stride_t;
    for (int64_t j = 0; j < g; ++j) keys[j * ld + t] = order_key((float)row[j * stride_e]);
  }
}

template <typename scalar_t>
void batchwise_experts(const scalar_t* scores, int64_t stride_t, int64_t stride_e, int64_t T,
                       int64_t m, int64_t begin, int64_t end, int64_t group, int64_t* tokens) {
  // Column buffers padded so that they are not a multiple of 4 KiB apart (store aliasing).
  const int64_t ld = T + 16;
  Scratch s;
  s.keys.resize(std::min(group, end - begin) * ld);
  for (int64_t e0 = begin; e0 < end; e0 += group) {
    const int64_t g = std::min(group, end - e0);
    gather_keys<scalar_t>(scores + e0 * stride_e, stride_t, stride_e, T, g, s.keys.data(), ld);
    for (int64_t j = 0; j < g; ++j) select_column(s.keys.data() + j * ld, T, m, s, tokens + (e0 + j) * m);
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
    int64_t* tk = tokens.mutable_data_ptr<int64_t>();
    const int64_t st = scores.stride(0), se = scores.stride(1);
    // Experts are independent; each task takes whole groups so that rows are read by cache line,
    // and writes only its experts' token lists.
    const int64_t threads = at::get_num_threads();
    const int64_t group = std::clamp<int64_t>(E / threads, 1, kMaxGroup);
    const int64_t groups = (E + group - 1) / group;
    // Tasks of at least kMinTaskElements scores: below that, waking a second thread costs more
    // than it saves (and far more on a loaded machine).
    const int64_t min_groups = (kMinTaskElements + group * T - 1) / (group * T);
    const int64_t per_task = std::max<int64_t>({1, (groups + threads - 1) / threads, min_groups});
    at::parallel_for(0, groups, per_task, [&](int64_t gb, int64_t ge) {
      batchwise_experts<scalar_t>(x, st, se, T, m, gb * group, std::min(E, ge * group), group, tk);
    });
  });
  // The mask from the token lists, parallel over token ranges: threads writing different
  // experts' bytes of the same mask rows would fight over cache lines. Each list is ascending, so
  // a range's entries start at a binary-searched position.
  bool* mk = mask.mutable_data_ptr<bool>();
  const int64_t* tk = tokens.const_data_ptr<int64_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, kMinTaskElements / E), [&](int64_t begin, int64_t end) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t* list = tk + e * m;
      for (const int64_t* p = std::lower_bound(list, list + m, begin); p != list + m && *p < end; ++p)
        mk[*p * E + e] = true;
    }
  });
  return {mask, tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("batchwise_mask(Tensor scores, int m) -> (Tensor mask, Tensor expert_tokens)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("batchwise_mask", &batchwise_mask_cpu); }

}  // namespace moe_kernels
