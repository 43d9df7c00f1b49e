"""The routing index maps in torch ops, shared by the Triton launchers and the backwards that
differentiate the reference: which choices are kept, a choice's row and a row's choice. Each map
is a scatter into a spare last element that is cut off, never boolean-mask indexing, whose
data-dependent shape would read the mask's count back to the host (a device sync). An id the
kernels drop (out of range, docs/reliability.md) is dropped here too."""

import torch


def kept(experts: torch.Tensor, positions: torch.Tensor, E: int, C: int) -> torch.Tensor:
    """[T, k] bool: the choices inside [0, E) x [0, C), the ones the kernels keep."""
    return (positions >= 0) & (experts >= 0) & (positions < C) & (experts < E)


def kept_choices(experts: torch.Tensor, positions: torch.Tensor, E: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, positions) with -1 for every choice the kernels drop: what the reference drops,
    before a backward hands the ids to it (the GPU backends never range-check them)."""
    keep = kept(experts, positions, E, C)
    return torch.where(keep, experts, -1), torch.where(keep, positions, -1)


def scatter_valid(index: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64 out with out[index[i]] = values[i] where valid[i], -1 elsewhere. index, values
    (>= -1), valid: one shape; index must be in [0, n) where valid. Where index repeats an entry
    the largest value wins on every device (a plain scatter leaves that to the device), as the
    Triton maps (triton/routing_maps.py) and the CPU's serial ones give it."""
    target = torch.where(valid, index, n).reshape(-1)
    out = torch.full((n + 1,), -1, dtype=torch.int64, device=index.device)
    return out.scatter_reduce(0, target, values.reshape(-1), reduce="amax")[:n]


def rows_of_choices(order: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: the row of each choice (the inverse of permute's order [R]), -1 for choices
    without a row; an entry outside [0, n) is ignored."""
    valid = (order >= 0) & (order < n)
    return scatter_valid(order, torch.arange(order.numel(), device=order.device), valid, n)


def kept_order(order: torch.Tensor, n: int) -> torch.Tensor:
    """order [R] with -1 for every row the kernels' unpermute reads nothing from: an entry outside
    [0, n), or a choice another row also names whose row (rows_of_choices) is not this one."""
    row_of = rows_of_choices(order, n)
    row = torch.arange(order.numel(), device=order.device)
    valid = (order >= 0) & (order < n)
    owns = valid & (row_of[order.clamp(0, max(n - 1, 0))] == row) if n else valid
    return torch.where(owns, order, -1)
