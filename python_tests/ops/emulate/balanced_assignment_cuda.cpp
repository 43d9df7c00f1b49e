// Host emulation of the CUDA balanced-assignment solver (csrc/cuda/balanced_assignment.cu): the
// same phases (moe_kernels/balanced_assignment_steps.h) in the same sequence as the kernels and
// the host loop, with a sequential executor. Each for_each visits its items forwards, backwards
// or in a shuffled order, and blocks of move_costs run in that order too, so a phase whose result
// depended on the order of its items (a race on the device) shows up as a changed result.
// Built and run by python_tests/ops/test_balanced_assignment_cuda_emulation.py with g++.
//
// Usage: balanced_assignment_cuda <in> <out>
//   in:  int64 n, k, capacity, float64 (1) or float32 (0), width, order (0 forwards,
//        1 backwards, 2 shuffled), seed, eps divisor (0: the default; Problem::eps_div, whole
//        numbers here); then n * k scores of that type, row-major.
//   out: int64 converged, rounds, auction iterations, restarted (the auction's second attempt ran),
//        failed (kFailed: 0, 1 a guard, 2 a token without a finite bid), bids (taken by the
//        experts, over both attempts), heap steps (levels a holder moved in the experts' heaps:
//        the serial work of taking the bids); int64 experts [n]; float64 value;
//        float64 distances [k, k].
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

// The auction's counters (MK_BA_COUNT in moe_kernels/balanced_assignment.h).
struct Counts {
  int64_t bids = 0, heap_steps = 0;
};
static Counts counts;
#define MK_BA_COUNT(counter) (++counts.counter)

#include "moe_kernels/balanced_assignment_steps.h"

namespace ba = moe_kernels::balanced_assignment;

// One block of `width` virtual threads, run by one host thread.
struct HostExec {
  int64_t width;
  int order;
  std::mt19937_64* rng;

  int64_t threads() const { return width; }
  bool leader() const { return true; }
  void barrier() const {}
  int64_t clock() const { return 0; }
  bool any(bool v) const { return v; }
  double reduce_min(double v) const { return v; }
  double reduce_max(double v) const { return v; }
  double reduce_sum(double v) const { return v; }
  int32_t atomic_add(int32_t* p, int32_t v) const {
    const int32_t old = *p;
    *p += v;
    return old;
  }
  void exclusive_scan(const int32_t* in, int32_t* out, int64_t n) const {
    int32_t carry = 0;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = carry;
      carry += in[i];
    }
    out[n] = carry;
  }
  std::vector<int64_t> items(int64_t count) const {
    std::vector<int64_t> idx(count);
    std::iota(idx.begin(), idx.end(), 0);
    if (order == 1) std::reverse(idx.begin(), idx.end());
    if (order == 2) std::shuffle(idx.begin(), idx.end(), *rng);
    return idx;
  }
  template <class F>
  void for_each(int64_t count, F&& f) const {
    for (int64_t i : items(count)) f(i);
  }
  // The device's shuffles in the same order: at each offset every lane merges its value with its
  // xor partner's (lane ^ offset), the merged value of lane 0 goes out.
  template <class Partial, class Out>
  void for_each_top2(int64_t groups, int64_t lanes, Partial&& partial, Out&& out) const {
    std::vector<ba::Top2> v(lanes), w(lanes);
    for (int64_t g : items(groups)) {
      for (int64_t lane : items(lanes)) v[lane] = partial(g, lane);
      for (int64_t offset = lanes / 2; offset > 0; offset /= 2) {
        for (int64_t lane = 0; lane < lanes; ++lane) w[lane] = ba::merge_top2(v[lane], v[lane ^ offset]);
        std::swap(v, w);
      }
      out(g, v[0]);
    }
  }
};

template <typename scalar_t>
int run(FILE* in, FILE* out, int64_t n, int64_t k, int64_t capacity, int64_t width, int order, uint64_t seed,
        int64_t eps_div) {
  std::vector<scalar_t> s(n * k);
  if (fread(s.data(), sizeof(scalar_t), s.size(), in) != s.size()) return 2;
  std::mt19937_64 rng(seed);
  const HostExec ex{width, order, &rng};
  const ba::Problem<scalar_t> P{s.data(), n, k, capacity, eps_div > 0 ? (double)eps_div : ba::kDeviceEpsDiv};
  ba::Workspace W;
  std::vector<double> buffer(ba::workspace_layout(n, k, capacity, nullptr, nullptr) / sizeof(double) + 2);
  ba::workspace_layout(n, k, capacity, buffer.data(), &W);
  std::vector<double> part_cost(width), distances(k * k, -1.0);
  std::vector<int32_t> part_token(width);
  std::vector<int64_t> experts(n, -1);
  double value = 0.0;

  // auction_kernel
  ba::score_stats(ex, P, W);
  ba::auction(ex, P, W);
  // The host loop: rounds of (move_costs_kernel on k blocks, cancel_cycles_kernel) until done.
  int64_t rounds = 0;
  while (!W.ints[ba::kDone] && rounds < (int64_t(1) << 16)) {
    for (int64_t j : ex.items(k)) ba::move_costs_row(ex, P, W, j, part_cost.data(), part_token.data());
    ba::cancel_cycles(ex, P, W, distances.data());
    ++rounds;
  }
  const int64_t converged = W.ints[ba::kDone] && !W.ints[ba::kFailed];
  if (converged) ba::finish(ex, P, W, experts.data(), &value);  // finish_kernel

  const int64_t head[7] = {converged,           rounds,      W.ints[ba::kIterations], W.ints[ba::kRestarted],
                           W.ints[ba::kFailed], counts.bids, counts.heap_steps};
  fwrite(head, sizeof(int64_t), 7, out);
  fwrite(experts.data(), sizeof(int64_t), n, out);
  fwrite(&value, sizeof(double), 1, out);
  fwrite(distances.data(), sizeof(double), k * k, out);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 3) return 1;
  FILE* in = fopen(argv[1], "rb");
  FILE* out = fopen(argv[2], "wb");
  if (in == nullptr || out == nullptr) return 1;
  int64_t h[8];  // n, k, capacity, float64, width, order, seed, eps_div (0: the default)
  if (fread(h, sizeof(int64_t), 8, in) != 8) return 2;
  const int rc = h[3] ? run<double>(in, out, h[0], h[1], h[2], h[4], (int)h[5], (uint64_t)h[6], h[7])
                      : run<float>(in, out, h[0], h[1], h[2], h[4], (int)h[5], (uint64_t)h[6], h[7]);
  fclose(in);
  fclose(out);
  return rc;
}
