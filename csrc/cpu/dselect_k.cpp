// Fused DSelect-k gate on CPU (003_a1a58754fcb6a991.txt, eq 6): per row b, softmax(alpha_b), the
// k selectors r(S(z_bi)) built by doubling (2^m products each), and their weighted sum; the
// backward recomputes the same in float32 and applies the chain rule in one pass per row.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "moe_kernels/dselect_k.h"
#include "score/vec_math.h"

namespace moe_kernels {
namespace {

constexpr int64_t kMaxBits = 24;  // 2^m floats of scratch per selector

void check_inputs(const at::Tensor& alpha, const at::Tensor& z, int64_t n, double gamma, const char* op) {
  TORCH_CHECK(alpha.dim() == 2 && z.dim() == 3 && z.size(0) == alpha.size(0) && z.size(1) == alpha.size(1),
              op, ": alpha must be [B, k] and z [B, k, m], got ", alpha.sizes(), " and ", z.sizes());
  TORCH_CHECK(alpha.size(1) >= 1, op, ": need k >= 1");
  TORCH_CHECK(z.size(2) <= kMaxBits, op, ": m too large");
  TORCH_CHECK(n >= 1 && n <= (int64_t(1) << z.size(2)) && (z.size(2) == 0 || n > (int64_t(1) << (z.size(2) - 1))),
              op, ": need m = ceil(log2(num_experts)), got num_experts=", n, ", m=", z.size(2));
  TORCH_CHECK(alpha.scalar_type() == z.scalar_type(), op, ": alpha and z must have the same dtype");
  TORCH_CHECK(alpha.scalar_type() == at::kFloat || alpha.scalar_type() == at::kHalf ||
                  alpha.scalar_type() == at::kBFloat16,
              op, ": alpha must be float32, float16 or bfloat16, got ", alpha.scalar_type());
  TORCH_CHECK(gamma > 0 && std::isfinite(gamma), op, ": gamma must be positive and finite, got ", gamma);
}

// softmax(alpha_b) [k] in float32, max-shifted (an all -inf row gives NaN, as torch.softmax). The
// exp is vec_math's, so that softmax_lanes computes the same values.
template <typename scalar_t>
void softmax_row(const scalar_t* a, int64_t k, float* p) {
  float vmax = -INFINITY;
  for (int64_t i = 0; i < k; ++i) vmax = std::max(vmax, (float)a[i]);
  float denom = 0.0f;
  for (int64_t i = 0; i < k; ++i) denom += (p[i] = vec_math::exp_full((float)a[i] - vmax));
  for (int64_t i = 0; i < k; ++i) p[i] /= denom;
}

// The forward for a block of rows with the rows in vector lanes (at most kLaneRows, 2^m at most
// kLaneMaxL): with few experts a row's own loops are a few elements long, and the per-row work
// around them costs more than the arithmetic. Every array is
// [what, lane] with R lanes; each value is computed by the same operations in the same order as
// the row path (softmax_row, smooth_step, selector) and the backward's recomputation, so both give
// the same bits where the row path is not contracted into FMAs either (the build's baseline
// x86-64 target has none; a -march build with FMA would differ in the last bits).
constexpr int64_t kLaneRows = 64;
constexpr int64_t kLaneMaxL = 64;

MK_VECTORISE MK_ISA_CLONES void softmax_lanes(const float* __restrict a, int64_t k, int64_t R, float* __restrict p) {
  float vmax[kLaneRows], denom[kLaneRows];
  for (int64_t r = 0; r < R; ++r) vmax[r] = -INFINITY;
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t r = 0; r < R; ++r) vmax[r] = vmax[r] < a[i * R + r] ? a[i * R + r] : vmax[r];  // std::max's NaN rule
  }
  for (int64_t r = 0; r < R; ++r) denom[r] = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t r = 0; r < R; ++r) denom[r] += (p[i * R + r] = vec_math::exp_full(a[i * R + r] - vmax[r]));
  }
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t r = 0; r < R; ++r) p[i * R + r] /= denom[r];
  }
}

