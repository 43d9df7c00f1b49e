"""Batchwise top-m mask (eq 18, Shazeer et al. 2017 Appendix F) in Triton, every expert at once
over coalesced row tiles ([BLOCK_T tokens, GROUP experts] of the row-major scores):
  1. a radix select of each column's m-th largest 32-bit order key, 4 bits per pass, MSB first:
     each pass histograms the digit of the keys still matching the column's prefix (a register
     histogram per tile, added into [E, 16] counters with integer atomics: order-independent, so
     deterministic), then one program per expert picks the digit holding its m-th key;
  2. each tile's count of keys above that key and of its ties, per expert;
  3. their exclusive sums down the tiles (torch's cumsum, on the device), then each tile keeps
     the keys above and the first `remaining` ties in token order (tl.cumsum ranks them), writes
     its mask rows whole and the kept tokens at their ranks.
No host sync; each output element has one writer."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device, rank_pair, to_float32

# A tile is 256 tokens x 16 experts (a 32-byte sector of a bf16 row); its histogram has 16 x 16
# bins (4-bit digits, 8 passes): Triton's histogram keeps bins / 32 counters in every thread, and
# 8-bit digits (16 x 256 bins) spilled.
# tl.histogram's GPU lowering needs its input to cover the program's threads at least once
# (_BLOCK_T * _GROUP >= 32 * _NUM_WARPS) and every value inside [0, bins): keep both.
_BLOCK_T = 256
_GROUP = 16
_RADIX_BITS = 4
_NUM_WARPS = 8


@triton.jit
def _order_keys(x):
    """int64 keys in [0, 2^32) ordered as the ranking order: NaN highest, -0 == +0, -inf lowest.
    The high half of rank_pair (a signed 32-bit key) shifted to unsigned."""
    return (rank_pair(x, tl.zeros(x.shape, tl.int32)) >> 32) + 2147483648


@triton.jit
def _tile_keys(scores_ptr, T, E, stride_t, stride_e, BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    """(token ids [BLOCK_T], expert ids [GROUP], in-range [BLOCK_T, GROUP], order keys) of this
    program's tile."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    valid = (t < T)[:, None] & (e < E)[None, :]
    ptrs = scores_ptr + t.to(tl.int64)[:, None] * stride_t + e.to(tl.int64)[None, :] * stride_e
    key = _order_keys(to_float32(tl.load(ptrs, mask=valid, other=0.0)))
    return t, e, valid, key


@triton.jit
def _signed(key):
    """An order key as int32 (the same order, signed): half the registers of the int64 key."""
    return (key - 2147483648).to(tl.int32)


