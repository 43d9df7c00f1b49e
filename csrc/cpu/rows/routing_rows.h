// Row kernels shared by the capacity-routing CPU ops (dispatch, combine, permute, unpermute and
// their backward passes). Every one of them is a gather: each output row is written by exactly one
// task, so the ops are deterministic without atomics, and the inner loops run along d over
// contiguous rows, which the compiler vectorises (-O3; __restrict tells it the rows do not alias).
//
// Terms: T tokens, k choices per token, E experts, C capacity, d hidden size. A "choice" j is the
// flat index t * k + s of experts[t, s]; `row[j]` is the row of the other side it reads (a buffer
// slot e * C + p, or a permuted row), -1 when the choice contributes nothing.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "moe_kernels/dispatch.h"

namespace moe_kernels {
namespace routing_rows {

// Accumulation type: float32 for every float type except float64 (as in the reference).
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// About this many elements per parallel task: enough to amortise the fork, small enough to balance.
constexpr int64_t kElementsPerTask = 1 << 15;

inline int64_t row_grain(int64_t d) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(d, 1)); }

// out[r] = w(choice[r]) * src[choice[r] / k] for every output row r (n_rows of them), zero where
// choice[r] < 0. w == nullptr means weight 1 (a plain copy). Rows are contiguous, d long.
template <typename scalar_t>
void gather_rows(scalar_t* __restrict out, int64_t n_rows, const scalar_t* __restrict src,
                 const int64_t* __restrict choice, int64_t k, const acc_t<scalar_t>* __restrict w,
                 int64_t d) {
  using acc = acc_t<scalar_t>;
  at::parallel_for(0, n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* __restrict o = out + r * d;
      const int64_t j = choice[r];
      if (j < 0) {
        std::fill(o, o + d, scalar_t(0));
      } else if (w == nullptr) {
        const scalar_t* __restrict s = src + (j / k) * d;
        std::copy(s, s + d, o);
      } else {
        const scalar_t* __restrict s = src + (j / k) * d;
        const acc wj = w[j];
        for (int64_t i = 0; i < d; ++i) o[i] = scalar_t(wj * acc(s[i]));
      }
    }
  });
}

// The same result as gather_rows(out, n_rows, src, source, k, nullptr, d), for source = invert(row):
// out[r] = src[source[r] / k], zero where source[r] < 0, but visiting the sources in order, so each
// source row is read once (and sequentially) however many of its choices are kept. A choice writes
// its row only if it owns it (source[row[j]] == j), so every output row still has one writer.
template <typename scalar_t>
void scatter_rows(scalar_t* __restrict out, int64_t n_rows, const scalar_t* __restrict src, int64_t T, int64_t k,
                  const int64_t* __restrict row, const int64_t* __restrict source, int64_t d) {
  at::parallel_for(0, n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (source[r] < 0) std::fill(out + r * d, out + (r + 1) * d, scalar_t(0));
  });
  at::parallel_for(0, T, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* __restrict s = src + t * d;
      for (int64_t j = t * k; j < (t + 1) * k; ++j) {
        const int64_t r = row[j];
        if (r >= 0 && source[r] == j) std::copy(s, s + d, out + r * d);
      }
    }
  });
}

// out[t] = sum over s with row[t*k+s] >= 0 of w[t*k+s] * src[row[t*k+s]] (weight 1 when w is
// null), accumulated in acc_t in the order s = 0, 1, ...; zero when no choice contributes.
template <typename scalar_t>
void gather_sum(scalar_t* __restrict out, int64_t T, int64_t k, const scalar_t* __restrict src,
                const int64_t* __restrict row, const acc_t<scalar_t>* __restrict w, int64_t d) {
  using acc = acc_t<scalar_t>;
  at::parallel_for(0, T, row_grain(d), [&](int64_t begin, int64_t end) {
    std::vector<acc> sum(std::is_same_v<acc, scalar_t> ? 0 : d);
    for (int64_t t = begin; t < end; ++t) {
      // Accumulate straight into the output row when it has the accumulation type.
      acc* __restrict a = std::is_same_v<acc, scalar_t> ? reinterpret_cast<acc*>(out + t * d) : sum.data();
      bool first = true;
      for (int64_t s = 0; s < k; ++s) {
        const int64_t r = row[t * k + s];
        if (r < 0) continue;
        const scalar_t* __restrict x = src + r * d;
        const acc ws = w == nullptr ? acc(1) : w[t * k + s];
        if (first) {
          for (int64_t i = 0; i < d; ++i) a[i] = ws * acc(x[i]);
          first = false;
        } else {
          for (int64_t i = 0; i < d; ++i) a[i] += ws * acc(x[i]);
        }
      }
      scalar_t* __restrict o = out + t * d;
      if (first) {
        std::fill(o, o + d, scalar_t(0));
      } else if constexpr (!std::is_same_v<acc, scalar_t>) {
        for (int64_t i = 0; i < d; ++i) o[i] = scalar_t(a[i]);
      }
    }
  });
}

