"""capacity_positions in Triton, in O(T k): the fill order cut into blocks of BLOCK_N choices;
each block's per-expert counts (a histogram), their exclusive sum over the blocks (torch's cumsum,
on the device), then each choice's rank = its expert's count in the blocks before it plus the
choices of its expert before it in its block (compared a chunk at a time). No atomics and no host
sync; every choice's position is written once. Past MAX_BINS experts, the older kernel: one
program per expert scans the whole fill order (O(E T k))."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device

# tl.histogram's GPU lowering needs its input to cover the program's threads at least once
# (BLOCK_N >= 32 * _WARPS) and every value inside [0, bins): keep both when changing these.
_BLOCK_N = 256  # choices per program of the O(T k) kernels
_CHUNK = 32  # the block's earlier choices compared at a time ([BLOCK_N, CHUNK] int32 per step)
_WARPS = 8
# Histogram bins per program: E + 1 rounded up to a power of two. The per-block counts are
# [T k / 256, E] int32, so at E in the thousands they outweigh the ids (at E = 4095 about 16 bytes
# per choice) but are still read once, where the per-expert scan reads the ids E times.
MAX_BINS = 4096


# The fill orders the kernels compute or read (ORDER): capacity_positions' default (every token's
# first choice, then every second choice, ...), one given as an array (by priority), or the flat
# order t * k + s (permute's: rows grouped by expert, stable by token).
S_MAJOR, GIVEN, FLAT = 0, 1, 2


@triton.jit
def _fill_slot(i, order_ptr, T, K, ORDER: tl.constexpr):
    """The flat index t * K + s of the i-th choice to fill in the ORDER fill order."""
    if ORDER == 1:
        return tl.load(order_ptr + i)
    if ORDER == 2:
        return i
    return (i % T) * K + i // T


@triton.jit
def block_counts_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64 fill order (read if ORDER is GIVEN)
    counts_ptr,  # [num_blocks, E] int32: each block's choices per expert
    N,  # T * K
    T,
    K,
    E,
    ORDER: tl.constexpr,  # S_MAJOR, GIVEN or FLAT
    BLOCK_N: tl.constexpr,
    BINS: tl.constexpr,  # power of two > E
):
    b = tl.program_id(0)
    i = b.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = i < N
    ex = tl.load(experts_ptr + _fill_slot(tl.where(ok, i, 0), order_ptr, T, K, ORDER), mask=ok, other=-1)
    # Empty choices, ids outside [0, E) (dropped on the device, docs/reliability.md) and padding
    # go to the spare bin E.
    bins = tl.where(ok & (ex >= 0) & (ex < E), ex, E).to(tl.int32)
    e = tl.arange(0, BINS)
    tl.store(counts_ptr + b.to(tl.int64) * E + e, tl.histogram(bins, BINS), mask=e < E)


@triton.jit
def block_positions_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64 fill order (read if ORDER is GIVEN)
    before_ptr,  # [num_blocks, E] int32: each expert's choices in the blocks before
    positions_ptr,  # [T, K] int64, every entry written
    N,
    T,
    K,
    E,
    C,  # capacity
    ORDER: tl.constexpr,  # S_MAJOR, GIVEN or FLAT
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    first = b.to(tl.int64) * BLOCK_N
    local = tl.arange(0, BLOCK_N)
    ok = first + local < N
    slot = _fill_slot(tl.where(ok, first + local, 0), order_ptr, T, K, ORDER)
    ex = tl.load(experts_ptr + slot, mask=ok, other=-1)
    real = ok & (ex >= 0) & (ex < E)
    # Choices of the same expert earlier in this block, compared as int32 (E < 2^31; an id outside
    # [0, E) is -2 here and -1 in the chunks, so it matches nothing).
    mine = tl.where(real, ex, -2).to(tl.int32)
    earlier = tl.zeros((BLOCK_N,), tl.int32)
    for c in tl.static_range(0, BLOCK_N, CHUNK):
        other = c + tl.arange(0, CHUNK)
        other_ok = first + other < N
        other_slot = _fill_slot(tl.where(other_ok, first + other, 0), order_ptr, T, K, ORDER)
        other_ex = tl.load(experts_ptr + other_slot, mask=other_ok, other=-1)
        other_ex = tl.where((other_ex >= 0) & (other_ex < E), other_ex, -1).to(tl.int32)
        same = (mine[:, None] == other_ex[None, :]) & (other[None, :] < local[:, None])
        earlier += tl.sum(same.to(tl.int32), axis=1)
    base = tl.load(before_ptr + b.to(tl.int64) * E + tl.where(real, ex, 0), mask=real, other=0)
    rank = (base + earlier).to(tl.int64)
    tl.store(positions_ptr + slot, tl.where(real & (rank < C), rank, -1), mask=ok)


_BLOCK = 1024  # choices per scan step


@triton.jit
def capacity_positions_kernel(  # the O(E T k) kernel, past MAX_BINS experts
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
    if experts.numel() == 0 or num_experts == 0:
        return torch.full_like(experts, -1), torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    order = None if priority is None else fill_order(experts, priority)
    return ranks(experts, num_experts, capacity, S_MAJOR if order is None else GIVEN, order)


@on_tensor_device
def ranks(
    experts: torch.Tensor, num_experts: int, capacity: int, mode: int, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [T, k]: each choice's rank among its expert's choices in the fill order `mode`
    (S_MAJOR, GIVEN: `order`, FLAT), -1 from `capacity` on and for empty or out-of-range ids;
    counts [E] int64). experts: [T, k] int64 contiguous, at least one choice and one expert."""
    T, k = experts.shape
    N = experts.numel()
    bins = triton.next_power_of_2(num_experts + 1)
    if bins > MAX_BINS:
        positions = torch.full_like(experts, -1)
        counts = torch.empty(num_experts, dtype=torch.int64, device=experts.device)
        if mode != GIVEN:
            order = fill_order(experts, None) if mode == S_MAJOR else torch.arange(N, device=experts.device)
        capacity_positions_kernel[(num_experts,)](experts, order, positions, counts, N, capacity, BLOCK=_BLOCK)
        return positions, counts
    blocks = triton.cdiv(N, _BLOCK_N)
    per_block = torch.empty((blocks, num_experts), dtype=torch.int32, device=experts.device)
    order_arg = experts if order is None else order  # unread unless GIVEN
    block_counts_kernel[(blocks,)](
        experts, order_arg, per_block, N, T, k, num_experts,
        ORDER=mode, BLOCK_N=_BLOCK_N, BINS=bins, num_warps=_WARPS,
    )  # fmt: skip
    # Each expert's choices in the blocks before each block: an exclusive sum down the blocks.
    running = per_block.cumsum(0, dtype=torch.int32)
    before = running - per_block
    positions = torch.empty_like(experts)
    block_positions_kernel[(blocks,)](
        experts, order_arg, before, positions, N, T, k, num_experts, capacity,
        ORDER=mode, BLOCK_N=_BLOCK_N, CHUNK=_CHUNK, num_warps=_WARPS,
    )  # fmt: skip
    return positions, running[-1].to(torch.int64)


