"""capacity_positions in Triton, in O(T k): the fill order cut into blocks of BLOCK_N choices;
each block's per-expert counts (a histogram), their sum over the blocks before it
(running_sums.down_columns, on the device), then each choice's rank = its expert's count in the blocks before it plus
its place among its expert's choices in its block (compared a chunk at a time, or from a sort of
the block, block_plan). No atomics and no host sync; every choice's position is written once.
Past MAX_BINS experts, the older kernel: one program per expert scans the whole fill order
(O(E T k))."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton import running_sums
from moe_kernels.triton.common import on_tensor_device

# tl.histogram's GPU lowering needs its input to cover the program's threads at least once
# (BLOCK_N >= 32 * warps) and every value inside [0, bins): block_plan keeps both.
_CHUNK = 32  # the block's earlier choices compared at a time ([BLOCK_N, CHUNK] int32 per step)
# From this many experts a block's choices are ranked by sorting (expert, place) keys.
SORTED_FROM = 64
# Histogram bins per program: E + 1 rounded up to a power of two. Past it, the per-expert scan.
MAX_BINS = 4096


def block_plan(num_experts: int) -> tuple[int, int, bool]:
    """(BLOCK_N, num_warps, SORTED) of the O(T k) kernels for E experts. The per-block counts are
    [T k / BLOCK_N, E] int32, written, summed down the blocks and read: BLOCK_N of at least 4 E
    keeps them to about a byte a choice each way. Below SORTED_FROM experts a choice is compared
    with its block's earlier ones, a chunk at a time: blocks of 64 or 128 (sm_90 SASS of the
    default fill order, bench/triton_sass.py's way of counting: 18 warp instructions a choice at
    64, 25 at 128, 40 at 256). From it, blocks of 1024 ranked by a sort of their (expert, place)
    keys: 16-17 a choice (the interpreter runs the sort ~50x slower than the comparisons, so only
    the wide routers take it)."""
    if num_experts >= SORTED_FROM:
        return 1024, 8, True
    block = min(128, max(64, triton.next_power_of_2(4 * num_experts)))
    return block, block // 32, False


# The fill orders the kernels compute or read (ORDER): capacity_positions' default (every token's
# first choice, then every second choice, ...), one given as an array (by priority), or the flat
# order t * k + s (permute's: rows grouped by expert, stable by token).
S_MAJOR, GIVEN, FLAT = 0, 1, 2


@triton.jit
def _fill_slots(first, local, ok, order_ptr, T, K, ORDER: tl.constexpr):
    """The flat indices t * K + s (int64) of the choices first + local of the ORDER fill order:
    first the program's first choice (an int64 scalar), local int32 offsets, ok the ones < N."""
    if ORDER == 1:
        return tl.load(order_ptr + first + local, mask=ok, other=0)
    if ORDER == 2:
        return first + local
    # S_MAJOR: choice i is token i % T's choice i // T. One int64 division a program, then int32
    # ones (t0 + local < T + BLOCK_N) where each entry's own int64 division and modulo were tens
    # of instructions.
    s0 = first // T
    t0 = (first - s0 * T).to(tl.int32)
    q = (t0 + local) // T
    t = t0 + local - q * T
    return t.to(tl.int64) * K + (s0 + q)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _block_bins_at(experts_ptr, order_ptr, first, start, N, T, K, E, ORDER: tl.constexpr, WIDTH: tl.constexpr):
    """WIDTH choices of the fill order from first + start: (first, their offsets from first
    (int32), which are < N, each one's bin: its expert, or the spare bin E for empty choices,
    ids outside [0, E) (dropped on the device, docs/reliability.md) and padding)."""
    local = start + tl.arange(0, WIDTH)
    ok = first + local < N
    ex = tl.load(experts_ptr + _fill_slots(first, local, ok, order_ptr, T, K, ORDER), mask=ok, other=-1)
    return first, local, ok, tl.where(ok & (ex >= 0) & (ex < E), ex, E).to(tl.int32)


