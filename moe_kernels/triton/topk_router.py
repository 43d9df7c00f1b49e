"""topk_router in Triton: a tile of rows per program, whole rows in registers. Scores, choice
values, the groups' scores and the eligible groups, then k rounds of a row max over unique
(value, index) keys, so ties and NaN behave exactly as in the reference. float32 compute."""

import torch
import triton
import triton.language as tl

from moe_kernels import reference
from moe_kernels.triton.common import (
    NO_PAIR,
    on_tensor_device,
    rank_pair,
    row_tile_config,
    sigmoid_accurate,
    take_best,
    take_best_ranked,
    to_float32,
)

MAX_EXPERTS = 2048
MAX_GROUPS = 64
_TILE = 1024  # values per program when E is small
_PER_THREAD = 8


def supports(num_experts: int, num_groups: int) -> bool:
    """Whether the kernel takes this size; past it moe_kernels.ops.topk_router asks
    backends.fallback (the CUDA kernel, else the reference) and the raw op raises."""
    return num_experts <= MAX_EXPERTS and num_groups <= MAX_GROUPS


@triton.jit
def logits_tile(logits_ptr, T, E, stride_t, stride_e, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's [BLOCK_T, BLOCK_E] tile of the [T, E] logits (any strides), as float32 with
    padding -inf: (rows, cols, rows in range, entries in range, x)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :].to(tl.int64) * stride_e
    return rows, cols, row_ok, valid, to_float32(tl.load(ptrs, mask=valid, other=float("-inf")))


@triton.jit
def softmax_parts(x, valid, cols):
    """The softmax of each row of a [BLOCK_T, BLOCK_E] float32 tile (`valid`: the real entries;
    padding loaded as -inf; padded rows get NaN scores, never stored): (scores, the row max, the
    row sum of exp(x - max), whether the row is all -inf). The max is taken by rank (NaN first,
    so a NaN row is all NaN as torch's); an all -inf row gets scores 0, as the reference's
    router_scores. A single score is softmax_score(x_e, max, sum, masked), bit for bit the tile's."""
    _b, _i, vmax, _p = take_best_ranked(tl.where(valid, rank_pair(x, cols), NO_PAIR), cols)
    masked_row = vmax == float("-inf")
    terms = tl.where(valid & ~masked_row[:, None], tl.exp(x - vmax[:, None]), 0.0)
    denom = tl.sum(terms, axis=1)
    return tl.where(masked_row[:, None], 0.0, terms / denom[:, None]), vmax, denom, masked_row


@triton.jit
def softmax_score(x, vmax, denom, masked_row):
    """One score per row from its logit x [BLOCK_T] and softmax_parts's row values."""
    return tl.where(masked_row, 0.0, tl.exp(x - vmax) / denom)


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
    RENORMALIZE: tl.constexpr,  # divide the selected scores by their sum
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # next power of two >= E
    BLOCK_G: tl.constexpr,  # next power of two >= NUM_GROUPS
    BLOCK_K: tl.constexpr,  # next power of two >= K
):
    rows, cols, row_ok, valid, x = logits_tile(logits_ptr, T, E, stride_t, stride_e, BLOCK_T, BLOCK_E)

    # Phase 1: scores.
    if SIGMOID:
        scores = tl.where(valid, sigmoid_accurate(x), 0.0)
    else:
        scores, vmax, denom, masked_row = softmax_parts(x, valid, cols)

    # Phase 2: the selection key. No bias and no group limit: the logits themselves (exact).
    GROUPED: tl.constexpr = TOPK_GROUPS < NUM_GROUPS
    if HAS_BIAS or GROUPED:
        key = scores
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
    else:
        key = x
    pairs = tl.where(valid, rank_pair(key, cols), NO_PAIR)

    # Phase 3: the group limit. Each group's score from its own largest keys, then the TOPK_GROUPS
    # best groups by rank (ties to the lower group); the other groups' experts are retired.
    if GROUPED:
        group = cols // (E // NUM_GROUPS)
        gcols = tl.arange(0, BLOCK_G)
        gscores = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_group = (group == g)[None, :]
            _b, _i, first, rest = take_best_ranked(tl.where(in_group, pairs, NO_PAIR), cols)
            score = first
            if not GROUP_MAX:
                _b, _i, second, _r = take_best_ranked(rest, cols)
                score = first + second
            gscores = tl.where(gcols[None, :] == g, score[:, None], gscores)
        gpairs = tl.where(gcols[None, :] < NUM_GROUPS, rank_pair(gscores, gcols), NO_PAIR)
        eligible = (rows[:, None] < 0) & (cols[None, :] < 0)  # all False
        for _ in tl.static_range(TOPK_GROUPS):
            _b, chosen, _v, gpairs = take_best_ranked(gpairs, gcols)
            eligible = eligible | (group[None, :] == chosen[:, None])
        pairs = tl.where(eligible, pairs, NO_PAIR)

    # Phase 4: the k selections, once, into a [BLOCK_T, BLOCK_K] tile of picks; then the
    # renormalisation and one store of each tile. Where the pairs rank the logits themselves (no
    # bias, no groups), a pick's score follows from its logit, decoded from the pair: one row
    # reduction per pick.
    RANKS_LOGITS: tl.constexpr = not (HAS_BIAS or GROUPED)
    kcols = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    picked_e = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    pair = pairs
    for s in range(0, K):
        if RANKS_LOGITS:
            _b, idx, logit, pair = take_best_ranked(pair, cols)
            if SIGMOID:
                w = sigmoid_accurate(logit)
            else:
                w = softmax_score(logit, vmax, denom, masked_row)
        else:
            _b, idx, w, pair = take_best(pair, scores, cols)
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


def launch_config(num_tokens: int, num_experts: int):
    """(grid, BLOCK_T, BLOCK_E, num_warps) for a [num_tokens, num_experts] input."""
    return row_tile_config(num_tokens, num_experts, _TILE, _PER_THREAD)


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
        b = bias.float().contiguous() if bias is not None else weights  # unread without a bias
        topk_router_kernel[grid](
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
            RENORMALIZE=renormalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_G=triton.next_power_of_2(num_groups),
            BLOCK_K=triton.next_power_of_2(k),
            num_warps=num_warps,
        )
    return weights, experts


@topk_router.register_fake
def _(logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor):
    T = logits.shape[0]
    return logits.new_empty((T, k), dtype=torch.float32), logits.new_empty((T, k), dtype=torch.int64)


# For the ahead-of-time compile test (python_tests/builds/test_triton_aot.py): the Mixtral-style softmax
# router, the DeepSeek-V3 grouped sigmoid router at E = 256, a biased bf16 router, the widest row.
def _aot(dt, num_experts, *, sigmoid, bias, groups=1, topk_groups=1, group_max=False, renormalize=True):
    _, block_t, block_e, num_warps = launch_config(1 << 20, num_experts)
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
        "RENORMALIZE": renormalize,
        "BLOCK_T": block_t,
        "BLOCK_E": block_e,
        "BLOCK_G": triton.next_power_of_2(groups),
        "BLOCK_K": 8,
    }
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return topk_router_kernel, signature, constexprs, {"num_warps": num_warps}


AOT_KERNELS = [
    _aot("fp32", 64, sigmoid=False, bias=False),
    _aot("fp32", 256, sigmoid=True, bias=True, groups=8, topk_groups=4),
    _aot("bf16", 128, sigmoid=False, bias=True, groups=8, topk_groups=3, group_max=True, renormalize=False),
    _aot("fp16", MAX_EXPERTS, sigmoid=True, bias=True),
]
