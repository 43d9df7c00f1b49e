"""capacity_positions in Triton, in O(T k): the fill order cut into segments; each segment's
per-expert counts, their sum over the segments before it (running_sums.exclusive_down, on the
device, in place), then each choice's rank = its expert's count in the segments before it plus its place
among its expert's choices in its segment. No atomics and no host sync; every choice's position is
written once. Two ways to the place in a segment:
- below SORTED_FROM experts, the packed scan: segments of SEGMENT choices, each expert's running
  count in an 8-bit field of an int64 word, eight experts a word, ceil(E / 8) scans a segment;
- from SORTED_FROM to MAX_BINS, blocks of BLOCK_N choices sorted by (expert, place) keys.
Past MAX_BINS experts, the older kernel: one program per expert scans the whole fill order
(O(E T k)).

Warp instructions a choice, sm_90 SASS of the default fill order at k = 8 (bench/triton_sass.py;
counts + positions kernel): packed E = 8 1.6 + 3.9, E = 16 2.2 + 5.4, E = 32 3.0 + 8.8, E = 63
4.9 + 15.9; sorted E = 256 5.0 + 15.1. The packed scan replaced comparisons of each choice
with its block's earlier ones (E = 8 4.8 + 18.1, E = 32 5.2 + 24.7). Not yet timed on a GPU."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton import running_sums
from moe_kernels.triton.common import GATHERS_LAST_AXIS_FIRST, on_tensor_device

# From this many experts a block's choices are ranked by sorting (expert, place) keys; below, by
# the packed scan (ceil(E / 8) scans of int64 words grow past a sort's cost at about 64).
SORTED_FROM = 64
# Histogram bins per program: E + 1 rounded up to a power of two. Past it, the per-expert scan.
MAX_BINS = 4096
# tl.histogram's GPU lowering needs its input to cover the program's threads at least once
# (BLOCK_N >= 32 * warps) and every value inside [0, bins): the sorted blocks keep both.
BLOCK_N = 1024
_SORTED_WARPS = 8


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
def _block_bins(experts_ptr, order_ptr, N, T, K, E, ORDER: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block of BLOCK_N choices of the fill order: (its first choice (int64), their
    offsets from it (int32), which are < N, each one's bin: its expert, or the spare bin E for
    empty choices, ids outside [0, E) (dropped on the device, docs/reliability.md) and padding)."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_N
    local = tl.arange(0, BLOCK_N)
    ok = first + local < N
    ex = tl.load(experts_ptr + _fill_slots(first, local, ok, order_ptr, T, K, ORDER), mask=ok, other=-1)
    return first, local, ok, tl.where(ok & (ex >= 0) & (ex < E), ex, E).to(tl.int32)


@triton.jit
def block_counts_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64 fill order (read if ORDER is GIVEN)
    counts_ptr,  # [num_blocks, E] int32: row b gets block b's choices per expert
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
    row = tl.program_id(0).to(tl.int64)
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
    LOG_BLOCK_N: tl.constexpr,  # log2(BLOCK_N)
):
    first, local, ok, bins = _block_bins(experts_ptr, order_ptr, N, T, K, E, ORDER, BLOCK_N)
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
    real = expert < E
    row = tl.program_id(0).to(tl.int64) * E
    before = tl.load(before_ptr + row + tl.where(real, expert, 0), mask=real, other=0)
    rank = (before + in_block).to(tl.int64)
    tl.store(positions_ptr + slot, tl.where(real & (rank < C), rank, -1), mask=place_ok)


# The packed scan (E < SORTED_FROM): segments of SEGMENT consecutive choices of the fill order, a
# program a [ROWS, SEGMENT] tile of them. An expert's count in a segment is at most SEGMENT, which
# fits an 8-bit field of an int64 word: _FIELDS experts a word, the running counts of all of them
# from ceil(E / _FIELDS) scans of those words along the segment. (int32 words of 4 fields took
# 15-25% more instructions a choice: twice the scans.)
SEGMENT = 128
_FIELDS = 8
# Segments a program (FLAT, GIVEN); S_MAJOR: up to this many slots of one token block. With a
# warp a segment (4 choices a thread), the positions kernel holds 48-96 registers at E = 8-63 on
# sm_80/sm_90; at 8 choices a thread it took 92-164 and spilled from E = 40.
_ROWS = 4
_PACKED_WARPS = 4


def gather_transposed(mode: int) -> bool:
    """GATHER_TRANSPOSED of packed_positions_kernel: its gather of each choice's count before the
    segment as the [SEG, ROWS] transpose of its tile where the order is S_MAJOR and triton lays a
    gather out last axis first (3.7 on; common.GATHERS_LAST_AXIS_FIRST). Laid out so, the [ROWS,
    SEG] gather left the tile's layout (the ids' load, ROWS contiguous ids a token) and came back
    through shared memory: E = 8, k = 8 494 -> 423 warp instructions a program at sm_90 under 3.7,
    9 block barriers -> 1; under 3.6 the transpose did the opposite (431 -> 500), and FLAT's tile
    compiles well untransposed under 3.7 (358 against 456)."""
    return GATHERS_LAST_AXIS_FIRST and mode == S_MAJOR


def packed_plan(k: int, mode: int) -> tuple[int, int]:
    """(ROWS, num_warps) of the packed kernels: S_MAJOR tiles take the slots of a token block,
    at most _ROWS of them; FLAT and GIVEN tiles _ROWS consecutive segments; a warp a segment."""
    rows = min(_ROWS, triton.next_power_of_2(k)) if mode == S_MAJOR else _ROWS
    return rows, max(1, min(_PACKED_WARPS, rows * SEGMENT // 128))


def packed_segments(num_tokens: int, k: int, mode: int) -> int:
    """Segments of the fill order (rows of the count table): S_MAJOR, a
    segment per slot and block of SEGMENT tokens (slot-major: segment s * cdiv(T, SEGMENT) + b);
    FLAT and GIVEN, a segment per SEGMENT consecutive choices."""
    if mode == S_MAJOR:
        return k * triton.cdiv(num_tokens, SEGMENT)
    return triton.cdiv(num_tokens * k, SEGMENT)


@triton.jit
def _segment_tile(
    experts_ptr, order_ptr, N, T, K, E, ORDER: tl.constexpr, ROWS: tl.constexpr, SEG: tl.constexpr
):  # fmt: skip
    """This program's [ROWS, SEG] tile of the fill order, a segment a row: (each row's segment
    [ROWS, 1] int64 (packed_segments' numbering), which rows are segments [ROWS, 1], the
    choices' flat indices t * K + s [ROWS, SEG] int64, which are choices, their bins [ROWS, SEG]
    int32: the expert, or E for empty choices, ids outside [0, E) and padding)."""
    j = tl.arange(0, SEG)[None, :]
    r = tl.arange(0, ROWS)[:, None]
    if ORDER == 0:
        # S_MAJOR: program (b, c) takes token block b's slots c * ROWS + r; their rows of
        # experts are contiguous, so the tile is one contiguous stretch of memory.
        b = tl.program_id(0)
        s = tl.program_id(1) * ROWS + r
        t = b * SEG + j
        row_ok = s < K
        ok = row_ok & (t < T)
        slot = t.to(tl.int64) * K + s
        segment = s.to(tl.int64) * tl.cdiv(T, SEG) + b
    else:
        segment = tl.program_id(0).to(tl.int64) * ROWS + r
        i = segment * SEG + j
        row_ok = segment * SEG < N
        ok = i < N
        if ORDER == 1:
            slot = tl.load(order_ptr + i, mask=ok, other=0)
        else:
            slot = i
    ex = tl.load(experts_ptr + slot, mask=ok, other=-1)
    return segment, row_ok, slot, ok, tl.where(ok & (ex >= 0) & (ex < E), ex, E).to(tl.int32)


@triton.jit
def _packed_one_hot(bins, w, E):
    """Word w of each choice's packed one-hot (int64): 1 in the 8-bit field bins % 8 where the
    choice's expert is in word w (bins // 8 == w), else 0; the spare bin E counts nowhere. A
    field's count of SEGMENT in the top field wraps the word's sign: the field is read back by a
    shift and a mask, which is exact there too."""
    one = tl.full(bins.shape, 1, tl.int64) << _field_shift(bins)
    return tl.where(((bins >> 3) == w) & (bins < E), one, 0)


@triton.jit
def _field_shift(bins):
    """The bit offset (int64) of expert bins' 8-bit field in its word."""
    return ((bins & 7) << 3).to(tl.int64)


