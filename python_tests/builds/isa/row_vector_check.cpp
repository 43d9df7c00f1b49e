// The row selections of csrc/cpu/select/ checked against a scalar specification (every
// rank pair of the row, sorted), built once per instruction set by python_tests/builds/test_isa_variants.py
// with MOE_KERNELS_NO_CLONES: the extension's load-time dispatch runs only the clone the machine
// supports, so the AVX2 and SSE2 variants are otherwise never executed where AVX-512 exists.
// Also the softmax terms and sums (csrc/cpu/score/exp_sums.cpp), and the renormalised weights
// (score/exp_terms.cpp where the variant has AVX-512 F). Prints the number of rows checked; exits 1 at the first mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>
#include <xmmintrin.h>

#include "moe_kernels/common.h"
#include "select/candidates.h"
#include "score/exp_sums.h"
#include "score/exp_terms.h"
#include "select/top8_avx512.h"
#include "select/select.h"
#include "xorshift.h"

using namespace moe_kernels;

namespace {

// A row of one of the kinds the fuzz tests use, plus the float-compare paths' edge cases.
void fill(int kind, int64_t E, float* x) {
  const float inf = INFINITY;
  for (int64_t e = 0; e < E; ++e) {
    const float u = uniform();
    switch (kind) {
      case 0: x[e] = 4.0f * u - 2.0f; break;                                  // random
      case 1: x[e] = (float)(next() % 3); break;                              // ties
      case 2: x[e] = u < 0.4f ? -inf : u; break;                              // masked experts
      case 3: x[e] = -inf; break;                                             // fully masked
      case 4: x[e] = u < 0.5f ? -0.0f : 0.0f; break;                          // signed zeros
      case 5: x[e] = u < 0.1f ? NAN : u; break;                               // NaN
      case 6: x[e] = u < 0.1f ? inf : (u < 0.2f ? -inf : u); break;           // +inf with -inf
      case 7: x[e] = u < 0.5f ? 1e-45f : (u < 0.75f ? -1e-40f : 0.0f); break;  // denormals
      case 8: x[e] = 3e38f; break;                                            // sums overflow
      default: x[e] = (float)e; break;                                        // ascending
    }
  }
  if (kind == 3 && E > 1) x[next() % E] = 0.5f;  // a single finite value
}

bool check(const char* what, const float* x, int64_t E, int64_t k, const int64_t* got) {
  std::vector<int64_t> all(E);
  for (int64_t e = 0; e < E; ++e) all[e] = rank_pair(x[e], (int32_t)e);
  std::sort(all.begin(), all.end(), std::greater<int64_t>());
  for (int64_t s = 0; s < k; ++s) {
    if (got[s] != all[s]) {
      std::printf("%s E=%lld k=%lld slot %lld: expert %d, expected %d\n", what, (long long)E, (long long)k,
                  (long long)s, pair_index(got[s]), pair_index(all[s]));
      return false;
    }
  }
  return true;
}

// selected_slots on a block's checked selection: each slot's expert, its value decoded from the key
// (the logit itself, except -0 as +0 and any NaN as NaN) and the row's first-slot value.
bool check_slots(const float* x, int64_t stride, int64_t rows, int64_t k, const int64_t* best) {
  std::vector<int64_t> experts(rows * k);
  std::vector<float> value(rows * k), vmax(rows * k);
  selected_slots(best, rows, k, experts.data(), value.data(), vmax.data());
  auto same = [](float a, float b) {
    return (a != a && b != b) || __builtin_bit_cast(uint32_t, a) == __builtin_bit_cast(uint32_t, b + 0.0f);
  };
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = x + i * stride;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t j = i * k + s, e = pair_index(best[j]);
      if (experts[j] != e || !same(value[j], row[e]) || !same(vmax[j], row[pair_index(best[i * k])])) {
        std::printf("selected_slots k=%lld row %lld slot %lld: expert %lld value %g vmax %g\n", (long long)k,
                    (long long)i, (long long)s, (long long)experts[j], value[j], vmax[j]);
        return false;
      }
    }
  }
  return true;
}

