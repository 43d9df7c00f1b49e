"""The sampled-threshold select of batchwise_mask in Triton: the CPU's column filter
(csrc/cpu/select/column_filter.h) on a GPU, for m a small fraction of T (expert choice,
m = kT/E). It reads the scores once where the radix select reads them 10 times:
  1. a strided sample of S rows gives each column a lower bound lo, the sample's rank-th largest
     order key, which about twice the column's m best scores reach (torch.topk of the [E, S] keys);
  2. one coalesced pass over the scores sets a bit per token and column where the score reaches lo,
     in words of 32 tokens, and counts each word's bits (chosen_words_kernel);
  3. the words' running counts (running_sums.along_rows), then each column's i-th candidate in token order
     is found from them (a binary search, then the bit in its word), its score read and written
     to slot i of the column's list, packed with its token (gather_candidates_kernel): work a
     candidate, not a score, and deterministic lists (no atomics);
  4. each column's m-th best candidate (torch.topk of the packed values, all distinct: the order
     key over 2^31 - 1 - token, so equal scores go to the lower token), then the list's entries
     at or above it, in list order, which is token order, go to the column's row of tokens and
     set the mask (taken_counts_kernel, a running sum of the counts, chosen_tokens_kernel): no
     sort of the tokens, no scatter of the mask by torch.
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
# The chosen words: a lane holds 16 bytes of a row (8 bf16/fp16 or 4 float32 columns) and a warp
# 32 consecutive rows, so each column's word of 32 rows is one warp reduction (REDUX), no
# shuffles: about 0.5 warp instructions a score (bench/triton_sass.py), where 16 columns a
# program, two lanes a row, took twice as many.
_WORD_BYTES = 16
_WORDS_BLOCK_T = 512
_WORDS_NUM_WARPS = 4
_BLOCK_C = 256  # candidate slots a program
_GATHER_NUM_WARPS = 4
_TAKE_BLOCK = 1024  # list slots a program of the taken-slot kernels
_TAKE_NUM_WARPS = 4
# The packed value of an empty slot: below every candidate (whose low half is >= 2^31 - T > 0).
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
def _halve(word, bit, rank, HALF: tl.constexpr):
    """One step of finding the rank-th set bit of `word` (uint32) in the window [bit, bit + 2 HALF):
    into its upper half, past the lower half's set bits, where the rank is beyond them."""
    below = _popcount(((word >> bit.to(tl.uint32)) & ((1 << HALF) - 1)).to(tl.int32, bitcast=True))
    up = rank >= below
    return tl.where(up, bit + HALF, bit), tl.where(up, rank - below, rank)


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
    BLOCK_T: tl.constexpr,  # a multiple of 32
    GROUP: tl.constexpr,
):
    """The pass over the scores: a few instructions an entry (a compare and a bit), where writing
    the candidates themselves from here cost tens an entry, every entry paying for the few
    candidates (Triton's lanes run the same instructions). A 1-D grid, the expert groups of a
    tile of tokens adjacent: GROUP columns are 16 bytes of a row, so neighbouring programs share
    the rows' 32-byte sectors while they are in the cache."""
    groups = tl.cdiv(E, GROUP)
    tile = tl.program_id(0) // groups
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    e = (tl.program_id(0) % groups) * GROUP + tl.arange(0, GROUP)
    valid = (t < T)[:, None] & (e < E)[None, :]
    x = to_float32(
        tl.load(scores_ptr + t.to(tl.int64)[:, None] * stride_t + e.to(tl.int64)[None, :] * stride_e, mask=valid)
    )
    # key >= lo compared as floats: lo's float ranks NaN alone above every float (x >= NaN is
    # false, so NaN is tested apart) and -0 as +0, as value_key does.
    lo = value_of(tl.load(lo_ptr + e, mask=e < E, other=0))
    chosen = valid & ((x >= lo[None, :]) | (x != x))
    bits = tl.where(chosen, (1 << (tl.arange(0, BLOCK_T) % 32))[:, None], 0)
    # Distinct bits: their sum is their or (bit 31 wraps to the sign, as it should).
    words = tl.sum(tl.reshape(bits, [BLOCK_T // 32, 32, GROUP]), axis=1)  # [BLOCK_T / 32, GROUP]
    w = tile * (BLOCK_T // 32) + tl.arange(0, BLOCK_T // 32)
    out = e.to(tl.int64)[None, :] * W + w[:, None]
    ok = (w < W)[:, None] & (e < E)[None, :]
    tl.store(words_ptr + out, words, mask=ok)
    tl.store(counts_ptr + out, _popcount(words).to(tl.int8), mask=ok)


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
    STEPS,  # ceil(log2(W + 1)): binary search steps
    BLOCK_C: tl.constexpr,
):
    """Grid (blocks of slots, E): a program a block of slots of one column. Slot i < min(count, C)
    finds the word holding the column's i-th set bit (a binary search of the running counts) and
    the bit in it, reads that token's score and writes value_key << 32 | (2^31 - 1 - token):
    distinct values, larger in the ranking order (equal scores: the lower token larger). Slots
    past the candidates get _EMPTY, below every candidate. Work a candidate, not an entry."""
    e = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row = e.to(tl.int64) * W
    lists = lists_ptr + e.to(tl.int64) * C + i
    n = tl.minimum(tl.load(prefix_ptr + row + W - 1), C)
    if tl.program_id(0) * BLOCK_C >= n:  # about half the blocks: the lists hold 2x the expected
        tl.store(lists, _EMPTY, mask=i < C)
        return
    active = i < n
    # The first word whose running count passes i.
    first = tl.zeros([BLOCK_C], tl.int32)
    last = tl.zeros([BLOCK_C], tl.int32) + W
    for _ in range(STEPS):
        mid = (first + last) // 2
        below = tl.load(prefix_ptr + row + mid, mask=active & (mid < W), other=2147483647) <= i
        first = tl.where(below, mid + 1, first)
        last = tl.where(below, last, mid)
    word = tl.load(words_ptr + row + first, mask=active, other=0).to(tl.uint32, bitcast=True)
    rank = i - tl.load(prefix_ptr + row + first - 1, mask=active & (first > 0), other=0)  # in the word
    # The rank-th set bit of the word: halve the window [bit, bit + 2 HALF) five times, moving up
    # past the lower half's set bits where the rank is beyond them.
    bit, rank = _halve(word, tl.zeros([BLOCK_C], tl.int32), rank, 16)
    bit, rank = _halve(word, bit, rank, 8)
    bit, rank = _halve(word, bit, rank, 4)
    bit, rank = _halve(word, bit, rank, 2)
    bit, _ = _halve(word, bit, rank, 1)
    t = first * 32 + bit
    x = tl.load(scores_ptr + t.to(tl.int64) * stride_t + e.to(tl.int64) * stride_e, mask=active)
    packed = (value_key(to_float32(x)).to(tl.int64) << 32) | (2147483647 - t).to(tl.int64)
    tl.store(lists, tl.where(active, packed, _EMPTY), mask=i < C)


@triton.jit
def _taken(lists_ptr, kth_ptr, count_ptr, C, M, BLOCK: tl.constexpr):
    """This program's block of column e's list (grid (blocks, E)): (e, the slots, their packed
    values, which are among the column's M best: at or above its M-th best value `kth`). A
    column with fewer than M candidates takes none (its group is redone); slots past the
    candidates are _EMPTY, and blocks past them are not read."""
    e = tl.program_id(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = tl.minimum(tl.load(count_ptr + e), C)
    live = (i < n) & (n >= M)
    v = tl.load(lists_ptr + e.to(tl.int64) * C + i, mask=live, other=_EMPTY)
    return e, i, v, live & (v >= tl.load(kth_ptr + e))


@triton.jit
def taken_counts_kernel(
    lists_ptr,  # [E, C] int64: gather_candidates_kernel's lists
    kth_ptr,  # [E] int64: each column's M-th best packed value in its list
    count_ptr,  # [E] int32: each column's candidates (may exceed C)
    taken_ptr,  # [E, B] int32 out: each block's taken slots
    C,
    M,
    B,  # blocks a column
    BLOCK: tl.constexpr,
):
    e, _i, _v, taken = _taken(lists_ptr, kth_ptr, count_ptr, C, M, BLOCK)
    tl.store(taken_ptr + e.to(tl.int64) * B + tl.program_id(0), tl.sum(taken.to(tl.int32), axis=0))


@triton.jit
def chosen_tokens_kernel(
    lists_ptr,  # [E, C] int64
    kth_ptr,  # [E] int64
    count_ptr,  # [E] int32
    before_ptr,  # [E, B] int32: the taken slots in the column's blocks before
    tokens_ptr,  # [E, M] int64 out: a column's M tokens, ascending (columns that take none untouched)
    mask_ptr,  # [T, E] bool: set at each taken (token, column)
    T,
    E,
    C,
    M,
    B,
    BLOCK: tl.constexpr,
):
    """The taken slots' tokens in list order (token order) into the column's row of tokens, and
    their mask entries: a column with M to C candidates takes exactly M, each written once."""
    e, _i, v, taken = _taken(lists_ptr, kth_ptr, count_ptr, C, M, BLOCK)
    t = 2147483647 - (v & 2147483647)
    flag = taken.to(tl.int32)
    place = tl.load(before_ptr + e.to(tl.int64) * B + tl.program_id(0)) + tl.cumsum(flag, axis=0) - flag
    ok = taken & (place < M) & (t < T)
    tl.store(tokens_ptr + e.to(tl.int64) * M + place, t, mask=ok)
    tl.store(mask_ptr + t * E + e, tl.full(t.shape, 1, tl.int1), mask=ok)


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
    columns = _WORD_BYTES // scores.element_size()  # a program's expert group
    chosen_words[(triton.cdiv(T, _WORDS_BLOCK_T) * triton.cdiv(E, columns),)](
        scores, lo_E, words_EW, counts_EW, T, E, W, scores.stride(0), scores.stride(1),
        BLOCK_T=_WORDS_BLOCK_T, GROUP=columns, num_warps=_WORDS_NUM_WARPS,
    )  # fmt: skip
    prefix_EW = running_sums.along_rows(counts_EW, bound=T * E)
    lists_EC = torch.empty((E, p.capacity), dtype=torch.int64, device=device)
    gather_candidates[(triton.cdiv(p.capacity, _BLOCK_C), E)](
        scores, words_EW, prefix_EW, lists_EC, T, E, W, scores.stride(0), scores.stride(1), p.capacity,
        W.bit_length(), BLOCK_C=_BLOCK_C, num_warps=_GATHER_NUM_WARPS,
    )  # fmt: skip
    count_E = prefix_EW[:, W - 1].contiguous()
    kth_E = torch.topk(lists_EC, m, dim=1, sorted=False).values.amin(dim=1)
    # The list is in token order, so its entries at or above the m-th best, in order, are the
    # column's tokens sorted: their places from the running count of those entries.
    B = triton.cdiv(p.capacity, _TAKE_BLOCK)
    taken_EB = torch.empty((E, B), dtype=torch.int32, device=device)
    args = (lists_EC, kth_E, count_E)
    taken_counts_kernel[(B, E)](*args, taken_EB, p.capacity, m, B, BLOCK=_TAKE_BLOCK, num_warps=_TAKE_NUM_WARPS)
    before_EB = running_sums.along_rows(taken_EB, bound=E * p.capacity) - taken_EB
    chosen_tokens_kernel[(B, E)](
        *args, before_EB, tokens, mask, T, E, p.capacity, m, B, BLOCK=_TAKE_BLOCK, num_warps=_TAKE_NUM_WARPS
    )
    ok = torch.ones(triton.cdiv(E, group) * group, dtype=torch.bool, device=device)
    ok[:E] = (count_E >= m) & (count_E <= p.capacity)
    return (~ok.view(-1, group).all(dim=1)).to(torch.int32)


def _aot(kernel, dt):
    if kernel is sample_keys_kernel:
        signature = {"scores_ptr": f"*{dt}", "keys_ptr": "*i32", "S": "i32", "E": "i32", "stride_s": "i64"}
        signature["stride_e"] = "i64"
        constexprs = {"BLOCK_S": _BLOCK_T, "GROUP": _GROUP}
    elif kernel is chosen_words_kernel:
        signature = {"scores_ptr": f"*{dt}", "lo_ptr": "*i32", "words_ptr": "*i32", "counts_ptr": "*i8"}
        signature.update({"T": "i32", "E": "i32", "W": "i32", "stride_t": "i64", "stride_e": "i64"})
        constexprs = {"BLOCK_T": _WORDS_BLOCK_T, "GROUP": _WORD_BYTES // (4 if dt == "fp32" else 2)}
    elif kernel in (taken_counts_kernel, chosen_tokens_kernel):
        signature = {"lists_ptr": "*i64", "kth_ptr": "*i64", "count_ptr": "*i32"}
        if kernel is taken_counts_kernel:
            signature.update({"taken_ptr": "*i32", "C": "i32", "M": "i32", "B": "i32"})
        else:
            signature.update({"before_ptr": "*i32", "tokens_ptr": "*i64", "mask_ptr": "*i1"})
            signature.update({"T": "i32", "E": "i32", "C": "i32", "M": "i32", "B": "i32"})
        constexprs = {"BLOCK": _TAKE_BLOCK}
    else:
        signature = {"scores_ptr": f"*{dt}", "words_ptr": "*i32", "prefix_ptr": "*i32", "lists_ptr": "*i64"}
        signature.update({"T": "i32", "E": "i32", "W": "i32", "stride_t": "i64", "stride_e": "i64", "C": "i32"})
        signature["STEPS"] = "i32"
        constexprs = {"BLOCK_C": _BLOCK_C}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    warps = {
        sample_keys_kernel: _NUM_WARPS,
        chosen_words_kernel: _WORDS_NUM_WARPS,
        taken_counts_kernel: _TAKE_NUM_WARPS,
        chosen_tokens_kernel: _TAKE_NUM_WARPS,
    }.get(kernel, _GATHER_NUM_WARPS)
    return kernel, signature, constexprs, {"num_warps": warps}


AOT_KERNELS = [
    _aot(sample_keys_kernel, "bf16"),
    _aot(chosen_words_kernel, "bf16"),
    _aot(chosen_words_kernel, "fp32"),
    _aot(chosen_words_kernel, "fp16"),
    _aot(gather_candidates_kernel, "bf16"),
    _aot(gather_candidates_kernel, "fp16"),
    _aot(taken_counts_kernel, None),
    _aot(chosen_tokens_kernel, None),
]
