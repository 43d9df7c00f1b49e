// The argmax of a contiguous float32 row in the routing ops' rank order (rank_key in
// moe_kernels/common.h: NaN highest, -0 == +0, ties to the lower index), vectorised. k = 1 routing
// (Switch) is this argmax per token; the scalar loop spends most of its time on data-dependent
// branches, the vector version has none.
#pragma once
#include <cstdint>

namespace moe_kernels {

// Index of the largest element of row[0 .. E) in rank order. E >= 1.
int32_t row_argmax_f32(const float* row, int64_t E);

}  // namespace moe_kernels
