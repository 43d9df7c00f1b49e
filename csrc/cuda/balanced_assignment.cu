// Exact balanced assignment on CUDA: the CPU kernel's algorithm (auction warm start, then cycle
// cancelling with Floyd-Warshall over the experts + the free-slot node) with the device doing
// every round. The phases live in moe_kernels/balanced_assignment_steps.h (run on the host by the
// emulation test); this file supplies the block executor, the kernels and the host loop.
//   auction_kernel       1 block: score range, parallel (Jacobi) auction phases (a warp's lanes
//                        share a bidder's row where bidders are few; none where every row of the
//                        scores is constant: its result is known, decided on the device), token
//                        grouping
//   move_costs_kernel    k blocks: row j of d, a min-reduction over the tokens of expert j
//   cancel_cycles_kernel 1 block: Floyd-Warshall (N steps of N x N relaxations; its state in
//                        shared memory where it fits), cycles, moves
//   finish_kernel        1 block: experts (int64) and the value
// A round is move_costs + cancel_cycles; both return at once when the done flag (device memory)
// is set, so the host enqueues rounds in batches (4, 8, 16, ...) and reads the flag once per
// batch: no host round trip per round. docs/balanced_assignment.md explains the choices.
#include <cuda_runtime.h>

#include "warp.cuh"
#include "moe_kernels/balanced_assignment_steps.h"
#include "moe_kernels/cuda_launchers.h"

namespace moe_kernels {
namespace {

namespace ba = balanced_assignment;

constexpr int kSolverThreads = 512;  // the single-block kernels
constexpr int kMoveThreads = 256;    // move_costs_kernel: lanes of tokens x columns
constexpr int kMaxWarps = kSolverThreads / kWarp;
// Whole warps: for_each_top2's groups, reduce and exclusive_scan rely on it.
static_assert(kSolverThreads % kWarp == 0 && kMoveThreads % kWarp == 0, "blocks of whole warps");
// __launch_bounds__(threads, 1) everywhere: without the minimum of one block per SM, ptxas 13 for
// sm_90 caps the registers of move_costs / auction (float) low enough to spill.
// Rounds enqueued between two reads of the done flag: 4, then doubling up to 64. The emulation's
// inputs take 1-7 rounds at the benchmark sizes (docs/balanced_assignment.md), so one or two
// reads; at most about half the enqueued rounds are no-ops.
constexpr int kFirstBatch = 4, kMaxBatch = 64;
// The auction's prices go to shared memory up to this size (k = 4096), within the 48 KB a launch
// gets without opting in to more (with the kernel's static shared memory).
constexpr int64_t kSharedPricesBytes = 32 * 1024;
// A guard against a solver bug, far above any count seen.
constexpr int64_t kMaxRounds = int64_t(1) << 16;
static_assert(kBalancedProfileFields == (int)ba::kNumInts + (int)ba::kNumClocks + 1, "the profile's fields (cuda_launchers.h)");

// The Exec of balanced_assignment_steps.h for one CUDA block. `red` and `scan` point to shared
// memory of the kernel.
struct BlockExec {
  double* red;       // [kMaxWarps + 1]
  int32_t* scan;     // [kMaxWarps + 1]

  __device__ int64_t threads() const { return blockDim.x; }
  __device__ bool leader() const { return threadIdx.x == 0; }
  __device__ int64_t clock() const { return clock64(); }
  __device__ void barrier() const { __syncthreads(); }
  __device__ bool any(bool v) const { return __syncthreads_or(v) != 0; }
  __device__ int32_t atomic_add(int32_t* p, int32_t v) const { return atomicAdd(p, v); }

  template <class F>
  __device__ void for_each(int64_t count, F&& f) const {
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) f(i);
  }

  // Block-wide reduction by `op` (identity `id`); every thread gets the result.
  template <class Op>
  __device__ double reduce(double v, double id, Op op) const {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
    for (int offset = kWarp / 2; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
      double x = lane < warps ? red[lane] : id;
      for (int offset = kWarp / 2; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
      if (lane == 0) red[kMaxWarps] = x;
    }
    __syncthreads();
    const double out = red[kMaxWarps];
    __syncthreads();  // red is reused by the next reduction
    return out;
  }
  __device__ double reduce_min(double v) const {
    return reduce(v, ba::inf(), [](double a, double b) { return a < b ? a : b; });
  }
  __device__ double reduce_max(double v) const {
    return reduce(v, -ba::inf(), [](double a, double b) { return a > b ? a : b; });
  }
  __device__ double reduce_sum(double v) const {
    return reduce(v, 0.0, [](double a, double b) { return a + b; });
  }

  // Groups of `lanes` consecutive threads (a power of two <= kWarp, so a group never straddles a
  // warp; count = groups * lanes and blockDim.x are multiples of lanes, so a stride of the loop
  // holds whole groups) each merge their partials by xor shuffles among the group's lanes only.
  template <class Partial, class Out>
  __device__ void for_each_top2(int64_t groups, int64_t lanes, Partial&& partial, Out&& out) const {
    const int64_t count = groups * lanes;
    const int base = (int)(threadIdx.x % kWarp) & ~(int)(lanes - 1);
    const unsigned mask = lanes == kWarp ? 0xffffffffu : ((1u << lanes) - 1u) << base;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      const int64_t g = i / lanes, lane = i % lanes;
      ba::Top2 t = partial(g, lane);
      for (int offset = (int)lanes / 2; offset > 0; offset /= 2) {
        ba::Top2 o;
        o.v1 = __shfl_xor_sync(mask, t.v1, offset);
        o.v2 = __shfl_xor_sync(mask, t.v2, offset);
        o.j1 = (int64_t)__shfl_xor_sync(mask, (long long)t.j1, offset);
        t = ba::merge_top2(t, o);
      }
      if (lane == 0) out(g, t);
    }
  }

