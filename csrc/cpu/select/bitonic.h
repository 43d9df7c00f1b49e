// Bitonic sorting-network steps across the lanes of one GCC vector (rank pairs as int64 lanes,
// or float lanes), shared by the top-k selections: pairs_topk.h's candidate sorts (compiled per
// instruction set) and top8_avx512.cpp's AVX-512 top eight. Branch-free: a step is one shuffle, one
// max, one min and one blend by a constant mask, whatever the data. The compares are the lane
// type's own (`x > y`): int64 rank pairs order as rank_pair (moe_kernels/common.h); float lanes
// order as floats, so float callers must exclude NaN.
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "moe_kernels/common.h"  // MK_ALWAYS_INLINE

// The helpers pass 512-bit vectors by value; GCC warns that a caller without AVX-512 would pass
// them differently. They are always inlined, so no such call exists.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moe_kernels {
namespace bitonic {

// The integer vector a compare of two V vectors gives (the blend masks' type).
template <typename V>
using mask_of = decltype(V{} > V{});

template <typename V>
MK_ALWAYS_INLINE V larger(V a, V b) {
  return a > b ? a : b;
}

// Whether lane l keeps the larger of itself and its partner l ^ j, in the step of a bitonic
// sorting network whose sorted blocks of size `block` alternate direction, the first descending
// (the step with block = the lane count sorts the whole vector descending).
constexpr int64_t keeps_larger(int l, int block, int j) { return ((l < (l ^ j)) == ((l & block) == 0)) ? -1 : 0; }

template <typename M, int j, std::size_t... l>
constexpr M partners(std::index_sequence<l...>) {
  return M{(typename std::remove_reference<decltype(M{}[0])>::type)(l ^ j)...};
}

template <typename M, int block, int j, bool descending, std::size_t... l>
constexpr M takes_larger(std::index_sequence<l...>) {
  return M{(typename std::remove_reference<decltype(M{}[0])>::type)(descending ? keeps_larger(l, block, j)
                                                                                : ~keeps_larger(l, block, j))...};
}

// One compare-exchange step of that network over every lane of x, or of its mirror image (every
// exchange reversed: the network then sorts ascending).
template <int block, int j, bool descending, typename V>
MK_ALWAYS_INLINE V bitonic_step(V x) {
  using M = mask_of<V>;
  constexpr std::size_t n = sizeof(V) / sizeof(x[0]);
  constexpr M partner = partners<M, j>(std::make_index_sequence<n>{});
  constexpr M take = takes_larger<M, block, j, descending>(std::make_index_sequence<n>{});
  const V y = __builtin_shuffle(x, partner);
  // The larger and the smaller, blended by a constant mask: one max, one min, one masked move (a
  // select on the compare instead leaves GCC with scalar code).
  const V big = x > y ? x : y, small = x > y ? y : x;
  return take ? big : small;
}

// Eight lanes sorted, descending or ascending: six compare-exchange steps. On a 16-lane vector
// the same steps sort lanes 0-7 one way and lanes 8-15 the other (blocks alternate direction).
template <bool descending, typename V>
MK_ALWAYS_INLINE V sort8(V x) {
  x = bitonic_step<2, 1, descending>(x);
  x = bitonic_step<4, 2, descending>(x);
  x = bitonic_step<4, 1, descending>(x);
  x = bitonic_step<8, 4, descending>(x);
  x = bitonic_step<8, 2, descending>(x);
  return bitonic_step<8, 1, descending>(x);
}

// A running top eight (descending) merged with eight more lanes: `more` sorted ascending; the
// lane-wise larger of a descending and an ascending run is a bitonic sequence holding the eight
// largest of both, which three steps sort.
template <typename V>
MK_ALWAYS_INLINE V merge_into_top8(V top, V more) {
  top = larger(top, sort8<false>(more));
  top = bitonic_step<8, 4, true>(top);
  top = bitonic_step<8, 2, true>(top);
  return bitonic_step<8, 1, true>(top);
}

// The same networks over R independent vectors at once, step by step: one vector's steps are a
// chain of dependent shuffles, maxima and blends, and an out-of-order core only overlaps R such
// chains when their instructions come interleaved (a whole chain ahead of the next one fills the
// scheduler with waiting instructions). Exchange::step<block, j, descending>(v) is one step on one
// vector, the caller's own (top8_avx512.cpp's with intrinsics; bitonic_step is the generic one).
template <int block, int j, bool descending, int R, typename Exchange, typename V>
MK_ALWAYS_INLINE void bitonic_steps(V* x) {
  for (int r = 0; r < R; ++r) x[r] = Exchange::template step<block, j, descending>(x[r]);
}

// sort8 of each of x[0 .. R).
template <bool descending, int R, typename Exchange, typename V>
MK_ALWAYS_INLINE void sort8_each(V* x) {
  bitonic_steps<2, 1, descending, R, Exchange>(x);
  bitonic_steps<4, 2, descending, R, Exchange>(x);
  bitonic_steps<4, 1, descending, R, Exchange>(x);
  bitonic_steps<8, 4, descending, R, Exchange>(x);
  bitonic_steps<8, 2, descending, R, Exchange>(x);
  bitonic_steps<8, 1, descending, R, Exchange>(x);
}

// Each of x[0 .. R) (16 lanes) sorted: sort8's blocks (alternating), then the bitonic merge of
// the whole vector; ten steps.
template <bool descending, int R, typename Exchange, typename V>
MK_ALWAYS_INLINE void sort16_each(V* x) {
  sort8_each<descending, R, Exchange>(x);
  bitonic_steps<16, 8, descending, R, Exchange>(x);
  bitonic_steps<16, 4, descending, R, Exchange>(x);
  bitonic_steps<16, 2, descending, R, Exchange>(x);
  bitonic_steps<16, 1, descending, R, Exchange>(x);
}

}  // namespace bitonic
}  // namespace moe_kernels

#pragma GCC diagnostic pop
