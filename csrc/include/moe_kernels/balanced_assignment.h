// Balanced assignment (Kool et al., 004_62bca7777c830867.txt, Appendix D.2): the pieces of the
// auction + cycle-cancelling solver that do not depend on where they run: the rules (bids, tie
// orders, the relaxation, the residual graph, the negative-cycle test) and the sequential
// cycle extraction. The CPU kernel (csrc/cpu/balanced_assignment.cpp) and the CUDA kernel
// (csrc/cuda/balanced_assignment.cu, through balanced_assignment_steps.h) both call them. All
// arithmetic is float64 so the results match the reference
// (moe_kernels/reference/balanced_assignment.py) exactly.
#pragma once
#include <stdint.h>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace balanced_assignment {

// +inf without <limits> (usable in device code).
MK_HD double inf() { return __builtin_huge_val(); }

// The auction's bidding step for one token over the experts first, first + step, ...: the best
// value s[j] - price[j] (ties to the lower j), its expert (-1 if none), and the second best value
// (-inf when there is none): the best of the values other than the best's own.
struct Top2 {
  double v1, v2;
  int64_t j1;
};
template <typename scalar_t>
MK_HD Top2 top2_of(const scalar_t* row, const double* prices, int64_t k, int64_t first, int64_t step) {
  Top2 t{-inf(), -inf(), -1};
  for (int64_t j = first; j < k; j += step) {
    const double v = (double)row[j] - prices[j];
    if (v > t.v1) {
      t.j1 = j;
      t.v2 = t.v1;
      t.v1 = v;
    } else if (v > t.v2) {
      t.v2 = v;
    }
  }
  return t;
}

// The Top2 of the union of two disjoint sets of experts from each one's: the better best (ties to
// the lower expert; an empty set's j1 = -1 loses only to a higher value, and values are finite),
// and the second best is the better of the winner's second and the loser's best. Commutative
// and associative, so lanes that each scan a share of a row and merge in any order find
// top2_of of the whole row: the same expert and values.
MK_HD Top2 merge_top2(const Top2& a, const Top2& b) {
  const bool a_wins = a.v1 > b.v1 || (a.v1 == b.v1 && (b.j1 < 0 || (a.j1 >= 0 && a.j1 < b.j1)));
  const Top2& w = a_wins ? a : b;
  const Top2& l = a_wins ? b : a;
  return Top2{w.v1, w.v2 > l.v1 ? w.v2 : l.v1, w.j1};
}

// The bid of a token whose best value is v1 and second best v2 for an expert priced `price`.
MK_HD double bid(double price, double v1, double v2, int64_t k, double eps) {
  const double gap = k > 1 ? v1 - v2 : 0.0;
  return price + gap + eps;
}

// Cost of moving a token from expert j to j' (it loses s[i, j] and gains s[i, j']).
MK_HD double move_cost(double s_from, double s_to) { return s_from - s_to; }

// Does u close a negative cycle through m (before relaxing through m, all distances use
// intermediates < m and are exact shortest paths)?
MK_HD bool closes_negative_cycle(const double* dist, int64_t N, int64_t u, int64_t m, double tol) {
  return dist[u * N + m] + dist[m * N + u] < -tol;
}

// Cycles cheaper than -tol are cancelled; tol = kTolRel * max(1, max|s|) is float64 rounding noise
// (the reference's TOL_REL; the CPU kernel keeps its own copy next to its epsilon schedule).
constexpr double kTolRel = 1e-12;
MK_HD double cycle_tolerance(double max_abs_score) {
  return kTolRel * (max_abs_score > 1.0 ? max_abs_score : 1.0);
}

// The auction's epsilon, never below the cycle tolerance: on nearly equal large scores (spread
// 1e-9 at magnitude 1e6) a smaller eps is below the float64 spacing of the prices, price + eps ==
// price, and the auction bids forever. See reference.auction_epsilon.
MK_HD double auction_epsilon(double eps, double tol) { return eps > tol ? eps : tol; }

