// batchwise_mask logic shared by the CPU (csrc/cpu/batchwise_mask.cpp) and CUDA
// (csrc/cuda/batchwise_mask.cu) kernels: a radix select of the m-th largest score of a column.
// No torch headers.
#pragma once
#include "moe_kernels/common.h"

namespace moe_kernels {
namespace batchwise_mask {

// Radix digits of 8 bits, most significant first: 4 passes over a 32-bit key.
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kRadixPasses = 32 / kRadixBits;

// rank_key as an unsigned integer in the same order (NaN highest, -0 == +0, -inf lowest), so
// that radix digits can be taken from the most significant bit down.
MK_HD uint32_t order_key(float x) { return (uint32_t)rank_key(x) ^ 0x80000000u; }

// The digit of `key` at radix pass `pass` (0 = most significant).
MK_HD uint32_t digit(uint32_t key, int pass) {
  return (key >> (32 - kRadixBits * (pass + 1))) & (kRadixBins - 1);
}

// Given the histogram hist[0 .. bins) of the current candidates' digits, the digit of the
// `*remaining`-th largest candidate (1-based). On return *remaining is its rank among the
// candidates with that digit. After the last pass the threshold key is known and *remaining is
// how many keys equal to it are kept (the lowest token indices: ties go to the lower index).
// Every radix select of the project walks its histogram here (CPU digits of 5-11 bits, the
// sampled select's candidate bins, CUDA's 8-bit digits).
template <typename count_t>
MK_HD uint32_t select_bin(const count_t* hist, int bins, int64_t* remaining) {
  int64_t above = 0;
  for (int d = bins - 1; d > 0; --d) {
    if (above + hist[d] >= *remaining) {
      *remaining -= above;
      return (uint32_t)d;
    }
    above += hist[d];
  }
  *remaining -= above;
  return 0;
}

MK_HD uint32_t select_digit(const int64_t* hist, int64_t* remaining) { return select_bin(hist, kRadixBins, remaining); }

}  // namespace batchwise_mask
}  // namespace moe_kernels