// row_candidates_f32 on a row (E >= 8): -1 only when the row's elements sum to NaN in some order
// (a NaN, or both infinities); else ascending indices with their values, the 8 largest rank pairs
// among them, every element at or above the least of them, and 8 zeros after them.
bool check_candidates(const float* x, int64_t E) {
  std::vector<int32_t> index(E + kCandidatePad, -7);
  std::vector<float> value(E + kCandidatePad, -7.0f);
  const int64_t n = row_candidates_f32(x, E, index.data(), value.data());
  bool nan = false, pos_inf = false, neg_inf = false;
  for (int64_t e = 0; e < E; ++e) {
    nan |= std::isnan(x[e]);
    pos_inf |= x[e] == INFINITY;
    neg_inf |= x[e] == -INFINITY;
  }
  if (n < 0) {
    if (nan || (pos_inf && neg_inf)) return true;
    bool overflow = false;  // partial sums of huge values may meet as +inf and -inf
    for (int64_t e = 0; e < E; ++e) overflow |= std::fabs(x[e]) > 1e37f;
    if (overflow) return true;
    std::printf("row_candidates_f32 E=%lld: -1 for a row without NaN or infinities\n", (long long)E);
    return false;
  }
  if (nan) {
    std::printf("row_candidates_f32 E=%lld: %lld candidates for a row holding a NaN\n", (long long)E, (long long)n);
    return false;
  }
  std::vector<int64_t> all(E);
  for (int64_t e = 0; e < E; ++e) all[e] = rank_pair(x[e], (int32_t)e);
  std::sort(all.begin(), all.end(), std::greater<int64_t>());
  std::vector<bool> kept(E, false);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = index[i];
    if (e < 0 || e >= E || (i > 0 && e <= index[i - 1]) || __builtin_bit_cast(uint32_t, value[i]) != __builtin_bit_cast(uint32_t, x[e])) {
      std::printf("row_candidates_f32 E=%lld: candidate %lld is index %d value %g\n", (long long)E, (long long)i, e, value[i]);
      return false;
    }
    kept[e] = true;
  }
  for (int64_t s = 0; s < std::min<int64_t>(8, E); ++s) {
    if (!kept[pair_index(all[s])]) {
      std::printf("row_candidates_f32 E=%lld: the %lld-th largest (expert %d) is missing\n", (long long)E, (long long)s, pair_index(all[s]));
      return false;
    }
  }
  // Exactly the elements at or above some floor: every element left out is below every one kept.
  const float least = *std::min_element(value.begin(), value.begin() + n);
  for (int64_t e = 0; e < E; ++e) {
    if (!kept[e] && x[e] >= least) {
      std::printf("row_candidates_f32 E=%lld: expert %d (%g) left out, %g kept\n", (long long)E, (int)e, x[e], least);
      return false;
    }
  }
  for (int64_t i = n; i < n + 8; ++i) {
    if (index[i] != 0 || value[i] != 0.0f) {
      std::printf("row_candidates_f32 E=%lld: no zero at %lld after %lld candidates\n", (long long)E, (long long)i, (long long)n);
      return false;
    }
  }
  return true;
}

