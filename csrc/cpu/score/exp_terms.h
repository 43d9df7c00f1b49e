// Softmax denominators of float32 rows with AVX-512 F intrinsics: the terms exp(x - vmax) by a
// 32-entry table of 2^(j / 32) and a degree-3 polynomial, with FMA (~15 vector operations per 16
// terms, 7 of them on the FMA unit, which bounds the loop), where vec_math::exp_nonpositive
// (exp_sums.cpp's terms on other CPUs) is auto-vectorised without FMA contraction (its scalar and
// vector values must agree, and not every build has FMA) and takes ~30 (docs/topk_softmax.md has
// the timings).
//
// The terms are exp's to ~1 ulp (the table entry's rounding, then the result's); exactly 1 at
// x == vmax, 0 below x - vmax = -80 (as vec_math::exp: those terms are noise in a sum >= 1, and
// their denormals would be slow) and for -inf, NaN for a NaN difference (a NaN row, or an
// infinite or NaN vmax). A term of an element above vmax is undefined (its exponent wraps): vmax
// must be the row's largest value. Their values differ from vec_math::exp's in the last bit: a
// forward and a backward that must agree bit for bit take their terms from the same source.
// topk_router's full-softmax forward takes only the sums from here (its k numerators are
// vec_math::exp_full's); its backward recomputes every term from the logits with torch's tails
// (row_exp_terms_full_f32), so nothing there needs the forward's bits.
#pragma once
#include <cstdint>

namespace moe_kernels {

// For each of the n rows x[i * stride .. i * stride + E) (E >= 1): sums[i] = the sum of the terms
// exp(x[i * stride + e] - vmax[i * vmax_stride]) (a fixed order), and the terms themselves to
// exps[i * E + e] unless exps is null (the sums are the same either way). vmax must be the row's
// largest value (every difference <= 0, or NaN). Returns false, writing nothing, when the CPU
// lacks AVX-512 F; the caller's own terms run then.
bool rows_exp_terms_f32(const float* x, int64_t stride, int64_t n, int64_t E, const float* vmax,
                        int64_t vmax_stride, float* exps, float* sums);

// out[j] = exp(v[j] - vmax[j]) for j < count, bit for bit the term rows_exp_terms_f32 computes for
// an element v[j] of a row whose largest value is vmax[j] (a forward's selected experts' terms,
// without storing every term of the row). Returns false, writing nothing, where rows_exp_terms_f32
// does.
bool exp_terms_f32(const float* v, const float* vmax, int64_t count, float* out);

// rows_exp_terms_f32's terms of one row, stored, with torch's tails instead of the flush below
// -80: denormals down to e^-104, 0 below (vec_math::exp_full's range; the same values where the
// result is normal), their sum to *sum. Returns false, writing nothing, where rows_exp_terms_f32
// does.
bool row_exp_terms_full_f32(const float* row, int64_t E, float vmax, float* exps, float* sum);

// Renormalised top-k weights of n rows' k slots (value, vmax [n * k], vmax the row's largest
// value in each of its slots) into w [n * k]: exp(value - vmax) with torch's tails (denormals
// down to e^-104, as vec_math::exp_full), over the row's sum of them, 0 for a row whose vmax is
// -inf (NaN rows give NaN). 1 <= k <= 16: each row a group of G lanes (k rounded up to a power
// of two; lanes past k hold 0), 16 / G rows a vector, each row's sum by halves folded onto each
// other. Returns false, writing nothing, for k > 16 or where rows_exp_terms_f32 does.
bool renormalized_weights_f32(const float* value, const float* vmax, int64_t n, int64_t k, float* w);

// renormalized_weights_f32 on the rows' selections as rank pairs (best [n * k], each row's
// descending, as rows_top_pairs_f32 writes them): experts[j] = pair_index(best[j]), and w the
// weights renormalized_weights_f32 gives for selected_slots' value and vmax of those pairs, bit
// for bit, without writing those. Returns false, writing nothing, where renormalized_weights_f32
// does.
bool renormalized_pairs_f32(const int64_t* best, int64_t n, int64_t k, int64_t* experts, float* w);

}  // namespace moe_kernels
