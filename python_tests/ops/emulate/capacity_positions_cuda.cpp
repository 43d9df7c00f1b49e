// Host emulation of the CUDA capacity_positions segment kernels (csrc/cuda/capacity_positions.cu):
// the same layout (moe_kernels/capacity_segments.h: the blocks' warps -> segments, the segments'
// spans of the fill order, the chunks of 32, the scan's row blocks and warps' rows; the tile path's
// blocks, tiles, thread walks, label table and warps' slots) with the warp's lanes run in order. A
// chunk's ranks as the device computes them: each lane's peers (by equality, as __match_any_sync
// gives them, or by capacity_segments::peers_by_votes from the chunk's votes), the leader (the
// lowest peer) reading and advancing the label's counter, a lane's rank the leader's count plus its
// lower peers. Built as a shared library and called through ctypes by
// python_tests/ops/test_capacity_positions_cuda_emulation.py.
#include <stdint.h>
#include <stdlib.h>

#include <vector>

#include "moe_kernels/capacity_segments.h"
#include "moe_kernels/dispatch.h"

namespace cs = moe_kernels::capacity_segments;

namespace {

constexpr int kLanes = 32;

bool uses_votes(int path) { return path == cs::kStridedVotes || path == cs::kTilesVotes; }

// A chunk's ranks: rank[lane] for labels[lane] (label 0: no counter, rank unused), the counters
// [E] advanced as the device's leaders advance them.
void rank_chunk(const unsigned labels[kLanes], int64_t E, bool votes, int32_t* counters, int32_t rank[kLanes]) {
  unsigned voted[32] = {};  // voted[b]: the lanes whose label has bit b set (a __ballot_sync)
  const int bits = cs::label_bits(E);
  for (int b = 0; b < bits; ++b)
    for (int lane = 0; lane < kLanes; ++lane) voted[b] |= ((labels[lane] >> b) & 1u) << lane;
  int32_t base[kLanes] = {};
  for (int lane = 0; lane < kLanes; ++lane) {  // lanes in order: a leader before its peers
    unsigned peers = 0;
    if (votes) {
      peers = cs::peers_by_votes(labels[lane], bits, [&](int b, bool) { return voted[b]; });
    } else {
      for (int other = 0; other < kLanes; ++other) peers |= (unsigned)(labels[other] == labels[lane]) << other;
    }
    const int leader = __builtin_ctz(peers);
    if (lane == leader && labels[lane] != 0) {
      base[lane] = counters[labels[lane] - 1];
      counters[labels[lane] - 1] = base[lane] + __builtin_popcount(peers);
    }
    rank[lane] = base[leader] + __builtin_popcount(peers & ((1u << lane) - 1u));
  }
}

// A warp's segment on the strided path: `visit(choice, label, rank)` for every lane of every
// chunk, in the device's order.
template <class Visit>
void rank_segment(const cs::Layout& L, const int64_t* experts, const int64_t* order, int64_t g, int64_t E,
                  bool votes, int32_t* counters, Visit visit) {
  const cs::Span span = cs::span_of(L, g);
  for (int c = 0; c < cs::kChunks; ++c) {
    int64_t choice[kLanes];
    unsigned labels[kLanes];
    int32_t rank[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) {
      choice[lane] = cs::choice_at(L, span, order, c * cs::kChunk + lane);
      labels[lane] = choice[lane] >= 0 ? cs::label_of(experts[choice[lane]], E) : 0u;
    }
    rank_chunk(labels, E, votes, counters, rank);
    for (int lane = 0; lane < kLanes; ++lane) visit(choice[lane], labels[lane], rank[lane]);
  }
}

// The tile path's entries of thread `tid` of a tile: `visit(q, walk)` for q = tid + r * threads,
// r < tile_loads(k), as the device's unrolled loops (the caller skips q past the tile or past the
// choices, as they do; the callers check that every entry is visited).
template <class Visit>
void walk_tile(int tid, int threads, int k, Visit visit) {
  cs::TileWalk w = cs::tile_walk(tid, threads, k);
  for (int r = 0; r < cs::tile_loads(k); ++r, cs::advance(w)) visit(tid + r * threads, w);
}

void tile_counts(const cs::Layout& L, const int64_t* experts, int64_t E, std::vector<int32_t>& table) {
  const int k = (int)L.k, threads = cs::tile_warps(k) * kLanes, entries = cs::kTileTokens * k;
  const int64_t n = L.T * L.k;
  std::vector<int32_t> counters(k * E);
  std::vector<int64_t> seen(n, 0);
  for (int64_t b = 0; b < L.token_blocks; ++b) {
    for (auto& c : counters) c = 0;
    for (int64_t first = b * cs::kSegment * k; first < n && first < (b + 1) * cs::kSegment * k; first += entries)
      for (int tid = 0; tid < threads; ++tid)
        walk_tile(tid, threads, k, [&](int q, const cs::TileWalk& w) {
          if (q >= entries || first + q >= n) return;
          if (w.t * k + w.s != q || seen[first + q]++) abort();  // the walk's (t, s), each entry once
          const unsigned label = cs::label_of(experts[first + q], E);
          if (label != 0) ++counters[w.s * E + label - 1];
        });
    for (int s = 0; s < k; ++s)
      for (int64_t e = 0; e < E; ++e) {
        int32_t& row = table[(s * L.token_blocks + b) * E + e];
        if (row != -1) abort();  // a row written twice
        row = counters[s * E + e];
      }
  }
  for (int64_t i = 0; i < n; ++i)
    if (seen[i] != 1) abort();
}

void tile_positions(const cs::Layout& L, const int64_t* experts, int64_t E, int64_t C, bool votes,
                    const std::vector<int32_t>& scanned, int64_t* positions) {
  const int k = (int)L.k, warps = cs::tile_warps(k), threads = warps * kLanes, entries = cs::kTileTokens * k;
  const int64_t n = L.T * L.k;
  std::vector<int32_t> counters(k * E);
  std::vector<int64_t> labels(cs::kTileTokens * cs::tile_stride(k));  // int64: a -9 marks a place not written
  for (int64_t b = 0; b < L.token_blocks; ++b) {
    for (int s = 0; s < k; ++s)
      for (int64_t e = 0; e < E; ++e) counters[s * E + e] = scanned[(s * L.token_blocks + b) * E + e];
    const int64_t end = n < (b + 1) * cs::kSegment * k ? n : (b + 1) * cs::kSegment * k;
    for (int64_t first = b * cs::kSegment * k; first < end; first += entries) {
      for (auto& l : labels) l = -9;
      for (int tid = 0; tid < threads; ++tid)
        walk_tile(tid, threads, k, [&](int q, const cs::TileWalk& w) {
          if (q >= entries) return;
          int64_t& place = labels[cs::label_index(w.t, w.s, k)];
          if (place != -9) abort();  // two entries on one place
          place = first + q < n ? cs::label_of(experts[first + q], E) : 0u;
        });
      for (int warp = 0; warp < warps; ++warp)
        for (int s = warp; s < k; s += warps)
          for (int c = 0; c < cs::kTileTokens / cs::kChunk; ++c) {
            unsigned chunk[kLanes];
            int32_t rank[kLanes];
            for (int lane = 0; lane < kLanes; ++lane) {
              const int64_t label = labels[cs::label_index(c * cs::kChunk + lane, s, k)];
              if (label < 0) abort();  // a place no thread loaded
              chunk[lane] = (unsigned)label;
            }
            rank_chunk(chunk, E, votes, counters.data() + s * E, rank);
            for (int lane = 0; lane < kLanes; ++lane)
              labels[cs::label_index(c * cs::kChunk + lane, s, k)] =
                  chunk[lane] != 0 ? moe_kernels::dispatch::position_or_drop(rank[lane], C) : -1;
          }
      for (int tid = 0; tid < threads; ++tid)
        walk_tile(tid, threads, k, [&](int q, const cs::TileWalk& w) {
          if (q < entries && first + q < n) positions[first + q] = labels[cs::label_index(w.t, w.s, k)];
        });
    }
  }
}

}  // namespace

