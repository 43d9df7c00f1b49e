// The k <= 8 largest rank pairs of rows of 16 to 256 float32 elements on AVX-512 (F, BW, VBMI2).
// pairs_topk.h's candidate sort (every other CPU and width) writes candidates and their pairs to
// memory and reads them back (partial overlaps of those stores with the loads stall store
// forwarding), keeps ~18 candidates of a 64-wide row (its floor is the least of 8 group maxima) and
// sorts them as 64-bit pairs; this one keeps the candidates in registers (about twice as fast at
// E = 64; docs/topk_softmax.md has the timings).
//
//  1. the 16 lane maxima (lane l holds elements l, l + 16, ...);
//  2. the floor: the 8th largest lane maximum. The 8 lanes whose maxima are at or above it hold 8
//     distinct elements >= floor, so no element below the floor is among the row's 8 largest;
//  3. the elements >= floor, and NaNs (an unordered compare; a row with one is left to the caller,
//     and if the maxima's network made the floor NaN, every element is taken): their indices by a
//     byte compress of each 64-element word's compare mask, the words joined by byte expands (on
//     random rows ~10 of 64, more than 16 in ~0.1% of rows; 0.4% at E = 128, 0.6% at 256), their
//     values by permutes of a 64-wide row's four vectors, gathered from a wider row;
//  4. the candidates sorted as one vector of int32: the rank key's top 28 bits above 15 - the
//     candidate's number (candidates are in index order, so a lower index ranks first among equal
//     prefixes). That is the rank-pair order (exact ties included) unless two different keys
//     share a prefix (values a few ulp apart: checked after the sort, on neighbouring lanes), and
//     those rows are left to the caller, which ranks them by full pairs.
//
// Rows of up to 128 go in blocks of 16, and steps 2 and 4 run on the block's 16 vectors
// transposed (lane r holding row r's): a network's compare-exchange is then a max and a min for 16
// rows, with no shuffle (19 exchanges for each half of the floor's 16, Batcher's 63 for the sort),
// where bitonic networks across one row's lanes take a shuffle, a min and a masked max for each of
// ~17 steps. The two transposes cost 64 shuffles a block. Wider rows keep the networks across
// lanes, four rows at a time (the blocks are slower there).
#pragma once
#include <cstdint>

namespace moe_kernels {

// The k largest rank pairs (1 <= k <= 8) of rows [0, n) of x (row i at x + i * stride, E in
// [16, 256] elements), descending, into best[k * i .. k * i + k). Returns false (nothing written
// but *n_redo = 0) when the CPU lacks AVX-512 F, BW or VBMI2 or popcnt, or E or k is out of range.
// A row the variant does not finish (it holds a NaN, more than 16 elements are at or above its
// floor, or two different candidates' rank keys agree but for their last 4 bits) is left for the
// caller: its index goes into redo [n], counted by *n_redo (its slots hold garbage). Writes
// nothing past best[k * n).
bool rows_top8_pairs_f32(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* best,
                         int64_t* redo, int64_t* n_redo);

// rows_top8_pairs_f32's selection of rows of 16 to 128 elements, each block of 16 rows' pairs
// kept in a buffer of the call's and turned into experts and renormalised weights there
// (score/exp_terms.h's renormalized_pairs_f32, bit for bit) into experts and w [n * k]: one pass
// over the rows, faster than blocks of rows selected into a buffer and then weighted (the pairs
// stay in L1). A row left for the
// caller (redo, *n_redo, as rows_top8_pairs_f32) holds garbage in experts and w. Returns false,
// writing nothing but *n_redo = 0, where rows_top8_pairs_f32 or renormalized_pairs_f32 would, or
// for E > 128. Writes nothing past experts[n * k] and w[n * k].
bool rows_top8_renormalized_f32(const float* x, int64_t stride, int64_t n, int64_t E, int k, int64_t* experts,
                                float* w, int64_t* redo, int64_t* n_redo);

}  // namespace moe_kernels