@triton.jit
def packed_counts_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64 fill order (read if ORDER is GIVEN)
    counts_ptr,  # [segments, E] int32: row g gets segment g's choices per expert
    N,  # T * K
    T,
    K,
    E,
    ORDER: tl.constexpr,  # S_MAJOR, GIVEN or FLAT
    ROWS: tl.constexpr,
    SEG: tl.constexpr,  # SEGMENT
    WORDS: tl.constexpr,  # cdiv(E, 8)
    BLOCK_E: tl.constexpr,  # next power of two >= E
):
    segment, row_ok, _slot, _ok, bins = _segment_tile(experts_ptr, order_ptr, N, T, K, E, ORDER, ROWS, SEG)
    e = tl.arange(0, BLOCK_E)[None, :]
    counts = tl.zeros((ROWS, BLOCK_E), tl.int32)
    for w in tl.static_range(WORDS):
        total = tl.sum(_packed_one_hot(bins, w, E), axis=1)[:, None]
        counts = tl.where((e >> 3) == w, ((total >> _field_shift(e)) & 255).to(tl.int32), counts)
    tl.store(counts_ptr + segment * E + e, counts, mask=row_ok & (e < E))


@triton.jit
def packed_positions_kernel(
    experts_ptr,  # [T, K] int64 contiguous, -1 = empty
    order_ptr,  # [N] int64 fill order (read if ORDER is GIVEN)
    before_ptr,  # [segments, E] int32: each expert's choices in the segments before
    positions_ptr,  # [T, K] int64, every entry written
    N,
    T,
    K,
    E,
    C,  # capacity
    ORDER: tl.constexpr,  # S_MAJOR, GIVEN or FLAT
    ROWS: tl.constexpr,
    SEG: tl.constexpr,  # SEGMENT
    WORDS: tl.constexpr,  # cdiv(E, 8)
    GATHER_TRANSPOSED: tl.constexpr,  # the before table's gather as a [SEG, ROWS] tile (gather_transposed)
):
    segment, _row_ok, slot, ok, bins = _segment_tile(experts_ptr, order_ptr, N, T, K, E, ORDER, ROWS, SEG)
    # A choice's place among its expert's choices in its segment: its field of the running sum
    # of its word, less its own 1.
    upto = tl.zeros(bins.shape, tl.int32)
    for w in tl.static_range(WORDS):
        running = tl.cumsum(_packed_one_hot(bins, w, E), axis=1)
        upto = tl.where((bins >> 3) == w, ((running >> _field_shift(bins)) & 255).to(tl.int32), upto)
    real = bins < E
    at = before_ptr + segment * E + tl.where(real, bins, 0)
    if GATHER_TRANSPOSED:
        before = tl.trans(tl.load(tl.trans(at), mask=tl.trans(real), other=0))
    else:
        before = tl.load(at, mask=real, other=0)
    rank = (before + upto - 1).to(tl.int64)
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
    order_arg = experts if order is None else order  # unread unless GIVEN
    if num_experts < SORTED_FROM:
        return _packed_ranks(experts, order_arg, num_experts, capacity, mode)
    return _sorted_ranks(experts, order_arg, num_experts, capacity, mode)


