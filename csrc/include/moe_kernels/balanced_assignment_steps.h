// The phases of the CUDA balanced-assignment solver (csrc/cuda/balanced_assignment.cu), written
// once over plain arrays and an executor `Exec`, so that the same code runs on the device (Exec =
// one CUDA block: for_each spreads items over the threads, barrier is __syncthreads) and
// sequentially on the host (python_tests/ops/emulate/balanced_assignment_cuda.cpp runs every phase
// with the items of each for_each visited forwards, backwards or shuffled, and checks the result
// against scipy). docs/balanced_assignment.md describes the design.
//
// An Exec provides (all block-uniform calls; `f` must not depend on other items of the same call):
//   for_each(count, f)          f(i) for i in [0, count), spread over the threads, no barrier
//   barrier()                   block-wide barrier with memory visibility
//   leader()                    true on exactly one thread
//   threads()                   threads of the block (the host reports a virtual width)
//   any(bool) / reduce_min(double) / reduce_max(double) / reduce_sum(double)
//                               block-wide; every thread gets the result; include barriers
//   atomic_add(int32_t* p, v)   returns the old value
//   clock()                     the calling thread's clock cycles (a profile's; the host's: 0)
//   exclusive_scan(in, out, n)  out[0..n] = exclusive prefix sums of in[0..n), out[n] = total;
//                               ends with a barrier
//   for_each_top2(groups, lanes, partial, out)
//                               for each group g in [0, groups): Top2 partials partial(g, lane)
//                               of `lanes` lanes (a power of two <= kMaxLanes) merged by
//                               merge_top2 in the xor-butterfly order, then out(g, merged) once;
//                               no barrier (the device: a group is `lanes` threads of one warp)
// Results never depend on the order of the items of a for_each: scatters with atomic_add produce
// lists in arbitrary order, and everything read from them is a min / max / set under a strict
// total order (better_move, holder_worse), so the device's output is deterministic.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "moe_kernels/balanced_assignment.h"

#if defined(__CUDACC__)
#define MK_HD_STEP __host__ __device__
#else
#define MK_HD_STEP inline
#endif

