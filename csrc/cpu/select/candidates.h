// The candidates of a row's k <= 8 largest elements (pairs_topk.h's top-8 selection sorts only
// these), written once per x86 instruction set with its own compress instruction (isa.h), chosen
// at the first call.
//
// Split the row into 8 disjoint groups and take each group's maximum: at least 8 elements are at
// or above the smallest of them (the floor), and no element below the floor can be among the 8
// largest. On random rows about a quarter of a 64-wide row is left to sort. The selection itself
// is done by rank pairs (moe_kernels/common.h), so which groups a variant uses changes only how many
// candidates it keeps, never the result.
#pragma once
#include <cstdint>

namespace moe_kernels {

// Room a candidate buffer needs past E: a variant stores whole vectors of up to 16 lanes.
constexpr int64_t kCandidatePad = 16;

// The elements of row[0 .. E) at or above the floor (float compares; a tail the groups do not
// cover is filtered too), in ascending index order: their indices into index and values into
// value (both [E + kCandidatePad]), followed by 8 zeros in each (so that whole vectors of them can
// be read). Returns how many; -1, writing nothing defined, when the row's
// float sum is NaN (a NaN, or +inf with -inf: float compares cannot rank those; the caller then
// ranks every element by rank key). Requires E >= 8.
int64_t row_candidates_f32(const float* row, int64_t E, int32_t* index, float* value);

}  // namespace moe_kernels
