"""Argument checks shared by the gates of this package."""

import torch


def check_sizes(d_model, num_experts, k=None):
    """d_model, num_experts (and k, unless None) ints: a TypeError naming the first that is not,
    a ValueError unless d_model, num_experts >= 1 and 1 <= k <= num_experts."""
    values = (("d_model", d_model), ("num_experts", num_experts)) + ((("k", k),) if k is not None else ())
    for name, value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if d_model < 1 or num_experts < 1:
        raise ValueError(f"d_model and num_experts must be >= 1, got {d_model}, {num_experts}")
    if k is not None and not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, num_experts = {num_experts}], got {k}")


def check_input(x, d_model, mask, *, any_leading=False):
    """x [T, d_model] ([..., d_model] with any_leading) and mask None or [T]: a ValueError naming
    x and the expected shape, or the mask, before the router's matmul would raise its own error.
    With any_leading the mask is the caller's to check once x is flattened (route_real_tokens)."""
    if not isinstance(x, torch.Tensor) or (x.dim() < 1 if any_leading else x.dim() != 2) or x.shape[-1] != d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        want = "[..., d_model]" if any_leading else "[T, d_model]"
        raise ValueError(f"x must be {want} with d_model = {d_model}, got {shape}")
    if not any_leading and mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (x.shape[0],)):
        raise ValueError(f"mask must be [T] = [{x.shape[0]}]")


def route_real_tokens(route, x, mask):
    """`route(x[mask])` spread back over all T tokens: padding tokens (mask False) get no expert
    (-1, weight 0), take no capacity and no place in a batchwise selection, and add nothing to the
    losses and loads, which are those of the real tokens. For gates whose routing couples the
    tokens (batchwise top-m, balanced assignment, Sinkhorn), where masking after the fact would
    not do. One host read (the number of real tokens).

    route: x' [T', d] -> Routing; x: [T, d]; mask: [T] bool, True = a real token.
    """
    from moe_kernels.routing import Routing

    if mask is None:
        return route(x)
    check_input(x, x.shape[1], mask)
    keep = mask.bool()
    index = keep.nonzero().squeeze(1)  # [T'] positions of the real tokens
    sub = route(x[index])
    T = x.shape[0]
    experts = sub.experts.new_full((T, sub.k), -1).index_copy(0, index, sub.experts)
    weights = sub.weights.new_zeros((T, sub.k)).index_copy(0, index, sub.weights)
    expert_tokens = sub.expert_tokens
    if expert_tokens is not None:  # subset token ids -> full token ids, -1 kept
        expert_tokens = torch.where(expert_tokens >= 0, index[expert_tokens.clamp(min=0)], -1)
    return Routing(
        experts=experts,
        weights=weights,
        num_experts=sub.num_experts,
        aux_loss=sub.aux_loss,
        layout=sub.layout,
        expert_tokens=expert_tokens,
        expert_weights=sub.expert_weights,
        stats=sub.stats,
    )
