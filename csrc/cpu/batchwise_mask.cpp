// Batchwise top-m mask (eq 18 of Shazeer et al. 2017, Appendix F) on CPU: parallel over experts.
// For m << T (T >= 4096) the sampled-threshold select of select/column_filter.h runs first and settles
// almost every column; the radix select below takes the rest, and every column otherwise.
// Each expert's column is read once into 32-bit order keys (a group of experts at a time, so the
// row-major scores are read a cache line at a time). A radix select finds the m-th largest key:
// one pass over the column histograms the first 11-bit digit, a second copies out the boundary
// keys (the threshold's first digit), on which the remaining passes run; a third writes the
// ascending token list (keys above the threshold, then its first ties: ties go to the lower
// token index). The mask is written from the lists at the end.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "select/column_filter.h"
#include "moe_kernels/batchwise_mask.h"
#include "score/vec_math.h"

namespace moe_kernels {
namespace {

using batchwise_mask::order_key;

// At most this many experts' columns are gathered together: 16 floats are one 64-byte cache line
// of a row. Fewer when there are few experts, so that every thread still gets a group.
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMinTaskElements = 1 << 18;

// Scratch space of one thread, reused across its experts.
struct Scratch {
  std::vector<uint32_t> keys;  // [group, ld] the group's order keys, column by column
  std::vector<int32_t> above;  // [T + 1] tokens whose first digit is above the threshold's
  std::vector<int32_t> boundary;  // [T + 1] tokens whose first digit equals the threshold's
  std::vector<uint32_t> boundary_keys, work;  // [T + 1] their keys; the candidates of a pass
  std::vector<int32_t> picked;  // boundary tokens kept
  std::vector<int32_t> hist;    // [2 * kFirstBins] two interleaved first-digit histograms
};

// The CPU radix select takes its digits at these (shift, bits), most significant first. The first
// digit is wide: a float's top 8 bits are its sign and 7 exponent bits, which on real scores
// (most in [0.5, 2)) leave a third of a column on the boundary; 11 bits reach 2 mantissa bits.
// (The CUDA kernel keeps 8-bit digits: batchwise_mask.h.)
constexpr int kDigitShift[4] = {21, 13, 5, 0};
constexpr int kDigitBits[4] = {11, 8, 8, 5};
constexpr int kFirstBins = 1 << 11;

inline uint32_t cpu_digit(uint32_t key, int pass) {
  return (key >> kDigitShift[pass]) & ((1u << kDigitBits[pass]) - 1);
}

using batchwise_mask::select_bin;

// Select the m largest keys of one column (1 <= m <= T) and write its token list (ascending).
// Pass 0 (the first digit) runs over all T keys: a histogram, then a split into tokens certainly
// kept (digit above the threshold's) and boundary tokens (a few % of the column); passes 1-3 run
// over the boundary keys only. The split is written branch-free: every token is stored in both
// lists and the counts advance by the comparisons (which tokens qualify is unpredictable on real
// scores: branches mispredicted on a third of them and cost most of the kernel's time).
void select_column(const uint32_t* keys, int64_t T, int64_t m, Scratch& s, int64_t* tokens) {
  s.hist.assign(2 * kFirstBins, 0);
  int32_t* h0 = s.hist.data();
  int32_t* h1 = h0 + kFirstBins;
  int64_t t = 0;
  // Two interleaved histograms: consecutive increments of one counter would serialise.
  for (; t + 2 <= T; t += 2) {
    ++h0[cpu_digit(keys[t], 0)];
    ++h1[cpu_digit(keys[t + 1], 0)];
  }
  for (; t < T; ++t) ++h0[cpu_digit(keys[t], 0)];
  for (int b = 0; b < kFirstBins; ++b) h0[b] += h1[b];
  int64_t remaining = m;
  uint32_t d = select_bin(h0, kFirstBins, &remaining);
  uint32_t threshold = d << kDigitShift[0];
  for (auto* v : {&s.above, &s.boundary}) v->resize(std::max<size_t>(v->size(), T + 1));
  s.boundary_keys.resize(std::max<size_t>(s.boundary_keys.size(), T + 1));
  int32_t* above = s.above.data();
  int32_t* boundary = s.boundary.data();
  uint32_t* boundary_keys = s.boundary_keys.data();
  int64_t n_above = 0, n_boundary = 0;
  for (int64_t j = 0; j < T; ++j) {
    const uint32_t key = keys[j];
    const uint32_t dj = cpu_digit(key, 0);
    above[n_above] = (int32_t)j;
    n_above += dj > d;
    boundary[n_boundary] = (int32_t)j;
    boundary_keys[n_boundary] = key;
    n_boundary += dj == d;
  }
  s.work.assign(boundary_keys, boundary_keys + n_boundary);
  int64_t hist[256];
  for (int pass = 1; pass < 4; ++pass) {
    const int bins = 1 << kDigitBits[pass];
    std::fill(hist, hist + bins, 0);
    for (uint32_t key : s.work) ++hist[cpu_digit(key, pass)];
    d = select_bin(hist, bins, &remaining);
    threshold |= d << kDigitShift[pass];
    size_t kept = 0;
    for (uint32_t key : s.work) {
      s.work[kept] = key;
      kept += cpu_digit(key, pass) == d;
    }
    s.work.resize(kept);
  }
  // Among the boundary tokens keep the keys above the threshold and its first `remaining` ties
  // in token order (ties go to the lower index); then merge with the certain ones.
  s.picked.clear();
  int64_t ties = 0;
  for (int64_t i = 0; i < n_boundary; ++i) {
    const uint32_t key = boundary_keys[i];
    if (key > threshold || (key == threshold && ties++ < remaining)) s.picked.push_back(boundary[i]);
  }
  // Never write past the expert's m slots, whatever happened above.
  TORCH_CHECK(n_above + (int64_t)s.picked.size() == m, "batchwise_mask: internal error, selected ",
              n_above + (int64_t)s.picked.size(), " tokens instead of m=", m);
  std::merge(above, above + n_above, s.picked.begin(), s.picked.end(), tokens);
}

using column_filter::order_key_f32;

// The common case of gather_keys (float32, contiguous rows, a full group of 16 experts): 16 rows
// at a time, their keys computed a row (one vector) at a time into a 16 x 16 tile, then written
// out column by column (16 consecutive tokens: one cache line per column).
MK_VECTORISE MK_ISA_CLONES
void gather_keys_f32_16(const float* scores, int64_t stride_t, int64_t T, uint32_t* keys, int64_t ld) {
  uint32_t tile[kMaxGroup][kMaxGroup];
  int64_t t0 = 0;
  for (; t0 + kMaxGroup <= T; t0 += kMaxGroup) {
    for (int64_t r = 0; r < kMaxGroup; ++r) {
      const float* row = scores + (t0 + r) * stride_t;
      for (int64_t j = 0; j < kMaxGroup; ++j) tile[r][j] = order_key_f32(row[j]);
    }
    for (int64_t j = 0; j < kMaxGroup; ++j)
      for (int64_t r = 0; r < kMaxGroup; ++r) keys[j * ld + t0 + r] = tile[r][j];
  }
  for (; t0 < T; ++t0)
    for (int64_t j = 0; j < kMaxGroup; ++j) keys[j * ld + t0] = order_key_f32(scores[t0 * stride_t + j]);
}

// Order keys of `g` consecutive experts' columns, a row (cache line) at a time.
template <typename scalar_t>
void gather_keys(const scalar_t* scores, int64_t stride_t, int64_t stride_e, int64_t T, int64_t g,
                 uint32_t* keys, int64_t ld) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (stride_e == 1 && g == kMaxGroup) {
      gather_keys_f32_16(scores, stride_t, T, keys, ld);
      return;
    }
  }
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

// At most this many columns share one row pass of the sampled-threshold select: all of them in
// real routers (a pass over slices of the rows reads far below the bandwidth), while the
// candidate lists, which shrink as m = O(T / E) does, stay a few MB.
constexpr int64_t kMaxFilterBlock = 512;

// Experts [begin, end) by column_filter (the sampled-threshold select), a block of columns at
// a time; a column it cannot settle is selected over the whole column.
template <typename scalar_t>
void filtered_experts(const scalar_t* scores, int64_t stride_t, int64_t stride_e, int64_t T, int64_t m,
                      int64_t begin, int64_t end, const column_filter::Plan& plan, int64_t* tokens) {
  const int64_t S = plan.sample_rows;
  // Kept by each thread between calls (a few MB at T = 65536): memory fresh from the system costs
  // a page fault per 4 KiB touched, which measured as much as the row pass itself.
  thread_local std::vector<float> sample, lo, rows;
  thread_local std::vector<uint32_t> lo_key;
  thread_local column_filter::CandidateLists lists;
  thread_local column_filter::SelectScratch select_scratch;
  Scratch s;
  for (int64_t c0 = begin; c0 < end; c0 += kMaxFilterBlock) {
    const int64_t w = std::min(kMaxFilterBlock, end - c0);
    const scalar_t* x = scores + c0 * stride_e;
    sample.resize(S * w);
    for (int64_t i = 0; i < S; ++i) {
      const scalar_t* row = x + column_filter::sample_row(i, S, T) * stride_t;
      for (int64_t j = 0; j < w; ++j) sample[i * w + j] = (float)row[j * stride_e];
    }
    lo.resize(w);
    lo_key.resize(w);
    column_filter::thresholds(sample.data(), S, w, plan.rank, lo.data(), lo_key.data());
    lists.reset(w, plan.capacity);
    if (std::is_same_v<scalar_t, float> && stride_e == 1) {
      column_filter::filter_rows(reinterpret_cast<const float*>(x), stride_t, 0, T, lo.data(), lists);
    } else {  // other dtypes and strides: blocks of rows converted to contiguous float32 first
      constexpr int64_t kRows = 64;
      rows.resize(kRows * w);
      for (int64_t t0 = 0; t0 < T; t0 += kRows) {
        const int64_t n = std::min(kRows, T - t0);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t j = 0; j < w; ++j) rows[r * w + j] = (float)x[(t0 + r) * stride_t + j * stride_e];
        column_filter::filter_rows(rows.data(), w, t0, n, lo.data(), lists);
      }
    }
    for (int64_t j = 0; j < w; ++j) {
      int64_t* out = tokens + (c0 + j) * m;
      if (column_filter::select_candidates(lists, j, m, lo_key[j], select_scratch, out)) continue;
      const int64_t ld = T + 16;
      s.keys.resize(ld);
      gather_keys<scalar_t>(x + j * stride_e, stride_t, stride_e, T, 1, s.keys.data(), ld);
      select_column(s.keys.data(), T, m, s, out);
    }
  }
}

