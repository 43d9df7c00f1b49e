// The sampled-threshold select of csrc/cpu/select/column_filter.cpp checked against a scalar
// specification (each column's (key, token) pairs sorted, the first m kept), built once per
// instruction set by python_tests/builds/test_isa_variants.py with MOE_KERNELS_NO_CLONES, since the
// extension runs only the row pass its machine supports. The candidate lists are checked exactly;
// columns select_candidates must decline (too few or too many candidates) are counted, not
// selected: the extension selects them whole.
// Prints the number of columns checked; exits 1 at the first mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <utility>
#include <vector>

#include "select/column_filter.h"
#include "moe_kernels/batchwise_mask.h"
#include "xorshift.h"

using namespace moe_kernels;

namespace {

// Scores of one kind: random, few distinct values (ties), -inf and NaN mixed in, signed zeros,
// ascending in the token (the sample sees the column's spread), rounded to 1/64 (ties at lo).
float score(int kind, int64_t t, int64_t T) {
  const float u = uniform();
  switch (kind) {
    case 0: return 4.0f * u - 2.0f;
    case 1: return (float)(next() % 5);
    case 2: return u < 0.05f ? NAN : (u < 0.3f ? -INFINITY : u);
    case 3: return u < 0.5f ? -0.0f : 0.0f;
    case 4: return (float)t / (float)T;
    default: return std::round(64.0f * u) / 64.0f;
  }
}

}  // namespace

int main() {
  int64_t columns = 0, declined = 0;
  for (int64_t T : {4096, 5000, 20000}) {
    for (int64_t w : {1, 7, 64, 100}) {
      for (int kind = 0; kind < 6; ++kind) {
        const int64_t m = std::max<int64_t>(1, T / (kind == 4 ? 40 : 25));
        const column_filter::Plan plan = column_filter::plan(T, m);
        if (!plan.use) {
          std::printf("no plan for T=%ld m=%ld\n", (long)T, (long)m);
          return 1;
        }
        const int64_t stride = w + 3;  // rows padded: the row pass must not read past w
        std::vector<float> x(T * stride, NAN);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < w; ++j) x[t * stride + j] = score(kind, t, T);
        const int64_t S = plan.sample_rows;
        std::vector<float> sample(S * w), lo(w);
        std::vector<uint32_t> lo_key(w);
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j < w; ++j) sample[i * w + j] = x[column_filter::sample_row(i, S, T) * stride + j];
        column_filter::thresholds(sample.data(), S, w, plan.rank, lo.data(), lo_key.data());
        for (int64_t j = 0; j < w; ++j) {  // each column's rank-th largest sampled key, exactly
          std::vector<uint32_t> column(S);
          for (int64_t i = 0; i < S; ++i) column[i] = batchwise_mask::order_key(sample[i * w + j]);
          std::sort(column.begin(), column.end(), std::greater<uint32_t>());
          if (lo_key[j] != column[plan.rank - 1] || batchwise_mask::order_key(lo[j]) != lo_key[j]) {
            std::printf("threshold differs: T=%ld w=%ld kind=%d column %ld\n", (long)T, (long)w, kind, (long)j);
            return 1;
          }
        }
        column_filter::CandidateLists lists;
        lists.reset(w, plan.capacity);
        // In two calls, as the extension does for blocks of converted rows.
        const int64_t half = T / 3;
        column_filter::filter_rows(x.data(), stride, 0, half, lo.data(), lists);
        column_filter::filter_rows(x.data() + half * stride, stride, half, T - half, lo.data(), lists);
        column_filter::SelectScratch scratch;
        std::vector<int64_t> out(m);
        for (int64_t j = 0; j < w; ++j) {
          // The row pass: every score that is not below lo (NaN included; every score when lo is
          // NaN), in token order, with its float32 bits.
          std::vector<uint64_t> candidates;
          for (int64_t t = 0; t < T; ++t) {
            const float v = x[t * stride + j];
            if (!(v < lo[j])) candidates.push_back((uint64_t)float_bits(v) << 32 | (uint64_t)t);
          }
          const int64_t n = lists.count[j];
          const uint64_t* list = lists.entries.get() + j * lists.ld;
          if (n != (int64_t)candidates.size() ||
              (n <= plan.capacity && !std::equal(candidates.begin(), candidates.end(), list))) {
            std::printf("candidates differ: T=%ld w=%ld kind=%d column %ld\n", (long)T, (long)w, kind, (long)j);
            return 1;
          }
          const bool settled = column_filter::select_candidates(lists, j, m, lo_key[j], scratch, out.data());
          if (settled != (n >= m && n <= plan.capacity)) {
            std::printf("select_candidates returned %d with %ld candidates: T=%ld w=%ld kind=%d column %ld\n",
                        (int)settled, (long)n, (long)T, (long)w, kind, (long)j);
            return 1;
          }
          if (!settled) {
            ++declined;
            continue;
          }
          std::vector<std::pair<int64_t, int64_t>> order(T);  // (-key, token): ascending = kept first
          for (int64_t t = 0; t < T; ++t) order[t] = {-(int64_t)batchwise_mask::order_key(x[t * stride + j]), t};
          std::sort(order.begin(), order.end());
          std::vector<int64_t> expected(m);
          for (int64_t i = 0; i < m; ++i) expected[i] = order[i].second;
          std::sort(expected.begin(), expected.end());
          if (expected != out) {
            std::printf("mismatch: T=%ld w=%ld kind=%d column %ld\n", (long)T, (long)w, kind, (long)j);
            return 1;
          }
          ++columns;
        }
      }
    }
  }
  std::printf("declined %ld\n%ld\n", (long)declined, (long)columns);
  return 0;
}