  // out[0..n] = exclusive prefix sums of in[0..n) (out[n] = total), blockDim.x entries at a time:
  // a warp scan, then a scan of the warp totals, plus the carry of the previous chunks.
  __device__ void exclusive_scan(const int32_t* in, int32_t* out, int64_t n) const {
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
    int32_t carry = 0;
    for (int64_t base = 0; base < n; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      const int32_t v = i < n ? in[i] : 0;
      int32_t inclusive = v;
      for (int offset = 1; offset < kWarp; offset *= 2) {
        const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += up;
      }
      if (lane == kWarp - 1) scan[warp] = inclusive;
      __syncthreads();
      if (warp == 0) {
        const int32_t total = lane < warps ? scan[lane] : 0;
        int32_t prefix = total;
        for (int offset = 1; offset < kWarp; offset *= 2) {
          const int32_t up = __shfl_up_sync(0xffffffffu, prefix, offset);
          if (lane >= offset) prefix += up;
        }
        if (lane < warps) scan[lane] = prefix - total;  // exclusive over the warps
        if (lane == kWarp - 1) scan[kMaxWarps] = prefix;  // the chunk's total
      }
      __syncthreads();
      if (i < n) out[i] = carry + scan[warp] + inclusive - v;
      carry += scan[kMaxWarps];
      __syncthreads();  // scan is rewritten by the next chunk
    }
    if (threadIdx.x == 0) out[n] = carry;
    __syncthreads();
  }
};

#define MK_BLOCK_EXEC                            \
  __shared__ double red_shared[kMaxWarps + 1];   \
  __shared__ int32_t scan_shared[kMaxWarps + 1]; \
  const BlockExec ex{red_shared, scan_shared}

// The auction's flags and counters, its few-bid buffers, its prices where they fit (shared_prices:
// k doubles of dynamic shared memory) and its experts' heaps of holders where they fit too (shared_heaps: heap_bid and
// heap_token [k, heap_stride], heap_size [k], after the prices) live in shared memory while it
// runs: most bidding iterations have a handful of bidders, so their time is the latency of the
// block's steps, not bandwidth, and a heap update is a chain of dependent loads, each of a line the
// last update wrote (global stores do not leave their lines in L1: from global memory each load of
// the chain waits on L2). The flags are copied back to the workspace at the end (the host and the
// later kernels read them there); the prices and heaps are not (nothing after the auction reads
// them; each attempt empties the heaps before it pushes).
template <typename scalar_t>
__global__ void __launch_bounds__(kSolverThreads, 1)
    auction_kernel(ba::Problem<scalar_t> P, ba::Workspace W, bool shared_prices, bool shared_heaps) {
  const int64_t started = clock64();
  MK_BLOCK_EXEC;
  extern __shared__ double prices_shared[];  // [k] if shared_prices, then the heaps if shared_heaps
  __shared__ int32_t ints_shared[ba::kNumInts];
  __shared__ int32_t few_queue_shared[2][ba::kFewBids], few_target_shared[ba::kFewBids];
  __shared__ double few_bid_shared[ba::kFewBids];
  ba::score_stats(ex, P, W);  // ends with a barrier: the flags and prices are initialised
  ba::Workspace local = W;
  local.ints = ints_shared;
  local.few_queue[0] = few_queue_shared[0];
  local.few_queue[1] = few_queue_shared[1];
  local.few_target = few_target_shared;
  local.few_bid = few_bid_shared;
  if (shared_prices) local.prices = prices_shared;
  if (shared_heaps) {  // (shared_heaps implies shared_prices: the host's rule)
    local.heap_bid = prices_shared + P.k;
    local.heap_token = reinterpret_cast<int32_t*>(local.heap_bid + P.k * W.heap_stride);
    local.heap_size = local.heap_token + P.k * W.heap_stride;
  }
  for (int64_t f = threadIdx.x; f < ba::kNumInts; f += blockDim.x)
    ints_shared[f] = f == ba::kSharedHeaps ? (int32_t)shared_heaps : W.ints[f];
  if (shared_prices)
    for (int64_t j = threadIdx.x; j < P.k; j += blockDim.x) prices_shared[j] = W.prices[j];
  __syncthreads();
  ba::auction(ex, P, local);
  __syncthreads();
  for (int64_t f = threadIdx.x; f < ba::kNumInts; f += blockDim.x) W.ints[f] = ints_shared[f];
  if (threadIdx.x == 0) W.clocks[ba::kClockAuction] = clock64() - started;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMoveThreads, 1) move_costs_kernel(ba::Problem<scalar_t> P, ba::Workspace W) {
  const int64_t started = clock64();
  MK_BLOCK_EXEC;
  __shared__ double part_cost[kMoveThreads];
  __shared__ int32_t part_token[kMoveThreads];
  ba::move_costs_row(ex, P, W, blockIdx.x, part_cost, part_token);
  if (threadIdx.x == 0)  // the round's longest block; the pass after it adds it up
    atomicMax(reinterpret_cast<unsigned long long*>(W.clocks + ba::kClockMovesRound),
              (unsigned long long)(clock64() - started));
}

// The Floyd-Warshall state of a pass for up to N nodes, one block of bytes: dist [N, N], col and
// row [N] (double), nxt [N, N], col_nxt [N] (int32), blocked [N] (char), in that order. Returns
// its size; with W also points W's arrays into `base`. A pass rebuilds all of it from the residual
// graph, and nothing after the pass reads it (d* goes to `distances`).
__host__ __device__ size_t graph_layout(int64_t N, char* base, ba::Workspace* W) {
  const size_t col = sizeof(double) * N * N, row = col + sizeof(double) * N, nxt = row + sizeof(double) * N;
  const size_t col_nxt = nxt + sizeof(int32_t) * N * N, blocked = col_nxt + sizeof(int32_t) * N;
  if (W != nullptr) {
    W->dist = reinterpret_cast<double*>(base);
    W->col = reinterpret_cast<double*>(base + col);
    W->row = reinterpret_cast<double*>(base + row);
    W->nxt = reinterpret_cast<int32_t*>(base + nxt);
    W->col_nxt = reinterpret_cast<int32_t*>(base + col_nxt);
    W->blocked = base + blocked;
  }
  return blocked + N;
}

// With shared_graph the pass's Floyd-Warshall state lives in dynamic shared memory (graph_layout
// of k + 1 nodes): each of its N steps relaxes N x N cells, a thread's cells one after the other, and from
// global memory each cell waited on the last one's store (the compiler cannot tell them apart).
template <typename scalar_t>
__global__ void __launch_bounds__(kSolverThreads, 1)
    cancel_cycles_kernel(ba::Problem<scalar_t> P, ba::Workspace W, double* __restrict__ distances,  // [k, k]
                         bool shared_graph) {
  const int64_t started = clock64();
  MK_BLOCK_EXEC;
  extern __shared__ double graph_shared[];
  if (shared_graph) graph_layout(P.k + 1, reinterpret_cast<char*>(graph_shared), &W);
  const bool done = W.ints[ba::kDone] != 0;
  ba::cancel_cycles(ex, P, W, distances);
  if (threadIdx.x == 0) {
    if (!done) {
      W.clocks[ba::kClockPasses] += clock64() - started;
      W.clocks[ba::kClockMoves] += W.clocks[ba::kClockMovesRound];
    }
    W.clocks[ba::kClockMovesRound] = 0;
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kSolverThreads, 1) finish_kernel(ba::Problem<scalar_t> P, ba::Workspace W,
                                                                int64_t* __restrict__ experts,  // [n]
                                                                double* __restrict__ value) {   // 0-dim
  MK_BLOCK_EXEC;
  ba::finish(ex, P, W, experts, value);
}

// The most dynamic shared memory a launch of `kernel` may ask for: the device's opt-in limit less
// the kernel's static shared memory, set as the kernel's limit (process-wide: always the device's
// most, so that a solve of another size, on another host thread, never lowers it under a launch).
// 0 where a query or the setting fails: then the state stays in global memory.
template <class Kernel>
size_t most_dynamic_shared(Kernel kernel) {
  int device = 0, optin = 0;
  cudaFuncAttributes attributes{};
  size_t most = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
      cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess && optin > (int)attributes.sharedSizeBytes) {
    const int limit = optin - (int)attributes.sharedSizeBytes;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit) == cudaSuccess)
      most = (size_t)limit;
  }
  cudaGetLastError();  // a failed query only means global memory
  return most;
}

