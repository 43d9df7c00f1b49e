"""topk_router in Triton: a tile of rows per program, whole rows in registers. Scores, choice
values, the groups' scores and the eligible groups, then k rounds of a row max over unique
(value, index) keys (where the index takes a value key's low bits, checked, and near ties ranked
again exactly), so ties and NaN behave exactly as in the reference. float32 compute."""

import torch
import triton
import triton.language as tl

from moe_kernels import reference
from moe_kernels.triton.common import (
    GATHERS_LAST_AXIS_FIRST,
    NO_KEY,
    NO_PAIR,
    on_tensor_device,
    packed_index,
    packed_key,
    packed_value,
    rank_pair,
    row_tile_config,
    sigmoid_accurate,
    take_best_key,
    take_best_ranked,
    to_float32,
    value_at,
    value_key,
    value_of,
)

MAX_EXPERTS = 2048
assert MAX_EXPERTS <= 65536, "packed_key holds an expert index in 16 bits"
MAX_GROUPS = 64
_TILE = 1024  # values per program when E is small
_PER_THREAD = 8


def supports(num_experts: int, num_groups: int) -> bool:
    """Whether the kernel takes this size; past it moe_kernels.ops.topk_router asks
    backends.fallback (the CUDA kernel, else the reference) and the raw op raises."""
    return num_experts <= MAX_EXPERTS and num_groups <= MAX_GROUPS


