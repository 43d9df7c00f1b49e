"""moe_kernels.ops.dispatch: scatter tokens into the [E, C, d] expert buffers.

Implementations: reference (moe_kernels/reference/dispatch.py), C++ CPU (csrc/cpu/dispatch.cpp, with
its backward dispatch_backward, the gather-sum), Triton (moe_kernels/triton/dispatch.py), CUDA
(csrc/cuda/dispatch.cu: dispatch and dispatch_backward, registered in csrc/cuda_ops.cpp under the
same schemas, so the autograd formula below serves both devices; float32 / float16 / bfloat16).
backends.py chooses among them.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _index_maps, _validate

_cpp = None
if backends._extension.defines("dispatch"):
    _cpp = _autograd.direct(torch.ops.moe_kernels.dispatch)

    @torch.library.register_fake("moe_kernels::dispatch")
    def _fake(x, experts, positions, num_experts, capacity):
        return x.new_empty(num_experts, capacity, x.shape[1])

    @torch.library.register_fake("moe_kernels::dispatch_backward")
    def _fake_backward(grad_buffer, experts, positions):
        return grad_buffer.new_empty(experts.shape[0], grad_buffer.shape[2])

    def _setup_context(ctx, inputs, output):
        _, experts, positions, _, _ = inputs
        ctx.save_for_backward(experts, positions)

    def _backward(ctx, grad_buffer):
        experts, positions = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a graph of torch ops (dispatch is linear in x)
            E, C, d = grad_buffer.shape
            kept_e, kept_p = _index_maps.kept_choices(experts, positions, E, C)
            x = grad_buffer.new_zeros(experts.shape[0], d, requires_grad=True)
            (grad_x,) = _autograd.through_reference(
                lambda x: reference.dispatch(x, kept_e, kept_p, E, C), (x,), (True,), (grad_buffer,)
            )
        else:
            grad_x = torch.ops.moe_kernels.dispatch_backward(grad_buffer, experts, positions)
        return grad_x, None, None, None, None

    _autograd.register_autograd("moe_kernels::dispatch", _backward, setup_context=_setup_context)

_triton = None
if backends.triton_importable():
    from moe_kernels.triton import dispatch as _triton_module

    def _triton(x, experts, positions, num_experts, capacity):
        return _triton_module.dispatch(x, experts, positions, num_experts, capacity, None)

    def _triton_setup_context(ctx, inputs, output):
        x, experts, positions, _, _, weights = inputs
        ctx.save_for_backward(experts, positions, weights)

    def _triton_backward(ctx, grad_buffer):
        # The gather-sum is combine with the dispatch weights (1 when there were none).
        experts, positions, weights = ctx.saved_tensors
        w = weights if weights is not None else torch.ones(experts.shape, device=experts.device)
        grad_x = _triton_module.combine(grad_buffer, experts, positions, w)
        return grad_x, None, None, None, None, None

    _triton_module.dispatch.register_autograd(_triton_backward, setup_context=_triton_setup_context)

# The CUDA kernel has no float64 path (csrc/cuda_ops.cpp): float64 x on CUDA runs the reference
# where "cuda" is chosen (backends.choose_for).
backends.register("dispatch", torch=reference.dispatch, cpu=_cpp, triton=_triton, cuda=_cpp, float64=("cpu", "triton"))


def dispatch(x: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, num_experts: int, capacity: int):
    """buffer [E, C, d] with buffer[experts[t, s], positions[t, s]] = x[t] for every kept choice
    (positions >= 0); slots nobody fills are zero.

    Args:
      x: [T, d] float32 / float16 / bfloat16 / float64.
      experts, positions: [T, k] int64 from capacity_positions.
      num_experts: E; capacity: C (as given to capacity_positions).
    Differentiable with respect to x (the backward is the gather).
    """
    _validate.tensor("x", x, dim=2, shape="[T, d]", dtypes=_validate.FLOAT_DTYPES)
    _validate.integer("num_experts", num_experts, low=1)
    _validate.integer("capacity", capacity, low=0)
    _validate.routing_indices("experts", experts)
    _validate.routing_indices("positions", positions, shape=experts.shape)
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts must be [T, k] with T = x.shape[0] = {x.shape[0]}, got {tuple(experts.shape)}")
    _validate.same_device(x=x, experts=experts, positions=positions)
    if _validate.host_readable("dispatch", x, experts, positions):
        _validate.index_range("experts", experts, num_experts)
        _validate.index_range("positions", positions, max(capacity, 1))
    return backends.implementation("dispatch", x)(x, experts, positions, num_experts, capacity)