// The selection with the weights in one pass, against the pairs' selection of the same rows
// (best, its left rows redo[0 .. n_redo)) for E <= 128: rows_top8_renormalized_f32 leaves the same
// rows and gives the other rows renormalized_pairs_f32's experts and weights on those pairs, bit
// for bit, writing nothing past its outputs (eight guard entries each); rows_top_renormalized_f32
// (the left rows by the candidate sort) gives every row rows_top_pairs_f32's and
// renormalized_pairs_f32's, for k >= 3 (k <= 2 it leaves to its caller).
bool check_top8_renormalized(const float* x, int64_t E, int k, int64_t n, const int64_t* best, const int64_t* redo,
                             int64_t n_redo) {
  std::vector<int64_t> experts(n * k + 8, -1), want_experts(n * k), fused_redo(n), all(n * k);
  std::vector<float> w(n * k + 8, -1.0f), want_w(n * k);
  int64_t n_fused = -1;
  if (!rows_top8_renormalized_f32(x, E, n, E, k, experts.data(), w.data(), fused_redo.data(), &n_fused)) {
    if (E <= 128) {
      std::printf("rows_top8_renormalized_f32 E=%lld k=%d: not run where rows_top8_pairs_f32 runs\n", (long long)E, k);
      return false;
    }
    return true;
  }
  auto past = [&]() {
    return std::any_of(experts.end() - 8, experts.end(), [](int64_t v) { return v != -1; }) ||
           std::any_of(w.end() - 8, w.end(), [](float v) { return v != -1.0f; });
  };
  auto same = [](float a, float b) { return std::memcmp(&a, &b, 4) == 0; };
  if (past() || n_fused != n_redo || !std::equal(redo, redo + n_redo, fused_redo.begin())) {
    std::printf("rows_top8_renormalized_f32 E=%lld k=%d: wrote past its outputs, or left other rows (%lld, not %lld)\n",
                (long long)E, k, (long long)n_fused, (long long)n_redo);
    return false;
  }
  renormalized_pairs_f32(best, n, k, want_experts.data(), want_w.data());
  std::vector<bool> left(n, false);
  for (int64_t r = 0; r < n_redo; ++r) left[redo[r]] = true;
  for (int64_t j = 0; j < n * k; ++j) {
    if (!left[j / k] && (experts[j] != want_experts[j] || !same(w[j], want_w[j]))) {
      std::printf("rows_top8_renormalized_f32 E=%lld k=%d slot %lld: expert %lld weight %.9g, not %lld %.9g\n",
                  (long long)E, k, (long long)j, (long long)experts[j], w[j], (long long)want_experts[j], want_w[j]);
      return false;
    }
  }
  std::fill(experts.begin(), experts.end(), -1);
  std::fill(w.begin(), w.end(), -1.0f);
  if (!rows_top_renormalized_f32(x, E, n, E, k, experts.data(), w.data())) {
    std::printf("rows_top_renormalized_f32 E=%lld k=%d: not run where rows_top8_renormalized_f32 runs\n", (long long)E, k);
    return false;
  }
  rows_top_pairs_f32(x, E, n, E, k, all.data());
  renormalized_pairs_f32(all.data(), n, k, want_experts.data(), want_w.data());
  for (int64_t j = 0; j < n * k; ++j) {
    if (experts[j] != want_experts[j] || !same(w[j], want_w[j]) || past()) {
      std::printf("rows_top_renormalized_f32 E=%lld k=%d slot %lld: expert %lld weight %.9g, not %lld %.9g\n",
                  (long long)E, k, (long long)j, (long long)experts[j], w[j], (long long)want_experts[j], want_w[j]);
      return false;
    }
  }
  return true;
}

