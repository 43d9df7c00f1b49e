// The two largest elements of each row, by values first and indices after: one pass keeps each
// lane's two largest values (max and min only, no index), the lanes' values give the row's two
// largest values t1 >= t2, and the indices are then found by equality masks: the lowest index
// holding t1, and the lowest holding t2 (the next one holding t1 when t2 == t1). That is rank-pair
// order (moe_kernels/common.h: larger value first, of equal values the lower index) without
// carrying indices through the pass, where tracking them cost three masked moves per step and a
// merge of (value, index) pairs across the lanes.
#pragma once
#include <cstdint>

namespace moe_kernels {

// The two largest rank pairs of rows [0, n) of x (row i at x + i * stride, 16 <= E <= 64 elements),
// descending, into best[2 * i], best[2 * i + 1]. Returns false (nothing written) when the CPU lacks
// AVX-512 (F and BW) or E is outside [16, 64]: there the lane pass with indices is faster. A row whose elements sum to NaN (a NaN, +inf with -inf, or an overflow) is left for the
// caller, which float compares cannot rank: its index goes into redo [n], counted by *n_redo.
bool rows_top2_values_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t* best, int64_t* redo,
                          int64_t* n_redo);

}  // namespace moe_kernels