// g[j] = dot(a[j / k], src[row[j]]) in acc_t for every choice j (n = T*k), 0 where row[j] < 0.
template <typename scalar_t, typename out_t>
void row_dots(out_t* __restrict g, int64_t n, int64_t k, const scalar_t* __restrict a,
              const scalar_t* __restrict src, const int64_t* __restrict row, int64_t d) {
  using acc = acc_t<scalar_t>;
  at::parallel_for(0, n, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = row[j];
      if (r < 0) {
        g[j] = out_t(0);
        continue;
      }
      const scalar_t* __restrict x = a + (j / k) * d;
      const scalar_t* __restrict y = src + r * d;
      // Eight partial sums: lets the compiler vectorise the reduction without -ffast-math.
      acc part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; ++l) part[l] += acc(x[i + l]) * acc(y[i + l]);
      for (; i < d; ++i) part[0] += acc(x[i]) * acc(y[i]);
      acc total = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      g[j] = out_t(total);
    }
  });
}

// combine's backward in one pass over the buffer slots, reading each grad_y row once for both
// outputs: for every slot r filled by choice j = source[r] (t = j / k),
//   grad_buffer[r] = w[j] * grad_y[t]   and   g[j] = <grad_y[t], buffer[r]>;
// unfilled slots get zero rows. g must be zero-filled by the caller (choices owning no slot keep 0);
// each g[j] is written by the one slot j owns.
template <typename scalar_t>
void scatter_grad_and_dots(scalar_t* __restrict grad_buffer, acc_t<scalar_t>* __restrict g, int64_t n_rows,
                           const scalar_t* __restrict grad_y, const scalar_t* __restrict buffer,
                           const int64_t* __restrict source, int64_t k, const acc_t<scalar_t>* __restrict w,
                           int64_t d) {
  using acc = acc_t<scalar_t>;
  at::parallel_for(0, n_rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* __restrict o = grad_buffer + r * d;
      const int64_t j = source[r];
      if (j < 0) {
        std::fill(o, o + d, scalar_t(0));
        continue;
      }
      const scalar_t* __restrict x = grad_y + (j / k) * d;
      const scalar_t* __restrict b = buffer + r * d;
      const acc wj = w[j];
      acc part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; ++l) {
          const acc xv = acc(x[i + l]);
          o[i + l] = scalar_t(wj * xv);
          part[l] += xv * acc(b[i + l]);
        }
      for (; i < d; ++i) {
        const acc xv = acc(x[i]);
        o[i] = scalar_t(wj * xv);
        part[0] += xv * acc(b[i]);
      }
      g[j] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
  });
}

// Stable ranks within columns, in parallel and deterministic: items i = 0..n-1 are visited in
// order; item i belongs to column col(i) in [0, ncols) or to none (col < 0). Calls
// emit(i, column, rank) with rank = the number of earlier items of the same column, and fills
// counts[ncols]. Two passes over chunks of items: per-chunk histograms, an exclusive prefix over
// chunks, then each chunk ranks its items from its own offsets (no shared counters).
template <typename ColFn, typename EmitFn>
void stable_column_ranks(int64_t n, int64_t ncols, ColFn col, EmitFn emit, int64_t* counts) {
  constexpr int64_t kItemsPerChunk = 1 << 16;  // below this a fork costs more than it saves
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((n + kItemsPerChunk - 1) / kItemsPerChunk,
                                                                4 * at::get_num_threads()));
  const int64_t per = (n + chunks - 1) / chunks;
  std::vector<int64_t> hist(chunks * ncols, 0);  // hist[c * ncols + e]
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t* h = hist.data() + c * ncols;
      for (int64_t i = c * per, end = std::min(n, (c + 1) * per); i < end; ++i) {
        const int64_t e = col(i);
        if (e >= 0) ++h[e];
      }
    }
  });
  for (int64_t e = 0; e < ncols; ++e) {
    int64_t running = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t here = hist[c * ncols + e];
      hist[c * ncols + e] = running;
      running += here;
    }
    counts[e] = running;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      int64_t* h = hist.data() + c * ncols;
      for (int64_t i = c * per, end = std::min(n, (c + 1) * per); i < end; ++i) {
        const int64_t e = col(i);
        if (e >= 0) emit(i, e, h[e]++);
      }
    }
  });
}

// slot[j] = experts[j] * C + positions[j] for every kept choice (0 <= experts < E,
// 0 <= positions < C), -1 otherwise: out-of-range entries are treated as dropped, never read.
inline std::vector<int64_t> kept_slots(const int64_t* experts, const int64_t* positions, int64_t n, int64_t E,
                                       int64_t C) {
  std::vector<int64_t> slot(n);
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      slot[j] = dispatch::kept_slot(experts[j], positions[j], E, C);
    }
  });
  return slot;
}

// The inverse of a map from choices to rows: inv[row[j]] = j, -1 for rows no choice maps to.
// Serial (n = T*k integers), so a malformed map with repeated rows still gives a deterministic
// answer (the last choice wins).
inline std::vector<int64_t> invert(const int64_t* row, int64_t n, int64_t n_rows) {
  std::vector<int64_t> inv(n_rows, -1);
  for (int64_t j = 0; j < n; ++j)
    if (row[j] >= 0 && row[j] < n_rows) inv[row[j]] = j;
  return inv;
}

}  // namespace routing_rows
}  // namespace moe_kernels