// rows_top8_pairs_f32 called directly where the variant runs (16 <= E <= 256): every row it
// finishes exact; the ones it leaves for its caller few on random rows, also with exact ties
// (its floor leaves more than 16 candidates in well under 1% of them), and all of those it must
// leave (a NaN). Rows of near-equal values (keys a few ulp apart) are left or exact. Counts
// the rows it finished.
bool check_top8_direct(long* finished) {
  constexpr int64_t kRows = 203;  // 50 blocks of four, and three rows left
  std::vector<int64_t> widths;
  for (int64_t E = 16; E <= 64; ++E) widths.push_back(E);
  for (int64_t E : {65, 96, 100, 127, 128, 129, 191, 200, 255, 256}) widths.push_back(E);
  for (int64_t E : widths) {
    for (int k = 3; k <= 8; ++k) {
      for (int kind = 0; kind < 4; ++kind) {
        std::vector<float> x(kRows * E);
        for (int64_t i = 0; i < kRows * E; ++i) {
          const float u = uniform();
          // random; random with every 7th row holding a tie at the top or a NaN; near-equal values;
          // kind 3 adds 8 to 17 copies of its largest value below
          x[i] = kind == 2 ? 1.0f + (float)(next() % 64) * 1.1920929e-7f : 4.0f * u - 2.0f;
        }
        if (kind == 1) {
          for (int64_t i = 0; i < kRows; i += 7) x[i * E + next() % (E - 1)] = i % 14 ? NAN : 2.5f, x[i * E + E - 1] = 2.5f;
          // Rows all NaN (a NaN floor), and a NaN first in its lane with larger values after it (the
          // lane maxima drop it): both must be left.
          for (int64_t i = 3; i < kRows; i += 21) std::fill(x.begin() + i * E, x.begin() + (i + 1) * E, NAN);
          for (int64_t i = 10; E > 16 && i < kRows; i += 21) x[i * E] = NAN, x[i * E + 16] = 5.0f;
        }
        if (kind == 3) {  // 8 + i % 10 copies of the largest value: 15 to 17 candidates and more
          for (int64_t i = 0; i < kRows; ++i) {
            for (int64_t c = 0; c < std::min<int64_t>(E, 8 + i % 10); ++c) x[i * E + (c * 5 + i) % E] = 3.0f;
          }
        }
        // Eight guard entries past the output: its stores of whole vectors must stop at its end.
        std::vector<int64_t> best(kRows * k + 8, -1), redo(kRows);
        int64_t n_redo = -1;
        if (!rows_top8_pairs_f32(x.data(), E, kRows, E, k, best.data(), redo.data(), &n_redo)) return true;
        if (std::any_of(best.end() - 8, best.end(), [](int64_t v) { return v != -1; })) {
          std::printf("rows_top8_pairs_f32 E=%lld k=%d: wrote past its output\n", (long long)E, k);
          return false;
        }
        std::vector<bool> left(kRows, false);
        int64_t must = 0;  // rows holding a NaN
        for (int64_t r = 0; r < n_redo; ++r) left[redo[r]] = true;
        for (int64_t i = 0; i < kRows; ++i) {
          const float* row = x.data() + i * E;
          const bool nan = std::any_of(row, row + E, [](float v) { return v != v; });
          must += nan;
          if (nan && !left[i]) {
            std::printf("rows_top8_pairs_f32 E=%lld k=%d: row %lld holds a NaN, not left\n", (long long)E, k, (long long)i);
            return false;
          }
          if (left[i]) continue;
          if (!check("rows_top8_pairs_f32", row, E, k, best.data() + i * k)) return false;
          ++*finished;
        }
        if ((kind == 0 || kind == 1) && n_redo - must > kRows / 20) {
          std::printf("rows_top8_pairs_f32 E=%lld k=%d: %lld of %lld rows left (kind %d)\n", (long long)E, k,
                      (long long)n_redo, (long long)kRows, kind);
          return false;
        }
        if (!check_top8_renormalized(x.data(), E, k, kRows, best.data(), redo.data(), n_redo)) return false;
      }
    }
  }
  return true;
}

