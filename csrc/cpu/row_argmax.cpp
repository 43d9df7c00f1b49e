// row_argmax_f32 (see row_argmax.h). GCC vector extensions with target_clones: an AVX2 body and a
// baseline (SSE2) body of the same source, chosen once at load time, so the extension still runs
// on any x86-64 while this machine's AVX2 is used.
#include "row_argmax.h"

#include <climits>
#include <cstring>

#include "moe_kernels/common.h"

namespace moe_kernels {
namespace {

constexpr int kLanes = 8;
typedef int32_t lanes_i32 __attribute__((vector_size(4 * kLanes)));
typedef float lanes_f32 __attribute__((vector_size(4 * kLanes)));

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
int32_t row_argmax_f32(const float* row, int64_t E) {
  // Lane l sees the elements l, l + 8, l + 16, ... in order and keeps the first of its largest
  // keys (strict >); the lanes are merged by key, then by the lower index.
  lanes_i32 best_key = {INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN, INT_MIN};
  lanes_i32 best_index = {0, 1, 2, 3, 4, 5, 6, 7};
  lanes_i32 index = best_index;
  int64_t e = 0;
  for (; e + kLanes <= E; e += kLanes) {
    lanes_f32 v;
    std::memcpy(&v, row + e, sizeof v);
    v = v + 0.0f;  // -0 -> +0, as rank_key does
    lanes_i32 bits;
    std::memcpy(&bits, &v, sizeof bits);
    // rank_key, lane-wise: negative floats flip their magnitude bits; NaN is the largest key.
    lanes_i32 key = bits < 0 ? bits ^ 0x7fffffff : bits;
    key = v != v ? (lanes_i32){} + 0x7fffffff : key;
    const lanes_i32 better = key > best_key;
    best_key = better ? key : best_key;
    best_index = better ? index : best_index;
    index += kLanes;
  }
  int32_t key = INT_MIN, arg = 0;
  if (e > 0) {
    key = best_key[0];
    arg = best_index[0];
    for (int l = 1; l < kLanes; ++l) {
      if (best_key[l] > key || (best_key[l] == key && best_index[l] < arg)) {
        key = best_key[l];
        arg = best_index[l];
      }
    }
  }
  for (; e < E; ++e) {  // the tail: later indices than every lane's, so strict > keeps ties right
    const int32_t k = rank_key(row[e]);
    if (k > key || e == 0) {
      key = k;
      arg = (int32_t)e;
    }
  }
  return arg;
}

}  // namespace moe_kernels