// One selector of every lane: s = S(z) [m, R] from z [m, R], then r [2^m, R] by doubling.
MK_VECTORISE MK_ALWAYS_INLINE void selector_of_lanes(const float* __restrict z, int64_t m, int64_t R, dselect_k::SmoothStep sp,
                                     float* __restrict s, float* __restrict r) {
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t l = 0; l < R; ++l) s[j * R + l] = dselect_k::smooth_step(z[j * R + l], sp);
  }
  for (int64_t l = 0; l < R; ++l) r[l] = 1.0f;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t half = int64_t(1) << j;
    for (int64_t e = 0; e < half; ++e) {
      for (int64_t l = 0; l < R; ++l) {
        const float x = r[e * R + l], sj = s[j * R + l];
        r[(e + half) * R + l] = x * sj;
        r[e * R + l] = x * (1.0f - sj);
      }
    }
  }
}

// selector_of_lanes, then acc [n, R] += p [R] * r.
MK_VECTORISE MK_ISA_CLONES void selector_lanes(const float* __restrict z, int64_t m, int64_t n, int64_t R,
                                               dselect_k::SmoothStep sp, const float* __restrict p,
                                               float* __restrict s, float* __restrict r, float* __restrict acc) {
  selector_of_lanes(z, m, R, sp, s, r);
  for (int64_t e = 0; e < n; ++e) {
    for (int64_t l = 0; l < R; ++l) acc[e * R + l] += p[l] * r[e * R + l];
  }
}

// The backward of one selector of every lane (the row path's loop body, by lanes): from z [m, R],
// p_i [R], the upstream gates g [n, R] and selectors gs [2^m, R] (or null): c [R] = <g, r[:n]>,
// pc [R] += p_i c, and dz [m, R] = S'(z) * selector_grad(u, r) with u = p_i g (0 past n) + gs.
MK_VECTORISE MK_ISA_CLONES void selector_backward_lanes(const float* __restrict z, int64_t m, int64_t n, int64_t R,
                                                        dselect_k::SmoothStep sp, const float* __restrict p,
                                                        const float* __restrict g, const float* __restrict gs,
                                                        float* __restrict s, float* __restrict r,
                                                        float* __restrict u, float* __restrict c,
                                                        float* __restrict pc, float* __restrict dz) {
  const int64_t L = int64_t(1) << m;
  selector_of_lanes(z, m, R, sp, s, r);
  for (int64_t l = 0; l < R; ++l) c[l] = 0.0f;
  for (int64_t e = 0; e < n; ++e) {
    for (int64_t l = 0; l < R; ++l) c[l] += g[e * R + l] * r[e * R + l];
  }
  for (int64_t l = 0; l < R; ++l) pc[l] += p[l] * c[l];
  for (int64_t e = 0; e < L; ++e) {
    for (int64_t l = 0; l < R; ++l) {
      const float from_gates = e < n ? p[l] * g[e * R + l] : 0.0f;
      u[e * R + l] = gs != nullptr ? from_gates + gs[e * R + l] : from_gates;
    }
  }
  for (int64_t j = 0; j < m; ++j) {
    const int64_t bit = int64_t(1) << j;
    float* acc = dz + j * R;
    for (int64_t l = 0; l < R; ++l) acc[l] = 0.0f;
    for (int64_t e = 0; e < L; ++e) {
      if (e & bit) continue;
      for (int64_t l = 0; l < R; ++l) {
        acc[l] += (u[(e + bit) * R + l] - u[e * R + l]) * (r[e * R + l] + r[(e + bit) * R + l]);
      }
    }
    for (int64_t l = 0; l < R; ++l) acc[l] = dselect_k::smooth_step_chain(acc[l], z[j * R + l], sp);
  }
}