namespace moe_kernels {
namespace balanced_assignment {

// The auction's schedule, the CPU kernel's shape (docs/balanced_assignment.md): one phase at
// eps = spread / kDeviceEpsDiv (the CPU's divisor) from zero prices; past kDeviceBidsPerToken * n
// bids (without free slots: auction()), a restart from the column means with no budget (where
// they are all 0, the starting prices, the first phase runs on without one instead). Jacobi
// bidding makes more bids than the CPU's sequential auction: integer scores took 5-8 a token,
// which the CPU's budget of 4 would restart into a price war (column means are tied there too).
// The two-phase schedule it replaced (spread / 16, then / 8192, every token re-bidding) fought
// price wars on tied scores: 39k-82k bidding iterations and 5-11 million bids on integer scores
// in {0, 1, 2} at (8192, 64) and (16384, 128), where this one takes 17-28 iterations. Chosen by
// the host emulation's counts of iterations and cycle-cancelling passes, not by a GPU's times:
// a larger eps takes fewer iterations and more passes (spread / 4096: 4-12 passes on randn). A
// Problem's eps_div replaces it (MOE_KERNELS_SOLVER_EPS_DIV: bench/gpu_solver_variants.py times
// several divisors on a GPU; the solve is exact at every one).
#ifndef MK_DEVICE_EPS_DIV  // a compile-time override for the emulation's sweeps of the schedule
#define MK_DEVICE_EPS_DIV 32768.0
#endif
constexpr double kDeviceEpsDiv = MK_DEVICE_EPS_DIV;
constexpr int64_t kDeviceBidsPerToken = 8;
// Lanes that share one bid's scan of its row (a warp at most: the device merges them by shuffles).
constexpr int64_t kMaxLanes = 32;
// Bidding iterations with at most this many bidders (most of them: chains of evictions, docs/
// balanced_assignment.md) skip grouping the bids by expert (a count, a scan and a scatter, five
// barriers and two rounds of global atomics): each expert scans the whole list of bids instead.
// Not tuned on a GPU.
constexpr int64_t kFewBids = 32;
static_assert(kFewBids <= 32, "an expert's few bids are a 32-bit mask of queue positions");

// The lowest set bit of a nonzero mask.
MK_HD_STEP int lowest_bit(uint32_t mask) {
#ifdef __CUDA_ARCH__
  return __ffs(mask) - 1;
#else
  return __builtin_ctz(mask);
#endif
}
// The lanes of one bid: the most (a power of two, at most kMaxLanes) that let every bidder of the
// iteration scan at once, one bid a thread when there are as many bidders as threads.
MK_HD_STEP int64_t bid_lanes(int64_t threads, int64_t bidders) {
  int64_t lanes = 1;
  while (lanes < kMaxLanes && 2 * lanes * bidders <= threads) lanes *= 2;
  return lanes;
}
// A guard, not a tuning knob: a phase of the parallel auction that has not placed every token
// after this many bidding iterations reports failure instead of hanging the device.
constexpr int64_t kMaxAuctionIterations = int64_t(1) << 20;

// Slots of Workspace::reals and Workspace::ints.
enum Real : int { kTol = 0, kSpread = 1, kNumReals = 2 };
enum Int : int {
  kDone = 0,        // 1 once a cycle-cancelling pass found no negative cycle (or on failure)
  kFailed = 1,      // 1 if the auction hit kMaxAuctionIterations, 2 if a token had no finite bid
  kQueued = 2,      // auction: tokens in the current queue
  kNextQueued = 3,  // auction: tokens evicted this iteration (the next queue)
  kCycles = 4,      // cycles taken in this pass
  kCycleNodes = 5,  // their nodes, in total
  kIterations = 6,  // auction: bidding iterations over both attempts (for the emulation's report)
  kRestarted = 7,   // auction: 1 if it restarted from the column means (for the emulation)
  kConstRows = 8,   // 1 if every row of the scores is constant and finite: the auction is skipped
  kFewIterations = 9,  // auction: its iterations of at most kFewBids bidders
  kPasses = 10,        // cycle-cancelling passes run (the rounds after the done flag return at once)
  kSharedHeaps = 11,   // auction: 1 if its heaps were in shared memory (the device's choice)
  kNumInts = 12
};
// Slots of Workspace::clocks: the leader's clock cycles (Exec::clock) in each part of the solve,
// for MOE_KERNELS_SOLVER_PROFILE (csrc/cuda_ops.cpp prints them). Between two barriers the
// leader's cycles are the block's. The bidding iterations: their bids (from the iteration's
// start to the barrier after the bids), the grouping of many bids by expert, the experts taking
// their bids and the queue's turn (to the iteration's last barrier). The host's clock is 0.
enum Clock : int {
  kClockAuction = 0,  // auction_kernel, whole
  kClockBids = 1,
  kClockGroup = 2,
  kClockTake = 3,
  kClockPasses = 4,      // cancel_cycles_kernel, every pass that ran
  kClockMoves = 5,       // move_costs_kernel's longest block, every round whose pass ran
  kClockMovesRound = 6,  // scratch: this round's longest move_costs block
  kNumClocks = 7
};

template <typename scalar_t>
struct Problem {
  const scalar_t* s;  // [n, k] contiguous scores (float or double)
  int64_t n, k, capacity;
  double eps_div = kDeviceEpsDiv;  // the auction's eps = spread / eps_div (> 0)
};

// Device scratch, carved from one allocation by workspace_layout. N = k + 1 nodes (the free-slot
// node F is always allocated; it is used only when capacity * k > n).
struct Workspace {
  double* reals;        // [kNumReals]
  int32_t* ints;        // [kNumInts]
  int64_t* clocks;      // [kNumClocks]
  double* prices;       // [k] auction prices, carried across phases
  double* means;        // [k] column means of the scores: the restart's prices
  int32_t* z;           // [n] expert of each token (-1: unassigned during the auction)
  double* heap_bid;     // [k, heap_stride] each expert's holders: a heap, worst at the root
  int32_t* heap_token;  // [k, heap_stride]
  int32_t* heap_size;   // [k]
  int32_t* queue[2];    // [n] each: tokens bidding in this iteration / evicted for the next one
  int32_t* target;      // [n] per queue position: the expert bid for
  double* bid;          // [n] per queue position: the bid
  int32_t* bucket;      // [n] queue positions grouped by target expert
  // An iteration of few bids (at most kFewBids) keeps its bids and the next queue here instead
  // (the device's auction kernel points them to shared memory): from then on every queue is as
  // short (each bid sends at most one token to the next queue).
  int32_t* few_queue[2];  // [kFewBids] each
  int32_t* few_target;    // [kFewBids]
  double* few_bid;        // [kFewBids]
  int32_t* count;       // [k] bids per expert (auction), tokens per expert (cycle cancelling)
  int32_t* start;       // [k + 1] exclusive prefix sums of count
  int32_t* cursor;      // [k] scatter cursors
  int32_t* members;     // [n] tokens grouped by expert (start[j] .. start[j + 1])
  char* dirty;          // [k] rows of d to recompute (experts whose tokens changed)
  double* d;            // [k, k] cheapest single move j -> j'
  int32_t* arg;         // [k, k] its token
  double* w;            // [N, N] residual graph
  double* dist;         // [N, N] Floyd-Warshall distances
  int32_t* nxt;         // [N, N] next node on the recorded path
  double* col;          // [N] dist[u][m] at the start of step m
  double* row;          // [N] dist[m][v] at the start of step m
  int32_t* col_nxt;     // [N] nxt[u][m] at the start of step m
  char* blocked;        // [N] nodes on a taken cycle (and skipped m) in this pass
  int32_t* walk;        // [2N] leader-only scratch of cycle_through
  int32_t* stack;       // [N]
  int32_t* pos;         // [N]
  int32_t* cycle;       // [N]
  int32_t* cycle_nodes; // [N] the nodes of the cycles taken in this pass, cycle after cycle
  int32_t* cycle_succ;  // [N] index in cycle_nodes of each node's successor on its cycle
  // min(capacity, n), an expert's holders at most (a bid for a full one replaces one), made odd: in
  // shared memory, experts' heaps a power of two apart put the same slot of each in one bank.
  int64_t heap_stride;
};

// Bytes of scratch for (n, k, capacity); with base != nullptr also points `ws` into it.
inline size_t workspace_layout(int64_t n, int64_t k, int64_t capacity, void* base, Workspace* ws) {
  const int64_t N = k + 1, stride = (capacity < n ? capacity : n) | 1;
  size_t offset = 0;
  auto take = [&](auto*& ptr, int64_t count) {
    using T = typename std::remove_reference<decltype(*ptr)>::type;
    offset = (offset + 15) / 16 * 16;
    if (base != nullptr) ptr = reinterpret_cast<T*>(static_cast<char*>(base) + offset);
    offset += sizeof(T) * (size_t)count;
  };
  Workspace local{};
  Workspace& W = ws != nullptr ? *ws : local;
  take(W.reals, kNumReals);
  take(W.ints, kNumInts);
  take(W.clocks, kNumClocks);
  take(W.prices, k);
  take(W.means, k);
  take(W.z, n);
  take(W.heap_bid, k * stride);
  take(W.heap_token, k * stride);
  take(W.heap_size, k);
  take(W.queue[0], n);
  take(W.queue[1], n);
  take(W.target, n);
  take(W.bid, n);
  take(W.bucket, n);
  take(W.few_queue[0], kFewBids);
  take(W.few_queue[1], kFewBids);
  take(W.few_target, kFewBids);
  take(W.few_bid, kFewBids);
  take(W.count, k);
  take(W.start, k + 1);
  take(W.cursor, k);
  take(W.members, n);
  take(W.dirty, k);
  take(W.d, k * k);
  take(W.arg, k * k);
  take(W.w, N * N);
  take(W.dist, N * N);
  take(W.nxt, N * N);
  take(W.col, N);
  take(W.row, N);
  take(W.col_nxt, N);
  take(W.blocked, N);
  take(W.walk, 2 * N);
  take(W.stack, N);
  take(W.pos, N);
  take(W.cycle, N);
  take(W.cycle_nodes, N);
  take(W.cycle_succ, N);
  W.heap_stride = stride;
  return offset;
}

// Tokens grouped by expert from z: count, start, members (in arbitrary order within an expert).
template <class Exec, typename scalar_t>
MK_HD_STEP void group_tokens(const Exec& ex, const Problem<scalar_t>& P, const Workspace& W) {
  ex.for_each(P.k, [&](int64_t j) { W.count[j] = 0; });
  ex.barrier();
  ex.for_each(P.n, [&](int64_t i) { ex.atomic_add(&W.count[W.z[i]], 1); });
  ex.barrier();
  ex.exclusive_scan(W.count, W.start, P.k);
  ex.for_each(P.k, [&](int64_t j) { W.cursor[j] = W.start[j]; });
  ex.barrier();
  ex.for_each(P.n, [&](int64_t i) { W.members[ex.atomic_add(&W.cursor[W.z[i]], 1)] = (int32_t)i; });
  ex.barrier();
}

// One block. The score range (the epsilon scale), the cycle tolerance and whether every row is
// constant (kConstRows: the auction's skip); clears the other flags.
template <class Exec, typename scalar_t>
MK_HD_STEP void score_stats(const Exec& ex, const Problem<scalar_t>& P, const Workspace& W) {
  double lo = inf(), hi = -inf(), amax = 0.0;
  // A score that is not finite (x - x is NaN for NaN and inf), or one that differs from its row's
  // first. The op rejects NaN / inf before the solve; on them the auction keeps its own handling.
  bool varies = false;
  ex.for_each(P.n * P.k, [&](int64_t t) {
    const double x = (double)P.s[t];
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
    const double a = x < 0 ? -x : x;
    amax = a > amax ? a : amax;
    varies |= !(x - x == 0.0);
  });
  // Each thread reads its rows up to the first score that differs from the row's first: two
  // reads a row on most scores, and none once one differs; every score only where rows are
  // constant (-0.0 == 0.0: equal values, any assignment of them is optimal alike).
  ex.for_each(P.n, [&](int64_t i) {
    const scalar_t* row = P.s + i * P.k;
    for (int64_t j = 1; j < P.k && !varies; ++j) varies = !(row[j] == row[0]);
  });
  lo = ex.reduce_min(lo);
  hi = ex.reduce_max(hi);
  amax = ex.reduce_max(amax);
  varies = ex.any(varies);
  if (ex.leader()) {
    double spread = hi - lo;
    if (!(spread > 0)) spread = 1.0;
    W.reals[kSpread] = spread;
    W.reals[kTol] = cycle_tolerance(amax);
    for (int f = 0; f < kNumInts; ++f) W.ints[f] = 0;
    for (int f = 0; f < kNumClocks; ++f) W.clocks[f] = 0;
    W.ints[kConstRows] = !varies;
  }
  ex.for_each(P.k, [&](int64_t j) { W.prices[j] = 0.0; });
  ex.barrier();
}

// One block. The auction (one epsilon, from zero prices, restarted once from the column means past
// the bid budget) with parallel Jacobi bidding: every unassigned token bids at once with the
// prices of the iteration's start (top2_of over lanes, bid), then every expert takes its bids
// (holders kept by holder_worse), the evicted tokens bid in the next iteration. Ends with every
// token placed (z) and grouped by expert, every row of d dirty; sets kFailed (and kDone) if an
// attempt hits kMaxAuctionIterations.
//
// Skipped where every row is constant (kConstRows, s[i][j] = c_i), with its result: z[i] =
// i / capacity. From equal prices p (zero, or the restart's column means, equal there) every
// unplaced token's best expert is the lowest-index one at p with a gap of exactly 0 to the next
// one at p, so all of them bid p + eps for it; it keeps the `capacity` lowest tokens
// (holder_worse), its price rises to p + eps and c_i - (p + eps) < c_i - p (eps >= tol is far
// above float64 rounding at the scores' scale), and the rest bid for the next expert. The last
// one (gaps not 0) has room for all of them: capacity * k >= n. The pile-up it skips is
// sum_m (n - m capacity) bids, each iteration's into one expert's heap on one thread (and at
// (8192, 64) past the bid budget: 335k bids with the restart, 656 ms on an H200). Any assignment
// is optimal there: the passes take no cycle and compute d* from it.
template <class Exec, typename scalar_t>
MK_HD_STEP void auction(const Exec& ex, const Problem<scalar_t>& P, const Workspace& W) {
  const int64_t n = P.n, k = P.k, capacity = P.capacity;
  const double eps = auction_epsilon(W.reals[kSpread] / P.eps_div, W.reals[kTol]);
  const bool row_constant = W.ints[kConstRows] != 0;
  if (row_constant) ex.for_each(n, [&](int64_t i) { W.z[i] = (int32_t)(i / capacity); });
  int64_t bid_cycles = 0, group_cycles = 0, take_cycles = 0;  // the leader's: kClockBids, ...
  for (int attempt = 0; attempt < 2 && !row_constant; ++attempt) {
    if (attempt == 1) ex.for_each(k, [&](int64_t j) { W.prices[j] = W.means[j]; });
    int32_t* queue = W.queue[0];
    int32_t* next = W.queue[1];
    ex.for_each(n, [&](int64_t i) {
      W.z[i] = -1;
      queue[i] = (int32_t)i;
    });
    ex.for_each(k, [&](int64_t j) { W.heap_size[j] = 0; });
    if (ex.leader()) W.ints[kQueued] = (int32_t)n;
    ex.barrier();
    // Every thread counts the bids (each reads every iteration's count), so all of them decide
    // the restart alike. No budget where there are free slots (capacity * k > n): an expert left
    // with one is optimal only at the lowest price, which zero prices keep (prices only rise)
    // and column means do not. Restarted there, per-expert-bias scores took 60-320 cycle-
    // cancelling passes where the unbudgeted auction took 1-4 (and 0.4k-13k bidding iterations).
    int64_t budget = attempt == 0 && n >= capacity * k ? kDeviceBidsPerToken * n : -1;
    int64_t bids_made = 0;
    bool over_budget = false;
    for (int64_t iteration = 0;; ++iteration) {
      const int64_t queued = W.ints[kQueued];
      if (queued == 0) break;
      if (budget >= 0 && bids_made >= budget) {
        // The restart's prices: means[j] = mean over i of s[i][j], summed in token order in
        // float64 (the CPU's). Where every one equals the starting price 0, the restart would
        // replay this attempt bid for bid (the same state, prices and rules; a mean of -0.0 makes
        // the same bids: s - p and p + gap + eps do not depend on the sign of a zero p) and then
        // run on without a budget: this attempt runs on instead, with the same result.
        bool moved = false;
        ex.for_each(k, [&](int64_t j) {
          double sum = 0.0;
          for (int64_t i = 0; i < n; ++i) sum += (double)P.s[i * k + j];
          const double mean = sum / (double)n;
          W.means[j] = mean;
          moved |= mean != 0.0;
        });
        if (ex.any(moved)) {
          over_budget = true;
          if (ex.leader()) W.ints[kRestarted] = 1;
          break;
        }
        budget = -1;
      }
      if (iteration == kMaxAuctionIterations) {
        if (ex.leader()) W.ints[kFailed] = W.ints[kDone] = 1;
        ex.barrier();
        return;
      }
      bids_made += queued;
      const int64_t started = ex.clock();
      // Few bidders: each expert finds its bids in the whole list; else they are grouped by expert.
      const bool few = queued <= kFewBids;
      if (!few) {
        ex.for_each(k, [&](int64_t j) { W.count[j] = 0; });
        ex.barrier();
      }
      // The iteration's bids, and the next queue: the few-bid buffers for few bids (the queue
      // read here is one of them from the second such iteration on, and is not the one written).
      int32_t* const target = few ? W.few_target : W.target;
      double* const offer = few ? W.few_bid : W.bid;
      if (few) next = queue == W.few_queue[0] ? W.few_queue[1] : W.few_queue[0];
      if (ex.leader()) W.ints[kNextQueued] = 0;
      // Bids, with the prices as they were at the start of the iteration; `lanes` threads scan a
      // bidder's row together where there are fewer bidders than threads.
      const int64_t lanes = bid_lanes(ex.threads(), queued);
      ex.for_each_top2(
          queued, lanes,
          [&](int64_t q, int64_t lane) { return top2_of(P.s + queue[q] * k, W.prices, k, lane, lanes); },
          [&](int64_t q, const Top2& t) {
            target[q] = (int32_t)t.j1;
            if (t.j1 < 0) {  // every value -inf: prices overflowed (float64 scores near its limit)
              W.ints[kFailed] = 2;
              return;
            }
            offer[q] = bid(W.prices[t.j1], t.v1, t.v2, k, eps);
            if (!few) ex.atomic_add(&W.count[t.j1], 1);
          });
      ex.barrier();
      const int64_t after_bids = ex.clock();
      if (W.ints[kFailed]) {  // read by every thread after the barrier: all of them return
        ex.barrier();
        if (ex.leader()) W.ints[kDone] = 1;
        ex.barrier();
        return;
      }
      if (!few) {
        // Bids grouped by expert.
        ex.exclusive_scan(W.count, W.start, k);
        ex.for_each(k, [&](int64_t j) { W.cursor[j] = W.start[j]; });
        ex.barrier();
        ex.for_each(queued, [&](int64_t q) { W.bucket[ex.atomic_add(&W.cursor[target[q]], 1)] = (int32_t)q; });
        ex.barrier();
      }
      const int64_t after_grouping = ex.clock();
      // Every expert takes its bids: one joins the heap of holders while the expert has room;
      // then of the capacity + 1 bids the worst (holder_worse) leaves for the next queue: the
      // bidder itself, untouched heap, when it is worse than the worst holder, else the worst
      // holder, replaced by the bid with one sift-down (the CPU kernel's way; a push and a pop
      // keep the same set, and under the pile-ups of tied scores cost two sifts a bid, the
      // bidder's climbing the whole heap). The kept set is the `capacity` best of (holders +
      // bids) under holder_worse whatever the order of the bids. A full expert's price is its
      // worst kept bid (as in the sequential auction).
      ex.for_each(k, [&](int64_t j) {
        double* bids = W.heap_bid + j * W.heap_stride;
        int32_t* holders = W.heap_token + j * W.heap_stride;
        int64_t size = W.heap_size[j];
        auto take = [&](int64_t q) {
          const int32_t i = queue[q];
          MK_BA_COUNT(bids);
          if (size < capacity) {
            size = heap_push(bids, holders, size, offer[q], i);
            W.z[i] = (int32_t)j;
            return;
          }
          int32_t out = i;  // a bidder is unassigned (z = -1) until an expert keeps it
          if (!holder_worse(offer[q], i, bids[0], holders[0])) {
            out = heap_replace_worst(bids, holders, size, offer[q], i);
            W.z[i] = (int32_t)j;
            W.z[out] = -1;
          }
          next[ex.atomic_add(&W.ints[kNextQueued], 1)] = out;
        };
        if (few) {
          // The expert's bids as a mask of queue positions, then taken in queue order: the experts'
          // threads take their bids side by side. Taken as the scan met them, every bid's heap
          // update ran after the last one's (the threads walk the list in step, and at each
          // position only the expert bid for takes it): `queued` heap updates one after another
          // an iteration, where now a warp runs as many as its busiest expert's bids.
          uint32_t mine = 0;
          for (int64_t q = 0; q < queued; ++q) mine |= (uint32_t)(target[q] == j) << q;
          for (; mine != 0; mine &= mine - 1) take(lowest_bit(mine));
        } else {
          for (int64_t p = W.start[j]; p < W.start[j + 1]; ++p) take(W.bucket[p]);
        }
        if (size == capacity) W.prices[j] = bids[0];
        W.heap_size[j] = (int32_t)size;
      });
      ex.barrier();
      int32_t* const t = queue;
      queue = next;
      next = t;
      if (ex.leader()) {
        W.ints[kQueued] = W.ints[kNextQueued];
        W.ints[kIterations] += 1;
        W.ints[kFewIterations] += few;
      }
      ex.barrier();
      const int64_t after_take = ex.clock();
      bid_cycles += after_bids - started;
      group_cycles += after_grouping - after_bids;
      take_cycles += after_take - after_grouping;
    }
    // Every thread has read kQueued before the leader sets it for the restart.
    ex.barrier();
    if (!over_budget) break;
  }
  if (ex.leader()) {
    W.clocks[kClockBids] = bid_cycles;
    W.clocks[kClockGroup] = group_cycles;
    W.clocks[kClockTake] = take_cycles;
  }
  group_tokens(ex, P, W);
  ex.for_each(k, [&](int64_t j) { W.dirty[j] = 1; });
  ex.barrier();
}

// One block per expert j: row j of d (d[j][j'] = min over the tokens i of j of s[i][j] - s[i][j'],
// with the argmin token under better_move; d[j][j] = 0), if the row is dirty. A parallel
// min-reduction over the tokens: `lanes` groups of threads each scan a strided share of the
// tokens for every column j', then the lanes are combined. part_cost / part_token: scratch of
// ex.threads() entries.
template <class Exec, typename scalar_t>
MK_HD_STEP void move_costs_row(const Exec& ex, const Problem<scalar_t>& P, const Workspace& W, int64_t j,
                               double* part_cost, int32_t* part_token) {
  if (W.ints[kDone] || !W.dirty[j]) return;
  const int64_t k = P.k, first = W.start[j], size = W.start[j + 1] - first;
  const int32_t* tokens = W.members + first;
  // The best move to column jp among tokens lane, lane + lanes, ...
  auto scan = [&](int64_t jp, int64_t lane, int64_t lanes, double* cost_out, int32_t* token_out) {
    double best = inf();
    int32_t best_token = -1;
    for (int64_t t = lane; t < size; t += lanes) {
      const int32_t i = tokens[t];
      const scalar_t* row = P.s + (int64_t)i * k;
      const double c = move_cost((double)row[j], (double)row[jp]);
      if (better_move(c, i, best, best_token)) {
        best = c;
        best_token = i;
      }
    }
    *cost_out = best;
    *token_out = best_token;
  };
  auto store = [&](int64_t jp, double c, int32_t i) {
    W.d[j * k + jp] = jp == j ? 0.0 : c;
    W.arg[j * k + jp] = jp == j ? -1 : i;
  };
  const int64_t lanes = ex.threads() >= 2 * k ? ex.threads() / k : 1;
  if (lanes == 1) {
    ex.for_each(k, [&](int64_t jp) {
      double c;
      int32_t i;
      scan(jp, 0, 1, &c, &i);
      store(jp, c, i);
    });
  } else {
    // Item lane * k + jp: consecutive threads read consecutive columns of a token's row.
    ex.for_each(lanes * k, [&](int64_t item) { scan(item % k, item / k, lanes, &part_cost[item], &part_token[item]); });
    ex.barrier();
    ex.for_each(k, [&](int64_t jp) {
      double best = part_cost[jp];
      int32_t best_token = part_token[jp];
      for (int64_t lane = 1; lane < lanes; ++lane) {
        const double c = part_cost[lane * k + jp];
        const int32_t i = part_token[lane * k + jp];
        if (better_move(c, i, best, best_token)) {
          best = c;
          best_token = i;
        }
      }
      store(jp, best, best_token);
    });
  }
  ex.barrier();
  if (ex.leader()) W.dirty[j] = 0;
}

// One block. One cycle-cancelling pass (reference.floyd_warshall_cycles): the residual graph from
// d and the counts, then Floyd-Warshall as N steps of N x N parallel relaxations; before step m
// the threads test in parallel whether some u closes a negative cycle through m, and if so the
// leader extracts it (cycle_through, sequential: short paths, rare) and m is skipped. Then every
// token on a cycle edge moves (in parallel: the cycles are disjoint, so movers are distinct), the
// rows of the touched experts are marked dirty and the tokens regrouped. A pass without a cycle
// writes d* (dist restricted to the experts) to `distances` [k, k] and sets kDone.
template <class Exec, typename scalar_t>
MK_HD_STEP void cancel_cycles(const Exec& ex, const Problem<scalar_t>& P, const Workspace& W, double* distances) {
  if (W.ints[kDone]) return;
  if (ex.leader()) W.ints[kPasses] += 1;  // read by no thread of this pass
  const int64_t k = P.k, N = P.n < P.capacity * k ? k + 1 : k;
  const double tol = W.reals[kTol];
  ex.for_each(N * N, [&](int64_t c) {
    const int64_t u = c / N, v = c % N;
    const double x = residual_weight(u, v, k, W.d, W.count, P.capacity);
    W.w[c] = x;
    W.dist[c] = x;
    W.nxt[c] = x < inf() ? (int32_t)v : -1;
  });
  ex.for_each(N, [&](int64_t u) { W.blocked[u] = 0; });
  if (ex.leader()) W.ints[kCycles] = W.ints[kCycleNodes] = 0;
  ex.barrier();
  for (int64_t m = 0; m < N; ++m) {
    if (W.blocked[m]) continue;
    bool closing = false;
    ex.for_each(N, [&](int64_t u) {
      if (u != m && !W.blocked[u] && closes_negative_cycle(W.dist, N, u, m, tol)) closing = true;
    });
    if (ex.any(closing)) {
      if (ex.leader()) {
        const int64_t c = cycle_through(m, N, W.dist, W.nxt, W.w, tol, W.blocked, W.walk, W.stack, W.pos, W.cycle);
        if (c > 0) {
          const int32_t base = W.ints[kCycleNodes];
          for (int64_t q = 0; q < c; ++q) {
            W.cycle_nodes[base + q] = W.cycle[q];
            W.cycle_succ[base + q] = base + (int32_t)((q + 1) % c);
            W.blocked[W.cycle[q]] = 1;
          }
          W.ints[kCycleNodes] = base + (int32_t)c;
          W.ints[kCycles] += 1;
        }
        W.blocked[m] = 1;  // never relax through a node on a negative cycle
      }
      ex.barrier();
      continue;
    }
    // Row m and column m as they are before the step (they do not change in it unless
    // dist[m][m] < 0, float64 noise above -tol; the CPU then updates them in place).
    ex.for_each(N, [&](int64_t u) {
      W.col[u] = W.dist[u * N + m];
      W.col_nxt[u] = W.nxt[u * N + m];
      W.row[u] = W.dist[m * N + u];
    });
    ex.barrier();
    ex.for_each(N * N, [&](int64_t c) {
      const int64_t u = c / N, v = c % N;
      const double dum = W.col[u];
      if (dum == inf() || !improves(dum, W.row[v], W.dist[c])) return;
      W.dist[c] = dum + W.row[v];
      W.nxt[c] = W.col_nxt[u];
    });
    ex.barrier();
  }
  const int64_t taken = W.ints[kCycleNodes];
  if (W.ints[kCycles] == 0) {
    ex.for_each(k * k, [&](int64_t c) { distances[c] = W.dist[(c / k) * N + c % k]; });
    ex.barrier();
    if (ex.leader()) W.ints[kDone] = 1;
    return;
  }
  // Every move is the argmin of its edge as computed: disjoint cycles take at most one token from
  // each expert, and d describes the assignment before any move.
  ex.for_each(taken, [&](int64_t p) {
    const int32_t a = W.cycle_nodes[p], b = W.cycle_nodes[W.cycle_succ[p]];
    if (a < k) W.dirty[a] = 1;
    if (a < k && b < k) W.z[W.arg[a * k + b]] = b;
  });
  ex.barrier();
  group_tokens(ex, P, W);
}

// One block. experts [n] int64 = z; value = sum_i s[i][z_i] in float64 (a block reduction: fixed
// order on a given block size, not the CPU's sequential order, so it may differ in the last bits).
template <class Exec, typename scalar_t>
MK_HD_STEP void finish(const Exec& ex, const Problem<scalar_t>& P, const Workspace& W, int64_t* experts,
                       double* value) {
  double sum = 0.0;
  ex.for_each(P.n, [&](int64_t i) {
    experts[i] = W.z[i];
    sum += (double)P.s[i * P.k + W.z[i]];
  });
  sum = ex.reduce_sum(sum);
  if (ex.leader()) *value = sum;
}

}  // namespace balanced_assignment
}  // namespace moe_kernels
