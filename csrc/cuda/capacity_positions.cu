// capacity_positions on CUDA in O(T k) (the layout: moe_kernels/capacity_segments.h):
//   1. segment_counts_kernel or tile_counts_kernel: each segment's choices per expert, a table row
//      a segment;
//   2. column_partials_kernel, then column_scan_kernel: the table's exclusive sums down each
//      column, in place (each segment's counts before it), and each expert's total;
//   3. segment_positions_kernel or tile_positions_kernel: each choice's position = its expert's
//      count before its segment plus its place in the segment.
// A warp ranks a chunk of 32 choices at once: each lane's peers (the lanes of its expert, from
// __match_any_sync or from one ballot a bit of the label: capacity_segments::Path), the lowest of
// them (the leader) reads and advances the expert's counter in shared memory, and a lane's place
// is the counter plus its lower peers. Chunks go in fill order, so the places are in fill order.
// Deterministic: the only atomics are the tile path's counts, whose sums do not depend on order.
// The strided path (segment_*) reads a warp's segment straight from the ids; the tile path
// (tile_*) loads a token block's ids [128, k] rows at a time into shared memory (capacity_segments.h).
// Past capacity_segments::supported (E > 8192, T k >= 2^31, or segments past the scan's grid),
// one block per expert scans the whole fill order (O(E T k)). The 1024-thread kernels are bounded
// to 64 registers a thread (sm_75 gave the scan 72 unbounded: a launch the device refuses).
#include <cuda_runtime.h>

#include "warp.cuh"
#include "moe_kernels/capacity_segments.h"
#include "moe_kernels/cuda_launchers.h"
#include "moe_kernels/dispatch.h"

namespace moe_kernels {
namespace {

namespace cs = capacity_segments;

constexpr unsigned kFull = 0xffffffffu;
// Chunks whose experts a lane loads before ranking them: independent loads in flight.
constexpr int kLoadsAhead = 8;
static_assert(cs::kChunks % kLoadsAhead == 0, "a segment is whole batches of chunks");

// A chunk's peers: the lanes whose label equals this lane's.
struct MatchPeers {
  __device__ __forceinline__ unsigned operator()(unsigned label) const { return __match_any_sync(kFull, label); }
};

struct VotePeers {
  int bits;  // cs::label_bits(E)
  __device__ __forceinline__ unsigned operator()(unsigned label) const {
    return cs::peers_by_votes(label, bits, [](int, bool set) { return __ballot_sync(kFull, set); });
  }
};

// The lane's rank among the choices of its label so far, in fill order: its counter, advanced by
// the leader (the lowest lane of its peers) by their number, plus its lower peers. Label 0 (no
// expert) takes no counter; its rank means nothing.
template <class Peers>
__device__ __forceinline__ int rank_in_chunk(unsigned label, int* counters, const Peers& peers_of, int lane) {
  const unsigned peers = peers_of(label);
  const int leader = __ffs(peers) - 1;
  int base = 0;
  if (lane == leader && label != 0) {
    base = counters[label - 1];
    counters[label - 1] = base + __popc(peers);
  }
  base = __shfl_sync(kFull, base, leader);
  return base + __popc(peers & ((1u << lane) - 1u));
}

// The lane's choice in chunk c of segment g (-1 past the end) and its label.
__device__ __forceinline__ void load_chunk(const cs::Layout& L, const cs::Span& span,
                                           const int64_t* __restrict__ experts, const int64_t* __restrict__ order,
                                           int c, int lane, int64_t E, int64_t* choice, unsigned* label) {
  const int64_t j = cs::choice_at(L, span, order, c * cs::kChunk + lane);
  *choice = j;
  *label = j >= 0 ? cs::label_of(experts[j], E) : 0u;
}

// The strided path: ranks the warp's chunks of segment g in fill order against its counters
// `mine` [E], each expert's count advanced by its choices; `place(choice, label, rank)` gets
// every lane's choice.
template <class Peers, class Place>
__device__ __forceinline__ void rank_segment(const cs::Layout& L, const int64_t* __restrict__ experts,
                                             const int64_t* __restrict__ order, int64_t g, int64_t E, int* mine,
                                             const Peers& peers_of, Place place) {
  const int lane = threadIdx.x % kWarp;
  const cs::Span span = cs::span_of(L, g);
  for (int c0 = 0; c0 < cs::kChunks; c0 += kLoadsAhead) {
    int64_t choice[kLoadsAhead];
    unsigned label[kLoadsAhead];
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u)
      load_chunk(L, span, experts, order, c0 + u, lane, E, &choice[u], &label[u]);
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u) {
      place(choice[u], label[u], rank_in_chunk(label[u], mine, peers_of, lane));
      __syncwarp();  // the next chunk's leader of an expert may be another lane
    }
  }
}

