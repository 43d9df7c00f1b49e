// CUDA implementations of the moe_kernels ops: torch tensors in, raw pointers to the launchers
// of csrc/cuda/*.cu out. Compiled only in CUDA builds (setup.py adds -DMOE_KERNELS_CUDA); each op
// is the same few lines: guard the device, allocate outputs, launch on the current stream.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "moe_kernels/cuda_launchers.h"

namespace moe_kernels {
namespace {

DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type());
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> batchwise_mask(const at::Tensor& scores, int64_t m) {
  TORCH_CHECK(scores.dim() == 2 && m >= 0 && m <= scores.size(0), "batchwise_mask: bad arguments");
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t T = scores.size(0), E = scores.size(1);
  auto mask = at::zeros({T, E}, scores.options().dtype(at::kBool));
  auto tokens = at::empty({E, m}, scores.options().dtype(at::kLong));
  check_launch(batchwise_mask_cuda(scores.const_data_ptr(), dtype_of(scores, "batchwise_mask"), T, E,
                                   scores.stride(0), scores.stride(1), m, mask.mutable_data_ptr<bool>(),
                                   tokens.mutable_data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "batchwise_mask");
  return {mask, tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_kernels, CUDA, m) {
  m.impl("batchwise_mask", &batchwise_mask);
}

}  // namespace moe_kernels

// load_probabilities (csrc/cuda/load_probabilities.cu).
namespace moe_kernels {
namespace {

std::tuple<at::Tensor, at::Tensor> load_probabilities(const at::Tensor& clean, const at::Tensor& noisy,
                                                      const at::Tensor& stddev, int64_t k) {
  TORCH_CHECK(noisy.dim() == 2 && clean.sizes() == noisy.sizes() && stddev.sizes() == noisy.sizes() && k >= 1 &&
                  k <= noisy.size(1) && clean.scalar_type() == noisy.scalar_type() &&
                  stddev.scalar_type() == noisy.scalar_type(),
              "load_probabilities: bad arguments");
  const c10::cuda::CUDAGuard guard(noisy.device());
  const int64_t T = noisy.size(0), E = noisy.size(1);
  auto probs = at::empty({T, E}, noisy.options());
  auto top = at::empty({T, k + 1}, noisy.options().dtype(at::kLong));
  const LoadProbabilitiesStrides strides{clean.stride(0), clean.stride(1), noisy.stride(0),
                                         noisy.stride(1), stddev.stride(0), stddev.stride(1)};
  check_launch(load_probabilities_cuda(clean.const_data_ptr(), noisy.const_data_ptr(), stddev.const_data_ptr(),
                                       dtype_of(noisy, "load_probabilities"), strides, T, E, k,
                                       probs.mutable_data_ptr(), top.mutable_data_ptr<int64_t>(),
                                       c10::cuda::getCurrentCUDAStream()),
               "load_probabilities");
  return {probs, top};
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_kernels, CUDA, m) { m.impl("load_probabilities", &load_probabilities); }

}  // namespace moe_kernels

// Capacity routing (csrc/cuda/capacity_positions.cu, dispatch.cu): capacity_positions, dispatch,
// combine and the two backward ops the autograd formulas of moe_kernels/ops call. float64 is
// CPU-only here.
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sort.h>

#include "moe_kernels/capacity_segments.h"

namespace moe_kernels {
namespace {

// path: a capacity_segments::Path (below).
std::tuple<at::Tensor, at::Tensor> capacity_positions_on_path(const at::Tensor& experts_in, int64_t num_experts,
                                                              int64_t capacity,
                                                              const std::optional<at::Tensor>& priority, int64_t path) {
  TORCH_CHECK(experts_in.dim() == 2 && num_experts >= 1 && capacity >= 0, "capacity_positions: bad arguments");
  const c10::cuda::CUDAGuard guard(experts_in.device());
  const at::Tensor experts = experts_in.contiguous();
  const int64_t T = experts.size(0), k = experts.size(1);
  // Fill order: s-major by default (computed in the kernels); by descending priority (stable,
  // NaN last) otherwise, as an array of flat indices.
  const auto s_major = [&] { return at::arange(T * k, experts.options()).view({T, k}).t().reshape({-1}); };
  std::optional<at::Tensor> order;
  if (priority.has_value()) {
    // The order array must hold every choice: the kernels write each one once and read no other.
    TORCH_CHECK(priority->sizes() == experts.sizes(), "capacity_positions: priority must have experts' shape");
    const at::Tensor by_priority =
        std::get<1>(at::sort(priority->t().reshape({-1}).to(at::kFloat).neg(), true, 0, false));
    order = s_major().index_select(0, by_priority);
  }
  auto counts = at::empty({num_experts}, experts.options());
  at::Tensor positions;
  const capacity_segments::Layout layout = capacity_segments::layout(T, k, order.has_value());
  TORCH_CHECK(path == capacity_segments::kAuto || (capacity_segments::supported(num_experts, T, k) &&
                                                    capacity_segments::path_fits((int)path, layout, num_experts)),
              "capacity_positions: path ", path, " does not take these experts (capacity_segments::path_fits)");
  if (capacity_segments::supported(num_experts, T, k)) {
    positions = at::empty({T, k}, experts.options());
    auto table = at::empty({capacity_positions_table_size(T, k, num_experts, order.has_value())},
                           experts.options().dtype(at::kInt));
    if (T * k > 0)
      check_launch(capacity_positions_segments_cuda(experts.const_data_ptr<int64_t>(),
                                                    order ? order->const_data_ptr<int64_t>() : nullptr, T, k,
                                                    num_experts, capacity, (int)path,
                                                    table.mutable_data_ptr<int32_t>(),
                                                    positions.mutable_data_ptr<int64_t>(),
                                                    counts.mutable_data_ptr<int64_t>(),
                                                    c10::cuda::getCurrentCUDAStream()),
                   "capacity_positions");
    else
      counts.zero_();
  } else {
    if (!order) order = s_major();
    positions = at::full({T, k}, -1, experts.options());
    check_launch(capacity_positions_cuda(experts.const_data_ptr<int64_t>(), order->const_data_ptr<int64_t>(), T * k,
                                         num_experts, capacity, positions.mutable_data_ptr<int64_t>(),
                                         counts.mutable_data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
                 "capacity_positions");
  }
  return {positions, counts};
}

// MOE_KERNELS_CAPACITY_PATH, a capacity_segments::Path number, forces the kernels' path (a
// benchmark's hook: bench/gpu_capacity_variants.py times each path; every path gives the same
// result). A path that does not fit the call raises. Unset: the launcher's choice.
std::tuple<at::Tensor, at::Tensor> capacity_positions_gpu(const at::Tensor& experts, int64_t num_experts,
                                                          int64_t capacity, const std::optional<at::Tensor>& priority) {
  int64_t path = capacity_segments::kAuto;
  if (const char* forced = std::getenv("MOE_KERNELS_CAPACITY_PATH"); forced != nullptr && *forced != '\0') {
    char* end = nullptr;
    path = std::strtol(forced, &end, 10);
    TORCH_CHECK(*end == '\0', "capacity_positions: MOE_KERNELS_CAPACITY_PATH must be a path's number "
                "(capacity_segments::Path: -1 to 3), got '", forced, "'");
  }
  return capacity_positions_on_path(experts, num_experts, capacity, priority, path);
}

at::Tensor dispatch_weighted(const at::Tensor& x_in, const at::Tensor& experts_in, const at::Tensor& positions_in,
                             int64_t E, int64_t C, const at::Tensor* weights) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), experts = experts_in.contiguous(), positions = positions_in.contiguous();
  const at::Tensor w = weights ? weights->to(at::kFloat).contiguous() : at::Tensor();
  auto out = at::empty({E, C, x.size(1)}, x.options());
  auto source = at::empty({E * C}, experts.options());
  check_launch(dispatch_cuda(x.const_data_ptr(), dtype_of(x, "dispatch"), x.size(0), x.size(1), experts.size(1),
                             experts.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(), E, C,
                             weights ? w.const_data_ptr<float>() : nullptr, source.mutable_data_ptr<int64_t>(),
                             out.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream()),
               "dispatch");
  return out;
}

at::Tensor dispatch_gpu(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& positions,
                        int64_t num_experts, int64_t capacity) {
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && experts.sizes() == positions.sizes(), "dispatch: bad arguments");
  return dispatch_weighted(x, experts, positions, num_experts, capacity, nullptr);
}

at::Tensor combine_weighted(const at::Tensor& buffer_in, const at::Tensor& experts_in, const at::Tensor& positions_in,
                            const at::Tensor* weights) {
  const c10::cuda::CUDAGuard guard(buffer_in.device());
  const at::Tensor buffer = buffer_in.contiguous(), experts = experts_in.contiguous(),
                   positions = positions_in.contiguous();
  const at::Tensor w = weights ? weights->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t T = experts.size(0), d = buffer.size(2);
  auto y = at::empty({T, d}, buffer.options());
  check_launch(combine_cuda(buffer.const_data_ptr(), dtype_of(buffer, "combine"), buffer.size(0), buffer.size(1), d,
                            T, experts.size(1), experts.const_data_ptr<int64_t>(), positions.const_data_ptr<int64_t>(),
                            weights ? w.const_data_ptr<float>() : nullptr, y.mutable_data_ptr(),
                            c10::cuda::getCurrentCUDAStream()),
               "combine");
  return y;
}

at::Tensor combine_gpu(const at::Tensor& buffer, const at::Tensor& experts, const at::Tensor& positions,
                       const at::Tensor& weights) {
  TORCH_CHECK(buffer.dim() == 3 && experts.sizes() == positions.sizes() && weights.sizes() == experts.sizes(),
              "combine: bad arguments");
  return combine_weighted(buffer, experts, positions, &weights);
}

at::Tensor dispatch_backward_gpu(const at::Tensor& grad_buffer, const at::Tensor& experts,
                                 const at::Tensor& positions) {
  TORCH_CHECK(grad_buffer.dim() == 3 && experts.sizes() == positions.sizes(), "dispatch_backward: bad arguments");
  return combine_weighted(grad_buffer, experts, positions, nullptr);  // the gather-sum, unit weights
}

std::tuple<at::Tensor, at::Tensor> combine_backward_gpu(const at::Tensor& grad_y_in, const at::Tensor& buffer_in,
                                                        const at::Tensor& experts_in, const at::Tensor& positions_in,
                                                        const at::Tensor& weights) {
  TORCH_CHECK(buffer_in.dim() == 3 && grad_y_in.dim() == 2, "combine_backward: bad arguments");
  const c10::cuda::CUDAGuard guard(buffer_in.device());
  const int64_t E = buffer_in.size(0), C = buffer_in.size(1), d = buffer_in.size(2);
  auto grad_buffer = dispatch_weighted(grad_y_in, experts_in, positions_in, E, C, &weights);
  const at::Tensor g = grad_y_in.contiguous(), buffer = buffer_in.contiguous(), experts = experts_in.contiguous(),
                   positions = positions_in.contiguous();
  auto grad_weights = at::empty(experts.sizes(), weights.options().dtype(at::kFloat));
  check_launch(combine_weights_grad_cuda(g.const_data_ptr(), buffer.const_data_ptr(), dtype_of(buffer, "combine"), E,
                                         C, d, experts.size(0), experts.size(1), experts.const_data_ptr<int64_t>(),
                                         positions.const_data_ptr<int64_t>(), grad_weights.mutable_data_ptr<float>(),
                                         c10::cuda::getCurrentCUDAStream()),
               "combine_backward");
  return {grad_buffer, grad_weights.to(weights.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_kernels, CUDA, m) {
  m.impl("capacity_positions", &capacity_positions_gpu);
  m.impl("dispatch", &dispatch_gpu);
  m.impl("dispatch_backward", &dispatch_backward_gpu);
  m.impl("combine", &combine_gpu);
  m.impl("combine_backward", &combine_backward_gpu);
}

}  // namespace moe_kernels

#include "moe_kernels/balanced_assignment_steps.h"

// Exact balanced assignment (csrc/cuda/balanced_assignment.cu). float16 / bfloat16 scores are
// solved in float32 (exact), as on the CPU. Synchronises the stream (the finiteness check, the
// solver's done flag).
namespace moe_kernels {
namespace {

// MOE_KERNELS_SOLVER_PROFILE=1: after each solve, one line on stderr with the solve's counts, where
// its auction's heaps were, and where its device time went (the leader thread's clock cycles by
// part, balanced_assignment::Clock, over the device's peak clock rate: an SM clocked lower ran
// longer than it says): a diagnosis for bench/gpu_solver_variants.py, which reads it.
void print_solver_profile(void* workspace, int64_t n, int64_t k, int64_t capacity, double eps_div,
                          cudaStream_t stream) {
  namespace ba = balanced_assignment;
  int64_t f[kBalancedProfileFields];
  check_launch(balanced_assignment_cuda_profile(workspace, n, k, capacity, f, stream), "balanced_assignment");
  const int64_t* ints = f;
  const int64_t* clocks = f + ba::kNumInts;
  const double khz = (double)f[kBalancedProfileFields - 1];
  const auto ms = [&](int slot) { return khz > 0 ? (double)clocks[slot] / khz : 0.0; };
  std::fprintf(stderr,
               "moe_kernels balanced_assignment profile: n=%lld k=%lld capacity=%lld eps_div=%g iterations=%lld "
               "few=%lld restarted=%lld passes=%lld const_rows=%lld heaps=%s | ms at %.0f MHz: auction %.4f (bids "
               "%.4f, grouping %.4f, take %.4f), passes %.4f, moves %.4f\n",
               (long long)n, (long long)k, (long long)capacity, eps_div > 0.0 ? eps_div : ba::kDeviceEpsDiv,
               (long long)ints[ba::kIterations], (long long)ints[ba::kFewIterations], (long long)ints[ba::kRestarted],
               (long long)ints[ba::kPasses], (long long)ints[ba::kConstRows], ints[ba::kSharedHeaps] ? "shared" : "global",
               khz / 1e3, ms(ba::kClockAuction),
               ms(ba::kClockBids), ms(ba::kClockGroup), ms(ba::kClockTake), ms(ba::kClockPasses), ms(ba::kClockMoves));
  std::fflush(stderr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> balanced_assignment_gpu(const at::Tensor& scores, int64_t capacity) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) >= 1 && capacity >= 1 &&
                  capacity * scores.size(1) >= scores.size(0) && scores.size(0) < INT32_MAX &&
                  scores.size(1) < INT32_MAX,
              "balanced_assignment: bad arguments");
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t n = scores.size(0), k = scores.size(1);
  const bool f64 = scores.scalar_type() == at::kDouble;
  const at::Tensor x = f64 ? scores.contiguous() : scores.to(at::kFloat).contiguous();
  // The solver does not reject NaN / inf itself (its auction would run to the iteration guard):
  // checked here, inside the op, where the solve reads its done flag on the host anyway, so a
  // compiled caller sees no host read of its own (torch.compile(fullgraph=True)).
  const bool finite = n == 0 || x.isfinite().all().item<bool>();
  TORCH_CHECK_VALUE(finite, "balanced_assignment: scores must be finite (no NaN or inf)");
  auto experts = at::empty({n}, scores.options().dtype(at::kLong));
  auto value = at::zeros({}, scores.options().dtype(at::kDouble));
  auto dist = at::full({k, k}, INFINITY, scores.options().dtype(at::kDouble)).fill_diagonal_(0.0);
  if (n == 0) return {experts, value, dist};
  auto workspace = at::empty({(int64_t)balanced_assignment_cuda_workspace(n, k, capacity)},
                             scores.options().dtype(at::kByte));
  // MOE_KERNELS_SOLVER_EPS_DIV, a number >= 1, replaces the auction's eps divisor (a benchmark's
  // hook: bench/gpu_solver_variants.py times several; the solve is exact at every one, its
  // iterations and passes change). Unset: the default (balanced_assignment_steps.h).
  double eps_div = 0.0;
  if (const char* forced = std::getenv("MOE_KERNELS_SOLVER_EPS_DIV"); forced != nullptr && *forced != '\0') {
    char* end = nullptr;
    eps_div = std::strtod(forced, &end);
    TORCH_CHECK(*end == '\0' && std::isfinite(eps_div) && eps_div >= 1.0,
                "balanced_assignment: MOE_KERNELS_SOLVER_EPS_DIV must be a finite number >= 1, got '", forced, "'");
  }
  int status = kAssignmentGuard;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  check_launch(f64 ? balanced_assignment_cuda(x.const_data_ptr<double>(), n, k, capacity, eps_div,
                                              workspace.mutable_data_ptr(), experts.mutable_data_ptr<int64_t>(),
                                              value.mutable_data_ptr<double>(), dist.mutable_data_ptr<double>(),
                                              &status, stream)
                   : balanced_assignment_cuda(x.const_data_ptr<float>(), n, k, capacity, eps_div,
                                              workspace.mutable_data_ptr(), experts.mutable_data_ptr<int64_t>(),
                                              value.mutable_data_ptr<double>(), dist.mutable_data_ptr<double>(),
                                              &status, stream),
               "balanced_assignment");
  TORCH_CHECK_VALUE(status != kAssignmentOverflow,
                    "balanced_assignment: the CUDA solver's auction prices overflowed float64 on these scores "
                    "(values near the float64 limit); scale them down, or solve them on the CPU");
  TORCH_CHECK(status == kAssignmentSolved,
              "balanced_assignment: the CUDA solver hit a guard (auction iterations or rounds); a bug");
  if (const char* want = std::getenv("MOE_KERNELS_SOLVER_PROFILE"); want != nullptr && std::string(want) == "1")
    print_solver_profile(workspace.mutable_data_ptr(), n, k, capacity, eps_div, stream);
  return {experts, value, dist};
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_kernels, CUDA, m) { m.impl("balanced_assignment", &balanced_assignment_gpu); }

}  // namespace moe_kernels

// topk_router (csrc/cuda/topk_router.cu). float64 logits are computed in float64 on the device.
namespace moe_kernels {
namespace {

DType router_dtype(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? kFloat64 : dtype_of(t, "topk_router"); }

at::ScalarType router_acc(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

int router_scoring(const std::string& s) {
  TORCH_CHECK(s == "softmax" || s == "sigmoid", "topk_router: scoring must be 'softmax' or 'sigmoid'");
  return s == "sigmoid" ? topk_router::kSigmoid : topk_router::kSoftmax;
}

std::tuple<at::Tensor, at::Tensor> topk_router_gpu(const at::Tensor& logits, int64_t k, std::string scoring,
                                                   const std::optional<at::Tensor>& bias, int64_t num_groups,
                                                   int64_t topk_groups, std::string group_scoring, bool renormalize,
                                                   double scaling_factor) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1 && num_groups >= 1 && logits.size(1) % num_groups == 0 &&
                  topk_groups >= 1 && topk_groups <= num_groups && k >= 1 &&
                  k <= topk_groups * (logits.size(1) / num_groups) &&
                  (topk_groups == num_groups || num_groups <= topk_router::kMaxGroups) &&
                  (!bias.has_value() || (bias->dim() == 1 && bias->size(0) == logits.size(1))),
              "topk_router: bad arguments");
  TORCH_CHECK(group_scoring == "top2_sum" || group_scoring == "max", "topk_router: bad group_scoring");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), E = logits.size(1);
  const auto acc = router_acc(logits);
  const at::Tensor b = bias.has_value() ? bias->to(acc).contiguous() : at::Tensor();
  auto weights = at::empty({T, k}, logits.options().dtype(acc));
  auto experts = at::empty({T, k}, logits.options().dtype(at::kLong));
  const topk_router::RowParams params{E, k, router_scoring(scoring),
                                      group_scoring == "max" ? topk_router::kMax : topk_router::kTop2Sum,
                                      num_groups, topk_groups, renormalize, scaling_factor};
  check_launch(topk_router_cuda(logits.const_data_ptr(), router_dtype(logits), T, logits.stride(0), logits.stride(1),
                                b.defined() ? b.const_data_ptr() : nullptr, params, weights.mutable_data_ptr(),
                                experts.mutable_data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "topk_router");
  return {weights, experts};
}

at::Tensor topk_router_backward_gpu(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& experts,
                                   std::string scoring, bool renormalize, double scaling_factor,
                                   bool /*ranked_by_logits: unused, the kernel finds each row's max itself*/) {
  TORCH_CHECK(logits.dim() == 2 && experts.dim() == 2 && experts.size(0) == logits.size(0) &&
                  experts.scalar_type() == at::kLong && grad_weights.sizes() == experts.sizes(),
              "topk_router_backward: bad arguments");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), E = logits.size(1);
  const auto g = grad_weights.to(router_acc(logits)).contiguous();
  const auto ex = experts.contiguous();
  auto grad = at::empty({T, E}, logits.options());
  const topk_router::RowParams params{E, ex.size(1), router_scoring(scoring), topk_router::kTop2Sum, 1, 1, renormalize,
                                      scaling_factor};
  check_launch(topk_router_backward_cuda(g.const_data_ptr(), logits.const_data_ptr(), router_dtype(logits), T,
                                         logits.stride(0), logits.stride(1), ex.const_data_ptr<int64_t>(), params,
                                         grad.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream()),
               "topk_router_backward");
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_kernels, CUDA, m) {
  m.impl("topk_router", &topk_router_gpu);
  m.impl("topk_router_backward", &topk_router_backward_gpu);
}

}  // namespace moe_kernels
