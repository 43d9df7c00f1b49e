"""Dropless permute / unpermute on the Triton kernels of capacity_positions and dispatch:
- permute: capacity_positions' ranks in the flat order t * k + s with no capacity give each choice
  its rank within its expert; row = offsets[expert] + rank; each token row is read once and written
  to its k rows by dispatch.py's scatter_rows.
- unpermute: the inverse of `order` gives each choice its row; combine_kernel sums them per token.
The maps are routing_maps.py's kernels. No atomics on the rows: every output row / token has one
writer."""

import torch

from moe_kernels.triton import capacity_positions as _positions
from moe_kernels.triton import dispatch as _rows
from moe_kernels.triton.common import on_tensor_device
from moe_kernels.triton.routing_maps import expert_rows, inverse_map


@torch.library.custom_op("moe_kernels_triton::permute", mutates_args=())
@on_tensor_device
def permute(
    x: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.permute (validated there)."""
    T, k = experts.shape
    n = T * k
    experts = experts.contiguous()
    if n and num_experts:
        rank, counts = _positions.ranks(experts, num_experts, n + 1, _positions.FLAT)
    else:
        rank = torch.full_like(experts, -1)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    # An id outside [0, E) matches no expert's scan: dropped like an empty choice (row -1), without
    # indexing offsets out of range (docs/reliability.md).
    row, order, offsets = expert_rows(experts, rank, counts)
    return _rows.scatter_rows(x, row, order, k, None), offsets, order


@permute.register_fake
def _(x, experts, num_experts):
    n = experts.shape[0] * experts.shape[1]
    return x.new_empty(n, x.shape[1]), experts.new_empty(num_experts + 1), experts.new_empty(n)


@torch.library.custom_op("moe_kernels_triton::unpermute", mutates_args=())
def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Triton launch; arguments as moe_kernels.ops.unpermute (validated there)."""
    return _rows.gather_sum(y_sorted, inverse_map(order, weights.numel()), weights)


@unpermute.register_fake
def _(y_sorted, order, weights, num_tokens):
    return y_sorted.new_empty(num_tokens, y_sorted.shape[1])


@torch.library.custom_op("moe_kernels_triton::unpermute_backward", mutates_args=())
def unpermute_backward(
    grad_y: torch.Tensor,
    y_sorted: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    rows_grad: bool = True,
    weights_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_y_sorted[r] = weights[order[r]] * grad_y[order[r] // k] (0 where order is -1), and
    grad_weights[t, s] = <grad_y[t], y_sorted[row of (t, s)]> in float32 (float64 for float64).
    A gradient not asked for (rows_grad / weights_grad False) is not computed: an empty [0, d] /
    [0, k] in its place (the weights' reads all T k rows of y_sorted, as many bytes as the rows')."""
    k = weights.shape[1]
    rows = inverse_map(order, weights.numel())
    # The empties stand only for the gradients not asked for (full-size ones would sit beside the
    # kernels' outputs at the backward's peak).
    grad_y_sorted, grad_weights = _unasked(y_sorted, weights, False, False)
    if rows_grad:
        # order as each row's source: the row kernels ignore a source outside [0, T k).
        grad_y_sorted = _rows.scatter_rows(grad_y, rows, order, k, weights)
    if weights_grad:
        grad_weights = _rows.row_dots(grad_y, y_sorted, rows, k).to(weights.dtype)
    return grad_y_sorted, grad_weights


def _unasked(y_sorted, weights, rows_grad, weights_grad):
    """unpermute_backward's outputs in the shapes it returns them (the fake's and the kernels'):
    [T k, d] and [T, k] where asked for, else [0, d] and [0, k]; uninitialised."""
    rows_shape = y_sorted.shape if rows_grad else (0, y_sorted.shape[1])
    weights_shape = weights.shape if weights_grad else (0, weights.shape[1])
    return y_sorted.new_empty(rows_shape), weights.new_empty(weights_shape)


@unpermute_backward.register_fake
def _(grad_y, y_sorted, order, weights, rows_grad=True, weights_grad=True):
    return _unasked(y_sorted, weights, rows_grad, weights_grad)


AOT_KERNELS = []  # no kernels of its own: it launches capacity_positions.py's, dispatch.py's, routing_maps.py's