extern "C" {

int64_t warps_per_block(int64_t E) { return cs::warps_per_block(E); }
int64_t segment_choices() { return cs::kSegment; }
int supported(int64_t E, int64_t T, int64_t k) { return cs::supported(E, T, k); }
int tiles_fit(int64_t E, int64_t T, int64_t k, int given) { return cs::tiles_fit(cs::layout(T, k, given), E); }
int resolved_path(int path, int64_t E, int64_t T, int64_t k, int given) {
  return cs::resolved_path(path, cs::layout(T, k, given), E);
}
int label_bits(int64_t E) { return cs::label_bits(E); }

// positions [T, k] (every entry written: the caller fills a sentinel to check that), counts [E].
// order: the fill order [T k] or null (the default); path: a capacity_segments::Path. Returns the
// segments, or -1 where the path does not fit.
int64_t capacity_positions(const int64_t* experts, const int64_t* order, int64_t T, int64_t k, int64_t E, int64_t C,
                           int path, int64_t* positions, int64_t* counts) {
  const cs::Layout L = cs::layout(T, k, order != nullptr);
  if (!cs::path_fits(path, L, E)) return -1;
  path = cs::resolved_path(path, L, E);
  const bool votes = uses_votes(path);
  const int64_t G = cs::segments(L);
  const int warps = cs::warps_per_block(E);
  const int64_t blocks = cs::ceil_div(G, warps);
  std::vector<int32_t> table(G * E, -1);
  std::vector<int32_t> counters(E);
  // 1. tile_counts_kernel, or segment_counts_kernel: block x's warp w takes p = x * warps + w.
  if (cs::uses_tiles(path)) tile_counts(L, experts, E, table);
  for (int64_t x = 0; x < blocks && !cs::uses_tiles(path); ++x)
    for (int w = 0; w < warps; ++w) {
      const int64_t p = x * warps + w;
      if (p >= G) continue;
      const int64_t g = cs::segment_of(L, p);
      if (g < 0 || g >= G) abort();
      for (auto& c : counters) c = 0;
      rank_segment(L, experts, order, g, E, votes, counters.data(), [](int64_t, unsigned, int32_t) {});
      for (int64_t e = 0; e < E; ++e) {
        if (table[g * E + e] != -1) abort();  // a row written twice
        table[g * E + e] = counters[e];
      }
    }
  for (int64_t i = 0; i < G * E; ++i)
    if (table[i] == -1) abort();  // a row not written
  // 2. column_partials_kernel and column_scan_kernel: blocks of kScanRows rows, a warp's rows from
  // scan_first_row; each column's sums over the row blocks before, then over the warps before.
  const int64_t splits = cs::ceil_div(G, cs::kScanRows);
  std::vector<int64_t> partials(splits * E, 0), warp_sums(cs::kScanWarps * E, 0);
  std::vector<int32_t> scanned(G * E, -1);
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t split = 0; split < splits; ++split) {
      for (int w = 0; w < cs::kScanWarps; ++w)
        for (int64_t e = 0; e < E; ++e) {
          int64_t sum = 0;
          const int64_t first = cs::scan_first_row(split, w);
          for (int r = 0; r < cs::kScanRowsPerWarp; ++r)
            if (first + r < G) sum += table[(first + r) * E + e];
          warp_sums[w * E + e] = sum;
        }
      for (int64_t e = 0; e < E; ++e) {
        int64_t total = 0;
        for (int w = 0; w < cs::kScanWarps; ++w) total += warp_sums[w * E + e];
        if (pass == 0) {
          partials[split * E + e] = total;
          continue;
        }
        int64_t before_split = 0;
        for (int64_t s = 0; s < split; ++s) before_split += partials[s * E + e];
        if (split == splits - 1) counts[e] = before_split + total;
        for (int w = 0; w < cs::kScanWarps; ++w) {
          int64_t running = before_split;
          for (int v = 0; v < w; ++v) running += warp_sums[v * E + e];
          const int64_t first = cs::scan_first_row(split, w);
          for (int r = 0; r < cs::kScanRowsPerWarp; ++r)
            if (first + r < G) {
              if (scanned[(first + r) * E + e] != -1) abort();  // a row scanned twice
              scanned[(first + r) * E + e] = (int32_t)running;
              running += table[(first + r) * E + e];
            }
        }
      }
    }
  // 3. tile_positions_kernel, or segment_positions_kernel: the scanned rows seed the counters.
  if (cs::uses_tiles(path)) tile_positions(L, experts, E, C, votes, scanned, positions);
  for (int64_t x = 0; x < blocks && !cs::uses_tiles(path); ++x)
    for (int w = 0; w < warps; ++w) {
      const int64_t p = x * warps + w;
      if (p >= G) continue;
      const int64_t g = cs::segment_of(L, p);
      for (int64_t e = 0; e < E; ++e) counters[e] = scanned[g * E + e];
      rank_segment(L, experts, order, g, E, votes, counters.data(), [&](int64_t j, unsigned label, int32_t rank) {
        if (j >= 0) positions[j] = label != 0 ? moe_kernels::dispatch::position_or_drop(rank, C) : -1;
      });
    }
  return G;
}

}  // extern "C"