@triton.jit
def _block_bins(experts_ptr, order_ptr, N, T, K, E, ORDER: tl.constexpr, BLOCK_N: tl.constexpr):
    """_block_bins_at over this program's block of BLOCK_N choices."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_N
    return _block_bins_at(experts_ptr, order_ptr, first, 0, N, T, K, E, ORDER, BLOCK_N)


@triton.jit
def block_counts_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64 fill order (read if ORDER is GIVEN)
    counts_ptr,  # [num_blocks + 1, E] int32: row b + 1 gets block b's choices per expert
    N,  # T * K
    T,
    K,
    E,
    ORDER: tl.constexpr,  # S_MAJOR, GIVEN or FLAT
    BLOCK_N: tl.constexpr,
    BINS: tl.constexpr,  # power of two > E
):
    _first, _local, _ok, bins = _block_bins(experts_ptr, order_ptr, N, T, K, E, ORDER, BLOCK_N)
    e = tl.arange(0, BINS)
    row = tl.program_id(0).to(tl.int64) + 1
    tl.store(counts_ptr + row * E + e, tl.histogram(bins, BINS), mask=e < E)


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
    SORTED: tl.constexpr,  # rank by sorting the block (block_plan), else by comparisons
    LOG_BLOCK_N: tl.constexpr,  # log2(BLOCK_N)
    CHUNK: tl.constexpr,
):
    first, local, ok, bins = _block_bins(experts_ptr, order_ptr, N, T, K, E, ORDER, BLOCK_N)
    if SORTED:
        # The block's (bin, place) keys sorted: each expert's choices together, in fill order. A
        # choice's place among its expert's choices in the block is its sorted position (`local`
        # here) less the position where its expert's run starts (a running max of the starts).
        ranked = tl.sort((bins << LOG_BLOCK_N) | local)
        expert = ranked >> LOG_BLOCK_N
        place = ranked & (BLOCK_N - 1)
        previous = tl.gather(expert, tl.maximum(local - 1, 0), 0)
        starts = tl.where((local == 0) | (expert != previous), local, 0)
        in_block = local - tl.associative_scan(starts, 0, _maximum)
        place_ok = first + place < N
        slot = _fill_slots(first, place, place_ok, order_ptr, T, K, ORDER)
    else:
        # The choices of the same expert earlier in the block, a chunk at a time (the spare bin E
        # of empty, dropped and padding choices matches nothing: -1 here, -2 in the chunks).
        expert = bins
        mine = tl.where(bins < E, bins, -1)
        in_block = tl.zeros((BLOCK_N,), tl.int32)
        for c in tl.static_range(0, BLOCK_N, CHUNK):
            _f, other, _o, other_bins = _block_bins_at(experts_ptr, order_ptr, first, c, N, T, K, E, ORDER, CHUNK)
            other_bins = tl.where(other_bins < E, other_bins, -2)
            same = (mine[:, None] == other_bins[None, :]) & (other[None, :] < local[:, None])
            in_block += tl.sum(same.to(tl.int32), axis=1)
        place_ok = ok
        slot = _fill_slots(first, local, ok, order_ptr, T, K, ORDER)
    real = expert < E
    row = tl.program_id(0).to(tl.int64) * E
    before = tl.load(before_ptr + row + tl.where(real, expert, 0), mask=real, other=0)
    rank = (before + in_block).to(tl.int64)
    tl.store(positions_ptr + slot, tl.where(real & (rank < C), rank, -1), mask=place_ok)


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
    block, warps, sorted_ = block_plan(num_experts)
    blocks = triton.cdiv(N, block)
    # Row b + 1 holds block b's counts and row 0 zeros, so the running sum down the rows is, at
    # row b, each expert's choices in the blocks before block b, and at the last row its total.
    table = torch.empty((blocks + 1, num_experts), dtype=torch.int32, device=experts.device)
    table[0] = 0
    order_arg = experts if order is None else order  # unread unless GIVEN
    block_counts_kernel[(blocks,)](
        experts, order_arg, table, N, T, k, num_experts,
        ORDER=mode, BLOCK_N=block, BINS=bins, num_warps=warps,
    )  # fmt: skip
    table = running_sums.down_columns(table, bound=N)
    positions = torch.empty_like(experts)
    block_positions_kernel[(blocks,)](
        experts, order_arg, table, positions, N, T, k, num_experts, capacity,
        ORDER=mode, BLOCK_N=block, SORTED=sorted_, LOG_BLOCK_N=block.bit_length() - 1, CHUNK=_CHUNK,
        num_warps=warps,
    )  # fmt: skip
    return positions, table[-1].to(torch.int64)


@capacity_positions.register_fake
def _(experts, num_experts, capacity, priority=None):
    return experts.new_empty(experts.shape), experts.new_empty(num_experts)


def _aot_blocks(kernel, order: int, num_experts: int):
    block, warps, sorted_ = block_plan(num_experts)
    bins = triton.next_power_of_2(num_experts + 1)
    signature = {"experts_ptr": "*i64", "order_ptr": "*i64"}
    if kernel is block_counts_kernel:
        signature["counts_ptr"] = "*i32"
        constexprs = {"ORDER": order, "BLOCK_N": block, "BINS": bins}
    else:
        signature.update(before_ptr="*i32", positions_ptr="*i64")
        constexprs = {
            "ORDER": order,
            "BLOCK_N": block,
            "SORTED": sorted_,
            "LOG_BLOCK_N": block.bit_length() - 1,
            "CHUNK": _CHUNK,
        }
    signature.update(N="i32", T="i32", K="i32", E="i32")
    if kernel is block_positions_kernel:
        signature["C"] = "i32"
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return kernel, signature, constexprs, {"num_warps": warps}


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
    _aot_blocks(block_counts_kernel, S_MAJOR, 8),
    _aot_blocks(block_positions_kernel, S_MAJOR, 256),
    _aot_blocks(block_positions_kernel, GIVEN, 8),
    _aot_blocks(block_positions_kernel, FLAT, 64),
    _aot_blocks(block_positions_kernel, S_MAJOR, 16),
    _aot_blocks(block_positions_kernel, GIVEN, MAX_BINS - 1),
]
