// The segment layout of the CUDA capacity_positions kernels (csrc/cuda/capacity_positions.cu),
// shared with their host emulation (python_tests/ops/emulate/capacity_positions_cuda.cpp). No
// torch headers.
//
// The fill order is cut into segments of kSegment choices. A segment's table row (row g in fill
// order) holds its choices per expert; the rows' exclusive sums down each column give every
// segment its experts' counts before it; a choice's position is that count plus its place among
// its expert's choices in its segment. On the strided path a warp takes a segment 32 choices at a
// time (a chunk, a lane a choice, in fill order), each expert's running count in the warp's row
// of shared counters: O(T k) work, every choice written once; the tile path (below) ranks the
// same chunks from shared memory, and only its counts use atomics (sums, whatever their order).
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

// A choice's label: its expert + 1, or 0 for an empty choice and an id outside [0, E), which the
// kernels drop (no slot, not counted: docs/reliability.md). Label l > 0 takes counter l - 1.
MK_HD unsigned label_of(int64_t expert, int64_t E) { return expert >= 0 && expert < E ? (unsigned)expert + 1u : 0u; }

// The bits that tell the labels 0..E apart (E >= 1): the bit width of E.
MK_HD int label_bits(int64_t E) {
  int bits = 0;
  while (bits < 32 && (E >> bits) != 0) ++bits;
  return bits;
}

// The lanes of a warp whose label equals this lane's, from one vote a bit: `vote(b, set)` is the
// mask of the lanes whose label has bit b set (a __ballot_sync on the device, every lane passing
// its own `set`). The same mask as __match_any_sync(~0u, label) for labels below 2^bits; CUB ranks
// its radix digits this way, its comment saying match.any is the slower on a few bits.
template <class Vote>
MK_HD unsigned peers_by_votes(unsigned label, int bits, Vote vote) {
  unsigned peers = 0xffffffffu;
  for (int b = 0; b < bits; ++b) {
    const bool set = ((label >> b) & 1u) != 0;
    const unsigned voted = vote(b, set);
    peers &= set ? voted : ~voted;
  }
  return peers;
}

// The ways the kernels run (csrc/cuda/capacity_positions.cu): the strided path (a warp a segment,
// as above) and the tile path (below), each with a chunk's peers from __match_any_sync ("match")
// or from votes (peers_by_votes). kAuto: the strided path with match, the one timed on the H200 at
// 290ae21. The other three run only where forced, until a GPU has timed them against it
// (bench/gpu_capacity_variants.py): a default is chosen by a measurement, and the tile path has
// been checked only by the host emulation and nvcc.
enum Path : int { kAuto = -1, kStridedMatch = 0, kStridedVotes = 1, kTilesVotes = 2, kTilesMatch = 3 };

// The tile path, for the default order: a block takes a token block b and all k of its segments
// (s, b), a warp the slots s = warp, warp + warps, ... Its threads load the block's experts
// kTileTokens tokens at a time, the [kTileTokens, k] rows whole (a warp's load is 32 neighbouring
// ids, where the strided path's takes one id from each of 32 rows k ids apart), into a [kTileTokens,
// tile_stride(k)] table of labels in shared memory; the warps rank their slots' chunks from it, and
// each position goes back into the label's place, to be stored in the loading threads' order. Its
// counts kernel adds each label to its slot's counter with a shared-memory atomic (a count does not
// depend on the order). Fits the default order with 2 <= k <= kMaxTileSlots and k E <= kCounters.
constexpr int kTileTokens = 128;
constexpr int kMaxTileSlots = 16;
static_assert(kSegment % kTileTokens == 0 && kTileTokens % kChunk == 0, "a segment is whole tiles of chunks");
// A thread's entries of a tile: ceil(kTileTokens k / (32 min(k, kMaxWarps))), 4 up to kMaxWarps
// slots (tile_loads: the kernels are compiled for 4 and kMaxTileLoads), at most k / 2 rounded up
// from there.
constexpr int kMaxTileLoads = kTileTokens * kMaxTileSlots / (kChunk * kMaxWarps);
constexpr int kFewTileLoads = kTileTokens / kChunk;
static_assert(kFewTileLoads * kChunk >= kTileTokens && kMaxTileLoads * kChunk * kMaxWarps >= kTileTokens * kMaxTileSlots,
              "a tile's threads take all of its entries");

MK_HD bool tiles_fit(const Layout& L, int64_t E) {
  return !L.given && L.k >= 2 && L.k <= kMaxTileSlots && L.k * E <= kCounters;
}

MK_HD bool path_fits(int path, const Layout& L, int64_t E) {
  if (path == kTilesVotes || path == kTilesMatch) return tiles_fit(L, E);
  return path == kAuto || path == kStridedMatch || path == kStridedVotes;
}

MK_HD int resolved_path(int path, const Layout&, int64_t) { return path != kAuto ? path : kStridedMatch; }

MK_HD bool uses_tiles(int path) { return path == kTilesVotes || path == kTilesMatch; }

// Warps a block of the tile path: one a slot up to kMaxWarps.
MK_HD int tile_warps(int64_t k) { return (int)(k < kMaxWarps ? k : kMaxWarps); }

// A thread's entries of a tile, as the kernels are compiled: kFewTileLoads up to kMaxWarps slots.
MK_HD int tile_loads(int64_t k) { return k <= kMaxWarps ? kFewTileLoads : kMaxTileLoads; }

// The label table's row stride: odd, so that a warp reading one slot of 32 tokens hits 32 banks.
MK_HD int tile_stride(int64_t k) { return (int)(k | 1); }

// Shared bytes of a tile kernel's block: the k rows of E counters, and for the positions the labels.
MK_HD int64_t tile_shared_bytes(int64_t k, int64_t E, bool labels) {
  return (int64_t)sizeof(int) * (k * E + (labels ? (int64_t)kTileTokens * tile_stride(k) : 0));
}
// The most (k E = kCounters, k = kMaxTileSlots) within the 48 KB a launch gets without opting in.
static_assert(sizeof(int) * (kCounters + kTileTokens * (kMaxTileSlots | 1)) <= 48 * 1024, "the tile path's shared memory");

// Thread `tid` of `threads` takes a tile's entries q = tid, tid + threads, ... < kTileTokens k
// (the tile's ids in memory order), entry q being token t = q / k and slot s = q % k of the tile.
// TileWalk keeps (t, s) from one entry to the next without a division.
struct TileWalk {
  int t, s, dt, ds, k;
};

MK_HD TileWalk tile_walk(int tid, int threads, int k) { return TileWalk{tid / k, tid % k, threads / k, threads % k, k}; }

MK_HD void advance(TileWalk& w) {
  w.t += w.dt;
  w.s += w.ds;
  if (w.s >= w.k) {
    w.s -= w.k;
    ++w.t;
  }
}

// Entry (t, s)'s place in the label table.
MK_HD int label_index(int t, int s, int k) { return t * tile_stride(k) + s; }

}  // namespace capacity_segments
}  // namespace moe_kernels