// Auction holders: is (bid_a, token_a) evicted before (bid_b, token_b)? The lower bid, and on
// equal bids the higher token index (the reference's min-heap of (bid, -token)). A strict total
// order on distinct tokens, so the `capacity` holders an expert keeps are the same set whatever
// order the bids arrive in (what makes the CUDA kernel's parallel bidding deterministic).
MK_HD bool holder_worse(double bid_a, int64_t token_a, double bid_b, int64_t token_b) {
  return bid_a < bid_b || (bid_a == bid_b && token_a > token_b);
}

// A counter of the auction's serial work: the host emulation (python_tests/ops/emulate/
// balanced_assignment_cuda.cpp) defines it before including this header to report the counts;
// everywhere else it is nothing.
#ifndef MK_BA_COUNT
#define MK_BA_COUNT(counter) ((void)0)
#endif

// A bounded heap of holders with the worst (holder_worse) at the root: bids[0..size), tokens alike.
template <typename token_t>
MK_HD void heap_swap(double* bids, token_t* tokens, int64_t a, int64_t b) {
  const double tb = bids[a];
  bids[a] = bids[b];
  bids[b] = tb;
  const token_t tt = tokens[a];
  tokens[a] = tokens[b];
  tokens[b] = tt;
}

// Adds (bid, token) to the heap of `size` holders (room for one more); returns the new size.
template <typename token_t>
MK_HD int64_t heap_push(double* bids, token_t* tokens, int64_t size, double bid, token_t token) {
  int64_t c = size;
  bids[c] = bid;
  tokens[c] = token;
  while (c > 0) {
    const int64_t p = (c - 1) / 2;
    if (!holder_worse(bids[c], tokens[c], bids[p], tokens[p])) break;
    MK_BA_COUNT(heap_steps);
    heap_swap(bids, tokens, c, p);
    c = p;
  }
  return size + 1;
}

// Replaces the worst holder (the root) of a heap of `size` holders by (bid, token), which must not
// be worse than it (holder_worse), with one sift-down; returns the evicted token. The CPU
// kernel's replace_lowest: the same set as a push and a pop of the worst, without the push's
// sift-up and the pop's sift-down.
template <typename token_t>
MK_HD token_t heap_replace_worst(double* bids, token_t* tokens, int64_t size, double bid, token_t token) {
  const token_t out = tokens[0];
  int64_t p = 0;
  while (true) {
    const int64_t l = 2 * p + 1, r = l + 1;
    if (l >= size) break;
    const int64_t c = r < size && holder_worse(bids[r], tokens[r], bids[l], tokens[l]) ? r : l;
    if (!holder_worse(bids[c], tokens[c], bid, token)) break;
    MK_BA_COUNT(heap_steps);
    bids[p] = bids[c];
    tokens[p] = tokens[c];
    p = c;
  }
  bids[p] = bid;
  tokens[p] = token;
  return out;
}

// The token that realises d[j][j'] among candidates: the lower cost, ties to the lower token
// index (the reference's strict-< scan in increasing token order). (inf, -1) is "no candidate"
// and loses to every real one. A total order, so a parallel min-reduction gives the same pair in
// any combining order.
MK_HD bool better_move(double cost, int64_t token, double best_cost, int64_t best_token) {
  return cost < best_cost || (cost == best_cost && token < best_token);
}

// Floyd-Warshall relaxation of cell (u, v) through m: dist[u][m] + dist[m][v] < dist[u][v].
// Strict: on ties the earlier path (and its nxt) is kept.
MK_HD bool improves(double dist_um, double dist_mv, double dist_uv) { return dist_um + dist_mv < dist_uv; }