// Row g of table [segments, E] int32: segment g's choices per expert.
template <class Peers>
__global__ void segment_counts_kernel(const int64_t* __restrict__ experts, const int64_t* __restrict__ order,
                                      cs::Layout L, int64_t E, Peers peers_of, int32_t* __restrict__ table) {
  extern __shared__ int counters[];  // [warps, E]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = (int64_t)blockIdx.x * (blockDim.x / kWarp) + warp;
  if (p >= cs::segments(L)) return;  // whole warps: no lane of a returning warp syncs below
  int* mine = counters + (int64_t)warp * E;
  for (int64_t e = lane; e < E; e += kWarp) mine[e] = 0;
  __syncwarp();
  const int64_t g = cs::segment_of(L, p);
  rank_segment(L, experts, order, g, E, mine, peers_of, [](int64_t, unsigned, int) {});
  for (int64_t e = lane; e < E; e += kWarp) table[g * E + e] = mine[e];
}

// partials [splits, E]: the sums of each kScanRows rows of the table, per column.
__device__ __forceinline__ int block_rows_sum(const int32_t* __restrict__ table, int64_t G, int64_t E,
                                              int64_t split, int64_t e, int* warp_sums) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t first = cs::scan_first_row(split, warp);
  int sum = 0;
#pragma unroll
  for (int r = 0; r < cs::kScanRowsPerWarp; ++r)
    if (e < E && first + r < G) sum += table[(first + r) * E + e];
  warp_sums[warp * kWarp + lane] = sum;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < cs::kScanWarps; ++w) total += warp_sums[w * kWarp + lane];
  return total;
}

__global__ void __launch_bounds__(cs::kScanWarps * kWarp)
    column_partials_kernel(const int32_t* __restrict__ table, int64_t G, int64_t E, int32_t* __restrict__ partials) {
  __shared__ int warp_sums[cs::kScanWarps * kWarp];
  const int64_t e = (int64_t)blockIdx.x * cs::kScanColumns + threadIdx.x % kWarp;
  const int total = block_rows_sum(table, G, E, blockIdx.y, e, warp_sums);
  if (threadIdx.x < kWarp && e < E) partials[(int64_t)blockIdx.y * E + e] = total;
}