template <typename scalar_t>
cudaError_t solve(const scalar_t* scores, int64_t n, int64_t k, int64_t capacity, double eps_div, void* workspace,
                  int64_t* experts, double* value, double* distances, int* status, cudaStream_t stream) {
  *status = kAssignmentGuard;
  if (n == 0) {
    *status = kAssignmentSolved;
    return cudaSuccess;
  }
  const ba::Problem<scalar_t> P{scores, n, k, capacity, eps_div > 0.0 ? eps_div : ba::kDeviceEpsDiv};
  ba::Workspace W;
  ba::workspace_layout(n, k, capacity, workspace, &W);
  // The auction's heaps in shared memory where the device's opt-in limit holds them with the
  // prices (k = 64, capacity 128: 99 KB; k = 128, capacity 128: 198 KB, within sm_90's 227 KB,
  // not sm_80's 163 KB); else its prices alone, within the 48 KB a launch gets without opting in.
  const size_t prices = sizeof(double) * k;
  const size_t heaps = (sizeof(double) + sizeof(int32_t)) * k * W.heap_stride + sizeof(int32_t) * k;
  const bool shared_heaps = prices + heaps <= most_dynamic_shared(auction_kernel<scalar_t>);
  const bool shared_prices = shared_heaps || k * (int64_t)sizeof(double) <= kSharedPricesBytes;
  const size_t auction_shared = (shared_prices ? prices : 0) + (shared_heaps ? heaps : 0);
  // The pass's graph in shared memory where the device's opt-in limit holds it (k + 1 = 129
  // nodes: 202 KB, within sm_90's 227 KB; sm_80's 163 KB holds up to 116 nodes). Both queries
  // before the first launch: each clears the runtime's last error, which would hide its failure.
  const size_t graph = graph_layout(k + 1, nullptr, nullptr);
  const bool shared_graph = graph <= most_dynamic_shared(cancel_cycles_kernel<scalar_t>);
  auction_kernel<scalar_t><<<1, kSolverThreads, auction_shared, stream>>>(P, W, shared_prices, shared_heaps);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  int32_t flags[2] = {0, 0};  // kDone, kFailed
  for (int64_t round = 0, batch = kFirstBatch; round < kMaxRounds && !flags[ba::kDone];
       batch = batch < kMaxBatch ? 2 * batch : batch) {
    for (int64_t r = 0; r < batch; ++r, ++round) {
      move_costs_kernel<scalar_t><<<(unsigned)k, kMoveThreads, 0, stream>>>(P, W);
      cancel_cycles_kernel<scalar_t><<<1, kSolverThreads, shared_graph ? graph : 0, stream>>>(P, W, distances,
                                                                                          shared_graph);
    }
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpyAsync(flags, W.ints, sizeof(flags), cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return err;
  }
  if (flags[ba::kFailed] == 2) *status = kAssignmentOverflow;
  if (!flags[ba::kDone] || flags[ba::kFailed]) return cudaSuccess;  // outputs unwritten
  finish_kernel<scalar_t><<<1, kSolverThreads, 0, stream>>>(P, W, experts, value);
  *status = kAssignmentSolved;
  return cudaGetLastError();
}

}  // namespace