// Weight of edge a -> b of the (k + 1)-node residual graph (node F = k exists only when
// capacity * k > n): a -> b < k is d[a][b]; j -> F costs 0 if expert j has a free slot, F -> j
// costs 0 if j holds a token, F -> F 0; +inf otherwise. See reference.graph.
template <typename count_t>
MK_HD double residual_weight(int64_t a, int64_t b, int64_t k, const double* d, const count_t* counts,
                             int64_t capacity) {
  if (a < k && b < k) return d[a * k + b];
  if (a < k) return counts[a] < capacity ? 0.0 : inf();
  if (b < k) return counts[b] > 0 ? 0.0 : inf();
  return 0.0;
}

// Appends the nodes of the recorded path u -> v, without v, to out[len..]; returns the new
// length, or -1 if the path has more than N nodes (nxt pointers in a loop: impossible with exact
// shortest paths, a guard against hanging on float64 noise).
MK_HD int64_t append_path(const int32_t* nxt, int64_t N, int64_t u, int64_t v, int32_t* out, int64_t len) {
  const int64_t stop = len + N;
  out[len++] = (int32_t)u;
  while (nxt[u * N + v] != v) {
    u = nxt[u * N + v];
    if (u < 0 || len == stop) return -1;
    out[len++] = (int32_t)u;
  }
  return len;
}

// A simple cycle of cost < -tol inside the closed walk walk[0..len) (last -> first implied),
// written to `cycle`; returns its length, 0 if none. A closed walk of negative cost decomposes into
// simple cycles, at least one of them negative. Scratch: stack [N], pos [N]. See
// reference.split_negative_cycle (same visiting order and summation order).
MK_HD int64_t split_negative_cycle(const int32_t* walk, int64_t len, const double* w, int64_t N, double tol,
                                   int32_t* stack, int32_t* pos, int32_t* cycle) {
  for (int64_t v = 0; v < N; ++v) pos[v] = -1;
  int64_t depth = 0;
  for (int64_t t = 0; t <= len; ++t) {
    const int32_t v = walk[t % len];
    if (pos[v] >= 0) {
      const int64_t from = pos[v], c = depth - from;
      double cost = 0.0;
      for (int64_t q = 0; q < c; ++q) {
        cycle[q] = stack[from + q];
        cost += w[(int64_t)stack[from + q] * N + stack[from + (q + 1) % c]];
      }
      if (cost < -tol) return c;
      for (int64_t q = 1; q < c; ++q) pos[cycle[q]] = -1;
      depth = from + 1;
    } else {
      pos[v] = (int32_t)depth;
      stack[depth++] = v;
    }
  }
  return 0;
}

// Step m of Floyd-Warshall with cycle extraction (reference.floyd_warshall_cycles): the nodes u
// that close a negative cycle through m (u != m, not blocked, closes_negative_cycle) are tried in
// increasing order; for each, the closed walk u -> m -> u of recorded paths, skipped if it
// touches a blocked node, split into simple cycles. Returns the length of the first negative
// simple cycle found (in `cycle`), 0 if some u closes a cycle through m but none gives a usable
// one, -1 if no u closes one (then m is relaxed through). The caller blocks the cycle's nodes and
// m. Scratch: walk [2N], stack [N], pos [N]; cycle [N].
MK_HD int64_t cycle_through(int64_t m, int64_t N, const double* dist, const int32_t* nxt, const double* w,
                            double tol, const char* blocked, int32_t* walk, int32_t* stack, int32_t* pos,
                            int32_t* cycle) {
  int64_t found = -1;
  for (int64_t u = 0; u < N; ++u) {
    if (u == m || blocked[u] || !closes_negative_cycle(dist, N, u, m, tol)) continue;
    found = 0;
    int64_t len = append_path(nxt, N, u, m, walk, 0);
    if (len >= 0) len = append_path(nxt, N, m, u, walk, len);
    if (len < 0) continue;
    bool touches = false;
    for (int64_t t = 0; t < len; ++t) touches |= blocked[walk[t]] != 0;
    if (touches) continue;
    const int64_t c = split_negative_cycle(walk, len, w, N, tol, stack, pos, cycle);
    if (c > 0) return c;
  }
  return found;
}

}  // namespace balanced_assignment
}  // namespace moe_kernels