// Rows [b0, b0 + R) of the forward by lanes: alpha [B, k], z [B, k, m] in, gates [B, n] and
// optionally selectors [B, k, 2^m] out (contiguous).
template <typename scalar_t>
void dselect_k_lanes(const scalar_t* a, const scalar_t* zp, int64_t b0, int64_t R, int64_t k, int64_t m, int64_t n,
                     dselect_k::SmoothStep sp, scalar_t* g, scalar_t* so, std::vector<float>& scratch) {
  const int64_t L = int64_t(1) << m;
  scratch.resize((2 * k + 2 * std::max<int64_t>(m, 1) + L + n) * kLaneRows);
  float* at = scratch.data();
  float* p = at + k * kLaneRows;
  float* zt = p + k * kLaneRows;
  float* s = zt + std::max<int64_t>(m, 1) * kLaneRows;
  float* r = s + std::max<int64_t>(m, 1) * kLaneRows;
  float* acc = r + L * kLaneRows;
  for (int64_t l = 0; l < R; ++l) {
    for (int64_t i = 0; i < k; ++i) at[i * R + l] = (float)a[(b0 + l) * k + i];
  }
  softmax_lanes(at, k, R, p);
  std::fill(acc, acc + n * R, 0.0f);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t l = 0; l < R; ++l) {
      for (int64_t j = 0; j < m; ++j) zt[j * R + l] = (float)zp[((b0 + l) * k + i) * m + j];
    }
    selector_lanes(zt, m, n, R, sp, p + i * R, s, r, acc);
    if (so != nullptr) {
      for (int64_t l = 0; l < R; ++l) {
        for (int64_t e = 0; e < L; ++e) so[((b0 + l) * k + i) * L + e] = (scalar_t)r[e * R + l];
      }
    }
  }
  for (int64_t l = 0; l < R; ++l) {
    for (int64_t e = 0; e < n; ++e) g[(b0 + l) * n + e] = (scalar_t)acc[e * R + l];
  }
}

std::tuple<at::Tensor, at::Tensor> dselect_k_cpu(const at::Tensor& alpha_in, const at::Tensor& z_in,
                                                 int64_t n, double gamma, bool return_selectors) {
  check_inputs(alpha_in, z_in, n, gamma, "dselect_k");
  const int64_t B = alpha_in.size(0), k = alpha_in.size(1), m = z_in.size(2), L = int64_t(1) << m;
  const auto alpha = alpha_in.contiguous();
  const auto z = z_in.contiguous();
  auto gates = at::empty({B, n}, alpha.options());
  auto sel = at::empty({B, k, return_selectors ? L : 0}, alpha.options());
  if (B == 0) return {gates, sel};
  const auto sp = dselect_k::smooth_step_params(gamma);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "dselect_k", [&] {
    const scalar_t* a = alpha.const_data_ptr<scalar_t>();
    const scalar_t* zp = z.const_data_ptr<scalar_t>();
    scalar_t* g = gates.mutable_data_ptr<scalar_t>();
    scalar_t* so = return_selectors ? sel.mutable_data_ptr<scalar_t>() : nullptr;
    const int64_t grain = std::max<int64_t>(1, 16384 / (k * L));
    if (L <= kLaneMaxL) {
      at::parallel_for(0, B, kLaneRows, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        for (int64_t b0 = begin; b0 < end; b0 += kLaneRows) {
          dselect_k_lanes(a, zp, b0, std::min(kLaneRows, end - b0), k, m, n, sp, g, so, scratch);
        }
      });
      return;
    }
    at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(k), s(std::max<int64_t>(m, 1)), r(L), acc(n);
      for (int64_t b = begin; b < end; ++b) {
        softmax_row(a + b * k, k, p.data());
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t i = 0; i < k; ++i) {
          for (int64_t j = 0; j < m; ++j) s[j] = dselect_k::smooth_step((float)zp[(b * k + i) * m + j], sp);
          dselect_k::selector(s.data(), (int)m, r.data());
          for (int64_t l = 0; l < n; ++l) acc[l] += p[i] * r[l];
          if (so != nullptr)
            for (int64_t l = 0; l < L; ++l) so[(b * k + i) * L + l] = (scalar_t)r[l];
        }
        for (int64_t l = 0; l < n; ++l) g[b * n + l] = (scalar_t)acc[l];
      }
    });
  });
  return {gates, sel};
}

