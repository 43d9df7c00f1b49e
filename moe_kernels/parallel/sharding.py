"""Move expert weights between the single-process layout [E, ...] and the expert-parallel one
[E/W, ...] (rank r holds experts r*E/W .. (r+1)*E/W - 1), for building a sharded model from a
single-process one and for checkpointing / resuming it as one full state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from moe_kernels.parallel.exchange import local_experts, rank_and_world

__all__ = ["gather_experts", "gather_state_dict", "shard_experts", "shard_state_dict", "sync_replicated_grads"]


def shard_experts(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's experts of a full [E, ...] tensor: a copy of rows r*E_l .. (r+1)*E_l - 1."""
    rank, W = rank_and_world(group)
    E_l = local_experts(full.shape[0], W)
    return full.detach()[rank * E_l : (rank + 1) * E_l].clone()


def gather_experts(local: torch.Tensor, group) -> torch.Tensor:
    """The full [E, ...] tensor on every rank from each rank's [E_l, ...] (one all_gather)."""
    _, W = rank_and_world(group)
    if W == 1:
        return local.detach().clone()
    local = local.detach().contiguous()
    blocks = [torch.empty_like(local) for _ in range(W)]
    dist.all_gather(blocks, local, group=group)
    return torch.cat(blocks)


def _selector(expert_keys) -> Callable[[str], bool]:
    if callable(expert_keys):
        return expert_keys
    keys = set(expert_keys)
    return lambda name: name in keys


def shard_state_dict(state_dict: dict, group, expert_keys: Iterable[str] | Callable[[str], bool]) -> dict:
    """A rank's state dict from a full one: entries named by `expert_keys` (a collection of names
    or a predicate) are sharded along dim 0 (shard_experts); every other entry is replicated."""
    is_expert = _selector(expert_keys)
    return {n: shard_experts(t, group) if is_expert(n) else t for n, t in state_dict.items()}


def gather_state_dict(state_dict: dict, group, expert_keys: Iterable[str] | Callable[[str], bool]) -> dict:
    """The full (single-process) state dict on every rank from the ranks' sharded ones. Every rank
    must call it (it is one all_gather per expert entry, in the dict's order)."""
    is_expert = _selector(expert_keys)
    return {n: gather_experts(t, group) if is_expert(n) else t for n, t in state_dict.items()}


def sync_replicated_grads(params: Iterable[torch.Tensor], group) -> None:
    """all_reduce(SUM) the gradients of the replicated (non-expert) parameters in one collective.

    With each rank's loss = (its tokens' loss sum) / (global token count), the summed gradients
    are those of the global loss; expert gradients need no sync (the reverse exchange already
    brought every rank's contribution to the expert's owner).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or rank_and_world(group)[1] == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(part.view_as(g))
