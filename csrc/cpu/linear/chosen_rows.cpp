// chosen_rows.h's linear blocks, each entry point compiled per instruction set (MK_ISA_CLONES) with
// GCC vector extensions of eight floats: the row block's accumulators in registers, a weight
// vector loaded once and multiplied into every row of the block. fp-contract=off (MK_VECTORISE)
// keeps the AVX2 / AVX-512 variants from fusing a product into its sum, which would round once
// where the baseline rounds twice: every variant gives the same bits.
#include "linear/chosen_rows.h"

#include <cstring>

#include "isa.h"
#include "moe_kernels/common.h"

// The helpers pass 256-bit vectors by value; always inlined, so no such call exists.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace moe_kernels {
namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

MK_ALWAYS_INLINE f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bf16 bits to float32, exactly: the bits shifted into the high half.
MK_ALWAYS_INLINE f32x8 load8(const uint16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 bits = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// fp16 bits to float32, exactly, in integer and float operations that every variant has (the
// baseline has no F16C): the exponent re-biased in the bits; infinities and NaNs to exponent 255;
// a subnormal half m 2^-24 as (2^-14 + m 2^-24) - 2^-14. Every float operand and result is normal,
// so a CPU flushing subnormals (torch.set_flush_denormal) widens the same.
constexpr uint32_t kHalfExponent = 0x7c00u << 13;  // a half's exponent bits, placed as a float's
constexpr uint32_t kRebias = (127 - 15) << 23;
constexpr uint32_t kTwoPowMinus14 = (127 - 14) << 23;

MK_VECTORISE MK_ALWAYS_INLINE f32x8 load8(const f16_bits* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 wide = __builtin_convertvector(h, u32x8);
  const u32x8 placed = (wide & 0x7fff) << 13;
  const u32x8 exponent = placed & kHalfExponent;
  u32x8 bits = placed + kRebias;
  bits = exponent == kHalfExponent ? bits + kRebias : bits;
  f32x8 sub, bias;
  const u32x8 sub_bits = bits + (1u << 23), bias_bits = (u32x8){} + kTwoPowMinus14;
  std::memcpy(&sub, &sub_bits, sizeof sub);
  std::memcpy(&bias, &bias_bits, sizeof bias);
  sub -= bias;
  u32x8 sub_as_bits;
  std::memcpy(&sub_as_bits, &sub, sizeof sub_as_bits);
  bits = exponent == 0 ? sub_as_bits : bits;
  bits |= (wide & 0x8000) << 16;
  f32x8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

MK_ALWAYS_INLINE float widen(float x) { return x; }
MK_ALWAYS_INLINE float widen(uint16_t h) { return bits_float(uint32_t(h) << 16); }
MK_VECTORISE MK_ALWAYS_INLINE float widen(f16_bits h) {
  const uint32_t placed = uint32_t(h.bits & 0x7fff) << 13;
  const uint32_t exponent = placed & kHalfExponent;
  uint32_t bits = placed + kRebias;
  if (exponent == kHalfExponent) bits += kRebias;
  if (exponent == 0) {
    const float sub = bits_float(bits + (1u << 23)) - bits_float(kTwoPowMinus14);
    std::memcpy(&bits, &sub, sizeof bits);
  }
  return bits_float(bits | uint32_t(h.bits & 0x8000) << 16);
}

MK_ALWAYS_INLINE void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

// R rows by NF weight rows (features), [out, in] layout: chosen_rows.h's dot order.
template <int R, int NF, typename W>
MK_VECTORISE MK_ALWAYS_INLINE void dot_block(const float* __restrict x, int64_t in, const W* __restrict w,
                                             int64_t stride, float* __restrict out, int64_t out_stride) {
  f32x8 acc[NF][R];
  for (int f = 0; f < NF; ++f)
    for (int r = 0; r < R; ++r) acc[f][r] = (f32x8){};
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    f32x8 wv[NF];
    for (int f = 0; f < NF; ++f) wv[f] = load8(w + f * stride + i);
    for (int r = 0; r < R; ++r) {
      const f32x8 xv = load8(x + r * in + i);
      for (int f = 0; f < NF; ++f) acc[f][r] += xv * wv[f];
    }
  }
  for (int f = 0; f < NF; ++f) {
    for (int r = 0; r < R; ++r) {
      float lane0 = acc[f][r][0];
      for (int64_t j = i; j < in; ++j) lane0 += x[r * in + j] * widen(w[f * stride + j]);
      const f32x8 p = acc[f][r];
      out[r * out_stride + f] = ((lane0 + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    }
  }
}

// Rows in blocks of up to kChosenRowBlock over one weight row (NF = 1) or two (NF = 2: each row
// vector then feeds two products, where a block's loads would otherwise bound it); the weight rows
// stay in L1 while the blocks of rows pass over them.
template <int R, int NF, typename W>
MK_VECTORISE MK_ALWAYS_INLINE void dot_rows(const float* x, int64_t in, const W* w, int64_t stride, int64_t F,
                                            float* out, int64_t out_stride) {
  int64_t f = 0;
  if constexpr (NF == 2)
    for (; f + 2 <= F; f += 2) dot_block<R, 2>(x, in, w + f * stride, stride, out + f, out_stride);
  for (; f < F; ++f) dot_block<R, 1>(x, in, w + f * stride, stride, out + f, out_stride);
}

template <int NF, typename W>
MK_VECTORISE MK_ALWAYS_INLINE void dot_blocks(const float* x, int64_t n, int64_t in, const W* w, int64_t stride,
                                              int64_t F, float* out, int64_t out_stride) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) dot_rows<4, NF>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride);
  switch (n - r) {
    case 3: dot_rows<3, NF>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride); break;
    case 2: dot_rows<2, NF>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride); break;
    case 1: dot_rows<1, NF>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride); break;
    default: break;
  }
}

