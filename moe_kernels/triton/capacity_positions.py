"""capacity_positions in Triton: one program per expert scans the fill order in blocks, numbering
the expert's choices with a block cumsum plus a running count. No atomics and no host sync; every
choice is written by the program of its expert (empty choices keep the -1 the launcher fills)."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device

_BLOCK = 1024  # choices per scan step


@triton.jit
def capacity_positions_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64: flat index t * K + s of the i-th choice to fill (N = T * K)
    positions_ptr,  # [T, K] int64, prefilled with -1
    counts_ptr,  # [E] int64
    N,  # T * K
    C,  # capacity
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    running = tl.zeros((), dtype=tl.int64)  # this expert's choices seen so far
    offs = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        i = start + offs
        ok = i < N
        j = tl.load(order_ptr + i, mask=ok, other=0)
        ex = tl.load(experts_ptr + j, mask=ok, other=-1)
        hit = (ex == e) & ok
        rank = running + tl.cumsum(hit.to(tl.int64), axis=0) - 1
        tl.store(positions_ptr + j, tl.where(rank < C, rank, -1), mask=hit)
        running += tl.sum(hit.to(tl.int64), axis=0)
    tl.store(counts_ptr + e, running)


def fill_order(experts: torch.Tensor, priority: torch.Tensor | None) -> torch.Tensor:
    """Flat indices t * k + s in fill order (see moe_kernels/reference/capacity_positions.py)."""
    T, k = experts.shape
    default = torch.arange(T * k, device=experts.device).view(T, k).t().reshape(-1)
    if priority is None:
        return default
    p = priority.t().reshape(-1).float()
    return default[torch.sort(-p, stable=True).indices]


@torch.library.custom_op("moe_kernels_triton::capacity_positions", mutates_args=())
@on_tensor_device
def capacity_positions(
    experts: torch.Tensor, num_experts: int, capacity: int, priority: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.capacity_positions (validated there)."""
    experts = experts.contiguous()
    positions = torch.full_like(experts, -1)
    counts = torch.empty(num_experts, dtype=torch.int64, device=experts.device)
    order = fill_order(experts, priority)
    capacity_positions_kernel[(num_experts,)](
        experts, order, positions, counts, experts.numel(), capacity, BLOCK=_BLOCK
    )
    return positions, counts


@capacity_positions.register_fake
def _(experts, num_experts, capacity, priority=None):
    return experts.new_empty(experts.shape), experts.new_empty(num_experts)


AOT_KERNELS = [
    (
        capacity_positions_kernel,
        {
            "experts_ptr": "*i64",
            "order_ptr": "*i64",
            "positions_ptr": "*i64",
            "counts_ptr": "*i64",
            "N": "i32",
            "C": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": _BLOCK},
        {"num_warps": 4},
    )
]
