// Host emulation of the CUDA capacity_positions segment kernels (csrc/cuda/capacity_positions.cu):
// the same layout (moe_kernels/capacity_segments.h: the blocks' warps -> segments, the segments'
// spans of the fill order, the chunks of 32, the scan's row blocks and warps' rows) with the warp's
// lanes run in order. A chunk's lanes in order, each taking its expert's counter and advancing it,
// rank as the device's __match_any_sync leader does (the counter plus the lower lanes of the same
// expert). Built as a shared library and called through ctypes by
// python_tests/ops/test_capacity_positions_cuda_emulation.py.
#include <stdint.h>
#include <stdlib.h>

#include <vector>

#include "moe_kernels/capacity_segments.h"
#include "moe_kernels/dispatch.h"

namespace cs = moe_kernels::capacity_segments;

namespace {

constexpr int kLanes = 32;

// A warp's segment: `visit(choice, bin, rank)` for every lane of every chunk, in the device's order.
template <class Visit>
void rank_segment(const cs::Layout& L, const int64_t* experts, const int64_t* order, int64_t g, int64_t E,
                  int32_t* counters, Visit visit) {
  const cs::Span span = cs::span_of(L, g);
  for (int c = 0; c < cs::kChunks; ++c)
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t j = cs::choice_at(L, span, order, c * cs::kChunk + lane);
      const int bin = j >= 0 ? cs::bin_of(experts[j], E) : -1;
      int32_t rank = 0;
      if (bin >= 0) rank = counters[bin]++;
      visit(j, bin, rank);
    }
}

}  // namespace

extern "C" {

int64_t warps_per_block(int64_t E) { return cs::warps_per_block(E); }
int64_t segment_choices() { return cs::kSegment; }
int supported(int64_t E, int64_t T, int64_t k) { return cs::supported(E, T, k); }

// positions [T, k] (every entry written: the caller fills a sentinel to check that), counts [E].
// order: the fill order [T k] or null (the default). Returns the segments.
int64_t capacity_positions(const int64_t* experts, const int64_t* order, int64_t T, int64_t k, int64_t E, int64_t C,
                           int64_t* positions, int64_t* counts) {
  const cs::Layout L = cs::layout(T, k, order != nullptr);
  const int64_t G = cs::segments(L);
  const int warps = cs::warps_per_block(E);
  const int64_t blocks = cs::ceil_div(G, warps);
  std::vector<int32_t> table(G * E, -1);
  std::vector<int32_t> counters(E);
  // 1. segment_counts_kernel: block x's warp w takes p = x * warps + w.
  for (int64_t x = 0; x < blocks; ++x)
    for (int w = 0; w < warps; ++w) {
      const int64_t p = x * warps + w;
      if (p >= G) continue;
      const int64_t g = cs::segment_of(L, p);
      if (g < 0 || g >= G) abort();
      for (auto& c : counters) c = 0;
      rank_segment(L, experts, order, g, E, counters.data(), [](int64_t, int, int32_t) {});
      for (int64_t e = 0; e < E; ++e) {
        if (table[g * E + e] != -1) abort();  // a row written twice
        table[g * E + e] = counters[e];
      }
    }
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
  // 3. segment_positions_kernel: the scanned row seeds the counters.
  for (int64_t x = 0; x < blocks; ++x)
    for (int w = 0; w < warps; ++w) {
      const int64_t p = x * warps + w;
      if (p >= G) continue;
      const int64_t g = cs::segment_of(L, p);
      for (int64_t e = 0; e < E; ++e) counters[e] = scanned[g * E + e];
      rank_segment(L, experts, order, g, E, counters.data(), [&](int64_t j, int bin, int32_t rank) {
        if (j >= 0) positions[j] = bin >= 0 ? moe_kernels::dispatch::position_or_drop(rank, C) : -1;
      });
    }
  return G;
}

}  // extern "C"
