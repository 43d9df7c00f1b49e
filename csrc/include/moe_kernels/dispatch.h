// Capacity routing logic shared by the CPU and CUDA kernels (no torch headers).
#pragma once
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace dispatch {

// The buffer row e * C + p of a kept choice; -1 for an empty, dropped or out-of-range choice
// (out-of-range values are treated as dropped: the kernels never read or write out of bounds).
MK_HD int64_t kept_slot(int64_t expert, int64_t position, int64_t E, int64_t C) {
  return (expert >= 0 && expert < E && position >= 0 && position < C) ? expert * C + position : -1;
}

// A choice's slot given its rank among its expert's choices in fill order: dropped (-1) past C.
MK_HD int64_t position_or_drop(int64_t rank, int64_t C) { return rank < C ? rank : -1; }

}  // namespace dispatch
}  // namespace moe_kernels