@triton.jit
def logits_raw_tile(
    logits_ptr, tile, T, E, stride_t, stride_e, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ROW_VECTOR: tl.constexpr, ALIGNED_ROWS: tl.constexpr,
):  # fmt: skip
    """Row tile `tile` (rows tile * BLOCK_T on) of the [T, E] logits (any strides), [BLOCK_T,
    BLOCK_E] in their own dtype, padding -inf: (rows, cols, rows below T, entries in range, the
    tile). T may be less than the logits' rows (a prefetch past a program's tiles loads none of
    them: multi_tile). ROW_VECTOR: the
    contiguous entries a thread loads at once (row_vector), which sets how many threads share a
    row, and so how the row reductions run. ALIGNED_ROWS: stride_t and E are multiples of
    ROW_VECTOR (the launcher checks), so each row starts a vector and the mask is whole vectors: a
    launch tells Triton only of values divisible by 16, and Mixtral's rows of 8 bf16 were read 2
    bytes at a time (sm_90 SASS: 29 warp instructions a row against 9)."""
    rows, cols, row_ok, valid = tile_indices(tile, T, E, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS)
    row_start = rows[:, None].to(tl.int64) * stride_t
    if ALIGNED_ROWS:
        # The same offsets, as a product with ROW_VECTOR: the compiler's alignment analysis sees it.
        row_start = rows[:, None].to(tl.int64) * (stride_t // ROW_VECTOR) * ROW_VECTOR
    ptrs = logits_ptr + row_start + cols[None, :].to(tl.int64) * stride_e
    return rows, cols, row_ok, valid, tl.load(ptrs, mask=valid, other=float("-inf"))


@triton.jit
def tile_indices(
    tile, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ROW_VECTOR: tl.constexpr, ALIGNED_ROWS: tl.constexpr
):  # fmt: skip
    """Row tile `tile`'s (rows, cols, rows below T, entries in range) as logits_raw_tile lays them
    out (ALIGNED_ROWS: the mask constant over each thread's vector)."""
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.max_contiguous(tl.arange(0, BLOCK_E), ROW_VECTOR)
    col_ok = cols[None, :] < E
    if ALIGNED_ROWS:
        col_ok = tl.max_constancy(col_ok, [1, ROW_VECTOR])
    row_ok = rows < T
    return rows, cols, row_ok, row_ok[:, None] & col_ok


@triton.jit
def bias_tile(bias_ptr, rows, cols, E, ROW_VECTOR: tl.constexpr):
    """The [E] float32 bias as a [BLOCK_T, BLOCK_E] tile in the logits tile's layout (each row
    reads it again, from cache: ROW_VECTOR entries a thread, as its logits). Loaded as [BLOCK_E]
    and broadcast, it came in a layout of its own and went through shared memory to the tile's,
    behind three barriers."""
    offsets = tl.max_contiguous(cols[None, :] + 0 * rows[:, None], [1, ROW_VECTOR])
    return tl.load(bias_ptr + offsets, mask=(cols < E)[None, :] & (rows >= 0)[:, None], other=0.0)


@triton.jit
def softmax_terms(x, valid, vmax):
    """(exp(x - max) over a [BLOCK_T, BLOCK_E] float32 tile, 0 off `valid` and on all -inf rows;
    their row sums; whether each row is all -inf) from the row max `vmax` [BLOCK_T] (NaN where
    the row holds one)."""
    masked_row = vmax == float("-inf")
    terms = tl.where(valid & ~masked_row[:, None], tl.exp(x - vmax[:, None]), 0.0)
    return terms, tl.sum(terms, axis=1), masked_row


@triton.jit
def softmax_parts(x, valid, cols):
    """The softmax of each row of a [BLOCK_T, BLOCK_E] float32 tile (`valid`: the real entries;
    padding loaded as -inf; padded rows get NaN scores, never stored): (scores, the row max, the
    row sum of exp(x - max), whether the row is all -inf). The max is taken by rank (NaN first,
    so a NaN row is all NaN as torch's); an all -inf row gets scores 0, as the reference's
    router_scores. A single score is softmax_score(x_e, max, sum, masked), bit for bit the tile's."""
    vmax = value_of(tl.max(tl.where(valid, value_key(x), NO_KEY), axis=1))
    terms, denom, masked_row = softmax_terms(x, valid, vmax)
    return tl.where(masked_row[:, None], 0.0, terms / denom[:, None]), vmax, denom, masked_row


@triton.jit
def softmax_score(x, vmax, denom, masked_row):
    """One score per row from its logit x [BLOCK_T] and softmax_parts's row values."""
    return tl.where(masked_row, 0.0, tl.exp(x - vmax) / denom)


@triton.jit
def pick_term(x, vmax):
    """exp(x - max) of picked logits x (float32) given their row's max: a renormalised softmax
    weight over the picks' sum. An all -inf row's picks get 0 (the reference's masked row), not
    exp(-inf + inf); a NaN max gives NaN."""
    return tl.where(vmax == float("-inf"), 0.0, tl.exp(x - vmax))


@triton.jit
def choice_tile(tile, T, K, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, CHOICE_ROWS: tl.constexpr = False):
    """Row tile `tile`'s [T, K] choices as a [BLOCK_K, BLOCK_T] tile: (the rows, int64
    [1, BLOCK_T]; the choice indices [BLOCK_K, 1]; which are in range). Choice-major, so the
    compiler gives the tile a layout of its own (about a choice a thread): laid out as the row
    tile, each thread would hold, and compute, every choice of its row. CHOICE_ROWS: the
    [BLOCK_T, BLOCK_K] tile instead (rows [BLOCK_T, 1], choices [1, BLOCK_K]; choice_rows)."""
    if CHOICE_ROWS:
        kcols = tl.arange(0, BLOCK_K)[None, :]
        rows_k = tile * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    else:
        kcols = tl.arange(0, BLOCK_K)[:, None]
        rows_k = tile * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    return rows_k.to(tl.int64), kcols, (rows_k < T) & (kcols < K)


@triton.jit
def pick_logit(keys, cols, PACKED: tl.constexpr, dtype: tl.constexpr, BLOCK_E: tl.constexpr):
    """One round where the keys rank the logits themselves: (the index, the logit, the keys with
    it retired). PACKED: packed_key of 16-bit logits (one row reduction); else value_key."""
    if PACKED:
        best = tl.max(keys, axis=1)
        return packed_index(best), packed_value(best, dtype), tl.where(keys == best[:, None], NO_KEY, keys)
    else:
        best, idx, rest = take_best_key(keys, cols, BLOCK_E)
        return idx, value_of(best), rest


@triton.jit
def _exchange(a, b):
    """A comparator of a sorting network: (the larger, the smaller) of two key tensors."""
    return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def _sorted4(k0, k1, k2, k3):
    """Four key tensors sorted elementwise, largest first (five comparators)."""
    k0, k1 = _exchange(k0, k1)
    k2, k3 = _exchange(k2, k3)
    k0, k2 = _exchange(k0, k2)
    k1, k3 = _exchange(k1, k3)
    k1, k2 = _exchange(k1, k2)
    return k0, k1, k2, k3


@triton.jit
def _sorted8(k0, k1, k2, k3, k4, k5, k6, k7):
    """Eight key tensors sorted elementwise, largest first: Batcher's odd-even merge of two sorted
    fours (19 comparators)."""
    k0, k1, k2, k3 = _sorted4(k0, k1, k2, k3)
    k4, k5, k6, k7 = _sorted4(k4, k5, k6, k7)
    k0, k4 = _exchange(k0, k4)
    k1, k5 = _exchange(k1, k5)
    k2, k6 = _exchange(k2, k6)
    k3, k7 = _exchange(k3, k7)
    k2, k4 = _exchange(k2, k4)
    k3, k5 = _exchange(k3, k5)
    k1, k2 = _exchange(k1, k2)
    k3, k4 = _exchange(k3, k4)
    k5, k6 = _exchange(k5, k6)
    return k0, k1, k2, k3, k4, k5, k6, k7


@triton.jit
def sorted_runs(keys, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ROW_VECTOR: tl.constexpr):
    """The ROW_VECTOR keys each thread holds of a [BLOCK_T, BLOCK_E] tile (its run: 1, 2, 4 or 8
    contiguous entries, as loaded), sorted in the thread, largest first: a tuple of ROW_VECTOR
    [BLOCK_T, BLOCK_E // ROW_VECTOR] tensors, one entry a thread (tl.split: register moves). The
    largest key of a row is then the row max of the runs' heads."""
    if ROW_VECTOR == 8:
        even, odd = tl.split(tl.reshape(keys, (BLOCK_T, BLOCK_E // 8, 2, 2, 2)))
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        k0, k1 = tl.split(e0)
        k2, k3 = tl.split(e1)
        k4, k5 = tl.split(o0)
        k6, k7 = tl.split(o1)
        return _sorted8(k0, k1, k2, k3, k4, k5, k6, k7)
    elif ROW_VECTOR == 4:
        even, odd = tl.split(tl.reshape(keys, (BLOCK_T, BLOCK_E // 4, 2, 2)))
        k0, k1 = tl.split(even)
        k2, k3 = tl.split(odd)
        return _sorted4(k0, k1, k2, k3)
    elif ROW_VECTOR == 2:
        k0, k1 = tl.split(tl.reshape(keys, (BLOCK_T, BLOCK_E // 2, 2)))
        return _exchange(k0, k1)
    else:
        return (keys,)


@triton.jit
def _shifted(run, hit, ROW_VECTOR: tl.constexpr):
    """The run with its head taken where `hit`: the rest move up, NO_KEY comes in last."""
    if ROW_VECTOR == 8:
        return (
            tl.where(hit, run[1], run[0]),
            tl.where(hit, run[2], run[1]),
            tl.where(hit, run[3], run[2]),
            tl.where(hit, run[4], run[3]),
            tl.where(hit, run[5], run[4]),
            tl.where(hit, run[6], run[5]),
            tl.where(hit, run[7], run[6]),
            tl.where(hit, NO_KEY, run[7]),
        )
    elif ROW_VECTOR == 4:
        return (
            tl.where(hit, run[1], run[0]),
            tl.where(hit, run[2], run[1]),
            tl.where(hit, run[3], run[2]),
            tl.where(hit, NO_KEY, run[3]),
        )
    elif ROW_VECTOR == 2:
        return tl.where(hit, run[1], run[0]), tl.where(hit, NO_KEY, run[1])
    else:
        return (tl.where(hit, NO_KEY, run[0]),)


@triton.jit
def take_head(run, ROW_VECTOR: tl.constexpr):
    """One round over sorted_runs of unique keys: (the row's largest key [BLOCK_T], the runs with
    it taken). The row max of the heads, then the one thread holding it moves its run up: a
    compare and ROW_VECTOR selects an entry a thread, where a max over the thread's entries and a
    retire of the pick (a compare and a select each) took three a key."""
    best = tl.max(run[0], axis=1)
    return best, _shifted(run, run[0] == best[:, None], ROW_VECTOR)


@triton.jit
def store_pick(experts_ptr, rows, row_ok, K, s, index, LANES: tl.constexpr):
    """A row's pick s, `index` [BLOCK_T] (int32), at experts[row, s] (int64), stored by the first
    of the row's LANES threads: a [BLOCK_T, LANES] tile in the runs' layout, where a [BLOCK_T]
    store went through shared memory to a layout of its own (a barrier each pick). The tile's
    addresses run on along its lanes (lane 0's is the pick's; the others are masked off): with
    one address a row, triton 3.6 laid the store out column-major and took it through shared
    memory behind two barriers a pick (Qwen3-MoE's forward: 16 barriers a program, 190 warp
    instructions a row at sm_90 against 182 now; triton 3.7 kept the runs' layout either way, and
    there the running addresses cost about 4 instructions a row with K at run time, as launched)."""
    lane = tl.arange(0, LANES)[None, :]
    ptrs = experts_ptr + (rows.to(tl.int64) * K + s)[:, None] + lane
    values = tl.broadcast_to(index.to(tl.int64)[:, None], (index.shape[0], LANES))
    tl.store(ptrs, values, mask=row_ok[:, None] & (lane == 0))


@triton.jit
def index_packed_keys(keys, cols, INDEX_BITS: tl.constexpr):
    """value_key keys [BLOCK_T, BLOCK_E] with their lowest INDEX_BITS bits (BLOCK_E = 2^INDEX_BITS)
    replaced by the complement of the index: unique in a row, and ordered as rank_pair orders the
    values wherever the keys' upper bits differ. NO_KEY becomes a key below NO_KEY + BLOCK_E."""
    LOW: tl.constexpr = (1 << INDEX_BITS) - 1
    return (keys & ~LOW) | (LOW - cols)[None, :]


@triton.jit
def packed_rounds(
    keys, cols, rows, row_ok, experts_ptr, K, INDEX_BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, ROW_VECTOR: tl.constexpr,
):  # fmt: skip
    """The K rounds over value keys [BLOCK_T, BLOCK_E] (value_key, NO_KEY where none) on
    index_packed_keys in sorted_runs, each pick's index stored (store_pick): [BLOCK_T] int32, 1
    where the picks may rank unlike the value keys. Packed keys order two keys as the value keys
    do unless their upper bits agree; if the upper bits of the K + 1 best packed keys differ from
    round to round, no other key shares them, so the K best, in order, are the value keys' (the
    C++ kernel's register selection checks its 28-bit keys so). Where two agree (ties, and values
    within 2^INDEX_BITS key steps), the row is flagged and the caller ranks the value keys
    instead. A row with fewer than K + 1 keys above NO_KEY (rows past T, a raw call past the
    eligible experts) ends in NO_KEY's upper bits twice: flagged, and its picks past its keys are
    padding or NO_KEY's index."""
    LOW: tl.constexpr = (1 << INDEX_BITS) - 1
    run = sorted_runs(index_packed_keys(keys, cols, INDEX_BITS), BLOCK_T, BLOCK_E, ROW_VECTOR)
    previous, run = take_head(run, ROW_VECTOR)
    store_pick(experts_ptr, rows, row_ok, K, 0, LOW - (previous & LOW), BLOCK_E // ROW_VECTOR)
    # The upper bits fall from round to round (the packed keys are unique): the least step is 0
    # where two agree.
    least_step = tl.full((BLOCK_T,), 1, tl.int32)
    for s in range(1, K):
        best, run = take_head(run, ROW_VECTOR)
        least_step = tl.minimum(least_step, (previous >> INDEX_BITS) - (best >> INDEX_BITS))
        previous = best
        store_pick(experts_ptr, rows, row_ok, K, s, LOW - (best & LOW), BLOCK_E // ROW_VECTOR)
    # The (K + 1)-th key, below every pick. In a row of K real keys a padded one: NO_KEY, whose
    # upper bits no real key shares, or -inf for logits ranked by themselves, which agrees only
    # with a -inf pick: an exact tie the index orders, kept by the caller's low-bits check.
    best = tl.max(run[0], axis=1)
    least_step = tl.minimum(least_step, (previous >> INDEX_BITS) - (best >> INDEX_BITS))
    return (least_step == 0).to(tl.int32)


@triton.jit
def rank_value_keys(
    keys, cols, rows, row_ok, experts_ptr, K, INDEX_BITS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, ROW_VECTOR: tl.constexpr, NEAR_TIES: tl.constexpr,
):  # fmt: skip
    """The K picks of value keys [BLOCK_T, BLOCK_E] (ties to the lower index), each one's index
    stored at experts[row, s]. By packed_rounds (one row reduction a round), and where a row of
    this program's is flagged (near ties), the program's rounds again by take_best_key (two a
    round), exactly, over the same slots. NEAR_TIES=False puts a barrier in that pass's place:
    only for bench/triton_sass.py's count of the path a program without near ties runs (a static
    count takes both sides of a branch; the barrier keeps the flags and the branch, one
    instruction more)."""
    flagged = packed_rounds(keys, cols, rows, row_ok, experts_ptr, K, INDEX_BITS, BLOCK_T, BLOCK_E, ROW_VECTOR)
    if tl.max(flagged, axis=0) != 0:
        if NEAR_TIES:
            # A row whose values' lowest INDEX_BITS bits are 0 (float32 holding bfloat16 or
            # float16 values, +-inf; NO_KEY aside) loses nothing to the packing: its keys agree in
            # the upper bits only where they are equal, which the packed keys already order by
            # index. Only rows with finer values need the exact rounds. key ^ (key >> 31) is the
            # value's bits (the sign flipped for a negative one).
            LOW: tl.constexpr = (1 << INDEX_BITS) - 1
            low_bits = tl.where(keys == NO_KEY, 0, (keys ^ (keys >> 31)) & LOW)
            fine = tl.max(low_bits, axis=1) != 0
            if tl.max(flagged * fine.to(tl.int32), axis=0) != 0:
                for s in range(0, K):
                    _best, index, keys = take_best_key(keys, cols, BLOCK_E)
                    store_pick(experts_ptr, rows, row_ok, K, s, index, BLOCK_E // ROW_VECTOR)
        else:
            tl.debug_barrier()


@triton.jit
def _top_two(first_a, second_a, first_b, second_b):
    """Combines two (largest, next) pairs of keys: the largest of the four, and the next (the
    same key where it is held twice; NO_KEY where there is none)."""
    return tl.maximum(first_a, first_b), tl.maximum(tl.minimum(first_a, first_b), tl.maximum(second_a, second_b))


@triton.jit
def group_limit_reshaped(
    keys, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, GROUP_MAX: tl.constexpr,
):  # fmt: skip
    """The group limit on value keys [BLOCK_T, BLOCK_E] where E == BLOCK_E (so the groups are
    whole power-of-two slices): each group's score from its own slice of a [BLOCK_T, NUM_GROUPS,
    width] view (its largest key, and the next: the same key if it is held twice), the
    TOPK_GROUPS best groups by rank (ties to the lower group); the others' keys become NO_KEY.
    A group is eligible where fewer than TOPK_GROUPS groups outrank it: one [rows, groups,
    groups] comparison, where TOPK_GROUPS rounds of a row max and the lowest index holding it
    took twice the instructions (DeepSeek-V3 656 -> 636 warp instructions a row, sm_90)."""
    WIDTH: tl.constexpr = BLOCK_E // NUM_GROUPS
    keys3 = tl.reshape(keys, (BLOCK_T, NUM_GROUPS, WIDTH))
    if GROUP_MAX:
        gscores = value_of(tl.max(keys3, axis=2))
    else:
        # One reduction of (largest, next) pairs, where a count of the largest and a masked max
        # were three reductions over the slice.
        first, second = tl.reduce((keys3, tl.full(keys3.shape, NO_KEY, tl.int32)), 2, _top_two)
        gscores = value_of(first) + value_of(second)
    gcols = tl.arange(0, NUM_GROUPS)
    gkeys = value_key(gscores)
    mine = gkeys[:, :, None]
    other = gkeys[:, None, :]
    # Group h outranks group g: a larger key, or the same at a lower index.
    outranked = (other > mine) | ((other == mine) & (gcols[None, None, :] < gcols[None, :, None]))
    eligible = tl.sum(outranked.to(tl.int32), axis=2) < TOPK_GROUPS
    keys3 = tl.where(eligible[:, :, None], keys3, NO_KEY)
    return tl.reshape(keys3, (BLOCK_T, BLOCK_E))


@triton.jit
def group_limit_loop(
    key, keys, valid, rows, cols, E, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_MAX: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """group_limit_reshaped for any E: each group's score by a row reduction over its masked
    row, group after group; float32 choice values `key`, their value keys `keys`."""
    pairs = tl.where(valid, rank_pair(key, cols), NO_PAIR)
    group = cols // (E // NUM_GROUPS)
    gcols = tl.arange(0, BLOCK_G)
    gscores = tl.full((rows.shape[0], BLOCK_G), float("-inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        in_group = (group == g)[None, :]
        _b, _i, first, rest = take_best_ranked(tl.where(in_group, pairs, NO_PAIR), cols)
        score = first
        if not GROUP_MAX:
            _b, _i, second, _r = take_best_ranked(rest, cols)
            score = first + second
        gscores = tl.where(gcols[None, :] == g, score[:, None], gscores)
    gkeys = tl.where(gcols[None, :] < NUM_GROUPS, value_key(gscores), NO_KEY)
    eligible = (rows[:, None] < 0) & (cols[None, :] < 0)  # all False
    for _ in tl.static_range(TOPK_GROUPS):
        _best, chosen, gkeys = take_best_key(gkeys, gcols, BLOCK_G)
        eligible = eligible | (group[None, :] == chosen[:, None])
    return tl.where(eligible, keys, NO_KEY)


@triton.jit
def route_tile(
    logits_ptr, bias_ptr, weights_ptr, experts_ptr, T, E, stride_t, stride_e, K, scaling,
    tile, rows, cols, row_ok, valid, raw,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_MAX: tl.constexpr, GROUPS_RESHAPED: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, ROW_VECTOR: tl.constexpr,
    ALIGNED_ROWS: tl.constexpr, SORTED_RUNS: tl.constexpr, INDEX_BITS: tl.constexpr, NEAR_TIES: tl.constexpr,
    CHOICE_ROWS: tl.constexpr,
):  # fmt: skip
    """Row tile `tile`'s picks and weights stored, from its logits as logits_raw_tile gave them
    (rows, cols, row_ok, valid, raw); the arguments as topk_router_kernel's."""
    x = to_float32(raw)
    GROUPED: tl.constexpr = TOPK_GROUPS < NUM_GROUPS
    # No bias and no group limit: the logits themselves rank the experts (exact), each pick's
    # score follows from its logit, decoded from its key.
    RANKS_LOGITS: tl.constexpr = not (HAS_BIAS or GROUPED)
    dtype: tl.constexpr = logits_ptr.dtype.element_ty
    PACKED: tl.constexpr = RANKS_LOGITS and dtype.primitive_bitwidth == 16
    # A renormalised softmax of the logits needs no row sum: it cancels in the weights, which are
    # then each pick's exp(x - max) over their sum (a few ulps from the reference's two divisions,
    # as every backend's tolerance allows).
    PICKS_ONLY: tl.constexpr = RANKS_LOGITS and not SIGMOID and RENORMALIZE

    if RANKS_LOGITS:
        # Entries outside the row were loaded as -inf: their keys rank below every entry of the
        # row with the same value (a higher index), so they are never among its k <= E picks,
        # and need no mask to NO_KEY (rows past T are never stored).
        if PACKED:
            keys = packed_key(raw, x, cols)
        else:
            keys = value_key(x)
    else:
        if SIGMOID:
            scores = tl.where(valid, sigmoid_accurate(x), 0.0)
        else:
            scores, vmax, denom, masked_row = softmax_parts(x, valid, cols)
        key = scores
        if HAS_BIAS:
            key = key + bias_tile(bias_ptr, rows, cols, E, ROW_VECTOR)
        keys = tl.where(valid, value_key(key), NO_KEY)
        if GROUPED:
            if GROUPS_RESHAPED:
                keys = group_limit_reshaped(keys, BLOCK_T, BLOCK_E, NUM_GROUPS, TOPK_GROUPS, GROUP_MAX)
            else:
                keys = group_limit_loop(key, keys, valid, rows, cols, E, NUM_GROUPS, TOPK_GROUPS, GROUP_MAX, BLOCK_G)

    if SORTED_RUNS:
        # Each round stores its pick's expert (store_pick) and computes no score: the keys are
        # sorted in each thread's run once (sorted_runs), a round is the row max of the runs'
        # heads. The experts are read back (after a barrier: this program's own stores) as a
        # [BLOCK_K, BLOCK_T] choice tile ([BLOCK_T, BLOCK_K] where CHOICE_ROWS), in whose own
        # layout (about a choice a thread) each pick's score and weight are computed once and
        # stored.
        LANES: tl.constexpr = BLOCK_E // ROW_VECTOR
        if PACKED:
            run = sorted_runs(keys, BLOCK_T, BLOCK_E, ROW_VECTOR)
            # The first pick is the row's max (NaN first): the softmax's shift.
            best, run = take_head(run, ROW_VECTOR)
            vmax = packed_value(best, dtype)
            store_pick(experts_ptr, rows, row_ok, K, 0, packed_index(best), LANES)
            for s in range(1, K):
                best, run = take_head(run, ROW_VECTOR)
                store_pick(experts_ptr, rows, row_ok, K, s, packed_index(best), LANES)
        else:
            if RANKS_LOGITS and not SIGMOID and not PICKS_ONLY:
                # The row's max (NaN first): the softmax's shift.
                vmax = value_of(tl.max(keys, axis=1))
            rank_value_keys(
                keys, cols, rows, row_ok, experts_ptr, K, INDEX_BITS, BLOCK_T, BLOCK_E, ROW_VECTOR, NEAR_TIES
            )
        if RANKS_LOGITS and not SIGMOID and not PICKS_ONLY:
            _terms, denom, masked_row = softmax_terms(x, valid, vmax)
        tl.debug_barrier()
        rows_k64, kcols, choice_ok = choice_tile(tile, T, K, BLOCK_T, BLOCK_K, CHOICE_ROWS)
        PICKS: tl.constexpr = 1 if CHOICE_ROWS else 0  # the tile's axis of a row's picks
        out_k = rows_k64 * K + kcols
        e_k = tl.load(experts_ptr + out_k, mask=choice_ok, other=0)
        # Every slot was stored above, but a raw call past the eligible experts (the op refuses
        # one) gets padding's or NO_KEY's index there: never read outside the row for them.
        inside = choice_ok & (e_k >= 0) & (e_k < E)
        logit_k = tl.load(logits_ptr + rows_k64 * stride_t + e_k * stride_e, mask=inside, other=float("-inf"))
        x_k = to_float32(logit_k)
        # The tile's own score functions, so each pick's score is the tile's, bit for bit.
        if SIGMOID:
            p_k = sigmoid_accurate(x_k)
        elif PICKS_ONLY:
            # The max: the first pick's logit (NaN first).
            shift = tl.sum(tl.where(kcols == 0, x_k, 0.0), axis=PICKS)
            p_k = pick_term(x_k, tl.expand_dims(shift, PICKS))
        else:
            # softmax_score's exp(x - max) / denom, its all -inf rows' 0 by a shift and divisor
            # that make it so (exp(-inf) / 1), not a mask kept across the barrier.
            shift = tl.where(masked_row, 0.0, vmax)
            divisor = tl.where(masked_row, 1.0, denom)
            p_k = tl.exp(x_k - tl.expand_dims(shift, PICKS)) / tl.expand_dims(divisor, PICKS)
        p_k = tl.where(choice_ok, p_k, 0.0)
        if RENORMALIZE:
            # The picks' sum in the choice tile's reduction order, not in pick order: the weights
            # may differ from the [rows, k] recording's in the last bit, within every backend's
            # tolerance.
            total = tl.sum(p_k, axis=PICKS)
            safe = tl.where(total == 0, 1.0, total)
            weights_k = tl.where(
                tl.expand_dims(total, PICKS) == 0, 0.0, tl.div_rn(p_k, tl.expand_dims(safe, PICKS)) * scaling
            )
        else:
            weights_k = p_k * scaling
        tl.store(weights_ptr + out_k, weights_k, mask=choice_ok)
    else:
        # The rounds record each pick into a [BLOCK_T, BLOCK_K] tile; the weights are
        # renormalised and stored once.
        kcols = tl.arange(0, BLOCK_K)
        picked_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        picked_e = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
        total = tl.zeros((BLOCK_T,), tl.float32)
        if RANKS_LOGITS:
            # The first pick is the row's max (NaN first): the softmax's shift.
            idx, logit, keys = pick_logit(keys, cols, PACKED, dtype, BLOCK_E)
            if SIGMOID:
                w = sigmoid_accurate(logit)
            elif PICKS_ONLY:
                vmax = logit
                w = pick_term(logit, vmax)
            else:
                vmax = logit
                _terms, denom, masked_row = softmax_terms(x, valid, vmax)
                w = softmax_score(logit, vmax, denom, masked_row)
            picked_w = tl.where(kcols[None, :] == 0, w[:, None], picked_w)
            picked_e = tl.where(kcols[None, :] == 0, idx[:, None], picked_e)
            total += w
            for s in range(1, K):
                idx, logit, keys = pick_logit(keys, cols, PACKED, dtype, BLOCK_E)
                if SIGMOID:
                    w = sigmoid_accurate(logit)
                elif PICKS_ONLY:
                    w = pick_term(logit, vmax)
                else:
                    w = softmax_score(logit, vmax, denom, masked_row)
                here = kcols[None, :] == s
                picked_w = tl.where(here, w[:, None], picked_w)
                picked_e = tl.where(here, idx[:, None], picked_e)
                total += w
        else:
            for s in range(0, K):
                _best, idx, keys = take_best_key(keys, cols, BLOCK_E)
                w = value_at(scores, cols, idx)
                here = kcols[None, :] == s
                picked_w = tl.where(here, w[:, None], picked_w)
                picked_e = tl.where(here, idx[:, None], picked_e)
                total += w
        if not RENORMALIZE:
            total = tl.full((BLOCK_T,), 1.0, tl.float32)
        # w / total rounded once (IEEE), then the scaling: the reference's order. `/` in Triton is
        # the approximate div.full.f32 on a GPU, and w * (1 / total) is not w / total either: with
        # k = 1 both missed 1.0 for some rows, which broke ties by weight (Megatron's "probs" drop).
        safe = tl.where(total == 0, 1.0, total)
        weights = tl.where(total[:, None] == 0, 0.0, tl.div_rn(picked_w, safe[:, None]) * scaling)
        out = rows[:, None].to(tl.int64) * K + kcols[None, :]
        tile_ok = row_ok[:, None] & (kcols[None, :] < K)
        tl.store(experts_ptr + out, picked_e.to(tl.int64), mask=tile_ok)
        tl.store(weights_ptr + out, weights, mask=tile_ok)


@triton.jit
def topk_router_kernel(
    logits_ptr,  # [T, E] fp32/fp16/bf16, any strides
    bias_ptr,  # [E] float32 contiguous (read only if HAS_BIAS)
    weights_ptr,  # [T, K] float32 contiguous
    experts_ptr,  # [T, K] int64 contiguous
    T,  # tokens
    E,  # experts
    stride_t,  # elements between consecutive tokens of logits
    stride_e,  # elements between consecutive experts of logits
    K,  # experts per token
    scaling,  # multiplies the weights last
    SIGMOID: tl.constexpr,  # scores = sigmoid(logits) (True) or softmax over the row (False)
    HAS_BIAS: tl.constexpr,  # choice = scores + bias
    NUM_GROUPS: tl.constexpr,  # contiguous groups of E / NUM_GROUPS experts
    TOPK_GROUPS: tl.constexpr,  # eligible groups (== NUM_GROUPS: no group limit)
    GROUP_MAX: tl.constexpr,  # a group's score: its max (True) or its top-2 sum (False)
    GROUPS_RESHAPED: tl.constexpr,  # E == BLOCK_E: the group limit on a [rows, groups, width] view
    RENORMALIZE: tl.constexpr,  # divide the selected scores by their sum
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # next power of two >= E
    BLOCK_G: tl.constexpr,  # next power of two >= NUM_GROUPS
    BLOCK_K: tl.constexpr,  # next power of two >= K
    ROW_VECTOR: tl.constexpr,  # row_vector(E, dtype)
    ALIGNED_ROWS: tl.constexpr,  # stride_t and E multiples of ROW_VECTOR
    SORTED_RUNS: tl.constexpr,  # rounds over sorted runs, picks stored in their round (uses_sorted_runs)
    INDEX_BITS: tl.constexpr,  # log2(BLOCK_E)
    NEAR_TIES: tl.constexpr,  # True (rank_value_keys: False only for a static count)
    CHOICE_ROWS: tl.constexpr,  # the sorted runs' choice tile as [rows, k] (choice_rows), else [k, rows]
    TILES: tl.constexpr,  # row tiles a program, each one's logits loaded during the one before (multi_tile)
):
    first = tl.program_id(0) * TILES
    rows, cols, row_ok, valid, raw = logits_raw_tile(
        logits_ptr, first, T, E, stride_t, stride_e, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS
    )
    if TILES == 1:
        route_tile(
            logits_ptr, bias_ptr, weights_ptr, experts_ptr, T, E, stride_t, stride_e, K, scaling,
            first, rows, cols, row_ok, valid, raw,
            SIGMOID, HAS_BIAS, NUM_GROUPS, TOPK_GROUPS, GROUP_MAX, GROUPS_RESHAPED, RENORMALIZE, BLOCK_T,
            BLOCK_E, BLOCK_G, BLOCK_K, ROW_VECTOR, ALIGNED_ROWS, SORTED_RUNS, INDEX_BITS, NEAR_TIES, CHOICE_ROWS,
        )  # fmt: skip
    else:
        # Each tile's logits are loaded before the rounds of the tile before it, so that their
        # memory latency overlaps those rounds rather than stalling the program. The rows end at
        # the program's last tile (int64: (first + TILES) * BLOCK_T may pass 2^31): the load after
        # it reads nothing. The last program runs only the tiles that hold rows.
        end = tl.minimum(T, (first + TILES).to(tl.int64) * BLOCK_T)
        for t in range(0, tl.minimum(TILES, tl.cdiv(T, BLOCK_T) - first)):
            tile = first + t
            _rows, _cols, _row_ok, _valid, raw_n = logits_raw_tile(
                logits_ptr, tile + 1, end, E, stride_t, stride_e, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS
            )
            # Only the loaded tile is carried to the next trip; its rows and masks are recomputed
            # (for rows below T): carried, they took more registers (Mixtral 32 -> 38).
            rows, cols, row_ok, valid = tile_indices(tile, T, E, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS)
            route_tile(
                logits_ptr, bias_ptr, weights_ptr, experts_ptr, T, E, stride_t, stride_e, K, scaling,
                tile, rows, cols, row_ok, valid, raw,
                SIGMOID, HAS_BIAS, NUM_GROUPS, TOPK_GROUPS, GROUP_MAX, GROUPS_RESHAPED, RENORMALIZE, BLOCK_T,
                BLOCK_E, BLOCK_G, BLOCK_K, ROW_VECTOR, ALIGNED_ROWS, SORTED_RUNS, INDEX_BITS, NEAR_TIES, CHOICE_ROWS,
            )  # fmt: skip
            raw = raw_n


def launch_config(num_tokens: int, num_experts: int):
    """(grid, BLOCK_T, BLOCK_E, num_warps) for a [num_tokens, num_experts] input."""
    return row_tile_config(num_tokens, num_experts, _TILE, _PER_THREAD)


def row_vector(block_e: int, itemsize: int) -> int:
    """ROW_VECTOR, the contiguous logits a thread loads at once, for rows of block_e entries of
    itemsize bytes; it decides how many threads share a row. A row of at most 16 bytes: one
    thread (its reductions in registers). 16-bit rows of up to 128 entries: 4 a thread, so a row
    of 128 spans a warp (the 32-bit warp reductions are one REDUX) where 16-byte loads gave 16
    threads 8 entries each and a row reduction four shuffles; sm_90 SASS of the forward per row
    (bench/triton_sass.py, qwen3): E = 128 273 instructions against 352. Else
    16 bytes (wider 16-bit rows: one warp a row up to 256; smaller vectors split E = 256 across
    warps, through shared memory)."""
    full = 16 // itemsize
    if block_e * itemsize <= 16:
        return min(full, block_e)
    if itemsize == 2 and block_e <= 128:
        return 4
    return full


def uses_sorted_runs(block_e: int, k: int, vector: int) -> bool:
    """SORTED_RUNS: the recording that timed faster on the H200 (bench/gpu_router_variants.py at
    T = 262,144; the times in docs/routers.md and bench/results/gpu-nvidia-h200.md), where the
    static sm_90 counts (bench/triton_sass.py) had ranked three shapes the other way; the counts
    where no run timed. With the keys sorted in each thread's run once (sorted_runs), a round is
    the row max of the runs' heads and a compare and a select an entry of the thread holding it,
    each pick's expert stored in its round; the barrier and the choice tile cost a fixed amount.
    A round of the tile computes and records the pick's weight, so the tile leads at small k:
    the runs from k = 5; at k = 4 from E = 32; at k = 3 with 4 entries a thread (not 8); never at
    k = 2. A row in one thread (16 bytes or less, untimed): the runs from k = 4, by the counts."""
    if block_e <= vector:
        return k >= 4
    if k >= 5:
        return True
    if k == 4:
        return block_e >= 32
    if k == 3:
        return vector == 4
    return False


# Triton from 3.7 lays out the sorted runs' gather of the picks' logits last axis first
# (common.GATHERS_LAST_AXIS_FIRST): the [k, rows] choice tile then got a layout with a row's picks
# across warps, and its sums, its stores and
# its gather's operands went through shared memory (13 block barriers a program at E = 64, k = 8,
# against 2; sm_90). With 16 rows or more a program (E <= 64), a [rows, k] tile compiles to the
# choice-major one's code under 3.7 and 3.9 (E = 64, k = 8 133 -> 115 warp instructions a row under
# 3.7, 130 -> 108 under 3.9) and to the broken one under 3.6 (115 -> 136); below 16 rows it gains
# nothing, and at E = 256, k = 8 under 3.7 it cost 298 -> 342.


def multi_tile(num_tiles: int) -> int:
    """TILES, the row tiles a program routes, each tile's logits loaded while the program runs the
    rounds of the one before. At T = 262,144 the H200 ran the forward at about half the issue
    rate its static counts allow (docs/routers.md) with a tile a program, which waits for its
    logits before any round; more tiles a program would overlap that wait with rounds. One tile
    a program until a GPU has timed more (bench/gpu_router_variants.py times 1, 2 and 4)."""
    return 1


def choice_rows(block_t: int, block_k: int, least_k: int = 4) -> bool:
    """CHOICE_ROWS: the choice tile (the sorted runs', the backward's) as [rows, k] under triton 3.7
    and later with 16 rows or more a program and least_k choices or more (next power of two),
    else [k, rows] (the comment above). The backward passes 8 (backward_choice_rows): below it,
    [rows, k] counted more under 3.7 and 3.9 (E = 64, k = 4 91 -> 102 warp instructions a row in
    bf16, 103 -> 140 in float32; Mixtral's k = 2 11.8 -> 13.8)."""
    return GATHERS_LAST_AXIS_FIRST and block_t >= 16 and block_k >= least_k


@torch.library.custom_op("moe_kernels_triton::topk_router", mutates_args=())
@on_tensor_device
def topk_router(
    logits: torch.Tensor,
    k: int,
    scoring: str,
    bias: torch.Tensor | None,
    num_groups: int,
    topk_groups: int,
    group_scoring: str,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.topk_router (validated there), float16 /
    bfloat16 / float32 logits (float64 is computed by the op's reference path)."""
    if logits.dtype == torch.float64:
        # The kernel ranks float32 keys; float64 rows take the specification itself.
        return reference.topk_router(
            logits,
            k,
            scoring=scoring,
            bias=bias,
            num_groups=num_groups,
            topk_groups=topk_groups,
            group_scoring=group_scoring,
            renormalize=renormalize,
            scaling_factor=scaling_factor,
        )
    T, E = logits.shape
    if not supports(E, num_groups):
        raise ValueError(
            f"topk_router: the Triton kernel supports E <= {MAX_EXPERTS} and num_groups <= {MAX_GROUPS}, "
            f"got E={E}, num_groups={num_groups}; use MOE_KERNELS_BACKEND=torch"
        )
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    experts = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T > 0:
        grid, block_t, block_e, num_warps = launch_config(T, E)
        tiles = multi_tile(grid[0])
        vector = row_vector(block_e, logits.element_size())
        b = bias.float().contiguous() if bias is not None else weights  # unread without a bias
        topk_router_kernel[(triton.cdiv(grid[0], tiles),)](
            logits,
            b,
            weights,
            experts,
            T,
            E,
            logits.stride(0),
            logits.stride(1),
            k,
            scaling_factor,
            SIGMOID=scoring == "sigmoid",
            HAS_BIAS=bias is not None,
            NUM_GROUPS=num_groups,
            TOPK_GROUPS=topk_groups,
            GROUP_MAX=group_scoring == "max",
            GROUPS_RESHAPED=E == block_e,
            RENORMALIZE=renormalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_G=triton.next_power_of_2(num_groups),
            BLOCK_K=triton.next_power_of_2(k),
            ROW_VECTOR=vector,
            ALIGNED_ROWS=logits.stride(0) % vector == 0 and E % vector == 0,
            SORTED_RUNS=uses_sorted_runs(block_e, k, vector),
            INDEX_BITS=block_e.bit_length() - 1,
            NEAR_TIES=True,
            CHOICE_ROWS=choice_rows(block_t, triton.next_power_of_2(k)),
            TILES=tiles,
            num_warps=num_warps,
        )
    return weights, experts


@topk_router.register_fake
def _(logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor):
    T = logits.shape[0]
    return logits.new_empty((T, k), dtype=torch.float32), logits.new_empty((T, k), dtype=torch.int64)


# For the ahead-of-time compile test (python_tests/builds/test_triton_aot.py): the Mixtral-style softmax
# router, the DeepSeek-V3 grouped sigmoid router at E = 256, a biased bf16 router, the widest row.
def _aot(
    dt, num_experts, *, sigmoid, bias, groups=1, topk_groups=1, group_max=False, renormalize=True, runs=None, tiles=1
):
    _, block_t, block_e, num_warps = launch_config(1 << 20, num_experts)
    vector = row_vector(block_e, 4 if dt == "fp32" else 2)
    signature = {
        "logits_ptr": f"*{dt}",
        "bias_ptr": "*fp32",
        "weights_ptr": "*fp32",
        "experts_ptr": "*i64",
        "T": "i32",
        "E": "i32",
        "stride_t": "i64",
        "stride_e": "i64",
        "K": "i32",
        "scaling": "fp32",
    }
    constexprs = {
        "SIGMOID": sigmoid,
        "HAS_BIAS": bias,
        "NUM_GROUPS": groups,
        "TOPK_GROUPS": topk_groups if groups > 1 else 1,
        "GROUP_MAX": group_max,
        "GROUPS_RESHAPED": num_experts == block_e,  # as the launcher decides
        "RENORMALIZE": renormalize,
        "BLOCK_T": block_t,
        "BLOCK_E": block_e,
        "BLOCK_G": triton.next_power_of_2(groups),
        "BLOCK_K": 8,
        "ROW_VECTOR": vector,
        "ALIGNED_ROWS": True,
        # k = 8 as the launcher decides, unless asked
        "SORTED_RUNS": uses_sorted_runs(block_e, 8, vector) if runs is None else runs,
        "INDEX_BITS": block_e.bit_length() - 1,
        "NEAR_TIES": True,
        "CHOICE_ROWS": choice_rows(block_t, 8),
        "TILES": tiles,
    }
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return topk_router_kernel, signature, constexprs, {"num_warps": num_warps}


AOT_KERNELS = [
    _aot("fp32", 64, sigmoid=False, bias=False),
    _aot("bf16", 128, sigmoid=False, bias=False),
    _aot("bf16", 160, sigmoid=False, bias=False, groups=8, topk_groups=3, group_max=True),
    _aot("fp32", 256, sigmoid=True, bias=True, groups=8, topk_groups=4),
    _aot("bf16", 128, sigmoid=False, bias=True, groups=8, topk_groups=3, group_max=True, renormalize=False),
    _aot("fp16", MAX_EXPERTS, sigmoid=True, bias=True),
    _aot("fp16", MAX_EXPERTS, sigmoid=False, bias=False),
    # The [rows, k] tile, which the rule does not take at k = 8 above: at 4 entries a thread and at 8.
    _aot("bf16", 128, sigmoid=False, bias=False, runs=False),
    _aot("fp32", 256, sigmoid=True, bias=True, groups=8, topk_groups=4, runs=False),
    _aot("bf16", 256, sigmoid=True, bias=True, groups=8, topk_groups=4, runs=False),
    # The sorted runs where k is the whole row (two threads a row): their most registers.
    _aot("fp32", 8, sigmoid=False, bias=False),
    # Four tiles a program (multi_tile), the next tile's logits held through the rounds.
    _aot("bf16", 128, sigmoid=False, bias=False, tiles=4),
    _aot("bf16", 256, sigmoid=True, bias=True, groups=8, topk_groups=4, tiles=4),
    _aot("fp32", 64, sigmoid=False, bias=False, tiles=4),
]