template <typename scalar_t>
void batchwise_experts(const scalar_t* scores, int64_t stride_t, int64_t stride_e, int64_t T,
                       int64_t m, int64_t begin, int64_t end, int64_t group, int64_t* tokens) {
  const column_filter::Plan plan = column_filter::plan(T, m);
  if (plan.use) {
    filtered_experts<scalar_t>(scores, stride_t, stride_e, T, m, begin, end, plan, tokens);
    return;
  }
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

// Rows [begin, end) of the mask [T, E] from the experts' ascending token lists tokens [E, m], a
// block of rows (256 KiB) at a time: the block zeroed, then each expert's entries in it set, the
// expert's place in its list carried from block to block (the first found by binary search).
// Setting the bytes over the whole mask after a zero fill of it missed the cache on most of them;
// much smaller blocks are slower at large E (an expert's loop exits once per block).
void write_mask_rows(const int64_t* tokens, int64_t E, int64_t m, int64_t begin, int64_t end, bool* mask) {
  constexpr int64_t kBlockBytes = 256 << 10;
  const int64_t block = std::max<int64_t>(1, kBlockBytes / E);
  std::vector<const int64_t*> next(E);
  for (int64_t e = 0; e < E; ++e) next[e] = std::lower_bound(tokens + e * m, tokens + (e + 1) * m, begin);
  for (int64_t b0 = begin; b0 < end; b0 += block) {
    const int64_t b1 = std::min(end, b0 + block);
    std::memset(mask + b0 * E, 0, (b1 - b0) * E);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t* p = next[e];
      const int64_t* last = tokens + (e + 1) * m;
      for (; p != last && *p < b1; ++p) mask[*p * E + e] = true;
      next[e] = p;
    }
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
  auto tokens = at::empty({E, m}, scores.options().dtype(at::kLong));
  if (m == 0 || E == 0) return {at::zeros({T, E}, scores.options().dtype(at::kBool)), tokens};
  auto mask = at::empty({T, E}, scores.options().dtype(at::kBool));  // every byte written below
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
  // experts' bytes of the same mask rows would fight over cache lines.
  bool* mk = mask.mutable_data_ptr<bool>();
  const int64_t* tk = tokens.const_data_ptr<int64_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, kMinTaskElements / E),
                   [&](int64_t begin, int64_t end) { write_mask_rows(tk, E, m, begin, end, mk); });
  return {mask, tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def("batchwise_mask(Tensor scores, int m) -> (Tensor mask, Tensor expert_tokens)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) { m.impl("batchwise_mask", &batchwise_mask_cpu); }

}  // namespace moe_kernels
