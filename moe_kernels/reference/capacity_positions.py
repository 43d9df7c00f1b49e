"""Reference capacity assignment: which slot of its expert's buffer each choice gets.

Terms: T tokens, k choices per token, E experts, C capacity (slots per expert), d hidden size.
A "choice" is a (token t, slot s) pair of `experts` [T, k]; -1 marks an empty choice.
"""

import math

import torch

from moe_kernels.reference.ranking import descending_order


def capacity_for(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int = 0) -> int:
    """max(min_capacity, ceil(capacity_factor * T * k / E)): the GShard / Switch capacity."""
    return max(min_capacity, math.ceil(capacity_factor * num_tokens * k / num_experts))


def _fill_order(experts: torch.Tensor, priority: torch.Tensor | None) -> torch.Tensor:
    """Flat indices t * k + s of all choices in the order slots are filled.

    Default (GShard / Switch "position" policy): every token's first choice before any second
    choice, and within one choice index by token index. With `priority`, by descending priority,
    ties in the default order (NaN priorities last).
    """
    T, k = experts.shape
    default = torch.arange(T * k, device=experts.device).view(T, k).t().reshape(-1)  # s-major
    if priority is None:
        return default
    p = priority.t().reshape(-1).float()  # float32 comparisons, as every kernel makes them
    return default[descending_order(p, dim=0, nan_last=True)]


def capacity_positions(experts: torch.Tensor, num_experts: int, capacity: int, *, priority=None):
    """Slot of every choice in its expert's buffer.

    Args:
      experts: [T, k] int64, values in [-1, E); -1 = empty choice.
      num_experts: E.
      capacity: C >= 0 slots per expert.
      priority: optional [T, k] float; slots go to higher priority first.

    Returns:
      positions: [T, k] int64, the slot in [0, C), or -1 when the choice is empty or overflows.
      counts: [E] int64, choices routed to each expert before dropping.
    """
    T, k = experts.shape
    E = num_experts
    flat = experts.reshape(-1)
    order = _fill_order(experts, priority)
    in_order = flat[order]
    column = torch.where(in_order >= 0, in_order, E)  # empties go to a spare column E
    one_hot = torch.nn.functional.one_hot(column, E + 1)[:, :E]  # [T*k, E]
    rank = (one_hot.cumsum(0) - 1).gather(1, column.clamp(max=E - 1).unsqueeze(1)).squeeze(1) if E else column
    kept = (in_order >= 0) & (rank < capacity)
    positions = torch.full_like(flat, -1)
    positions[order] = torch.where(kept, rank, -1)
    return positions.view(T, k), one_hot.sum(0).to(torch.int64)