// The table's exclusive sums down each column in place; counts[e] its column's total.
__global__ void __launch_bounds__(cs::kScanWarps * kWarp)
    column_scan_kernel(int32_t* __restrict__ table, const int32_t* __restrict__ partials, int64_t G, int64_t E,
                       int64_t* __restrict__ counts) {
  __shared__ int warp_sums[cs::kScanWarps * kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t e = (int64_t)blockIdx.x * cs::kScanColumns + lane;
  const int64_t split = blockIdx.y;
  const int total = block_rows_sum(table, G, E, split, e, warp_sums);
  int before_split = 0;  // the column's sum over the splits before this one
  for (int64_t s = 0; s < split; ++s) before_split += e < E ? partials[s * E + e] : 0;
  if (warp == 0 && split == gridDim.y - 1 && e < E) counts[e] = (int64_t)before_split + total;
  int running = before_split;  // and over this split's warps before this one
  for (int w = 0; w < warp; ++w) running += warp_sums[w * kWarp + lane];
  const int64_t first = cs::scan_first_row(split, warp);
#pragma unroll
  for (int r = 0; r < cs::kScanRowsPerWarp; ++r) {
    if (e < E && first + r < G) {
      const int v = table[(first + r) * E + e];
      table[(first + r) * E + e] = running;
      running += v;
    }
  }
}

// Every choice's position: row g of table (after the scan) seeds the warp's counters.
template <class Peers>
__global__ void segment_positions_kernel(const int64_t* __restrict__ experts, const int64_t* __restrict__ order,
                                         cs::Layout L, int64_t E, int64_t C, Peers peers_of,
                                         const int32_t* __restrict__ table, int64_t* __restrict__ positions) {
  extern __shared__ int counters[];  // [warps, E]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = (int64_t)blockIdx.x * (blockDim.x / kWarp) + warp;
  if (p >= cs::segments(L)) return;
  int* mine = counters + (int64_t)warp * E;
  const int64_t g = cs::segment_of(L, p);
  for (int64_t e = lane; e < E; e += kWarp) mine[e] = table[g * E + e];
  __syncwarp();
  rank_segment(L, experts, order, g, E, mine, peers_of, [&](int64_t choice, unsigned label, int rank) {
    if (choice >= 0) positions[choice] = label != 0 ? dispatch::position_or_drop(rank, C) : -1;
  });
}

// The tile path (capacity_segments.h). Block b: token block b, every slot; kLoads = tile_loads(k)
// entries of a tile a thread. The tile's ids that thread `tid` takes (entries q = tid + r *
// threads, memory order), -1 past the choices.
template <int kLoads>
__device__ __forceinline__ void load_tile(const int64_t* __restrict__ experts, int64_t first, int64_t n, int k,
                                          int64_t ids[kLoads]) {
  const int entries = cs::kTileTokens * k;
#pragma unroll
  for (int r = 0; r < kLoads; ++r) {
    const int q = threadIdx.x + r * blockDim.x;
    ids[r] = q < entries && first + q < n ? experts[first + q] : -1;
  }
}

// Rows (s, b) of the table: the block's choices per slot and expert, by shared-memory atomics
// (the next tile's loads in flight while this one's are added).
template <int kLoads>
__global__ void tile_counts_kernel(const int64_t* __restrict__ experts, cs::Layout L, int64_t E,
                                   int32_t* __restrict__ table) {
  extern __shared__ int counters[];  // [k, E]
  const int k = (int)L.k, threads = blockDim.x, tid = threadIdx.x;
  const int64_t b = blockIdx.x, n = L.T * L.k;
  for (int i = tid; i < k * E; i += threads) counters[i] = 0;
  __syncthreads();
  const int entries = cs::kTileTokens * k;
  const int64_t end = min(n, (b + 1) * cs::kSegment * k);
  int64_t ids[kLoads], next[kLoads];
  load_tile<kLoads>(experts, b * cs::kSegment * k, n, k, next);
  for (int64_t first = b * cs::kSegment * k; first < end; first += entries) {
#pragma unroll
    for (int r = 0; r < kLoads; ++r) ids[r] = next[r];
    if (first + entries < end) load_tile<kLoads>(experts, first + entries, n, k, next);
    cs::TileWalk w = cs::tile_walk(tid, threads, k);
#pragma unroll
    for (int r = 0; r < kLoads; ++r, cs::advance(w)) {
      const unsigned label = cs::label_of(ids[r], E);
      if (label != 0) atomicAdd(&counters[w.s * E + label - 1], 1);
    }
  }
  __syncthreads();
  for (int s = 0; s < k; ++s)
    for (int64_t e = tid; e < E; e += threads) table[(s * L.token_blocks + b) * E + e] = counters[s * E + e];
}

// Every choice's position: rows (s, b) of the table (after the scan) seed slot s's counters.
template <int kLoads, class Peers>
__global__ void tile_positions_kernel(const int64_t* __restrict__ experts, cs::Layout L, int64_t E, int64_t C,
                                      Peers peers_of, const int32_t* __restrict__ table,
                                      int64_t* __restrict__ positions) {
  extern __shared__ int shared[];
  const int k = (int)L.k, threads = blockDim.x, tid = threadIdx.x;
  int* counters = shared;        // [k, E]
  int* labels = shared + k * E;  // [kTileTokens, tile_stride(k)]: labels, then positions in their place
  const int warp = tid / kWarp, lane = tid % kWarp, warps = threads / kWarp;
  const int64_t b = blockIdx.x, n = L.T * L.k;
  for (int s = 0; s < k; ++s)
    for (int64_t e = tid; e < E; e += threads) counters[s * E + e] = table[(s * L.token_blocks + b) * E + e];
  const int entries = cs::kTileTokens * k;
  const int64_t end = min(n, (b + 1) * cs::kSegment * k);
  int64_t ids[kLoads];
  load_tile<kLoads>(experts, b * cs::kSegment * k, n, k, ids);
  for (int64_t first = b * cs::kSegment * k; first < end; first += entries) {
    // Each thread writes and later reads back only its own entries' places: the two barriers
    // below are all that order the table between the loading threads and the ranking warps.
    cs::TileWalk w = cs::tile_walk(tid, threads, k);
#pragma unroll
    for (int r = 0; r < kLoads; ++r, cs::advance(w))
      if (tid + r * threads < entries) labels[cs::label_index(w.t, w.s, k)] = (int)cs::label_of(ids[r], E);
    __syncthreads();  // the tile's labels, and the counters' seeds, before the ranks
    if (first + entries < end) load_tile<kLoads>(experts, first + entries, n, k, ids);  // in flight while ranking
    for (int s = warp; s < k; s += warps)
      for (int c = 0; c < cs::kTileTokens / cs::kChunk; ++c) {
        const int i = cs::label_index(c * cs::kChunk + lane, s, k);
        const unsigned label = (unsigned)labels[i];
        const int rank = rank_in_chunk(label, counters + s * E, peers_of, lane);
        labels[i] = label != 0 ? (int)dispatch::position_or_drop(rank, C) : -1;
        __syncwarp();  // the next chunk's leader of an expert may be another lane
      }
    __syncthreads();  // the positions before the stores
    w = cs::tile_walk(tid, threads, k);
#pragma unroll
    for (int r = 0; r < kLoads; ++r, cs::advance(w)) {
      const int q = tid + r * threads;
      if (q < entries && first + q < n) positions[first + q] = labels[cs::label_index(w.t, w.s, k)];
    }
  }
}

// One of the tile path's two kernels (the counts, else the positions) at kLoads entries a thread.
template <int kLoads>
cudaError_t launch_tiles(const int64_t* experts, const cs::Layout& L, int64_t E, int64_t C, int path,
                         int32_t* table, int64_t* positions, bool counts, cudaStream_t stream) {
  const unsigned blocks = (unsigned)L.token_blocks, threads = cs::tile_warps(L.k) * kWarp;
  if (counts) {
    tile_counts_kernel<kLoads><<<blocks, threads, cs::tile_shared_bytes(L.k, E, false), stream>>>(experts, L, E, table);
  } else {
    const size_t shared = cs::tile_shared_bytes(L.k, E, true);
    if (path == cs::kTilesMatch)
      tile_positions_kernel<kLoads><<<blocks, threads, shared, stream>>>(experts, L, E, C, MatchPeers{}, table,
                                                                         positions);
    else
      tile_positions_kernel<kLoads><<<blocks, threads, shared, stream>>>(experts, L, E, C,
                                                                         VotePeers{cs::label_bits(E)}, table,
                                                                         positions);
  }
  return cudaGetLastError();
}

cudaError_t launch_tile_kernel(const int64_t* experts, const cs::Layout& L, int64_t E, int64_t C, int path,
                               int32_t* table, int64_t* positions, bool counts, cudaStream_t stream) {
  return cs::tile_loads(L.k) == cs::kFewTileLoads
             ? launch_tiles<cs::kFewTileLoads>(experts, L, E, C, path, table, positions, counts, stream)
             : launch_tiles<cs::kMaxTileLoads>(experts, L, E, C, path, table, positions, counts, stream);
}

constexpr int kScanThreads = 1024;  // choices per scan step of the per-expert kernel

// Rank of every hit among the block's hits (exclusive), and the block's total, by warp ballots.
__device__ __forceinline__ int block_exclusive_rank(bool hit, int* warp_totals, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const unsigned ballot = __ballot_sync(kFull, hit);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_totals[warp] = __popc(ballot);
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x / kWarp;
    int v = lane < n_warps ? warp_totals[lane] : 0;
    int inclusive = v;
    for (int offset = 1; offset < kWarp; offset *= 2) {
      const int up = __shfl_up_sync(kFull, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane < n_warps) warp_totals[lane] = inclusive - v;  // exclusive prefix over warps
    if (lane == kWarp - 1) *total = inclusive;
  }
  __syncthreads();
  return warp_totals[warp] + in_warp;
}

__global__ void __launch_bounds__(kScanThreads)
    expert_scan_kernel(const int64_t* __restrict__ experts,  // [n] flat t*k+s
                       const int64_t* __restrict__ order,    // [n] fill order
                       int64_t n, int64_t C,
                       int64_t* __restrict__ positions,  // [n], prefilled -1
                       int64_t* __restrict__ counts) {   // [E]
  __shared__ int warp_totals[kScanThreads / kWarp];
  __shared__ int total;
  const int64_t e = blockIdx.x;
  int64_t running = 0;
  for (int64_t start = 0; start < n; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int64_t j = i < n ? order[i] : -1;
    const bool hit = j >= 0 && experts[j] == e;
    const int rank = block_exclusive_rank(hit, warp_totals, &total);
    if (hit) positions[j] = dispatch::position_or_drop(running + rank, C);
    running += total;
    __syncthreads();  // warp_totals / total are rewritten by the next step
  }
  if (threadIdx.x == 0) counts[e] = running;
}

}  // namespace

