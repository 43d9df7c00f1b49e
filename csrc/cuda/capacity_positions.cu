// capacity_positions on CUDA in O(T k) (the layout: moe_kernels/capacity_segments.h):
//   1. segment_counts_kernel: each segment's choices per expert, a table row a segment;
//   2. column_partials_kernel, then column_scan_kernel: the table's exclusive sums down each
//      column, in place (each segment's counts before it), and each expert's total;
//   3. segment_positions_kernel: each choice's position = its expert's count before its segment
//      plus its place in the segment.
// A warp ranks a chunk of 32 choices at once: __match_any_sync gives each lane the lanes of its
// expert, the lowest of them (the leader) reads and advances the expert's counter in the warp's
// shared row, and a lane's place is the counter plus its lower peers. Chunks go in fill order,
// so the places are in fill order. No atomics; deterministic.
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

// The lane's choice in chunk c of segment g (-1 past the end) and its counter (-1: dropped).
__device__ __forceinline__ void load_chunk(const cs::Layout& L, const cs::Span& span,
                                           const int64_t* __restrict__ experts, const int64_t* __restrict__ order,
                                           int c, int lane, int64_t E, int64_t* choice, int* bin) {
  const int64_t j = cs::choice_at(L, span, order, c * cs::kChunk + lane);
  *choice = j;
  *bin = j >= 0 ? cs::bin_of(experts[j], E) : -1;
}

// Ranks the warp's chunks of segment g in fill order against its counters `mine` [E], each
// expert's count advanced by its choices; `place(choice, bin, rank)` gets every lane's choice.
template <class Place>
__device__ __forceinline__ void rank_segment(const cs::Layout& L, const int64_t* __restrict__ experts,
                                             const int64_t* __restrict__ order, int64_t g, int64_t E, int* mine,
                                             Place place) {
  const int lane = threadIdx.x % kWarp;
  const unsigned lower = (1u << lane) - 1u;
  const cs::Span span = cs::span_of(L, g);
  for (int c0 = 0; c0 < cs::kChunks; c0 += kLoadsAhead) {
    int64_t choice[kLoadsAhead];
    int bin[kLoadsAhead];
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u) load_chunk(L, span, experts, order, c0 + u, lane, E, &choice[u], &bin[u]);
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u) {
      const unsigned peers = __match_any_sync(kFull, bin[u]);
      const int leader = __ffs(peers) - 1;
      int base = 0;
      if (lane == leader && bin[u] >= 0) {
        base = mine[bin[u]];
        mine[bin[u]] = base + __popc(peers);
      }
      base = __shfl_sync(kFull, base, leader);
      place(choice[u], bin[u], base + __popc(peers & lower));
      __syncwarp();  // the next chunk's leader of an expert may be another lane
    }
  }
}

// Row g of table [segments, E] int32: segment g's choices per expert.
__global__ void segment_counts_kernel(const int64_t* __restrict__ experts, const int64_t* __restrict__ order,
                                      cs::Layout L, int64_t E, int32_t* __restrict__ table) {
  extern __shared__ int counters[];  // [warps, E]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = (int64_t)blockIdx.x * (blockDim.x / kWarp) + warp;
  if (p >= cs::segments(L)) return;  // whole warps: no lane of a returning warp syncs below
  int* mine = counters + (int64_t)warp * E;
  for (int64_t e = lane; e < E; e += kWarp) mine[e] = 0;
  __syncwarp();
  const int64_t g = cs::segment_of(L, p);
  rank_segment(L, experts, order, g, E, mine, [](int64_t, int, int) {});
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
__global__ void segment_positions_kernel(const int64_t* __restrict__ experts, const int64_t* __restrict__ order,
                                         cs::Layout L, int64_t E, int64_t C, const int32_t* __restrict__ table,
                                         int64_t* __restrict__ positions) {
  extern __shared__ int counters[];  // [warps, E]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t p = (int64_t)blockIdx.x * (blockDim.x / kWarp) + warp;
  if (p >= cs::segments(L)) return;
  int* mine = counters + (int64_t)warp * E;
  const int64_t g = cs::segment_of(L, p);
  for (int64_t e = lane; e < E; e += kWarp) mine[e] = table[g * E + e];
  __syncwarp();
  rank_segment(L, experts, order, g, E, mine, [&](int64_t choice, int bin, int rank) {
    if (choice >= 0) positions[choice] = bin >= 0 ? dispatch::position_or_drop(rank, C) : -1;
  });
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
                                             int64_t E, int64_t C, int32_t* table, int64_t* positions,
                                             int64_t* counts, cudaStream_t stream) {
  const cs::Layout L = cs::layout(T, k, order != nullptr);
  const int64_t G = cs::segments(L);
  const int warps = cs::warps_per_block(E);
  const size_t shared = (size_t)warps * E * sizeof(int);
  const unsigned blocks = (unsigned)cs::ceil_div(G, warps);
  segment_counts_kernel<<<blocks, warps * kWarp, shared, stream>>>(experts, order, L, E, table);
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
  segment_positions_kernel<<<blocks, warps * kWarp, shared, stream>>>(experts, order, L, E, C, table, positions);
  return cudaGetLastError();
}

cudaError_t capacity_positions_cuda(const int64_t* experts, const int64_t* order, int64_t n, int64_t E, int64_t C,
                                    int64_t* positions, int64_t* counts, cudaStream_t stream) {
  if (E == 0) return cudaSuccess;
  expert_scan_kernel<<<(unsigned)E, kScanThreads, 0, stream>>>(experts, order, n, C, positions, counts);
  return cudaGetLastError();
}

}  // namespace moe_kernels
