// The segment layout of the CUDA capacity_positions kernels (csrc/cuda/capacity_positions.cu),
// shared with their host emulation (python_tests/ops/emulate/capacity_positions_cuda.cpp). No
// torch headers.
//
// The fill order is cut into segments of kSegment choices, a warp a segment. A segment's table
// row (row g in fill order) holds its choices per expert; the rows' exclusive sums down each
// column give every segment its experts' counts before it; a choice's position is that count
// plus its place among its expert's choices in its segment. A warp takes its segment 32 choices
// at a time (a chunk, a lane a choice, in fill order), each expert's running count in the warp's
// row of shared counters: O(T k) work, no atomics, every choice written once.
//
// Fill orders: the default (s-major: every token's first choice, then every second, ...) and a
// given one (an array of flat indices t * k + s, by priority). In the default order segment
// g = s * token_blocks + b holds slot s of token block b (kSegment tokens), so the warps of a
// block, which take consecutive (b, s) pairs, read neighbouring entries of one stretch of experts.
#pragma once
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace capacity_segments {

constexpr int kChunk = 32;                     // choices a warp ranks at once: a lane each
constexpr int kChunks = 64;                    // chunks a segment
constexpr int64_t kSegment = kChunk * kChunks;  // choices a segment
constexpr int kMaxWarps = 8;                   // segments (warps) a block
constexpr int kCounters = 8192;                // shared int32 counters a block: warps * E
constexpr int64_t kMaxExperts = kCounters;     // one warp a block at the most experts
// The scan of the table: a block takes kScanColumns columns (a lane each) and kScanRows rows,
// a warp kScanRowsPerWarp of them.
constexpr int kScanColumns = 32;
constexpr int kScanWarps = 32;
constexpr int kScanRowsPerWarp = 8;
constexpr int64_t kScanRows = (int64_t)kScanWarps * kScanRowsPerWarp;

// The first of the kScanRowsPerWarp table rows that warp `warp` of the scan's row block `split`
// takes (rows past the table's end are skipped).
MK_HD int64_t scan_first_row(int64_t split, int warp) { return split * kScanRows + (int64_t)warp * kScanRowsPerWarp; }

MK_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether the segment kernels take E experts and T x k choices: the counters are int32, a block
// holds at least one warp's row of E of them, and the scan's row blocks fit a grid's y axis (the
// default order has k * cdiv(T, kSegment) segments, a given one fewer). Past it, the per-expert scan.
MK_HD bool supported(int64_t E, int64_t T, int64_t k) {
  return E >= 1 && E <= kMaxExperts && T * k < ((int64_t)1 << 31) && k * ceil_div(T, kSegment) <= 65535 * kScanRows;
}

// Warps (segments) a block: as many as kMaxWarps whose rows of E counters fit kCounters.
MK_HD int warps_per_block(int64_t E) {
  const int64_t w = kCounters / (E < 1 ? 1 : E);
  return (int)(w < 1 ? 1 : (w > kMaxWarps ? kMaxWarps : w));
}

struct Layout {
  int64_t T, k;
  int64_t token_blocks;  // cdiv(T, kSegment): the default order's segments a slot
  bool given;            // the fill order is an array (else the default s-major order)
};

MK_HD Layout layout(int64_t T, int64_t k, bool given) { return Layout{T, k, ceil_div(T, kSegment), given}; }

// Segments (table rows) of the fill order.
MK_HD int64_t segments(const Layout& L) { return L.given ? ceil_div(L.T * L.k, kSegment) : L.k * L.token_blocks; }

// The segment (table row) of a block's warp p (= block * warps + warp): in the default order the
// warps go along the slots of a token block (p = b * k + s); a given order's segments in order.
MK_HD int64_t segment_of(const Layout& L, int64_t p) {
  if (L.given) return p;
  const int64_t b = p / L.k, s = p - b * L.k;
  return s * L.token_blocks + b;
}

// Segment g's choices: offsets o in [0, length) of the fill order, whose flat indices t * k + s
// are first + o * step (the default order: slot s of consecutive tokens), or order[first + o]
// for a given order.
struct Span {
  int64_t first, step, length;
};

MK_HD Span span_of(const Layout& L, int64_t g) {
  if (L.given) {
    const int64_t first = g * kSegment, left = L.T * L.k - first;
    return Span{first, 1, left < kSegment ? left : kSegment};
  }
  const int64_t s = g / L.token_blocks, b = g - s * L.token_blocks;
  const int64_t t = b * kSegment, left = L.T - t;
  return Span{t * L.k + s, L.k, left < kSegment ? left : kSegment};
}

// The flat index t * k + s of offset o of a segment's span, or -1 past its length. order: the
// given order (read only if L.given).
MK_HD int64_t choice_at(const Layout& L, const Span& span, const int64_t* order, int64_t o) {
  if (o >= span.length) return -1;
  return L.given ? order[span.first + o] : span.first + o * span.step;
}

// A choice's counter (its expert), or -1 for an empty choice and an id outside [0, E), which the
// kernels drop (no slot, not counted: docs/reliability.md).
MK_HD int bin_of(int64_t expert, int64_t E) { return expert >= 0 && expert < E ? (int)expert : -1; }

}  // namespace capacity_segments
}  // namespace moe_kernels
