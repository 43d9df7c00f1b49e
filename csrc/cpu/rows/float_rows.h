// Rows of a [T, E] input of any float dtype and strides, read as contiguous float32 rows: the
// input itself where it already is, else converted into a buffer. The conversion is exact and
// keeps the order, -0 and NaN, so selecting on the converted row selects on the input's.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace moe_kernels {

// A [T, E] input of any float dtype and strides, read element-wise as float32.
struct Strided {
  const void* data;
  int64_t stride_t, stride_e;
};

template <typename scalar_t>
float at(const Strided& s, int64_t t, int64_t e) {
  return (float)static_cast<const scalar_t*>(s.data)[t * s.stride_t + e * s.stride_e];
}

// The row as contiguous float32: itself when it already is, else converted into `buffer` [E].
// The conversion is exact and keeps the order, -0 and NaN, so selecting on it selects on the row.
template <typename scalar_t>
const float* float_row(const scalar_t* row, int64_t stride_e, int64_t E, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (stride_e == 1) return row;
  }
  for (int64_t e = 0; e < E; ++e) buffer[e] = (float)row[e * stride_e];
  return buffer;
}

// Row t of a Strided input as contiguous float32 (float_row).
template <typename scalar_t>
const float* float_row(const Strided& s, int64_t t, int64_t E, float* buffer) {
  return float_row(static_cast<const scalar_t*>(s.data) + t * s.stride_t, s.stride_e, E, buffer);
}

// Rows per block of the row kernels that take a block of rows at a time (noisy_topk_gate,
// load_probabilities): up to `most`, fewer for wide rows so that each of a block's [rows, E]
// float32 buffers stays within 256 KiB.
inline int64_t block_rows(int64_t E, int64_t most = 64) {
  return std::clamp<int64_t>(65536 / std::max<int64_t>(E, 1), 1, most);
}

// Rows [t0, t0 + n) of a [T, E] input as contiguous float32 rows: the input itself when it is
// float32 with stride_e = 1, else converted into buffer [n, E] (float_row's exact conversion).
// Returns the first row and sets *stride to the result's row stride.
template <typename scalar_t>
const float* float_rows(const scalar_t* data, int64_t stride_t, int64_t stride_e, int64_t t0, int64_t n, int64_t E,
                        float* buffer, int64_t* stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (stride_e == 1) {
      *stride = stride_t;
      return data + t0 * stride_t;
    }
  }
  for (int64_t i = 0; i < n; ++i) float_row(data + (t0 + i) * stride_t, stride_e, E, buffer + i * E);
  *stride = E;
  return buffer;
}

}  // namespace moe_kernels
