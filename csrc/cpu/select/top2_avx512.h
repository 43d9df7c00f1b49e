// The two largest elements of each row, by values first and indices after: one pass keeps each
// lane's two largest values (max and min only, no index), the lanes' values give the row's two
// largest values t1 >= t2, and the indices are then found by compare masks (on most rows exactly
// two elements are at or above t2; else equality masks for t1 and t2): the lowest index holding
// t1, and the lowest other one holding t2 (the second holding t1 when t2 == t1). That is rank-pair
// order (moe_kernels/common.h: larger value first, of equal values the lower index) without
// carrying indices through the pass, where tracking them cost three masked moves per step and a
// merge of (value, index) pairs across the lanes.
#pragma once
#include <cstdint>

namespace moe_kernels {

// The two largest rank pairs of rows [0, n) of x (row i at x + i * stride, 16 <= E <= 64
// elements), descending, into best[2 * i], best[2 * i + 1]. Returns false (nothing written) when
// the CPU lacks AVX-512 F and BW, BMI or popcnt, or E is outside [16, 64] (there the lane pass
// with indices is faster). A row whose 16 lane-wise float sums hold a NaN (a NaN in the row, or
// +inf and -inf in one lane, or an overflow meeting an opposite infinity there) is left for the
// caller: its index goes into redo [n], counted by *n_redo. (Float compares rank infinities
// correctly; only a NaN needs the caller's rank keys.)
bool rows_top2_values_f32(const float* x, int64_t stride, int64_t n, int64_t E, int64_t* best, int64_t* redo,
                          int64_t* n_redo);

}  // namespace moe_kernels