// The softmax terms (score/exp_terms.cpp's where this variant has AVX-512 F, vec_math::exp's
// elsewhere): each within 1.5e-7 of exp (float's x - vmax, in double), exactly 1 at the row's
// largest value, 0 below -80 and for -inf, NaN for NaN; the per-row call's sum, the block call's
// (rows cut from a wider buffer) and the slots' terms bit for bit the per-row call's stored terms;
// the terms with torch's tails (row_exp_sum_full_f32) as exp down to e^-104.
bool check_softmax_terms(long* checked) {
  const double tiny = (_mm_getcsr() & 0x8000) ? 1.2e-38 : 1.5e-45;
  std::vector<int64_t> widths;
  for (int64_t E = 1; E <= 70; ++E) widths.push_back(E);
  for (int64_t E : {127, 128, 256, 600}) widths.push_back(E);
  constexpr int64_t kRows = 23;
  for (int64_t E : widths) {
    for (float scale : {1.0f, 30.0f, 100.0f}) {
      const int64_t stride = E + 3;
      std::vector<float> x(kRows * stride, 7.0f), vmax(kRows), sums(kRows), scratch(kRows * E);
      for (int64_t i = 0; i < kRows; ++i) {
        float* row = x.data() + i * stride;
        fill(i % 10, E, row);
        if (i % 10 == 0) {
          for (int64_t e = 0; e < E; ++e) row[e] *= scale;
        }
        if (i == kRows - 1) {  // the flush and tail boundaries, below a largest value of 0
          const float edges[] = {-80.0f, std::nextafter(-80.0f, 0.0f), std::nextafter(-80.0f, -INFINITY), -87.33f,
                                 -103.97f, -104.0f, std::nextafter(-104.0f, 0.0f), std::nextafter(-104.0f, -INFINITY),
                                 -0.0f, -1e-45f, -INFINITY, -3e38f};
          for (int64_t e = 0; e < E; ++e) row[e] = e == 0 ? 0.0f : edges[(e - 1) % 12];
        }
        std::vector<int64_t> top(1);
        row_top_pairs(row, E, 1, top.data());
        vmax[i] = row[pair_index(top[0])];
      }
      rows_softmax_sums_f32(x.data(), stride, kRows, E, vmax.data(), 1, scratch.data(), sums.data());
      std::vector<float> exps(E), slots(E), maxes(E), full(E);
      for (int64_t i = 0; i < kRows; ++i) {
        const float* row = x.data() + i * stride;
        const float sum = row_exp_sum_f32(row, E, vmax[i], exps.data());
        const float full_sum = row_exp_sum_full_f32(row, E, vmax[i], full.data());
        std::fill(maxes.begin(), maxes.end(), vmax[i]);
        softmax_terms_f32(row, maxes.data(), E, slots.data());
        double exact = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          const float d = row[e] - vmax[i], t = exps[e];
          const bool same = t == slots[e] || (t != t && slots[e] != slots[e]);
          const double want = d != d ? NAN : (d < -80.0f ? 0.0 : std::exp((double)d));
          const bool close = d != d ? t != t : (d == 0.0f ? t == 1.0f : std::fabs(t - want) <= 1.5e-7 * want);
          if (!same || !close) {
            std::printf("softmax terms E=%lld row %d element %lld: d=%.9g term %.9g slot %.9g exp %.9g\n", (long long)E,
                        (int)i, (long long)e, d, t, slots[e], want);
            return false;
          }
          exact += t;
          // With torch's tails: denormals down to e^-104 (within one of float's smallest, or
          // float's smallest normal when flushing to zero), the same term where it is normal.
          const double want_full = d != d ? NAN : (d < -104.0f ? 0.0 : std::exp((double)d));
          const bool full_ok = d != d ? full[e] != full[e]
                                      : std::fabs(full[e] - want_full) <= 1.5e-7 * want_full + tiny &&
                                            (d < -80.0f || full[e] == t);
          if (!full_ok) {
            std::printf("softmax terms with tails E=%lld row %d element %lld: d=%.9g term %.9g exp %.9g\n",
                        (long long)E, (int)i, (long long)e, d, full[e], want_full);
            return false;
          }
        }
        if ((full_sum != full_sum) != (sum != sum) || (sum == sum && std::fabs(full_sum - sum) > 1e-6 * sum)) {
          std::printf("softmax sums with tails E=%lld row %d: %.9g against %.9g\n", (long long)E, (int)i, full_sum, sum);
          return false;
        }
        const bool nan = sum != sum;
        if (nan != (exact != exact) || (sum != sums[i] && !(nan && sums[i] != sums[i])) ||
            (!nan && std::fabs(sum - exact) > 6e-8 * (double)E * exact)) {
          std::printf("softmax sums E=%lld row %d: %.9g, block %.9g, terms add to %.9g\n", (long long)E, (int)i, sum,
                      sums[i], exact);
          return false;
        }
        ++*checked;
      }
    }
  }
  return true;
}

