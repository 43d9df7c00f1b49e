// chosen_linear's blocks (csrc/cpu/linear/chosen_rows.cpp) checked bit for bit against a scalar
// specification of the order chosen_rows.h fixes, built once per instruction set by
// python_tests/builds/test_isa_variants.py with MOE_KERNELS_NO_CLONES: the extension's load-time
// dispatch runs only the clone the machine supports. Both layouts, float32 / bf16 / fp16 weights
// (every 16-bit pattern among them: subnormals, infinities, NaNs), 1 to 9 rows (blocks of four and
// fewer; one and two weight rows at a time), widths with and without a tail of eight; every fp16
// pattern's widening, with and without subnormals flushed. Prints the
// number of outputs checked; exits 1 at the first mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <xmmintrin.h>

#include "linear/chosen_rows.h"
#include "moe_kernels/common.h"  // bits_float
#include "xorshift.h"

using namespace moe_kernels;

namespace {

float widen(float x) { return x; }
float widen(uint16_t h) { return bits_float(uint32_t(h) << 16); }
float widen(f16_bits h) { return static_cast<float>(*reinterpret_cast<const _Float16*>(&h.bits)); }

// The specification: each product and sum rounded on its own (no contraction into an FMA).
template <typename W>
__attribute__((optimize("fp-contract=off"))) float spec(const float* x, int64_t in, const W* w, int64_t step) {
  if (step != 1) {  // axpy: one sum in order of i
    float sum = 0.0f;
    for (int64_t i = 0; i < in; ++i) sum += x[i] * widen(w[i * step]);
    return sum;
  }
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= in; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += x[i + l] * widen(w[i + l]);
  for (; i < in; ++i) lane[0] += x[i] * widen(w[i]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0; }

// Mostly finite values near 1, so that long sums stay finite and their order shows in the bits;
// one in a hundred any bit pattern (subnormals, infinities, NaNs).
void fill(float* p) { *p = uniform() < 0.01f ? (uniform() < 0.5f ? INFINITY : 0.0f) : 4.0f * uniform() - 2.0f; }
uint16_t near_one(int mantissa_bits, int bias) {
  const uint32_t sign = next() & 1, exponent = bias - 4 + next() % 6, mantissa = next() & ((1u << mantissa_bits) - 1);
  return uint16_t(sign << 15 | exponent << mantissa_bits | mantissa);
}
void fill(uint16_t* p) { *p = uniform() < 0.01f ? uint16_t(next()) : near_one(7, 127); }
void fill(f16_bits* p) { p->bits = uniform() < 0.01f ? uint16_t(next()) : near_one(10, 15); }

// Every fp16 pattern times 1 comes back as itself (-0 as +0), also with subnormals flushed and
// treated as zero (MXCSR FTZ and DAZ, as torch.set_flush_denormal sets them): the widening's
// float operations must all be on normal numbers. The count checked, or -1.
int64_t check_every_half(bool flush) {
  const unsigned csr = _mm_getcsr();
  if (flush) _mm_setcsr(csr | 0x8040);
  std::vector<f16_bits> w(65536);
  for (uint32_t b = 0; b < 65536; ++b) w[b].bits = uint16_t(b);
  std::vector<float> out(65536), one(1, 1.0f);
  chosen_dot_rows_f16(one.data(), 1, 1, w.data(), 1, 65536, out.data(), 65536);
  std::vector<float> out_t(65536);
  chosen_axpy_rows_f16(one.data(), 1, 1, w.data(), 65536, 65536, out_t.data(), 65536);
  _mm_setcsr(csr);
  for (uint32_t b = 0; b < 65536; ++b) {
    const float want = widen(w[b]) + 0.0f;
    if (!same(out[b], want) || !same(out_t[b], want)) {
      std::printf("fp16 %04x widens to %a / %a, want %a (flush %d)\n", b, out[b], out_t[b], want, flush);
      return -1;
    }
  }
  return 2 * 65536;
}

// Checks one layout and weight type at every shape; the count of outputs checked, or -1.
template <typename W>
int64_t check(void (*kernel)(const float*, int64_t, int64_t, const W*, int64_t, int64_t, float*, int64_t),
              bool transposed, const char* name) {
  int64_t checked = 0;
  for (int64_t in : {1, 7, 8, 64, 131}) {
    for (int64_t F : {1, 5, 16, 37}) {
      for (int64_t n = 1; n <= 9; ++n) {
        // Weights [F, in] (dot) or [in, F] (axpy) with padding past each row: strides not packed.
        const int64_t stride = (transposed ? F : in) + 3;
        std::vector<W> w((transposed ? in : F) * stride);
        for (auto& v : w) fill(&v);
        std::vector<float> x(n * in), out(n * (F + 2), -1.0f);
        for (auto& v : x) fill(&v);
        kernel(x.data(), n, in, w.data(), stride, F, out.data(), F + 2);
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t f = 0; f < F; ++f) {
            const float want = transposed ? spec(&x[r * in], in, &w[f], stride) : spec(&x[r * in], in, &w[f * stride], 1);
            const float got = out[r * (F + 2) + f];
            if (!same(got, want)) {
              std::printf("%s differs: in=%ld F=%ld n=%ld row %ld feature %ld: %a, want %a\n", name, (long)in, (long)F,
                          (long)n, (long)r, (long)f, got, want);
              return -1;
            }
            ++checked;
          }
          if (out[r * (F + 2) + F] != -1.0f || out[r * (F + 2) + F + 1] != -1.0f) {
            std::printf("%s wrote past F=%ld\n", name, (long)F);
            return -1;
          }
        }
      }
    }
  }
  return checked;
}

}  // namespace

int main() {
  int64_t total = 0;
  const int64_t counts[] = {
      check(chosen_dot_rows_f32, false, "dot f32"),    check(chosen_dot_rows_bf16, false, "dot bf16"),
      check(chosen_dot_rows_f16, false, "dot f16"),    check(chosen_axpy_rows_f32, true, "axpy f32"),
      check(chosen_axpy_rows_bf16, true, "axpy bf16"), check(chosen_axpy_rows_f16, true, "axpy f16"),
      check_every_half(false),                         check_every_half(true),
  };
  for (int64_t c : counts) {
    if (c < 0) return 1;
    total += c;
  }
  std::printf("%ld\n", (long)total);
  return 0;
}
