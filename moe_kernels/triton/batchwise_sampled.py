"""The sampled-threshold select of batchwise_mask in Triton: the CPU's column filter
(csrc/cpu/select/column_filter.h) on a GPU, for m a small fraction of T (expert choice,
m = kT/E). It reads the scores once where the radix select reads them 10 times:
  1. a strided sample of S rows gives each column a lower bound lo, the sample's rank-th largest
     order key, which about twice the column's m best scores reach (torch.topk of the [E, S] keys);
  2. one coalesced pass over the scores sets a bit per token and column where the score reaches lo,
     in words of 32 tokens, and counts each word's bits (chosen_words_kernel);
  3. the words' running counts (running_sums.along_rows), then each word's set bits, the column's
     candidates in token order from slot (running count - the word's bits) on, each its score read
     and written to its slot of the column's list, packed with its token (gather_candidates_kernel):
     a program a block of one column's words, read once and whole, and deterministic lists (no
     atomics); slots past a column's candidates are never written or read;
  4. a program a column (column_tokens_kernel): its m-th best candidate, radix-selected from its
     list (the packed values are all distinct: the order key over 2^31 - 1 - token, so equal
     scores go to the lower token), then the list's entries at or above it, in list order, which
     is token order, go to the column's row of tokens and set the mask: no sort of the tokens, no
     scatter of the mask by torch; a column it cannot select flags its group.
A column with at least m candidates has its m best among them (its m-th largest key is >= lo), so
the select is exact wherever a column has between m and `capacity` candidates. The expert groups
with a column outside that (a sample that caught too many of its largest scores: about 1 column
in 3000 on random scores; many ties) are flagged on the device and selected again by the radix
path, which is launched every time and returns at once for the others: nothing is read back."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_kernels.triton import running_sums
from moe_kernels.triton.common import on_tensor_device, to_float32, token_stride_unspecialized, value_key, value_of

# Below SAMPLED_FROM tokens a column is cheap to select whole (the radix path). SAMPLE_ROWS: the
# sample is read once and its top-rank taken by torch.topk, small next to the pass over the
# scores on a GPU, where more rows put lo nearer its target quantile than the CPU's 512 do.
SAMPLED_FROM = 4096
SAMPLE_ROWS = 4096
_BLOCK_T = 256  # the sample's tiles: 256 rows x 16 experts
_GROUP = 16
_NUM_WARPS = 8
# The chosen words: a warp reads whole row segments (512 bytes: 32 lanes of 16 bytes, up to 256
# bf16 / 128 float32 columns) and each thread builds its columns' words from 32 rows in its own
# registers (no shuffles, no reduction across lanes): about 0.17 warp instructions a score at sm_90
# (bench/triton_sass.py counts the loop over a word's rows once: 0.06), where a lane holding 16
# bytes of each of 32 rows (a word a warp reduction, and half of each 32-byte sector a load) took
# 0.49. The rows come 8 at a time: 56-57 registers a thread at sm_90 as a launch specialises the
# kernel, under triton 3.6 and 3.7 (32 rows at once took 125, and spilled with a 64-bit row stride;
# 16 spilled at sm_80 under triton 3.9, which held the kernel to 64 registers). Each row is its own
# tile: as one [8 rows, words, columns] tile summed over its rows, triton 3.6 (the H200's) gave
# the rows to the warps, summed them through shared memory (1030 warp instructions a program
# against 496) and spilled about 230 bytes a thread with a 64-bit row stride.
_ROW_SEGMENT_BYTES = 512
_WORDS_NUM_WARPS = 4
_WORD_ROWS = 8
# The gather: a program 1024 words of one column (4 KB of words and 4 KB of their running counts,
# whole), 8 a thread. A search from each list slot for its word read about 15 running counts one
# after another (a binary search over the column's T / 32), each a wait on the L2: 0.11 ms at T = 1M
# on the H200 at 9d92e7c.
_BLOCK_W = 1024
_GATHER_NUM_WARPS = 4
# A column's list, BLOCK slots a step, in each of 64 / 8 passes of the radix select (a histogram of
# 256 bins: 8 counters a thread at 8 warps) and once more to write its tokens. The lists are a few
# hundred KB a column, read from the L2 after the gather wrote them.
_SELECT_BLOCK = 2048
_SELECT_RADIX_BITS = 8
_SELECT_NUM_WARPS = 8
# Below every packed candidate (whose low half is >= 2^31 - T > 0): the value of a list slot a
# masked load does not read.
_EMPTY = tl.constexpr(-(2**63))


class Plan(NamedTuple):
    sample_rows: int  # S
    step: int  # rows between sampled rows
    rank: int  # lo is the sample's rank-th largest key
    capacity: int  # slots of each column's candidate list


def plan(T: int, m: int) -> Plan | None:
    """The sampled select's sizes for T tokens and m a column, from the shapes alone (so a graph
    captures one path), or None where the radix path selects every column: T below
    SAMPLED_FROM, or lo would keep more than a quarter of a column."""
    if T < SAMPLED_FROM or m < 1:
        return None
    S = min(SAMPLE_ROWS, T // 16)
    # lo is above the column's m-th largest only if the sample holds >= rank scores above it, a
    # Binomial(S, m / T) count (mean `expected`, sd <= sqrt(expected)): 3 sd above the mean (+2
    # for small means), as on the CPU.
    expected = m * S / T
    rank = math.ceil(expected + 3.0 * math.sqrt(expected) + 2.0)
    if rank * 4 > S:
        return None
    expected_candidates = -(-rank * T // S)
    return Plan(S, T // S, rank, min(T, 2 * expected_candidates + 256))


@triton.jit
def sample_keys_kernel(
    scores_ptr,  # [T, E] fp32/fp16/bf16: the sampled rows are `stride_s` apart
    keys_ptr,  # [E, S] int32 out: value_key of the sampled scores
    S,
    E,
    stride_s,  # the scores' row stride times the step between sampled rows
    stride_e,
    BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,
):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    e = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    valid = (s < S)[:, None] & (e < E)[None, :]
    x = tl.load(scores_ptr + s.to(tl.int64)[:, None] * stride_s + e.to(tl.int64)[None, :] * stride_e, mask=valid)
    tl.store(keys_ptr + e.to(tl.int64)[None, :] * S + s[:, None], value_key(to_float32(x)), mask=valid)


@triton.jit
def _popcount(x):
    """Set bits of each int32 (a SWAR count: portable to the interpreter)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def chosen_words_kernel(
    scores_ptr,  # [T, E] fp32/fp16/bf16, any strides
    lo_ptr,  # [E] int32: each column's lower bound (a value_key)
    words_ptr,  # [E, W] int32 out: bit j of word w is token 32 w + j's key >= lo
    counts_ptr,  # [E, W] int8 out: the set bits of each word
    T,
    E,
    W,
    stride_t,
    stride_e,
    WORDS: tl.constexpr,  # words (of 32 tokens) a program
    COLS: tl.constexpr,  # columns a program: a power of two
    EVEN_E: tl.constexpr,  # E % COLS == 0: no column is past E
    ROWS: tl.constexpr,  # rows of a word a step
):
    """Grid (blocks of WORDS words, blocks of COLS columns): the pass over the scores, a few
    instructions a score (a compare and a bit), where writing the candidates themselves from here
    cost tens a score, every score paying for the few candidates (Triton's lanes run the same
    instructions). Each row of a word is a [WORDS, COLS] tile, laid out as the loads coalesce it:
    a thread holds a 16-byte vector of columns of its word's row, and ors each score's bit into
    its own words. Nothing is masked a score: rows past T are read as row T - 1 and weigh 0, and
    columns past E (only where E % COLS != 0, masked loads) are not stored."""
    w = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
    e = tl.program_id(1) * COLS + tl.arange(0, COLS)
    # The candidates are the keys >= lo: !(x < lo) is x >= lo or x NaN, and ranks -0 as +0. A
    # bound of NaN (a sample of NaNs) is taken as +inf: the candidates are then +inf and NaN, still
    # every key from a bound up, which holds a column's best wherever they number m or more.
    lo = value_of(tl.load(lo_ptr + e, mask=e < E, other=0))
    lo = tl.where(lo != lo, float("inf"), lo)[None, :]
    columns = e.to(tl.int64)[None, :] * stride_e
    words = tl.zeros([WORDS, COLS], tl.int32)
    # A word's rows ROWS at a time (a loop, not unrolled: 32 rows of 16 bytes and their 32
    # addresses in a thread at once spilled), each row its own [WORDS, COLS] tile: a bit is or-ed
    # into the thread's own word, so no layout the compiler picks can put a row sum across lanes or
    # warps (a [ROWS, WORDS, COLS] tile summed over its rows did under triton 3.6: its warps took
    # the rows, and the sum went through shared memory).
    for first in range(0, 32, ROWS):
        for r in tl.static_range(ROWS):
            t = w * 32 + (first + r)  # [WORDS]
            ptrs = scores_ptr + tl.minimum(t, T - 1).to(tl.int64)[:, None] * stride_t + columns
            if EVEN_E:
                x = to_float32(tl.load(ptrs))
            else:
                x = to_float32(tl.load(ptrs, mask=(e < E)[None, :], other=0.0))
            # Bit 31 (the row 31 of a word) is the sign bit, as it should be.
            weight = tl.where(t < T, 1 << (first + r), 0)[:, None]
            words |= tl.where(x < lo, 0, weight)
    out = e.to(tl.int64)[None, :] * W + w[:, None]
    ok = (w < W)[:, None] & (e < E)[None, :]
    tl.store(words_ptr + out, words, mask=ok)
    tl.store(counts_ptr + out, _popcount(words).to(tl.int8), mask=ok)