// score/exp_terms.cpp's renormalised weights, where the variant has AVX-512 F: each within 3e-7
// (3.6e-7 for k > 8; relative, or two of float's smallest denormals, or float's smallest normal
// when flushing to zero) of the float64 value of exp(v - vmax) over its row's sum (terms below
// -104 are 0), exactly 1 for k = 1, 0 for a row whose vmax is -inf, NaN for a NaN row; partial
// vectors of rows included; renormalized_pairs_f32 on the same rows as rank pairs gives the same
// bits and the pairs' experts. Every k from 1 to 16: those that do not divide 16 fill groups of
// the next power of two partly.
bool check_renormalized_weights(long* checked) {
  // Flushing to zero (main's second run) loses a denormal weight whole.
  const double tiny = (_mm_getcsr() & 0x8000) ? 1.2e-38 : 2.9e-45;
  for (int64_t k = 1; k <= 16; ++k) {
    // A 16-lane group's sum is four roundings deep, an 8-lane one's three: one rounding (6e-8)
    // more than k <= 8's 3e-7 (seen: up to 2.7e-7 for k <= 8, 3.1e-7 at k = 15 under FTZ).
    const double bound = k > 8 ? 3.6e-7 : 3e-7;
    for (int64_t n : {1, 2, 3, 5, 8, 9, 37}) {
      for (float spread : {2.0f, 30.0f, 120.0f}) {
        std::vector<float> value(n * k), vmax(n * k), w(n * k + 16, -1.0f);
        for (int64_t i = 0; i < n; ++i) {
          float* v = value.data() + i * k;
          v[0] = spread * (uniform() - 0.5f);
          for (int64_t s = 1; s < k; ++s) v[s] = v[0] - spread * uniform();
          if (i % 7 == 3 && k > 1) v[k - 1] = -INFINITY;
          if (i % 7 == 5 && k > 1) v[1] = v[0];  // a tie at the top
          const float m = i % 11 == 6 ? -INFINITY : (i % 13 == 9 ? NAN : v[0]);
          if (m != v[0]) std::fill(v, v + k, m);
          std::fill(vmax.data() + i * k, vmax.data() + i * k + k, m);
        }
        // Not run at all without AVX-512 F; with it, for every k up to 16.
        if (!renormalized_weights_f32(value.data(), vmax.data(), n, k, w.data())) {
          if (k == 1) return true;
          std::printf("renormalized_weights_f32 k=%lld: not run where k = 1 runs\n", (long long)k);
          return false;
        }
        // The same weights from rank pairs (index 3 s + i % 5 at slot s), bit for bit, experts
        // decoded: value and vmax as selected_slots decodes them from the pairs.
        // 16 guard entries past the outputs: a tail mask writing past n * k shows there.
        std::vector<int64_t> pairs(n * k), experts(n * k + 16, -1), slot_experts(n * k);
        std::vector<float> slot_value(n * k), slot_vmax(n * k), w_pairs(n * k + 16, -1.0f), w_slots(n * k, -2.0f);
        for (int64_t j = 0; j < n * k; ++j) pairs[j] = rank_pair(value[j], (int32_t)(3 * (j % k) + (j / k) % 5));
        selected_slots(pairs.data(), n, k, slot_experts.data(), slot_value.data(), slot_vmax.data());
        renormalized_weights_f32(slot_value.data(), slot_vmax.data(), n, k, w_slots.data());
        if (!renormalized_pairs_f32(pairs.data(), n, k, experts.data(), w_pairs.data())) {
          std::printf("renormalized_pairs_f32 k=%lld: not run where renormalized_weights_f32 runs\n", (long long)k);
          return false;
        }
        for (int64_t j = n * k; j < n * k + 16; ++j) {
          if (experts[j] != -1 || w_pairs[j] != -1.0f || w[j] != -1.0f) {
            std::printf("renormalized_*_f32 k=%lld n=%lld: wrote past its %lld slots\n", (long long)k, (long long)n,
                        (long long)(n * k));
            return false;
          }
        }
        for (int64_t j = 0; j < n * k; ++j) {
          const bool same = std::memcmp(&w_pairs[j], &w_slots[j], 4) == 0 || (w_pairs[j] != w_pairs[j] && w_slots[j] != w_slots[j]);
          if (!same || experts[j] != slot_experts[j]) {
            std::printf("renormalized_pairs_f32 k=%lld n=%lld slot %lld: %.9g expert %lld, from slots %.9g expert %lld\n",
                        (long long)k, (long long)n, (long long)j, w_pairs[j], (long long)experts[j], w_slots[j],
                        (long long)slot_experts[j]);
            return false;
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          const float m = vmax[i * k];
          double t[16], sum = 0.0;
          for (int64_t s = 0; s < k; ++s) {
            const float d = value[i * k + s] - m;
            sum += t[s] = d < -104.0f ? 0.0 : std::exp((double)d);
          }
          for (int64_t s = 0; s < k; ++s) {
            const float got = w[i * k + s];
            const double want = m == -INFINITY ? 0.0 : t[s] / sum;
            const bool ok = m != m                ? got != got
                            : m == -INFINITY || k == 1 ? got == (float)want
                                                  : std::fabs(got - want) <= bound * want + tiny;
            if (!ok) {
              std::printf("renormalized_weights_f32 k=%lld n=%lld row %lld slot %lld: %.9g, expected %.9g\n",
                          (long long)k, (long long)n, (long long)i, (long long)s, got, want);
              return false;
            }
          }
          ++*checked;
        }
      }
    }
  }
  return true;
}

}  // namespace

