// Softmax denominators of float32 rows: the sum over a row of exp(x - vmax), vmax the row's largest
// value, one row or a block of rows at a time, compiled per instruction set. With AVX-512 F the
// terms are exp_terms.h's table exp; elsewhere vec_math.h's polynomial exp, auto-vectorised.
#pragma once
#include <cstdint>

namespace moe_kernels {

// sum over e of exp(row[e] - vmax), each term also stored to exps[e] (exps [E], not aliasing
// row). vmax is the row's largest value (every argument is <= 0), finite or NaN (NaN terms and
// sum). Terms below e^-80 (including those of -inf logits) are 0; a few ulp each: exp_terms.h's
// with AVX-512 F, vec_math::exp's elsewhere.
float row_exp_sum_f32(const float* row, int64_t E, float vmax, float* exps);

// row_exp_sum_f32's sum for a block of n rows x[i * stride ..] (a forward's softmax): the sum of
// row i's terms relative to vmax[i * vmax_stride], its largest value as its selection found it,
// to sums[i] (in row_exp_sum_f32's order and with its values). scratch [n * E] is overwritten.
// With AVX-512 F the terms are exp_terms.h's (not stored); elsewhere a finite vmax (every term in [-inf, 0]) takes
// vec_math::exp_nonpositive, a third fewer vector operations than exp, and a row with an infinite
// or NaN vmax takes exp.
void rows_softmax_sums_f32(const float* x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                           int64_t vmax_stride, float* scratch, float* sums);

// out[j] = the term row_exp_sum_f32 and rows_softmax_sums_f32 compute for an element value[j] of a
// row whose largest value is vmax[j], bit for bit (j < count): the full softmax's selected
// experts' numerators (topk_router's forward without bias or groups).
void softmax_terms_f32(const float* value, const float* vmax, int64_t count, float* out);

// row_exp_sum_f32 with torch's tails: the terms keep denormals below e^-87.3 (down to e^-104) where
// they are compared rather than only summed (topk_router ranks softmax scores when it has a bias
// or groups, and a flushed 0 would tie with an expert torch ranks above it). exp_terms.h's
// row_exp_terms_full_f32 with AVX-512 F, vec_math::exp_full elsewhere.
float row_exp_sum_full_f32(const float* row, int64_t E, float vmax, float* exps);

}  // namespace moe_kernels