@on_tensor_device
def _packed_ranks(experts, order_arg, num_experts: int, capacity: int, mode: int):
    """ranks() by the packed scan (E < SORTED_FROM)."""
    T, k = experts.shape
    N = experts.numel()
    rows, warps = packed_plan(k, mode)
    segments = packed_segments(T, k, mode)
    grid = (triton.cdiv(T, SEGMENT), triton.cdiv(k, rows)) if mode == S_MAJOR else (triton.cdiv(segments, rows),)
    # Row g holds segment g's counts, then (exclusive_down, in place) each expert's choices in the
    # segments before segment g.
    table = torch.empty((segments, num_experts), dtype=torch.int32, device=experts.device)
    words = triton.cdiv(num_experts, _FIELDS)
    packed_counts_kernel[grid](
        experts, order_arg, table, N, T, k, num_experts,
        ORDER=mode, ROWS=rows, SEG=SEGMENT, WORDS=words, BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=warps,
    )  # fmt: skip
    counts = running_sums.exclusive_down(table)
    positions = torch.empty_like(experts)
    packed_positions_kernel[grid](
        experts, order_arg, table, positions, N, T, k, num_experts, capacity,
        ORDER=mode, ROWS=rows, SEG=SEGMENT, WORDS=words, GATHER_TRANSPOSED=gather_transposed(mode), num_warps=warps,
    )  # fmt: skip
    return positions, counts