size_t balanced_assignment_cuda_workspace(int64_t n, int64_t k, int64_t capacity) {
  return ba::workspace_layout(n, k, capacity, nullptr, nullptr);
}

cudaError_t balanced_assignment_cuda_profile(void* workspace, int64_t n, int64_t k, int64_t capacity,
                                             int64_t* profile, cudaStream_t stream) {
  ba::Workspace W;
  ba::workspace_layout(n, k, capacity, workspace, &W);
  int32_t ints[ba::kNumInts];
  cudaError_t err = cudaMemcpyAsync(ints, W.ints, sizeof(ints), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(profile + ba::kNumInts, W.clocks, sizeof(int64_t) * ba::kNumClocks, cudaMemcpyDeviceToHost,
                          stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return err;
  for (int f = 0; f < ba::kNumInts; ++f) profile[f] = ints[f];
  int device = 0, khz = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  profile[(int)ba::kNumInts + (int)ba::kNumClocks] = khz;
  return err;
}

cudaError_t balanced_assignment_cuda(const float* scores, int64_t n, int64_t k, int64_t capacity, double eps_div,
                                     void* workspace, int64_t* experts, double* value, double* distances, int* status,
                                     cudaStream_t stream) {
  return solve(scores, n, k, capacity, eps_div, workspace, experts, value, distances, status, stream);
}

cudaError_t balanced_assignment_cuda(const double* scores, int64_t n, int64_t k, int64_t capacity, double eps_div,
                                     void* workspace, int64_t* experts, double* value, double* distances, int* status,
                                     cudaStream_t stream) {
  return solve(scores, n, k, capacity, eps_div, workspace, experts, value, distances, status, stream);
}

}  // namespace moe_kernels