// Every selection on every width, k and row kind; false at the first mismatch.
bool check_all(long* checked) {
  std::vector<int64_t> widths;
  for (int64_t E = 1; E <= 70; ++E) widths.push_back(E);
  for (int64_t E : {127, 128, 256, 512, 600}) widths.push_back(E);
  // More rows than one block of rows_top_pairs_f32 (16 for k = 2), every kind in each block.
  constexpr int64_t kRows = 19;
  for (int64_t E : widths) {
    for (int64_t k : {1, 2, 3, 4, 5, 7, 8, 9, 17}) {
      if (k > E) continue;
      for (int kind = 0; kind < 10; ++kind) {
        std::vector<float> x(kRows * E);
        for (int64_t i = 0; i < kRows; ++i) fill((kind + (int)i) % 10, E, x.data() + i * E);
        std::vector<int64_t> block(kRows * k), one(k > kRowInsertionMaxK ? E : k);
        rows_top_pairs_f32(x.data(), E, kRows, E, k, block.data());
        for (int64_t i = 0; i < kRows; ++i) {
          const float* row = x.data() + i * E;
          row_top_pairs(row, E, k, one.data());
          if (!check("row_top_pairs", row, E, k, one.data())) return false;
          if (!check("rows_top_pairs_f32", row, E, k, block.data() + i * k)) return false;
          if (k == 1 && E >= 8 && !check_candidates(row, E)) return false;
          if (k == 1) {
            const int64_t pair = rank_pair(row[row_argmax_f32(row, E)], row_argmax_f32(row, E));
            if (!check("row_argmax_f32", row, E, 1, &pair)) return false;
          }
          ++*checked;
        }
        if (!check_slots(x.data(), E, kRows, k, block.data())) return false;
      }
    }
  }
  return true;
}

// rows_top_renormalized_f32 over more rows than its 1024-row calls, with rows it leaves (NaN rows)
// in every call and a padded row stride: the same experts and weights, bit for bit, as
// rows_top_pairs_f32 and renormalized_pairs_f32 give the whole range.
bool check_top_renormalized_long(long* checked) {
  constexpr int64_t kRows = 2600;
  for (int64_t E : {24, 64, 100}) {
    for (int k : {3, 8}) {
      const int64_t stride = E + 3;
      std::vector<float> x(kRows * stride);
      for (float& v : x) v = 4.0f * uniform() - 2.0f;
      for (int64_t i = 5; i < kRows; i += 97) x[i * stride + next() % E] = NAN;
      std::vector<int64_t> experts(kRows * k), want_experts(kRows * k), pairs(kRows * k);
      std::vector<float> w(kRows * k), want_w(kRows * k);
      if (!rows_top_renormalized_f32(x.data(), stride, kRows, E, k, experts.data(), w.data())) return true;
      rows_top_pairs_f32(x.data(), stride, kRows, E, k, pairs.data());
      renormalized_pairs_f32(pairs.data(), kRows, k, want_experts.data(), want_w.data());
      for (int64_t j = 0; j < kRows * k; ++j) {
        if (experts[j] != want_experts[j] || std::memcmp(&w[j], &want_w[j], 4) != 0) {
          std::printf("rows_top_renormalized_f32 E=%lld k=%d row %lld slot %lld: expert %lld weight %.9g, not %lld %.9g\n",
                      (long long)E, k, (long long)(j / k), (long long)(j % k), (long long)experts[j], w[j],
                      (long long)want_experts[j], want_w[j]);
          return false;
        }
      }
      *checked += kRows;
    }
  }
  return true;
}