@on_tensor_device
def _sorted_ranks(experts, order_arg, num_experts: int, capacity: int, mode: int):
    """ranks() by sorted blocks (SORTED_FROM <= E, E + 1 <= MAX_BINS)."""
    T, k = experts.shape
    N = experts.numel()
    blocks = triton.cdiv(N, BLOCK_N)
    # The table as _packed_ranks', a row a block.
    table = torch.empty((blocks, num_experts), dtype=torch.int32, device=experts.device)
    block_counts_kernel[(blocks,)](
        experts, order_arg, table, N, T, k, num_experts,
        ORDER=mode, BLOCK_N=BLOCK_N, BINS=triton.next_power_of_2(num_experts + 1), num_warps=_SORTED_WARPS,
    )  # fmt: skip
    counts = running_sums.exclusive_down(table)
    positions = torch.empty_like(experts)
    block_positions_kernel[(blocks,)](
        experts, order_arg, table, positions, N, T, k, num_experts, capacity,
        ORDER=mode, BLOCK_N=BLOCK_N, LOG_BLOCK_N=BLOCK_N.bit_length() - 1, num_warps=_SORTED_WARPS,
    )  # fmt: skip
    return positions, counts


@capacity_positions.register_fake
def _(experts, num_experts, capacity, priority=None):
    return experts.new_empty(experts.shape), experts.new_empty(num_experts)


def _aot_blocks(kernel, order: int, num_experts: int):
    signature = {"experts_ptr": "*i64", "order_ptr": "*i64"}
    if kernel is block_counts_kernel:
        signature["counts_ptr"] = "*i32"
        constexprs = {"ORDER": order, "BLOCK_N": BLOCK_N, "BINS": triton.next_power_of_2(num_experts + 1)}
    else:
        signature.update(before_ptr="*i32", positions_ptr="*i64")
        constexprs = {"ORDER": order, "BLOCK_N": BLOCK_N, "LOG_BLOCK_N": BLOCK_N.bit_length() - 1}
    signature.update(N="i32", T="i32", K="i32", E="i32")
    if kernel is block_positions_kernel:
        signature["C"] = "i32"
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return kernel, signature, constexprs, {"num_warps": _SORTED_WARPS}


def _aot_packed(kernel, order: int, num_experts: int, k: int = 8):
    rows, warps = packed_plan(k, order)
    signature = {"experts_ptr": "*i64", "order_ptr": "*i64"}
    constexprs = {"ORDER": order, "ROWS": rows, "SEG": SEGMENT, "WORDS": triton.cdiv(num_experts, _FIELDS)}
    if kernel is packed_counts_kernel:
        signature["counts_ptr"] = "*i32"
        constexprs["BLOCK_E"] = triton.next_power_of_2(num_experts)
    else:
        signature.update(before_ptr="*i32", positions_ptr="*i64")
    signature.update(N="i32", T="i32", K="i32", E="i32")
    if kernel is packed_positions_kernel:
        signature["C"] = "i32"
        constexprs["GATHER_TRANSPOSED"] = gather_transposed(order)
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
    _aot_blocks(block_positions_kernel, S_MAJOR, 256),
    _aot_blocks(block_positions_kernel, FLAT, SORTED_FROM),
    _aot_blocks(block_positions_kernel, GIVEN, MAX_BINS - 1),
    _aot_packed(packed_counts_kernel, S_MAJOR, 8),
    _aot_packed(packed_counts_kernel, GIVEN, SORTED_FROM - 1),
    _aot_packed(packed_positions_kernel, S_MAJOR, 8),
    _aot_packed(packed_positions_kernel, S_MAJOR, 16, k=2),
    _aot_packed(packed_positions_kernel, FLAT, 5),
    _aot_packed(packed_positions_kernel, GIVEN, SORTED_FROM - 1),
]