@capacity_positions.register_fake
def _(experts, num_experts, capacity, priority=None):
    return experts.new_empty(experts.shape), experts.new_empty(num_experts)


def _aot_blocks(kernel, order: int, num_experts: int):
    signature = {"experts_ptr": "*i64", "order_ptr": "*i64"}
    if kernel is block_counts_kernel:
        signature["counts_ptr"] = "*i32"
        constexprs = {"ORDER": order, "BLOCK_N": _BLOCK_N, "BINS": triton.next_power_of_2(num_experts + 1)}
    else:
        signature.update(before_ptr="*i32", positions_ptr="*i64")
        constexprs = {"ORDER": order, "BLOCK_N": _BLOCK_N, "CHUNK": _CHUNK}
    signature.update(N="i32", T="i32", K="i32", E="i32")
    if kernel is block_positions_kernel:
        signature["C"] = "i32"
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return kernel, signature, constexprs, {"num_warps": _WARPS}


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
    ),
    _aot_blocks(block_counts_kernel, S_MAJOR, 256),
    _aot_blocks(block_counts_kernel, GIVEN, MAX_BINS - 1),
    _aot_blocks(block_positions_kernel, S_MAJOR, 256),
    _aot_blocks(block_positions_kernel, GIVEN, 8),
    _aot_blocks(block_positions_kernel, FLAT, 64),
]