// Rows [b0, b0 + R) of the backward by lanes (dselect_k_lanes' layout): g [B, n] and gsp
// [B, k, 2^m] (or null) float32 in; grad_alpha [B, k] and grad_z [B, k, m] out.
template <typename scalar_t>
void dselect_k_backward_lanes(const scalar_t* a, const scalar_t* zp, const float* g, const float* gsp, int64_t b0,
                              int64_t R, int64_t k, int64_t m, int64_t n, dselect_k::SmoothStep sp, scalar_t* ga,
                              scalar_t* gz, std::vector<float>& scratch) {
  const int64_t L = int64_t(1) << m, mm = std::max<int64_t>(m, 1);
  scratch.resize((3 * k + 3 * mm + n + 3 * L + 1) * kLaneRows);
  float* at = scratch.data();
  float* p = at + k * kLaneRows;
  float* c = p + k * kLaneRows;
  float* zt = c + k * kLaneRows;
  float* s = zt + mm * kLaneRows;
  float* dz = s + mm * kLaneRows;
  float* gt = dz + mm * kLaneRows;
  float* gst = gt + n * kLaneRows;
  float* r = gst + L * kLaneRows;
  float* u = r + L * kLaneRows;
  float* pc = u + L * kLaneRows;
  for (int64_t l = 0; l < R; ++l) {
    for (int64_t i = 0; i < k; ++i) at[i * R + l] = (float)a[(b0 + l) * k + i];
    for (int64_t e = 0; e < n; ++e) gt[e * R + l] = g[(b0 + l) * n + e];
  }
  softmax_lanes(at, k, R, p);
  std::fill(pc, pc + R, 0.0f);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t l = 0; l < R; ++l) {
      for (int64_t j = 0; j < m; ++j) zt[j * R + l] = (float)zp[((b0 + l) * k + i) * m + j];
      if (gsp != nullptr) {
        for (int64_t e = 0; e < L; ++e) gst[e * R + l] = gsp[((b0 + l) * k + i) * L + e];
      }
    }
    selector_backward_lanes(zt, m, n, R, sp, p + i * R, gt, gsp != nullptr ? gst : nullptr, s, r, u, c + i * R, pc,
                            dz);
    for (int64_t l = 0; l < R; ++l) {
      for (int64_t j = 0; j < m; ++j) gz[((b0 + l) * k + i) * m + j] = (scalar_t)dz[j * R + l];
    }
  }
  for (int64_t l = 0; l < R; ++l) {
    for (int64_t i = 0; i < k; ++i) ga[(b0 + l) * k + i] = (scalar_t)(p[i * R + l] * (c[i * R + l] - pc[l]));
  }
}