// Weight rows in pairs from a full block of rows on; one at a time below it, where reading the
// weights bounds the kernel: two interleaved streams from adjacent weight rows read a model's
// weights from memory at a third of the rate of one (13 against 37 GB/s on one thread of an EPYC,
// 32 MB of float32 weights, one row each).
template <typename W>
MK_VECTORISE MK_ALWAYS_INLINE void dot_all(const float* x, int64_t n, int64_t in, const W* w, int64_t stride,
                                           int64_t F, float* out, int64_t out_stride) {
  if (n >= kChosenRowBlock)
    dot_blocks<2>(x, n, in, w, stride, F, out, out_stride);
  else
    dot_blocks<1>(x, n, in, w, stride, F, out, out_stride);
}

// R rows by 8 NV features, [in, out] layout: chosen_rows.h's axpy order (one sum per output, in
// order of i; lanes are independent, so any feature block gives the same bits).
template <int R, int NV, typename W>
MK_VECTORISE MK_ALWAYS_INLINE void axpy_block(const float* __restrict x, int64_t in, const W* __restrict w,
                                              int64_t stride, float* __restrict out, int64_t out_stride) {
  f32x8 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = (f32x8){};
  for (int64_t i = 0; i < in; ++i) {
    f32x8 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load8(w + i * stride + 8 * v);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * in + i];
      for (int v = 0; v < NV; ++v) acc[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store8(out + r * out_stride + 8 * v, acc[r][v]);
}

template <int R, typename W>
MK_VECTORISE MK_ALWAYS_INLINE void axpy_rows(const float* x, int64_t in, const W* w, int64_t stride, int64_t F,
                                             float* out, int64_t out_stride) {
  int64_t f = 0;
  for (; f + 16 <= F; f += 16) axpy_block<R, 2>(x, in, w + f, stride, out + f, out_stride);
  if (f + 8 <= F) {
    axpy_block<R, 1>(x, in, w + f, stride, out + f, out_stride);
    f += 8;
  }
  for (; f < F; ++f) {  // the last F mod 8 features, one at a time, in the same order
    for (int r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * widen(w[i * stride + f]);
      out[r * out_stride + f] = sum;
    }
  }
}

template <typename W>
MK_VECTORISE MK_ALWAYS_INLINE void axpy_all(const float* x, int64_t n, int64_t in, const W* w, int64_t stride,
                                            int64_t F, float* out, int64_t out_stride) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) axpy_rows<4>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride);
  switch (n - r) {
    case 3: axpy_rows<3>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride); break;
    case 2: axpy_rows<2>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride); break;
    case 1: axpy_rows<1>(x + r * in, in, w, stride, F, out + r * out_stride, out_stride); break;
    default: break;
  }
}

static_assert(kChosenRowBlock == 4, "dot_all and axpy_all unroll blocks of four rows");

}  // namespace

MK_VECTORISE MK_ISA_CLONES void chosen_dot_rows_f32(const float* x, int64_t n, int64_t in, const float* w,
                                                   int64_t stride, int64_t F, float* out, int64_t out_stride) {
  dot_all(x, n, in, w, stride, F, out, out_stride);
}

MK_VECTORISE MK_ISA_CLONES void chosen_dot_rows_bf16(const float* x, int64_t n, int64_t in, const uint16_t* w,
                                                    int64_t stride, int64_t F, float* out, int64_t out_stride) {
  dot_all(x, n, in, w, stride, F, out, out_stride);
}

MK_VECTORISE MK_ISA_CLONES void chosen_dot_rows_f16(const float* x, int64_t n, int64_t in, const f16_bits* w,
                                                   int64_t stride, int64_t F, float* out, int64_t out_stride) {
  dot_all(x, n, in, w, stride, F, out, out_stride);
}

MK_VECTORISE MK_ISA_CLONES void chosen_axpy_rows_f32(const float* x, int64_t n, int64_t in, const float* w,
                                                    int64_t stride, int64_t F, float* out, int64_t out_stride) {
  axpy_all(x, n, in, w, stride, F, out, out_stride);
}

MK_VECTORISE MK_ISA_CLONES void chosen_axpy_rows_bf16(const float* x, int64_t n, int64_t in, const uint16_t* w,
                                                     int64_t stride, int64_t F, float* out, int64_t out_stride) {
  axpy_all(x, n, in, w, stride, F, out, out_stride);
}

MK_VECTORISE MK_ISA_CLONES void chosen_axpy_rows_f16(const float* x, int64_t n, int64_t in, const f16_bits* w,
                                                    int64_t stride, int64_t F, float* out, int64_t out_stride) {
  axpy_all(x, n, in, w, stride, F, out, out_stride);
}

}  // namespace moe_kernels
