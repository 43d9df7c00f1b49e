"""moe_kernels.ops.combine: gather expert outputs back to their tokens, weighted.

Implementations: reference (moe_kernels/reference/combine.py), C++ CPU (csrc/cpu/combine.cpp, with
its backward combine_backward: grad_buffer a weighted gather, grad_weights row dot products), Triton
(moe_kernels/triton/dispatch.py), CUDA (csrc/cuda/dispatch.cu: combine and combine_backward,
registered in csrc/cuda_ops.cpp under the same schemas, so the autograd formula below serves both
devices; float32 / float16 / bfloat16). backends.py chooses among them.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _index_maps, _validate


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_in_graph(ctx, grad_y):
    """A backward that builds a graph (create_graph): the reference's, differentiable again in the
    buffer and the weights jointly, with the ids the kernels drop dropped."""
    buffer, experts, positions, weights = ctx.saved_tensors
    E, C, _ = buffer.shape
    experts, positions = _index_maps.kept_choices(experts, positions, E, C)
    return _autograd.through_reference(
        reference.combine, (buffer, experts, positions, weights), ctx.needs_input_grad, (grad_y,)
    )


_cpp = None
if backends._extension.defines("combine"):
    _cpp = _autograd.direct(torch.ops.moe_kernels.combine)

    @torch.library.register_fake("moe_kernels::combine")
    def _fake(buffer, experts, positions, weights):
        return buffer.new_empty(experts.shape[0], buffer.shape[2])

    @torch.library.register_fake("moe_kernels::combine_backward")
    def _fake_backward(grad_y, buffer, experts, positions, weights):
        return buffer.new_empty(buffer.shape), weights.new_empty(weights.shape)

    def _backward(ctx, grad_y):
        buffer, experts, positions, weights = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a graph of torch ops, differentiable again
            return _backward_in_graph(ctx, grad_y)
        grad_buffer, grad_weights = torch.ops.moe_kernels.combine_backward(grad_y, buffer, experts, positions, weights)
        return grad_buffer, None, None, grad_weights

    _autograd.register_autograd("moe_kernels::combine", _backward, setup_context=_setup_context)

_triton = None
if backends.triton_importable():
    from moe_kernels.triton import dispatch as _triton_module
    from moe_kernels.triton import routing_maps as _triton_maps

    _triton = _triton_module.combine

    def _triton_backward(ctx, grad_y):
        if torch.is_grad_enabled():  # create_graph: as the kernel backward's above
            return _backward_in_graph(ctx, grad_y)
        buffer, experts, positions, weights = ctx.saved_tensors
        E, C, _ = buffer.shape
        needs = ctx.needs_input_grad
        grad_buffer = grad_weights = None
        # Each gradient only where asked for: the weights' reads every kept row of the buffer again
        # (as many bytes as the forward), the buffer's writes the whole [E, C, d].
        if needs[0]:
            # To the buffer: the weighted gather of grad_y into each kept slot (a weighted dispatch).
            grad_buffer = _triton_module.dispatch(grad_y, experts, positions, E, C, weights)
        if needs[3]:
            # To the weights: <grad_y[t], buffer[slot]> in float32 (float64 for float64) for the
            # choices the forward kept, 0 for the others (kept_slots: an out-of-range id is dropped,
            # never indexed); one pass over d (row_dots).
            slot = _triton_maps.kept_slots(experts, positions, E, C)
            rows = buffer.reshape(E * C, buffer.shape[2])
            grad_weights = _triton_module.row_dots(grad_y, rows, slot, experts.shape[1]).to(weights.dtype)
        return grad_buffer, None, None, grad_weights

    _triton.register_autograd(_triton_backward, setup_context=_setup_context)

# The CUDA kernel has no float64 path (csrc/cuda_ops.cpp): a float64 buffer on CUDA runs the
# reference where "cuda" is chosen (backends.choose_for).
backends.register("combine", torch=reference.combine, cpu=_cpp, triton=_triton, cuda=_cpp, float64=("cpu", "triton"))


def combine(buffer: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor):
    """y [T, d] = sum over kept choices s of weights[t, s] * buffer[experts[t, s], positions[t, s]].

    Args:
      buffer: [E, C, d] expert outputs, float32 / float16 / bfloat16 / float64.
      experts, positions: [T, k] int64 from capacity_positions.
      weights: [T, k] float gate values.
    Dropped (positions -1) and empty choices add nothing: a token whose choices were all dropped
    gets y = 0 (the caller's residual carries it). Accumulated in float32; y in buffer's dtype.
    Deterministic (no atomics). Differentiable with respect to buffer and weights.
    """
    _validate.tensor("buffer", buffer, dim=3, shape="[E, C, d]", dtypes=_validate.FLOAT_DTYPES)
    E, C, _ = buffer.shape
    _validate.routing_indices("experts", experts)
    _validate.routing_indices("positions", positions, shape=experts.shape)
    _validate.tensor("weights", weights, dim=2, shape="[T, k]", dtypes=_validate.FLOAT_DTYPES)
    if weights.shape != experts.shape:
        raise ValueError(f"weights must be [T, k] = {list(experts.shape)}, got {tuple(weights.shape)}")
    _validate.same_device(buffer=buffer, experts=experts, positions=positions, weights=weights)
    if _validate.host_readable("combine", buffer, experts, positions):
        _validate.index_range("experts", experts, E)
        _validate.index_range("positions", positions, max(C, 1))
    return backends.implementation("combine", buffer)(buffer, experts, positions, weights)
