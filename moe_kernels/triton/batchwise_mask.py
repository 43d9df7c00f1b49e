"""Batchwise top-m mask (eq 18, Shazeer et al. 2017 Appendix F) in Triton, every expert at once
over coalesced row tiles ([BLOCK_T tokens, GROUP experts] of the row-major scores).

Where m is a small fraction of T (batchwise_sampled.plan), the sampled select
(batchwise_sampled.py) reads the scores once; the expert groups it cannot select exactly, flagged
on the device, and every group otherwise, go through the radix path here:
  1. a radix select of each column's m-th largest 32-bit order key, 4 bits per pass, MSB first:
     each pass histograms the digit of the keys still matching the column's prefix (a register
     histogram per program, added into [E, 16] counters with integer atomics: order-independent,
     so deterministic); every program derives the digits chosen so far from those counters
     (_selected);
  2. each tile's count of keys above that key and of its ties, per expert;
  3. their exclusive sums down the tiles (a program a flagged group, in place), then each tile
     keeps the keys above and the first `remaining` ties in token order (tl.cumsum ranks them),
     writes its mask rows whole and the kept tokens at their ranks.
A program of the radix path loops over every programs-th tile of its expert group and returns at
once where the group is not flagged. No host sync; within a path each output element has one
writer, and the radix path writes its groups' columns whole after the sampled select (stream
order)."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton import batchwise_sampled
from moe_kernels.triton.common import on_tensor_device, to_float32, token_stride_unspecialized, value_key

# A histogram tile is 256 tokens x 16 experts (a 32-byte sector of a bf16 row); its histogram has
# 16 x 16 bins (4-bit digits, 8 passes): Triton's histogram keeps bins / 32 counters in every
# thread, and 8-bit digits (16 x 256 bins) spilled.
# tl.histogram's GPU lowering needs its input to cover the program's threads at least once
# (_BLOCK_T * _GROUP >= 32 * _NUM_WARPS) and every value inside [0, bins): keep both.
_BLOCK_T = 256
_GROUP = 16
_RADIX_BITS = 4
_NUM_WARPS = 8
# The counting and writing passes take tiles of 128 tokens: their two column scans held tiles of
# 256 in the tile loop past 255 registers (spills on sm_90 under triton 3.6).
_WRITE_BLOCK_T = 128
# Tiles a step of the scan down the tile counts (a program a group: [BLOCK, GROUP] int32 a step).
_SCAN_BLOCK = 256
# Programs a group and launch of the radix path behind the sampled select: it runs for a few
# groups, if any, and each of its launches costs the others a flag read a program.
_REDO_PROGRAMS = 32
# The radix path puts the expert groups on grid axis 1, which CUDA caps at 65535.
MAX_EXPERTS = 65535 * _GROUP


def supports(num_experts: int) -> bool:
    """Whether the kernels take E experts; past it (transposed scores, most likely) the op hands
    the call on (backends.fallback: the CUDA kernel, else the reference) and the raw op raises."""
    return num_experts <= MAX_EXPERTS


@triton.jit
def _tile_keys(scores_ptr, tile, T, E, stride_t, stride_e, BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    """(token ids [BLOCK_T], expert ids [GROUP], in-range [BLOCK_T, GROUP], int32 keys) of token
    tile `tile` of this program's expert group. The keys are value_key's: signed, in the ranking
    order (NaN highest, -0 == +0, -inf lowest); the radix digits are those of key + 2^31, the
    same order unsigned."""
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    valid = (t < T)[:, None] & (e < E)[None, :]
    ptrs = scores_ptr + t.to(tl.int64)[:, None] * stride_t + e.to(tl.int64)[None, :] * stride_e
    return t, e, valid, value_key(to_float32(tl.load(ptrs, mask=valid, other=0.0)))


@triton.jit
def _tiles(T, BLOCK_T: tl.constexpr):
    """Tiles of BLOCK_T tokens over T >= 1 tokens. Not tl.cdiv: its T + BLOCK_T - 1 wraps in int32
    for T within BLOCK_T of 2^31, and the tile loops would then run zero times."""
    return (T - 1) // BLOCK_T + 1


@triton.jit
def _signed(key):
    """An unsigned order key (int64 in [0, 2^32)) as the int32 value_key of the same rank."""
    return (key - 2147483648).to(tl.int32)


@triton.jit
def _selected(hist_ptr, e, E, M, PASSES: tl.constexpr, RADIX_BITS: tl.constexpr, GROUP: tl.constexpr):
    """(prefix, remaining), [GROUP] int64 each, of columns e after the first PASSES passes, from
    their histograms hist [passes, E, 2^RADIX_BITS]: the leading digits of each column's m-th
    largest key, and that key's rank among the keys sharing them. A pass's digit is the largest
    bin whose count from the top reaches `remaining` (the counts from the top fall with the bin).
    Every program derives them itself (a few hundred bytes of histograms) instead of a launch a
    pass of one program per expert."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    bins = tl.arange(0, BINS)
    prefix = tl.zeros([GROUP], tl.int64)
    remaining = tl.zeros([GROUP], tl.int64) + M
    for p in tl.static_range(PASSES):
        offsets = (p * E + e.to(tl.int64))[:, None] * BINS + bins[None, :]
        hist = tl.load(hist_ptr + offsets, mask=(e < E)[:, None], other=0).to(tl.int64)  # [GROUP, BINS]
        from_top = tl.sum(hist, axis=1)[:, None] - tl.cumsum(hist, axis=1) + hist  # this bin and above
        digit = tl.max(tl.where(from_top >= remaining[:, None], bins[None, :], 0), axis=1).to(tl.int64)
        remaining -= tl.sum(tl.where(bins[None, :] > digit[:, None], hist, 0), axis=1)
        prefix |= digit << (32 - RADIX_BITS * (p + 1))
    return prefix, remaining


