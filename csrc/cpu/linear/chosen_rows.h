// The chosen experts' linear layers at a few rows (decode): a block of output features for the
// rows of one expert, reading each weight element once per block of up to kChosenRowBlock rows.
// Torch-free, compiled per instruction set (chosen_rows.cpp, MK_ISA_CLONES), so that
// python_tests/builds/isa/chosen_rows_check.cpp runs every variant against a scalar specification.
//
// Both layouts compute, for rows x [n, in] (float32, row r at x + r * in) and features f in [0, F),
//   out[r * out_stride + f] = sum_i x[r, i] * w(f, i)
// in float32, each product and each sum rounded on its own (no fused multiply-add), in an order
// fixed by the layout alone, so that every instruction set, row block and thread count gives the
// same bits:
//  - dot  ([out, in] weights, w(f, i) = w[f * stride + i]): eight partial sums, lane l adding the
//    products at i = 8 j + l in order of j, the tail (in mod 8) then added to lane 0 in order,
//    and ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7));
//  - axpy ([in, out] weights, w(f, i) = w[i * stride + f]): one sum in order of i, from 0.
// bf16 and fp16 weights come as their bits (uint16_t, f16_bits) and widen exactly.
#pragma once

#include <cstdint>

namespace moe_kernels {

// Rows per pass over a weight block: the accumulators of this many rows stay in registers.
constexpr int64_t kChosenRowBlock = 4;

// An fp16 weight element by its bits.
struct f16_bits {
  uint16_t bits;
};

void chosen_dot_rows_f32(const float* x, int64_t n, int64_t in, const float* w, int64_t stride, int64_t F,
                         float* out, int64_t out_stride);
void chosen_dot_rows_bf16(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t stride, int64_t F,
                          float* out, int64_t out_stride);
void chosen_dot_rows_f16(const float* x, int64_t n, int64_t in, const f16_bits* w, int64_t stride, int64_t F,
                         float* out, int64_t out_stride);
void chosen_axpy_rows_f32(const float* x, int64_t n, int64_t in, const float* w, int64_t stride, int64_t F,
                          float* out, int64_t out_stride);
void chosen_axpy_rows_bf16(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t stride, int64_t F,
                           float* out, int64_t out_stride);

void chosen_axpy_rows_f16(const float* x, int64_t n, int64_t in, const f16_bits* w, int64_t stride, int64_t F,
                          float* out, int64_t out_stride);

}  // namespace moe_kernels