@triton.jit
def digit_histogram_kernel(
    scores_ptr,  # [T, E] fp32/fp16/bf16, any strides
    prefix_ptr,  # [E] int64: the leading digits of each column's m-th key found so far
    hist_ptr,  # [E, 2^RADIX_BITS] int32, zeroed: this pass's counts, added into
    T,
    E,
    stride_t,
    stride_e,
    SHIFT: tl.constexpr,  # the digit's lowest bit
    RADIX_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    BINS: tl.constexpr = 1 << RADIX_BITS
    t, e, valid, key = _tile_keys(scores_ptr, T, E, stride_t, stride_e, BLOCK_T, GROUP)
    prefix = tl.load(prefix_ptr + e, mask=e < E, other=0)
    match = valid & ((key >> (SHIFT + RADIX_BITS)) == (prefix >> (SHIFT + RADIX_BITS))[None, :])
    digit = (key >> SHIFT) & (BINS - 1)
    local = (tl.arange(0, GROUP)[None, :] * BINS + digit).to(tl.int32)  # in [0, GROUP * BINS)
    # Keys that no longer match (and padding) are left out of the histogram.
    counts = tl.histogram(tl.reshape(local, [BLOCK_T * GROUP]), GROUP * BINS, mask=tl.reshape(match, [BLOCK_T * GROUP]))
    bins = tl.arange(0, GROUP * BINS)
    column = tl.program_id(1) * GROUP + bins // BINS
    tl.atomic_add(
        hist_ptr + column.to(tl.int64) * BINS + bins % BINS, counts, mask=(column < E) & (counts > 0), sem="relaxed"
    )


@triton.jit
def select_digit_kernel(
    hist_ptr,  # [E, 2^RADIX_BITS] int32: this pass's counts
    prefix_ptr,  # [E] int64, updated
    remaining_ptr,  # [E] int64: the m-th key's rank among the keys sharing the prefix, updated
    SHIFT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """One program per expert: the digit of the remaining-th largest candidate is the largest bin
    whose count from the top reaches `remaining` (counts from the top decrease with the bin)."""
    e = tl.program_id(0)
    BINS: tl.constexpr = 1 << RADIX_BITS
    bins = tl.arange(0, BINS)
    hist = tl.load(hist_ptr + e.to(tl.int64) * BINS + bins).to(tl.int64)
    remaining = tl.load(remaining_ptr + e)
    from_top = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys in this bin and above
    digit = tl.max(tl.where(from_top >= remaining, bins, 0), axis=0).to(tl.int64)
    tl.store(remaining_ptr + e, remaining - tl.sum(tl.where(bins > digit, hist, 0), axis=0))
    tl.store(prefix_ptr + e, tl.load(prefix_ptr + e) | (digit << SHIFT))


@triton.jit
def tile_counts_kernel(
    scores_ptr,
    prefix_ptr,  # [E] int64: each column's m-th largest key
    above_ptr,  # [tiles, E] int32: keys above it in each tile
    ties_ptr,  # [tiles, E] int32: keys equal to it in each tile
    T,
    E,
    stride_t,
    stride_e,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    t, e, valid, key = _tile_keys(scores_ptr, T, E, stride_t, stride_e, BLOCK_T, GROUP)
    key = _signed(key)
    threshold = _signed(tl.load(prefix_ptr + e, mask=e < E, other=0))[None, :]
    out = tl.program_id(0).to(tl.int64) * E + e
    tl.store(above_ptr + out, tl.sum((valid & (key > threshold)).to(tl.int32), axis=0), mask=e < E)
    tl.store(ties_ptr + out, tl.sum((valid & (key == threshold)).to(tl.int32), axis=0), mask=e < E)


@triton.jit
def write_mask_kernel(
    scores_ptr,
    prefix_ptr,  # [E] int64: each column's m-th largest key
    remaining_ptr,  # [E] int64: how many of its ties are kept (the first ones in token order)
    above_before_ptr,  # [tiles, E] int32: keys above it in the tiles before
    ties_before_ptr,  # [tiles, E] int32: its ties in the tiles before
    mask_ptr,  # [T, E] contiguous bool, every element written
    tokens_ptr,  # [E, M] contiguous int64
    T,
    E,
    stride_t,
    stride_e,
    M,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    t, e, valid, key = _tile_keys(scores_ptr, T, E, stride_t, stride_e, BLOCK_T, GROUP)
    key = _signed(key)  # int32 below: counts and ranks are < 2^31 (T is an int32)
    col_ok = e < E
    threshold = _signed(tl.load(prefix_ptr + e, mask=col_ok, other=0))[None, :]
    remaining = tl.load(remaining_ptr + e, mask=col_ok, other=0).to(tl.int32)[None, :]
    before = tl.program_id(0).to(tl.int64) * E + e
    ties_before = tl.load(ties_before_ptr + before, mask=col_ok, other=0)[None, :]
    above_before = tl.load(above_before_ptr + before, mask=col_ok, other=0)[None, :]
    tie = (valid & (key == threshold)).to(tl.int32)
    tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie
    keep = valid & ((key > threshold) | ((tie != 0) & (tie_rank < remaining)))
    kept = keep.to(tl.int32)
    pos = above_before + tl.minimum(ties_before, remaining) + tl.cumsum(kept, axis=0) - kept
    tl.store(mask_ptr + t.to(tl.int64)[:, None] * E + e[None, :], keep, mask=valid)
    out = tokens_ptr + e.to(tl.int64)[None, :] * M + pos
    # Every column keeps exactly M tokens (above + min(ties, remaining)), so pos < M holds; the
    # mask says so anyway, so a disagreement between the passes could not write past a column.
    tl.store(out, t.to(tl.int64)[:, None] + tl.zeros(pos.shape, tl.int64), mask=keep & (pos < M))


@torch.library.custom_op("moe_kernels_triton::batchwise_mask", mutates_args=())
@on_tensor_device
def batchwise_mask(scores: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.batchwise_mask (validated there)."""
    T, E = scores.shape
    device = scores.device
    if m == 0 or E == 0:
        empty = torch.empty((E, m), dtype=torch.int64, device=device)
        return torch.zeros((T, E), dtype=torch.bool, device=device), empty
    mask = torch.empty((T, E), dtype=torch.bool, device=device)
    tokens = torch.empty((E, m), dtype=torch.int64, device=device)
    strides = (scores.stride(0), scores.stride(1))
    tiles = triton.cdiv(T, _BLOCK_T)
    grid = (tiles, triton.cdiv(E, _GROUP))
    passes = 32 // _RADIX_BITS
    prefix = torch.zeros(E, dtype=torch.int64, device=device)
    remaining = torch.full((E,), m, dtype=torch.int64, device=device)
    hist = torch.zeros((passes, E, 1 << _RADIX_BITS), dtype=torch.int32, device=device)
    for p in range(passes):
        shift = 32 - _RADIX_BITS * (p + 1)
        digit_histogram_kernel[grid](
            scores, prefix, hist[p], T, E, *strides,
            SHIFT=shift, RADIX_BITS=_RADIX_BITS, BLOCK_T=_BLOCK_T, GROUP=_GROUP, num_warps=_NUM_WARPS,
        )  # fmt: skip
        select_digit_kernel[(E,)](hist[p], prefix, remaining, SHIFT=shift, RADIX_BITS=_RADIX_BITS)
    above = torch.empty((tiles, E), dtype=torch.int32, device=device)
    ties = torch.empty((tiles, E), dtype=torch.int32, device=device)
    tile_counts_kernel[grid](
        scores, prefix, above, ties, T, E, *strides, BLOCK_T=_BLOCK_T, GROUP=_GROUP, num_warps=_NUM_WARPS
    )
    # Exclusive sums down the tiles: the keys above / the ties in the tiles before each tile.
    above_before = above.cumsum(0, dtype=torch.int32) - above
    ties_before = ties.cumsum(0, dtype=torch.int32) - ties
    write_mask_kernel[grid](
        scores, prefix, remaining, above_before, ties_before, mask, tokens, T, E, *strides, m,
        BLOCK_T=_BLOCK_T, GROUP=_GROUP, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return mask, tokens


# An opaque custom op (not triton_op): the interpreter reads data pointers, which fake tensors
# forbid, so torch.compile must see the shapes from here rather than trace the launch.
@batchwise_mask.register_fake
def _(scores, m):
    T, E = scores.shape
    return scores.new_empty((T, E), dtype=torch.bool), scores.new_empty((E, m), dtype=torch.int64)


def _aot(kernel, dt="fp32"):
    tile = {"BLOCK_T": _BLOCK_T, "GROUP": _GROUP}
    strides = {"T": "i32", "E": "i32", "stride_t": "i64", "stride_e": "i64"}
    if kernel is digit_histogram_kernel:
        signature = {"scores_ptr": f"*{dt}", "prefix_ptr": "*i64", "hist_ptr": "*i32", **strides}
        constexprs = {"SHIFT": 16, "RADIX_BITS": _RADIX_BITS, **tile}
    elif kernel is select_digit_kernel:
        signature = {"hist_ptr": "*i32", "prefix_ptr": "*i64", "remaining_ptr": "*i64"}
        constexprs = {"SHIFT": 16, "RADIX_BITS": _RADIX_BITS}
    elif kernel is tile_counts_kernel:
        signature = {"scores_ptr": f"*{dt}", "prefix_ptr": "*i64", "above_ptr": "*i32", "ties_ptr": "*i32", **strides}
        constexprs = tile
    else:
        signature = {
            "scores_ptr": f"*{dt}",
            "prefix_ptr": "*i64",
            "remaining_ptr": "*i64",
            "above_before_ptr": "*i32",
            "ties_before_ptr": "*i32",
            "mask_ptr": "*i1",
            "tokens_ptr": "*i64",
            **strides,
            "M": "i32",
        }
        constexprs = tile
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return kernel, signature, constexprs, {"num_warps": 4 if kernel is select_digit_kernel else _NUM_WARPS}


AOT_KERNELS = [
    _aot(digit_histogram_kernel, "bf16"),
    _aot(digit_histogram_kernel, "fp32"),
    _aot(select_digit_kernel),
    _aot(tile_counts_kernel, "fp16"),
    _aot(write_mask_kernel, "bf16"),
    _aot(write_mask_kernel, "fp32"),
]