@triton.jit
def digit_histogram_kernel(
    scores_ptr,  # [T, E] fp32/fp16/bf16, any strides
    redo_ptr,  # [groups] int32: nonzero where this expert group is selected here
    hist_ptr,  # [passes, E, 2^RADIX_BITS] int32, zeroed: pass PASS's counts added into hist[PASS]
    T,
    E,
    stride_t,
    stride_e,
    M,
    PASS: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Grid (programs, groups): program p histograms tiles p, p + programs, ... of its group (the
    digit of the keys that match the digits the passes before chose) into one register
    histogram, added into hist[PASS] once."""
    if tl.load(redo_ptr + tl.program_id(1)) == 0:
        return
    BINS: tl.constexpr = 1 << RADIX_BITS
    SHIFT: tl.constexpr = 32 - RADIX_BITS * (PASS + 1)  # the digit's lowest bit
    e = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    prefix, _ = _selected(hist_ptr, e, E, M, PASS, RADIX_BITS, GROUP)
    prefix = prefix.to(tl.uint32)[None, :]
    counts = tl.zeros([GROUP * BINS], tl.int32)
    for tile in range(tl.program_id(0), _tiles(T, BLOCK_T), tl.num_programs(0)):
        t, e, valid, key = _tile_keys(scores_ptr, tile, T, E, stride_t, stride_e, BLOCK_T, GROUP)
        key = key.to(tl.uint32, bitcast=True) ^ 0x80000000  # the unsigned order, 32-bit shifts
        if PASS == 0:  # no digits chosen yet (and a shift by 32 is undefined)
            match = valid
        else:
            match = valid & ((key >> (SHIFT + RADIX_BITS)) == (prefix >> (SHIFT + RADIX_BITS)))
        digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
        local = tl.arange(0, GROUP)[None, :] * BINS + digit  # in [0, GROUP * BINS)
        # Keys that no longer match (and padding) are left out of the histogram.
        counts += tl.histogram(
            tl.reshape(local, [BLOCK_T * GROUP]), GROUP * BINS, mask=tl.reshape(match, [BLOCK_T * GROUP])
        )
    bins = tl.arange(0, GROUP * BINS)
    column = tl.program_id(1) * GROUP + bins // BINS
    out = hist_ptr + (PASS * E + column.to(tl.int64)) * BINS + bins % BINS
    tl.atomic_add(out, counts, mask=(column < E) & (counts > 0), sem="relaxed")


@triton.jit
def tile_counts_kernel(
    scores_ptr,
    redo_ptr,  # [groups] int32: nonzero where this expert group is selected here
    hist_ptr,  # [PASSES, E, 2^RADIX_BITS] int32: the passes' histograms
    above_ptr,  # [tiles, E] int32: keys above each column's m-th largest in each tile
    ties_ptr,  # [tiles, E] int32: keys equal to it in each tile
    T,
    E,
    stride_t,
    stride_e,
    M,
    PASSES: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    if tl.load(redo_ptr + tl.program_id(1)) == 0:
        return
    e = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    threshold, _ = _selected(hist_ptr, e, E, M, PASSES, RADIX_BITS, GROUP)
    threshold = _signed(threshold)[None, :]
    for tile in range(tl.program_id(0), _tiles(T, BLOCK_T), tl.num_programs(0)):
        t, e, valid, key = _tile_keys(scores_ptr, tile, T, E, stride_t, stride_e, BLOCK_T, GROUP)
        out = tl.cast(tile, tl.int64) * E + e
        tl.store(above_ptr + out, tl.sum((valid & (key > threshold)).to(tl.int32), axis=0), mask=e < E)
        tl.store(ties_ptr + out, tl.sum((valid & (key == threshold)).to(tl.int32), axis=0), mask=e < E)


@triton.jit
def tiles_before_kernel(
    redo_ptr,  # [groups] int32: nonzero where this expert group is selected here
    above_ptr,  # [tiles, E] int32: in: keys above in each tile; out: in the tiles before it
    ties_ptr,  # [tiles, E] int32: the same for the ties
    tiles,
    E,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Grid (groups,): a flagged group's columns of both tables become their exclusive sums down
    the tiles, in place, BLOCK tiles a step. The other groups' columns are neither read nor
    written (tile_counts_kernel leaves them unwritten), so behind the sampled select, where few
    groups if any are flagged, this is one launch of programs that return at once; a flat scan of
    the tables (as running_sums does) cost a zero fill and several passes over both on every call."""
    if tl.load(redo_ptr + tl.program_id(0)) == 0:
        return
    e = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    above_sum = tl.zeros([GROUP], tl.int32)  # counts are below T < 2^31
    ties_sum = tl.zeros([GROUP], tl.int32)
    for start in range(0, tiles, BLOCK):
        r = start + tl.arange(0, BLOCK)
        ok = (r < tiles)[:, None] & (e < E)[None, :]
        at = r.to(tl.int64)[:, None] * E + e[None, :]
        above = tl.load(above_ptr + at, mask=ok, other=0)
        ties = tl.load(ties_ptr + at, mask=ok, other=0)
        tl.store(above_ptr + at, above_sum[None, :] + tl.cumsum(above, axis=0) - above, mask=ok)
        tl.store(ties_ptr + at, ties_sum[None, :] + tl.cumsum(ties, axis=0) - ties, mask=ok)
        above_sum += tl.sum(above, axis=0)
        ties_sum += tl.sum(ties, axis=0)


@triton.jit
def write_mask_kernel(
    scores_ptr,
    redo_ptr,  # [groups] int32: nonzero where this expert group is selected here
    hist_ptr,  # [PASSES, E, 2^RADIX_BITS] int32: the passes' histograms
    above_before_ptr,  # [tiles, E] int32: keys above the m-th largest in the tiles before
    ties_before_ptr,  # [tiles, E] int32: its ties in the tiles before
    mask_ptr,  # [T, E] contiguous bool: this group's columns written whole
    tokens_ptr,  # [E, M] contiguous int64: this group's rows written whole
    T,
    E,
    stride_t,
    stride_e,
    M,
    PASSES: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr,
):
    if tl.load(redo_ptr + tl.program_id(1)) == 0:
        return
    e = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    col_ok = e < E
    threshold, remaining = _selected(hist_ptr, e, E, M, PASSES, RADIX_BITS, GROUP)
    # int32 below: counts and ranks are < 2^31 (T is an int32). `remaining`: how many of the
    # ties are kept, the first ones in token order.
    threshold = _signed(threshold)[None, :]
    remaining = remaining.to(tl.int32)[None, :]
    for tile in range(tl.program_id(0), _tiles(T, BLOCK_T), tl.num_programs(0)):
        t, e, valid, key = _tile_keys(scores_ptr, tile, T, E, stride_t, stride_e, BLOCK_T, GROUP)
        before = tl.cast(tile, tl.int64) * E + e
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


# Scores whose token stride is 1 (after _expert_contiguous: one expert, e.g. a contiguous [T, 1])
# take these compiles of the kernels. On an H200 (triton 3.6) the compiles specialized on
# stride_t == 1 read a [5, 1] column as its first score and zeros (pass 0's histogram of
# [0, 0, 1, 2, 0] held five keys of 0.0); these were exact on the same columns
# (python_tests/ops/test_batchwise_mask.py's adversarial cases).
_UNSPECIALIZED = {
    kernel: token_stride_unspecialized(kernel)
    for kernel in (digit_histogram_kernel, tile_counts_kernel, write_mask_kernel)
}


@on_tensor_device
def radix_select(scores, m, mask, tokens, redo, programs=None):
    """The radix path into `mask` [T, E] and `tokens` [E, m] for the expert groups (of _GROUP
    columns) whose `redo` [groups] int32 is nonzero: their columns of mask and rows of tokens are
    written whole, the others' left as they are. Each launch has at most `programs` programs a
    group (default: one a tile), each looping over every programs-th tile."""
    T, E = scores.shape
    device = scores.device
    args = (T, E, scores.stride(0), scores.stride(1), m)
    kernels = (digit_histogram_kernel, tile_counts_kernel, write_mask_kernel)
    if scores.stride(0) == 1:
        kernels = tuple(_UNSPECIALIZED[k] for k in kernels)
    histogram, tile_counts, write_mask = kernels
    groups = triton.cdiv(E, _GROUP)
    passes = 32 // _RADIX_BITS
    hist = torch.zeros((passes, E, 1 << _RADIX_BITS), dtype=torch.int32, device=device)
    opts = {"RADIX_BITS": _RADIX_BITS, "GROUP": _GROUP, "num_warps": _NUM_WARPS}
    grid = (min(triton.cdiv(T, _BLOCK_T), programs or T), groups)
    for p in range(passes):
        histogram[grid](scores, redo, hist, *args, PASS=p, BLOCK_T=_BLOCK_T, **opts)
    tiles = triton.cdiv(T, _WRITE_BLOCK_T)
    grid = (min(tiles, programs or T), groups)
    opts.update(PASSES=passes, BLOCK_T=_WRITE_BLOCK_T)
    # Only the redone groups' columns are written, scanned and read: the others' stay uninitialised.
    above = torch.empty((tiles, E), dtype=torch.int32, device=device)
    ties = torch.empty((tiles, E), dtype=torch.int32, device=device)
    tile_counts[grid](scores, redo, hist, above, ties, *args, **opts)
    # In place: the keys above / the ties in the tiles before each tile.
    tiles_before_kernel[(groups,)](redo, above, ties, tiles, E, BLOCK=_SCAN_BLOCK, GROUP=_GROUP, num_warps=4)
    write_mask[grid](scores, redo, hist, above, ties, mask, tokens, *args, **opts)


def _expert_contiguous(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, E] with stride 1 between experts: copied row-major where its experts are
    strided (E > 1), viewed with expert stride 1 where it has one expert. On an H200 (triton 3.6)
    the radix path's histograms went wrong on scores with an expert stride other than 1, with or
    without the token stride specialized: a 600-token column of [600, 37] scores with strides
    (1, 600) counted 768 keys (its three tiles whole, padding included), one of [100, 3] with
    strides (1, 100) 48; [80, 6] scores with strides (1, 160) got wrong tokens. Scores with expert
    stride 1 and a token stride other than 1 were exact in every GPU test and at the goal shapes;
    a token stride of 1 (one expert) takes the unspecialized compiles (_UNSPECIALIZED). The copy
    costs column-major input one more read and write of the scores."""
    T, E = scores.shape
    if E == 1:
        return scores.as_strided((T, 1), (scores.stride(0), 1))
    return scores if scores.stride(1) == 1 else scores.contiguous()


@torch.library.custom_op("moe_kernels_triton::batchwise_mask", mutates_args=())
@on_tensor_device
def batchwise_mask(scores: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.batchwise_mask (validated there)."""
    T, E = scores.shape
    if not supports(E):
        raise ValueError(
            f"batchwise_mask: the Triton kernels support E <= {MAX_EXPERTS} experts (65535 groups of "
            f"{_GROUP} on CUDA's grid axis 1), got scores of shape {tuple(scores.shape)}; use MOE_KERNELS_BACKEND=torch"
        )
    device = scores.device
    if m == 0 or E == 0:
        empty = torch.empty((E, m), dtype=torch.int64, device=device)
        return torch.zeros((T, E), dtype=torch.bool, device=device), empty
    scores = _expert_contiguous(scores)
    tokens = torch.empty((E, m), dtype=torch.int64, device=device)
    # The sampled select's candidate gather has the experts on grid axis 1 (at most 65535).
    plan = batchwise_sampled.plan(T, m) if E <= 65535 else None
    if plan is None:
        mask = torch.empty((T, E), dtype=torch.bool, device=device)
        redo = torch.ones(triton.cdiv(E, _GROUP), dtype=torch.int32, device=device)
        radix_select(scores, m, mask, tokens, redo)
    else:
        mask = torch.zeros((T, E), dtype=torch.bool, device=device)
        redo = batchwise_sampled.sampled_select(scores, m, plan, mask, tokens, group=_GROUP)
        radix_select(scores, m, mask, tokens, redo, programs=_REDO_PROGRAMS)
    return mask, tokens


# An opaque custom op (not triton_op): the interpreter reads data pointers, which fake tensors
# forbid, so torch.compile must see the shapes from here rather than trace the launch.
@batchwise_mask.register_fake
def _(scores, m):
    T, E = scores.shape
    return scores.new_empty((T, E), dtype=torch.bool), scores.new_empty((E, m), dtype=torch.int64)


def _aot(kernel, dt="fp32"):
    """An AOT_KERNELS entry of `kernel` on `dt` scores, as radix_select launches it."""
    if kernel is tiles_before_kernel:
        signature = {"redo_ptr": "*i32", "above_ptr": "*i32", "ties_ptr": "*i32", "tiles": "i32", "E": "i32"}
        constexprs = {"BLOCK": _SCAN_BLOCK, "GROUP": _GROUP}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        return kernel, signature, constexprs, {"num_warps": 4}
    signature = {"scores_ptr": f"*{dt}", "redo_ptr": "*i32", "hist_ptr": "*i32"}
    if kernel is tile_counts_kernel:
        signature.update(above_ptr="*i32", ties_ptr="*i32")
    elif kernel is write_mask_kernel:
        signature.update(above_before_ptr="*i32", ties_before_ptr="*i32", mask_ptr="*i1", tokens_ptr="*i64")
    signature.update(T="i32", E="i32", stride_t="i64", stride_e="i64", M="i32")
    constexprs = {"RADIX_BITS": _RADIX_BITS, "GROUP": _GROUP}
    if kernel is digit_histogram_kernel:
        constexprs.update(PASS=3, BLOCK_T=_BLOCK_T)
    else:
        constexprs.update(PASSES=32 // _RADIX_BITS, BLOCK_T=_WRITE_BLOCK_T)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return kernel, signature, constexprs, {"num_warps": _NUM_WARPS}


AOT_KERNELS = [
    _aot(digit_histogram_kernel, "bf16"),
    _aot(digit_histogram_kernel, "fp32"),
    _aot(tile_counts_kernel, "fp16"),
    _aot(tiles_before_kernel),
    _aot(write_mask_kernel, "bf16"),
    _aot(write_mask_kernel, "fp32"),
]