def words_tile(E: int, element_size: int) -> tuple[int, int]:
    """(WORDS, COLS) of chosen_words_kernel on E columns of element_size bytes: COLS up to a row
    segment of _ROW_SEGMENT_BYTES, and WORDS so that each of the program's threads holds every
    row of one word (the lanes a row spans leave the warp's others to further words)."""
    cols = min(triton.next_power_of_2(E), _ROW_SEGMENT_BYTES // element_size)
    lanes_a_row = max(1, cols * element_size // 16)
    return _WORDS_NUM_WARPS * (32 // lanes_a_row), cols


@triton.jit
def gather_candidates_kernel(
    scores_ptr,  # [T, E] fp32/fp16/bf16, any strides
    words_ptr,  # [E, W] int32: the chosen bits
    prefix_ptr,  # [E, W] int32: the set bits of each column's words up to and including each
    lists_ptr,  # [E, C] int64 out: slot i the column's i-th candidate in token order, packed
    T,
    E,
    W,
    stride_t,
    stride_e,
    C,
    BLOCK_W: tl.constexpr,
):
    """Grid (blocks of words, E): a program BLOCK_W words of one column. A word's set bits are the
    column's candidates from slot (its running count - its bits) on, in token order: each below C
    reads its token's score and writes value_key << 32 | (2^31 - 1 - token) to its slot: distinct
    values, larger in the ranking order (equal scores: the lower token larger). A round takes the
    lowest set bit of every word, as many rounds as the block's fullest word has bits (most words
    hold none: about twice m of the column's T tokens are candidates). Slots past the candidates
    are left as they are (nothing reads them)."""
    e = tl.program_id(1)
    w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    inside = w < W
    row = e.to(tl.int64) * W
    word = tl.load(words_ptr + row + w, mask=inside, other=0)
    ones = _popcount(word)
    slot = tl.load(prefix_ptr + row + w, mask=inside, other=0) - ones
    bits = word.to(tl.uint32, bitcast=True)
    lists = lists_ptr + e.to(tl.int64) * C
    for _ in range(tl.max(ones, axis=0)):
        low = bits & (0 - bits)  # the lowest set bit, 0 where none is left
        has = low != 0
        t = w * 32 + _popcount((low - 1).to(tl.int32, bitcast=True))
        live = has & (slot < C)
        x = tl.load(scores_ptr + t.to(tl.int64) * stride_t + e.to(tl.int64) * stride_e, mask=live)
        packed = (value_key(to_float32(x)).to(tl.int64) << 32) | (2147483647 - t).to(tl.int64)
        tl.store(lists + slot, packed, mask=live)
        slot += has.to(tl.int32)
        bits = bits ^ low


@triton.jit
def _kth_largest(list_ptr, n, M, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """A value v with: exactly M of the n (>= M) distinct int64 values at list_ptr are >= v (the
    M-th largest, or the digits chosen so far where they pick out exactly the M largest).
    RADIX_BITS bits a pass from the top: each pass histograms the digit of the values that share
    the digits chosen so far, and the digit is the largest bin whose count from the top reaches
    the rank still sought among them (as batchwise_mask._selected does for the radix path). Once
    the values sharing the chosen digits are exactly the ones still sought (on float32 scores,
    usually once the score's bits are chosen, before the token's), the passes stop: those digits
    with zeros below them are <= each of those values and above every other."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    bins = tl.arange(0, BINS)
    kth = tl.zeros([], tl.int64)  # the digits chosen so far, in place, the bits below them 0
    remaining = M
    done = tl.zeros([], tl.int32)
    for p in tl.static_range(64 // RADIX_BITS):
        SHIFT = 64 - RADIX_BITS * (p + 1)  # constant: p is static
        if done == 0:
            counts = tl.zeros([BINS], tl.int32)
            for start in range(0, n, BLOCK):
                i = start + tl.arange(0, BLOCK)
                live = i < n
                v = tl.load(list_ptr + i, mask=live, other=0)
                digit = (v >> SHIFT) & (BINS - 1)  # the shift's sign extension stays above the digit
                if p == 0:
                    match = live
                    digit = digit ^ (BINS // 2)  # the sign bit flipped: the signed order, unsigned
                else:
                    match = live & (((v ^ kth) >> (SHIFT + RADIX_BITS)) == 0)
                counts += tl.histogram(digit.to(tl.int32), BINS, mask=match)
            from_top = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # this bin and above
            chosen = tl.max(tl.where(from_top >= remaining, bins, 0), axis=0)
            remaining -= tl.sum(tl.where(bins > chosen, counts, 0), axis=0)
            done = (tl.sum(tl.where(bins == chosen, counts, 0), axis=0) == remaining).to(tl.int32)
            if p == 0:
                chosen = chosen ^ (BINS // 2)
            kth |= chosen.to(tl.int64) << SHIFT
    return kth


@triton.jit
def column_tokens_kernel(
    lists_ptr,  # [E, C] int64: gather_candidates_kernel's lists
    prefix_ptr,  # [E, W] int32: the words' running counts (the last, each column's candidates)
    tokens_ptr,  # [E, M] int64 out: a column's M tokens, ascending (columns that take none untouched)
    mask_ptr,  # [T, E] bool, zeroed: set at each taken (token, column)
    redo_ptr,  # [ceil(E / REDO_GROUP)] int32, zeroed: set to 1 for a group with a column taking none
    T,
    E,
    W,
    C,
    M,
    REDO_GROUP,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """Grid (E,): column e's M best candidates, in one program. A column with M to C candidates
    has them all in its list: a value `kth` that exactly its M best reach (_kth_largest), then
    the list's entries at or above it, in list order (token order), are written to the column's row
    of tokens, each at the running count of those before it, and set in the mask: exactly M,
    each written once. A column with fewer than M or more than C candidates takes none and flags
    its group (an atomic max of 1: the same result in any order), which the radix path selects
    again."""
    e = tl.program_id(0)
    n = tl.load(prefix_ptr + e.to(tl.int64) * W + W - 1)
    if (n < M) | (n > C):
        tl.atomic_max(redo_ptr + e // REDO_GROUP, 1, sem="relaxed")
        return
    list_ptr = lists_ptr + e.to(tl.int64) * C
    kth = _kth_largest(list_ptr, n, M, BLOCK, RADIX_BITS)
    placed = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        v = tl.load(list_ptr + i, mask=i < n, other=_EMPTY)
        taken = (i < n) & (v >= kth)
        flag = taken.to(tl.int32)
        place = placed + tl.cumsum(flag, axis=0) - flag
        t = 2147483647 - (v & 2147483647)
        # place < M and t < T hold (exactly M entries reach kth, each a token's); the mask says so
        # anyway, so that no slip between the passes could write outside the outputs.
        ok = taken & (place < M) & (t < T)
        tl.store(tokens_ptr + e.to(tl.int64) * M + place, t, mask=ok)
        tl.store(mask_ptr + t * E + e, tl.full(t.shape, 1, tl.int1), mask=ok)
        placed += tl.sum(flag, axis=0)


# Scores whose token stride is 1 (after the op's _expert_contiguous: one expert) take compiles
# without that specialization, as the radix kernels do (batchwise_mask._UNSPECIALIZED): the radix
# kernels specialized on it read a [5, 1] column wrongly on an H200, and these load the same tiles.
_UNSPECIALIZED = {k: token_stride_unspecialized(k) for k in (chosen_words_kernel, gather_candidates_kernel)}


@on_tensor_device
def sampled_select(scores: torch.Tensor, m: int, p: Plan, mask: torch.Tensor, tokens: torch.Tensor, group: int):
    """Selects every column of scores [T, E] into `mask` [T, E] bool (zeroed) and `tokens` [E, m]
    int64 as `p` plans. Returns `redo` [ceil(E / group)] int32: nonzero for the expert groups (of
    `group` columns) with a column the candidates cannot select (fewer than m, or more than the
    capacity): their columns here are wrong, the caller selects them again."""
    T, E = scores.shape
    device = scores.device
    chosen_words, gather_candidates = chosen_words_kernel, gather_candidates_kernel
    if scores.stride(0) == 1:
        chosen_words, gather_candidates = _UNSPECIALIZED[chosen_words], _UNSPECIALIZED[gather_candidates]
    keys_ES = torch.empty((E, p.sample_rows), dtype=torch.int32, device=device)
    sample_keys_kernel[(triton.cdiv(p.sample_rows, _BLOCK_T), triton.cdiv(E, _GROUP))](
        scores, keys_ES, p.sample_rows, E, scores.stride(0) * p.step, scores.stride(1),
        BLOCK_S=_BLOCK_T, GROUP=_GROUP, num_warps=_NUM_WARPS,
    )  # fmt: skip
    lo_E = torch.topk(keys_ES, p.rank, dim=1).values[:, p.rank - 1].contiguous()
    W = triton.cdiv(T, 32)
    words_EW = torch.empty((E, W), dtype=torch.int32, device=device)
    counts_EW = torch.empty((E, W), dtype=torch.int8, device=device)
    words, cols = words_tile(E, scores.element_size())
    chosen_words[(triton.cdiv(W, words), triton.cdiv(E, cols))](
        scores, lo_E, words_EW, counts_EW, T, E, W, scores.stride(0), scores.stride(1),
        WORDS=words, COLS=cols, EVEN_E=E % cols == 0, ROWS=_WORD_ROWS, num_warps=_WORDS_NUM_WARPS,
    )  # fmt: skip
    prefix_EW = running_sums.along_rows(counts_EW)
    lists_EC = torch.empty((E, p.capacity), dtype=torch.int64, device=device)
    gather_candidates[(triton.cdiv(W, _BLOCK_W), E)](
        scores, words_EW, prefix_EW, lists_EC, T, E, W, scores.stride(0), scores.stride(1), p.capacity,
        BLOCK_W=_BLOCK_W, num_warps=_GATHER_NUM_WARPS,
    )  # fmt: skip
    redo = torch.zeros(triton.cdiv(E, group), dtype=torch.int32, device=device)
    column_tokens_kernel[(E,)](
        lists_EC, prefix_EW, tokens, mask, redo, T, E, W, p.capacity, m, group,
        BLOCK=_SELECT_BLOCK, RADIX_BITS=_SELECT_RADIX_BITS, num_warps=_SELECT_NUM_WARPS,
    )  # fmt: skip
    return redo


def _aot(kernel, dt):
    if kernel is sample_keys_kernel:
        signature = {"scores_ptr": f"*{dt}", "keys_ptr": "*i32", "S": "i32", "E": "i32", "stride_s": "i64"}
        signature["stride_e"] = "i64"
        constexprs = {"BLOCK_S": _BLOCK_T, "GROUP": _GROUP}
    elif kernel is chosen_words_kernel:
        signature = {"scores_ptr": f"*{dt}", "lo_ptr": "*i32", "words_ptr": "*i32", "counts_ptr": "*i8"}
        signature.update({"T": "i32", "E": "i32", "W": "i32", "stride_t": "i64", "stride_e": "i64"})
        words, cols = words_tile(256, 4 if dt == "fp32" else 2)
        constexprs = {"WORDS": words, "COLS": cols, "EVEN_E": True, "ROWS": _WORD_ROWS}
    elif kernel is column_tokens_kernel:
        signature = {"lists_ptr": "*i64", "prefix_ptr": "*i32", "tokens_ptr": "*i64", "mask_ptr": "*i1"}
        signature.update({"redo_ptr": "*i32", "T": "i32", "E": "i32", "W": "i32", "C": "i32", "M": "i32"})
        signature["REDO_GROUP"] = "i32"
        constexprs = {"BLOCK": _SELECT_BLOCK, "RADIX_BITS": _SELECT_RADIX_BITS}
    else:
        signature = {"scores_ptr": f"*{dt}", "words_ptr": "*i32", "prefix_ptr": "*i32", "lists_ptr": "*i64"}
        signature.update({"T": "i32", "E": "i32", "W": "i32", "stride_t": "i64", "stride_e": "i64", "C": "i32"})
        constexprs = {"BLOCK_W": _BLOCK_W}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    warps = {
        sample_keys_kernel: _NUM_WARPS,
        chosen_words_kernel: _WORDS_NUM_WARPS,
        column_tokens_kernel: _SELECT_NUM_WARPS,
    }.get(kernel, _GATHER_NUM_WARPS)
    return kernel, signature, constexprs, {"num_warps": warps}


AOT_KERNELS = [
    _aot(sample_keys_kernel, "bf16"),
    _aot(chosen_words_kernel, "bf16"),
    _aot(chosen_words_kernel, "fp32"),
    _aot(chosen_words_kernel, "fp16"),
    _aot(gather_candidates_kernel, "bf16"),
    _aot(gather_candidates_kernel, "fp16"),
    _aot(column_tokens_kernel, None),
]
