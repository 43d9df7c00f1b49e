"""moe_kernels.ops.permute / unpermute: dropless routing, rows grouped by expert.

Implementations: reference (moe_kernels/reference/permute.py), C++ CPU (csrc/cpu/permute.cpp, with
unpermute_backward; permute's backward is unpermute with unit weights), Triton (moe_kernels/triton/permute.py).
backends.py chooses among them.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _index_maps, _validate


def _unpermute_backward_in_graph(ctx, grad_y):
    """A backward that builds a graph (create_graph): the reference's, differentiable again, reading
    the rows the kernels read (_autograd.kept_order)."""
    y_sorted, order, weights = ctx.saved_tensors
    T = grad_y.shape[0]
    order = _index_maps.kept_order(order, weights.numel())
    needs = ctx.needs_input_grad
    grad_y_sorted, grad_weights = _autograd.through_reference(
        lambda y, w: reference.unpermute(y, order, w, T), (y_sorted, weights), (needs[0], needs[2]), (grad_y,)
    )
    return grad_y_sorted, None, grad_weights, None


_cpp_permute = _cpp_unpermute = None
if backends._extension.defines("permute"):
    _cpp_permute = _autograd.direct(torch.ops.moe_kernels.permute)
    _cpp_unpermute = _autograd.direct(torch.ops.moe_kernels.unpermute)

    @torch.library.register_fake("moe_kernels::permute")
    def _fake_permute(x, experts, num_experts):
        n = experts.shape[0] * experts.shape[1]
        return x.new_empty(n, x.shape[1]), experts.new_empty(num_experts + 1), experts.new_empty(n)

    @torch.library.register_fake("moe_kernels::unpermute")
    def _fake_unpermute(y_sorted, order, weights, num_tokens):
        return y_sorted.new_empty(num_tokens, y_sorted.shape[1])

    @torch.library.register_fake("moe_kernels::unpermute_backward")
    def _fake_unpermute_backward(grad_y, y_sorted, order, weights):
        return y_sorted.new_empty(y_sorted.shape), weights.new_empty(weights.shape)

    def _permute_setup_context(ctx, inputs, output):
        x, experts, _ = inputs
        ctx.save_for_backward(output[2])
        ctx.num_tokens, ctx.k = x.shape[0], experts.shape[1]

    def _permute_backward(ctx, grad_x_sorted, grad_offsets, grad_order):
        (order,) = ctx.saved_tensors
        # grad_x[t] = sum over s of grad_x_sorted[row of (t, s)]: unpermute with unit weights.
        ones = grad_x_sorted.new_ones(ctx.num_tokens, ctx.k)
        return torch.ops.moe_kernels.unpermute(grad_x_sorted, order, ones, ctx.num_tokens), None, None

    def _unpermute_setup_context(ctx, inputs, output):
        y_sorted, order, weights, _ = inputs
        ctx.save_for_backward(y_sorted, order, weights)

    def _unpermute_backward(ctx, grad_y):
        y_sorted, order, weights = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a graph of torch ops, differentiable again
            return _unpermute_backward_in_graph(ctx, grad_y)
        grad_y_sorted, grad_weights = torch.ops.moe_kernels.unpermute_backward(grad_y, y_sorted, order, weights)
        return grad_y_sorted, None, grad_weights, None

    _autograd.register_autograd("moe_kernels::permute", _permute_backward, setup_context=_permute_setup_context)
    _autograd.register_autograd("moe_kernels::unpermute", _unpermute_backward, setup_context=_unpermute_setup_context)

_triton_permute = _triton_unpermute = None
if backends.triton_importable():
    from moe_kernels.triton import permute as _triton_module

    _triton_permute = _triton_module.permute
    _triton_unpermute = _triton_module.unpermute

    def _triton_permute_backward(ctx, grad_x_sorted, grad_offsets, grad_order):
        (order,) = ctx.saved_tensors
        ones = grad_x_sorted.new_ones(ctx.num_tokens, ctx.k)
        return _triton_module.unpermute(grad_x_sorted, order, ones, ctx.num_tokens), None, None

    def _triton_unpermute_backward(ctx, grad_y):
        y_sorted, order, weights = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: as the kernel backward's above
            return _unpermute_backward_in_graph(ctx, grad_y)
        needs = ctx.needs_input_grad  # each gradient only where asked for (its kernel skipped)
        grad_y_sorted, grad_weights = _triton_module.unpermute_backward(
            grad_y, y_sorted, order, weights, needs[0], needs[2]
        )
        return (grad_y_sorted if needs[0] else None), None, (grad_weights if needs[2] else None), None

    def _triton_permute_setup_context(ctx, inputs, output):
        x, experts, _ = inputs
        ctx.save_for_backward(output[2])
        ctx.num_tokens, ctx.k = x.shape[0], experts.shape[1]

    def _triton_unpermute_setup_context(ctx, inputs, output):
        y_sorted, order, weights, _ = inputs
        ctx.save_for_backward(y_sorted, order, weights)

    _triton_permute.register_autograd(_triton_permute_backward, setup_context=_triton_permute_setup_context)
    _triton_unpermute.register_autograd(_triton_unpermute_backward, setup_context=_triton_unpermute_setup_context)

backends.register("permute", torch=reference.permute, cpu=_cpp_permute, triton=_triton_permute)
backends.register("unpermute", torch=reference.unpermute, cpu=_cpp_unpermute, triton=_triton_unpermute)


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Group the rows of all choices by expert, with no capacity and no drops.

    Args:
      x: [T, d] float; experts: [T, k] int64 (-1 = empty); num_experts: E.
    Returns:
      x_sorted [T*k, d] (expert 0's rows first, stable by token; empty choices' rows last, zero),
      expert_offsets [E+1] int64 (rows of expert e: offsets[e]:offsets[e+1]),
      order [T*k] int64 (order[r] = t*k + s, the choice of row r; -1 for empty choices' rows).
    Differentiable with respect to x.
    """
    _validate.tensor("x", x, dim=2, shape="[T, d]", dtypes=_validate.FLOAT_DTYPES)
    _validate.integer("num_experts", num_experts, low=1)
    _validate.routing_indices("experts", experts)
    if experts.shape[0] != x.shape[0]:
        raise ValueError(f"experts must be [T, k] with T = x.shape[0] = {x.shape[0]}, got {tuple(experts.shape)}")
    _validate.same_device(x=x, experts=experts)
    if _validate.host_readable("permute", x, experts):
        _validate.index_range("experts", experts, num_experts)
    return backends.implementation("permute", x)(x, experts, num_experts)


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int):
    """y [T, d] = sum over rows r with order[r] = t*k + s of weights[t, s] * y_sorted[r].

    Args:
      y_sorted: [T*k, d] float (expert outputs in permute's row order); order: [T*k] int64 from
      permute; weights: [T, k] float; num_tokens: T.
    Differentiable with respect to y_sorted and weights. Accumulated in float32.
    """
    _validate.tensor("y_sorted", y_sorted, dim=2, shape="[T*k, d]", dtypes=_validate.FLOAT_DTYPES)
    _validate.integer("num_tokens", num_tokens, low=0)
    _validate.tensor("weights", weights, dim=2, shape="[T, k]", dtypes=_validate.FLOAT_DTYPES)
    _validate.tensor("order", order, dim=1, shape="[T*k]", dtypes=(torch.int64,))
    T, k = weights.shape
    if T != num_tokens or order.shape[0] != T * k or y_sorted.shape[0] != T * k:
        raise ValueError(
            f"unpermute: need weights [T, k] with T = num_tokens = {num_tokens}, order [T*k] and y_sorted [T*k, d]; "
            f"got weights {tuple(weights.shape)}, order {tuple(order.shape)}, y_sorted {tuple(y_sorted.shape)}"
        )
    _validate.same_device(y_sorted=y_sorted, order=order, weights=weights)
    if order.numel() and _validate.host_readable("unpermute", y_sorted, order):
        _check_order(order, T * k)
    return backends.implementation("unpermute", y_sorted)(y_sorted, order, weights, num_tokens)


def _check_order(order: torch.Tensor, n: int) -> None:
    """order [n] int64 must hold -1 or distinct values in [0, n): a ValueError otherwise. Reads the
    values (and masks them), so only where host_readable is True; the Triton launcher ignores an
    entry outside [0, n) instead (docs/reliability.md)."""
    lo, hi = int(order.min()), int(order.max())
    if lo < -1 or hi >= n:
        raise ValueError(f"order values must be in [-1, T*k = {n}) (from permute), got min {lo} max {hi}")
    if int(torch.bincount(order[order >= 0], minlength=n).max()) > 1:
        raise ValueError("order must be permute's order: a choice t*k+s appears in it more than once")