// rows_top8_pairs_f32 on the last rows before an unmapped page: its blocks of 16 rows must not
// read a row past the n it is given (the block's missing rows repeat its last one), nor an
// element past a row's end (masked loads), however many rows the last block holds; nor write past
// its output (rows' stores of all 8 pairs), which ends at a second unmapped page; nor
// rows_top8_renormalized_f32 past its experts or its weights, each ending there in turn.
bool check_top8_guarded(long* finished) {
  const long page = sysconf(_SC_PAGESIZE);
  const size_t bytes = 16 * (size_t)page;  // room for 40 rows of 100, and for 40 rows' 8 pairs
  // Two regions, each followed by a guard page: the rows, and the pairs' output.
  char* base = (char*)mmap(nullptr, 2 * (bytes + page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED || mprotect(base + bytes, page, PROT_NONE) != 0 ||
      mprotect(base + 2 * bytes + page, page, PROT_NONE) != 0) {
    return true;  // no guard pages here
  }
  float* end = (float*)(base + bytes);
  int64_t* best_end = (int64_t*)(base + 2 * bytes + page);
  bool ok = true;
  for (int64_t E : {16, 33, 64, 100, 200}) {
    for (int k : {3, 8}) {
      for (int64_t n = 1; n <= 40 && ok; ++n) {
        float* x = end - n * E;  // the last row ends at the guard page
        for (int64_t i = 0; i < n * E; ++i) x[i] = 4.0f * uniform() - 2.0f;
        int64_t* best = best_end - n * k;  // and so does the output
        std::vector<int64_t> redo(n);
        int64_t n_redo = -1;
        if (!rows_top8_pairs_f32(x, E, n, E, k, best, redo.data(), &n_redo)) break;
        std::vector<bool> left(n, false);
        for (int64_t r = 0; r < n_redo; ++r) left[redo[r]] = true;
        for (int64_t i = 0; i < n && ok; ++i) {
          if (left[i]) continue;
          ok = check("rows_top8_pairs_f32 (guarded)", x + i * E, E, k, best + i * k);
          ++*finished;
        }
        // The one-pass weights' experts, then its weights, ending at the guard page.
        if (E <= 128 && ok) {
          std::vector<int64_t> experts(n * k);
          std::vector<float> w(n * k);
          int64_t* experts_end = best_end - n * k;
          float* w_end = (float*)best_end - n * k;
          ok = rows_top8_renormalized_f32(x, E, n, E, k, experts_end, w.data(), redo.data(), &n_redo) &&
               rows_top8_renormalized_f32(x, E, n, E, k, experts.data(), w_end, redo.data(), &n_redo);
          if (!ok) std::printf("rows_top8_renormalized_f32 E=%lld k=%d: not run (guarded)\n", (long long)E, k);
        }
      }
    }
  }
  munmap(base, 2 * (bytes + page));
  return ok;
}

int main() {
  long checked = 0;
  if (!check_all(&checked)) return 1;
  if (!check_top8_direct(&checked) || !check_top8_guarded(&checked) || !check_top_renormalized_long(&checked)) return 1;
  if (!check_softmax_terms(&checked) || !check_renormalized_weights(&checked)) return 1;
  // Again with denormals read as zero and results flushed (torch.set_flush_denormal(True)): the
  // float compares and rank_key (whose x + 0.0f then turns a denormal into 0) must still agree.
  _mm_setcsr(_mm_getcsr() | 0x8040);
  if (!check_all(&checked) || !check_top8_direct(&checked) || !check_softmax_terms(&checked) ||
      !check_renormalized_weights(&checked)) {
    std::printf("(with denormals-are-zero and flush-to-zero set)\n");
    return 1;
  }
  std::printf("%ld\n", checked);
  return 0;
}
