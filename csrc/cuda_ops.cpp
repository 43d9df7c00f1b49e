// CUDA implementations of the moe_kernels ops: torch tensors in, raw pointers to the launchers
// of csrc/cuda/*.cu out. Compiled only in CUDA builds (setup.py adds -DMOE_KERNELS_CUDA); each op
// is the same few lines: guard the device, allocate outputs, launch on the current stream.
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

std::tuple<at::Tensor, at::Tensor> topk_softmax(const at::Tensor& logits, int64_t k, bool renormalize) {
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "topk_softmax: bad arguments");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), E = logits.size(1);
  auto weights = at::empty({T, k}, logits.options());
  auto experts = at::empty({T, k}, logits.options().dtype(at::kLong));
  check_launch(topk_softmax_cuda(logits.const_data_ptr(), dtype_of(logits, "topk_softmax"), T, E,
                                 logits.stride(0), logits.stride(1), k, renormalize,
                                 weights.mutable_data_ptr(), experts.mutable_data_ptr<int64_t>(),
                                 c10::cuda::getCurrentCUDAStream()),
               "topk_softmax");
  return {weights, experts};
}

at::Tensor topk_softmax_backward(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& experts,
                                 bool renormalize) {
  TORCH_CHECK(logits.dim() == 2 && grad_weights.sizes() == experts.sizes(), "topk_softmax_backward: bad shapes");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto g = grad_weights.to(logits.scalar_type()).contiguous();
  const auto ex = experts.contiguous();
  auto grad = at::empty({logits.size(0), logits.size(1)}, logits.options());
  check_launch(topk_softmax_backward_cuda(g.const_data_ptr(), logits.const_data_ptr(),
                                          dtype_of(logits, "topk_softmax_backward"), logits.size(0), logits.size(1),
                                          logits.stride(0), logits.stride(1), ex.const_data_ptr<int64_t>(),
                                          ex.size(1), renormalize, grad.mutable_data_ptr(),
                                          c10::cuda::getCurrentCUDAStream()),
               "topk_softmax_backward");
  return grad;
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
  m.impl("topk_softmax", &topk_softmax);
  m.impl("topk_softmax_backward", &topk_softmax_backward);
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