// grad_gates [B, n], grad_selectors [B, k, 2^m] or absent/empty. With p = softmax(alpha_b),
// r_i = r(S(z_bi)), c_i = <grad_gates, r_i[:n]>:
//   d alpha_i = p_i (c_i - sum_i' p_i' c_i');  d r_il = p_i grad_gates_l [l < n] + grad_sel_il;
//   d z_ij = S'(z_ij) * selector_grad(d r_i, r_i)_j.
std::tuple<at::Tensor, at::Tensor> dselect_k_backward_cpu(const at::Tensor& grad_gates_in,
                                                          const std::optional<at::Tensor>& grad_sel_in,
                                                          const at::Tensor& alpha_in, const at::Tensor& z_in,
                                                          int64_t n, double gamma) {
  check_inputs(alpha_in, z_in, n, gamma, "dselect_k_backward");
  const int64_t B = alpha_in.size(0), k = alpha_in.size(1), m = z_in.size(2), L = int64_t(1) << m;
  TORCH_CHECK(grad_gates_in.dim() == 2 && grad_gates_in.size(0) == B && grad_gates_in.size(1) == n,
              "dselect_k_backward: grad_gates must be [B, num_experts]");
  const bool has_sel = grad_sel_in.has_value() && grad_sel_in->numel() > 0;
  if (has_sel)
    TORCH_CHECK(grad_sel_in->dim() == 3 && grad_sel_in->size(0) == B && grad_sel_in->size(1) == k &&
                    grad_sel_in->size(2) == L,
                "dselect_k_backward: grad_selectors must be [B, k, 2^m]");
  const auto alpha = alpha_in.contiguous();
  const auto z = z_in.contiguous();
  const auto gg = grad_gates_in.to(at::kFloat).contiguous();
  const auto gs = has_sel ? grad_sel_in->to(at::kFloat).contiguous() : at::Tensor();
  auto grad_alpha = at::empty({B, k}, alpha.options());
  auto grad_z = at::empty({B, k, m}, z.options());
  if (B == 0) return {grad_alpha, grad_z};
  const auto sp = dselect_k::smooth_step_params(gamma);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "dselect_k_backward", [&] {
    const scalar_t* a = alpha.const_data_ptr<scalar_t>();
    const scalar_t* zp = z.const_data_ptr<scalar_t>();
    const float* g = gg.const_data_ptr<float>();
    const float* gsp = has_sel ? gs.const_data_ptr<float>() : nullptr;
    scalar_t* ga = grad_alpha.mutable_data_ptr<scalar_t>();
    scalar_t* gz = grad_z.mutable_data_ptr<scalar_t>();
    if (L <= kLaneMaxL) {
      at::parallel_for(0, B, kLaneRows, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        for (int64_t b0 = begin; b0 < end; b0 += kLaneRows) {
          dselect_k_backward_lanes(a, zp, g, gsp, b0, std::min(kLaneRows, end - b0), k, m, n, sp, ga, gz, scratch);
        }
      });
      return;
    }
    const int64_t grain = std::max<int64_t>(1, 16384 / (k * L));
    at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(k), c(k), s(std::max<int64_t>(m, 1)), ds(std::max<int64_t>(m, 1)), r(L), u(L);
      for (int64_t b = begin; b < end; ++b) {
        softmax_row(a + b * k, k, p.data());
        const float* gb = g + b * n;
        float pc = 0.0f;
        for (int64_t i = 0; i < k; ++i) {
          const scalar_t* zi = zp + (b * k + i) * m;
          for (int64_t j = 0; j < m; ++j) s[j] = dselect_k::smooth_step((float)zi[j], sp);
          dselect_k::selector(s.data(), (int)m, r.data());
          float ci = 0.0f;
          for (int64_t l = 0; l < n; ++l) ci += gb[l] * r[l];
          c[i] = ci;
          pc += p[i] * ci;
          for (int64_t l = 0; l < n; ++l) u[l] = p[i] * gb[l];
          for (int64_t l = n; l < L; ++l) u[l] = 0.0f;
          if (gsp != nullptr)
            for (int64_t l = 0; l < L; ++l) u[l] += gsp[(b * k + i) * L + l];
          dselect_k::selector_grad(u.data(), r.data(), (int)m, ds.data());
          for (int64_t j = 0; j < m; ++j)
            gz[(b * k + i) * m + j] = (scalar_t)dselect_k::smooth_step_chain(ds[j], (float)zi[j], sp);
        }
        for (int64_t i = 0; i < k; ++i) ga[b * k + i] = (scalar_t)(p[i] * (c[i] - pc));
      }
    });
  });
  return {grad_alpha, grad_z};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_kernels, m) {
  m.def(
      "dselect_k(Tensor alpha, Tensor z, int num_experts, float gamma, bool return_selectors) "
      "-> (Tensor gates, Tensor selectors)");
  m.def(
      "dselect_k_backward(Tensor grad_gates, Tensor? grad_selectors, Tensor alpha, Tensor z, int num_experts, "
      "float gamma) -> (Tensor grad_alpha, Tensor grad_z)");
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("dselect_k", &dselect_k_cpu);
  m.impl("dselect_k_backward", &dselect_k_backward_cpu);
}

}  // namespace moe_kernels
