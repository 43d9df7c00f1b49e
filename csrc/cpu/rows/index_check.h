// Range checks of the index tensors that the registered ops receive from Python. The public ops
// pass indices their own forward produced, but every op is reachable raw through torch.ops, and a
// kernel that trusted an edited or fabricated index would read and write out of bounds.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace moe_kernels {

// The routing ids of a contiguous int64 [T, width] `index`: columns [0, strict) must lie in
// [0, E); the other columns in [-1, E) (-1 = none). One pass over T * width ids (far fewer than
// the T * E elements the kernels read); an IndexError names the op, the argument and the value.
inline void check_routing_ids(const at::Tensor& index, int64_t E, int64_t strict, const char* op, const char* name) {
  TORCH_CHECK(index.is_contiguous() && index.scalar_type() == at::kLong && index.dim() == 2, op, ": ", name,
              " must be a contiguous int64 [T, k] tensor");
  const int64_t* p = index.const_data_ptr<int64_t>();
  const int64_t rows = index.size(0), width = index.size(1);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < width; ++j) {
      const int64_t v = p[t * width + j];
      const int64_t low = j < strict ? 0 : -1;
      TORCH_CHECK_INDEX(v >= low && v < E, op, ": ", name, "[", t, ", ", j, "] = ", v, " is out of range [", low,
                        ", ", E, ")");
    }
  }
}

}  // namespace moe_kernels