int64_t capacity_positions_table_size(int64_t T, int64_t k, int64_t E, bool given) {
  const cs::Layout L = cs::layout(T, k, given);
  const int64_t G = cs::segments(L);
  return G * E + cs::ceil_div(G, cs::kScanRows) * E;  // the table, then the partial sums
}

cudaError_t capacity_positions_segments_cuda(const int64_t* experts, const int64_t* order, int64_t T, int64_t k,
                                             int64_t E, int64_t C, int path, int32_t* table, int64_t* positions,
                                             int64_t* counts, cudaStream_t stream) {
  const cs::Layout L = cs::layout(T, k, order != nullptr);
  if (!cs::path_fits(path, L, E)) return cudaErrorInvalidValue;
  path = cs::resolved_path(path, L, E);
  const int64_t G = cs::segments(L);
  const VotePeers votes{cs::label_bits(E)};
  const int warps = cs::warps_per_block(E);  // the strided path's
  const unsigned blocks = (unsigned)cs::ceil_div(G, warps);
  if (cs::uses_tiles(path))
    launch_tile_kernel(experts, L, E, C, path, table, positions, true, stream);
  else if (path == cs::kStridedVotes)
    segment_counts_kernel<<<blocks, warps * kWarp, warps * E * sizeof(int), stream>>>(experts, order, L, E, votes,
                                                                                      table);
  else
    segment_counts_kernel<<<blocks, warps * kWarp, warps * E * sizeof(int), stream>>>(experts, order, L, E,
                                                                                      MatchPeers{}, table);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  int32_t* partials = table + G * E;
  const dim3 scan_grid((unsigned)cs::ceil_div(E, cs::kScanColumns), (unsigned)cs::ceil_div(G, cs::kScanRows));
  column_partials_kernel<<<scan_grid, cs::kScanWarps * kWarp, 0, stream>>>(table, G, E, partials);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  column_scan_kernel<<<scan_grid, cs::kScanWarps * kWarp, 0, stream>>>(table, partials, G, E, counts);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t segment_shared = warps * E * sizeof(int);
  switch (path) {
    case cs::kTilesVotes:
    case cs::kTilesMatch:
      return launch_tile_kernel(experts, L, E, C, path, table, positions, false, stream);
    case cs::kStridedVotes:
      segment_positions_kernel<<<blocks, warps * kWarp, segment_shared, stream>>>(experts, order, L, E, C, votes,
                                                                                  table, positions);
      break;
    default:
      segment_positions_kernel<<<blocks, warps * kWarp, segment_shared, stream>>>(experts, order, L, E, C,
                                                                                  MatchPeers{}, table, positions);
  }
  return cudaGetLastError();
}

cudaError_t capacity_positions_cuda(const int64_t* experts, const int64_t* order, int64_t n, int64_t E, int64_t C,
                                    int64_t* positions, int64_t* counts, cudaStream_t stream) {
  if (E == 0) return cudaSuccess;
  expert_scan_kernel<<<(unsigned)E, kScanThreads, 0, stream>>>(experts, order, n, C, positions, counts);
  return cudaGetLastError();
}

}  // namespace moe_kernels
