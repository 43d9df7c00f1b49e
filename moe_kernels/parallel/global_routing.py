"""Routing over the global batch for gates that solve a problem across tokens (balanced
assignment, batchwise / expert-choice top-m): all-gather the small [T_r, E] scores, let every rank
solve the same problem on the same [T, E] tensor, and keep this rank's rows of the solution.

The gathered scores are bitwise identical on every rank and the solver runs the same code on the
same machine type, so every rank reaches the same global solution: each token goes where that
solution says, and a single process solving the concatenated batch gets the same routing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_kernels.parallel.exchange import collective_device, rank_and_world
from moe_kernels.routing import Routing

__all__ = ["all_gather_rows", "batch_offsets", "local_routing", "route_global_batch"]


def batch_offsets(num_rows: int, group) -> list[int]:
    """[W+1] row offsets of every rank's block in the gathered batch (one all_gather of int64)."""
    _, W = rank_and_world(group)
    if W == 1:
        return [0, num_rows]
    device = collective_device(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(W)]
    dist.all_gather(sizes, torch.tensor([num_rows], dtype=torch.int64, device=device), group=group)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + int(s))
    return offsets


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, group):
        rank, W = rank_and_world(group)
        longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
        padded = x.new_zeros((longest, *x.shape[1:]))  # all_gather needs equal shapes
        padded[: x.shape[0]] = x
        blocks = [torch.empty_like(padded) for _ in range(W)]
        dist.all_gather(blocks, padded, group=group)
        ctx.rows = (offsets[rank], offsets[rank + 1])
        return torch.cat([b[: offsets[i + 1] - offsets[i]] for i, b in enumerate(blocks)])

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.rows
        return grad[start:end], None, None


def all_gather_rows(x: torch.Tensor, group, offsets: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's x [T_r, ...] in rank order: [sum_r T_r, ...] on every rank.

    Unequal and zero T_r are fine (padded to the longest block for the collective). Differentiable:
    the backward returns this rank's rows of the incoming gradient, with no collective. That is the
    exact gradient when every rank computes the same function of the gathered tensor (the same
    gate, the same aux loss) and the routing weights of a token depend only on its own scores
    (true of softmax / sigmoid gates, expert choice and balanced assignment): rank r's rows then
    get d(its task loss + the global aux loss)/d(its scores), and the aux loss is counted once.
    `offsets`: batch_offsets(x.shape[0], group) if the caller already has them (saves a collective).
    """
    if rank_and_world(group)[1] == 1:
        return x
    if offsets is None:
        offsets = batch_offsets(x.shape[0], group)
    return _AllGatherRows.apply(x, offsets, group)


def local_routing(routing: Routing, start: int, end: int) -> Routing:
    """The rows [start, end) of a Routing of the global batch, as a Routing of the local tokens.

    The token view (experts / weights) is sliced; an expert_choice layout keeps its expert view
    with the other ranks' tokens replaced by -1 (empty) and token indices made local.
    """
    expert_tokens = expert_weights = None
    if routing.expert_tokens is not None:
        mine = (routing.expert_tokens >= start) & (routing.expert_tokens < end)
        expert_tokens = torch.where(mine, routing.expert_tokens - start, -1)
        if routing.expert_weights is not None:
            expert_weights = torch.where(mine, routing.expert_weights, 0.0)
    return Routing(
        experts=routing.experts[start:end],
        weights=routing.weights[start:end],
        num_experts=routing.num_experts,
        aux_loss=routing.aux_loss,
        layout=routing.layout,
        expert_tokens=expert_tokens,
        expert_weights=expert_weights,
        stats=dict(routing.stats),
    )


def route_global_batch(scores: torch.Tensor, gate: Callable[[torch.Tensor], Routing], group) -> Routing:
    """Route this rank's tokens by a gate solved over the whole batch of the group.

    Args:
      scores: [T_r, E] this rank's gate logits (T_r may differ between ranks, may be 0).
      gate: deterministic function [T, E] logits -> Routing of all T tokens (e.g. a batchwise or a
        balanced-assignment gate); every rank calls it on the same gathered tensor.
    Returns the Routing of this rank's T_r tokens (local_routing of the global one); its weights
    are differentiable with respect to `scores` (see all_gather_rows), its aux_loss is the global
    batch's.
    """
    rank, W = rank_and_world(group)
    if W == 1:
        return gate(scores)
    offsets = batch_offsets(scores.shape[0], group)
    routing = gate(all_gather_rows(scores, group, offsets))
    if routing.num_tokens != offsets[-1]:
        raise ValueError(f"gate returned a Routing of {routing.num_tokens} tokens for {offsets[-1]} gathered tokens")
    return local_routing(routing, offsets[rank], offsets[rank + 1])
