"""topk_router's backward in Triton: d loss / d logits [T, E] from d loss / d weights [T, k] in one
pass, a tile of rows per program as the forward (one read of the logits, the gradient and the
experts, one write of the [T, E] gradient). The formulas are _backward_from_logits's
(moe_kernels/ops/topk_router.py), which the C++ and CUDA backwards share; float32 compute.

    softmax: p = softmax(row), g'_s = d / d p[experts_s] through the renormalisation and scaling,
             grad_j = p_j (G'_j - sum_s g'_s p[experts_s]), G' = g' scattered onto the row
    sigmoid: grad_j = G'_j s_j (1 - s_j) at the chosen experts, 0 elsewhere (NaN at a NaN logit)
"""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import (
    GATHERS_LAST_AXIS_FIRST,
    NO_KEY,
    from_float32,
    on_tensor_device,
    row_tile_config,
    sigmoid_accurate,
    to_float32,
    value_key,
    value_of,
)
from moe_kernels.triton.topk_router import (
    _PER_THREAD,
    _TILE,
    MAX_EXPERTS,
    choice_rows,
    choice_tile,
    logits_raw_tile,
    softmax_terms,
    tile_indices,
)


@triton.jit
def backward_tile(
    grad_weights_ptr, logits_ptr, experts_ptr, grad_ptr, T, E, stride_t, stride_e, stride_gt, stride_gk, K, scaling,
    tile, rows, cols, row_ok, valid, raw,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, DISTINCT: tl.constexpr, CHOICE_ROWS: tl.constexpr, ROW_VECTOR: tl.constexpr,
    VECTOR_STORES: tl.constexpr, STORE_TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """Row tile `tile`'s gradient stored, from its logits as logits_raw_tile gave them (rows, cols,
    row_ok, valid, raw); the arguments as topk_router_backward_kernel's."""
    x = to_float32(raw)
    rows64 = rows.to(tl.int64)

    # The choices as a [BLOCK_K, BLOCK_T] tile (CHOICE_ROWS: [BLOCK_T, BLOCK_K]): their experts,
    # gradients and logits (gathered, from cache), each chosen score computed once.
    rows_k64, kcols, choice_ok = choice_tile(tile, T, K, BLOCK_T, BLOCK_K, CHOICE_ROWS)
    PICKS: tl.constexpr = 1 if CHOICE_ROWS else 0  # the tile's axis of a row's choices
    idx = tl.load(experts_ptr + rows_k64 * K + kcols, mask=choice_ok, other=-1)
    # kcols in int64: a transposed [k, T] gradient's stride_gk is T, and (k - 1) T passes 2^31.
    g_ptrs = grad_weights_ptr + rows_k64 * stride_gt + kcols.to(tl.int64) * stride_gk
    g = to_float32(tl.load(g_ptrs, mask=choice_ok, other=0.0))
    # A choice outside [0, E) (a raw call's) reads -inf (score 0) and is stored nowhere.
    inside = choice_ok & (idx >= 0) & (idx < E)
    x_k = to_float32(tl.load(logits_ptr + rows_k64 * stride_t + idx * stride_e, mask=inside, other=float("-inf")))
    if SIGMOID:
        p_k = sigmoid_accurate(x_k)
    else:
        # The softmax as softmax_parts, with one division a row: scores within an ulp or two of
        # the forward's (which divides each), the same in the tile and at each choice.
        vmax = value_of(tl.max(tl.where(valid, value_key(x), NO_KEY), axis=1))
        terms, denom, masked_row = softmax_terms(x, valid, vmax)
        inverse = tl.where(masked_row, 0.0, 1.0 / tl.where(masked_row, 1.0, denom))
        scores = terms * inverse[:, None]
        # vmax and inverse cross to the choice tile's layout as one int64 (one trip through
        # shared memory where two took their own).
        both = (vmax.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (
            inverse.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        )
        both_k = tl.expand_dims(both, PICKS)
        vmax_k = (both_k >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        inverse_k = both_k.to(tl.int32).to(tl.float32, bitcast=True)
        p_k = tl.where(inverse_k == 0.0, 0.0, tl.exp(x_k - vmax_k) * inverse_k)

    # d loss / d each chosen score (g'), through the renormalisation and the scaling.
    if RENORMALIZE:
        total = tl.sum(p_k, axis=PICKS)
        zero = total == 0
        safe = tl.where(zero, 1.0, total)
        dot = tl.sum(g * p_k, axis=PICKS) / safe
        g1 = tl.where(
            tl.expand_dims(zero, PICKS),
            0.0,
            scaling / tl.expand_dims(safe, PICKS) * (g - tl.expand_dims(dot, PICKS)),
        )
    else:
        g1 = scaling * g
    # The softmax's shift sum_s g'_s p_s, per choice (a repeated expert counts once a choice).
    shift = tl.sum(g1 * p_k, axis=PICKS)
    if not DISTINCT:
        # A repeated expert (a raw call's) gets the sum of its choices' g' (the reference's
        # scatter_add); each of its choices computes the same sum, so their stores agree.
        if CHOICE_ROWS:  # [rows, this choice, another]
            same = (idx[:, :, None] == idx[:, None, :]) & inside[:, None, :]
            g1 = tl.sum(tl.where(same, g1[:, None, :], 0.0), axis=2)
        else:  # [this choice, another, rows]
            same = (idx[:, None, :] == idx[None, :, :]) & inside[None, :, :]
            g1 = tl.sum(tl.where(same, g1[None, :, :], 0.0), axis=1)

    # Every entry as if unchosen, then (after a barrier: the same program's earlier stores come
    # first) the chosen entries over them, each stored from the choice tile.
    if SIGMOID:
        # 0 off the choices, NaN at a NaN logit: the reference's sigmoid over the whole row
        # backpropagates 0 * sigmoid'(NaN) = NaN.
        grad = tl.where(x != x, x, 0.0)
        grad_k = tl.where(x_k != x_k, x_k, g1 * p_k * (1.0 - p_k))
    else:
        grad = scores * (0.0 - shift[:, None])
        grad_k = p_k * (g1 - tl.expand_dims(shift, PICKS))
    row_start = rows64[:, None] * E
    if VECTOR_STORES:
        # The same offsets, as a product with ROW_VECTOR (E is a multiple of it): the compiler's
        # alignment analysis sees it, and each thread stores its entries of a row at once.
        row_start = rows64[:, None] * (E // ROW_VECTOR) * ROW_VECTOR
    tl.store(grad_ptr + row_start + cols[None, :], from_float32(grad, grad_ptr.dtype.element_ty), mask=valid)
    tl.debug_barrier()
    ptrs_k = grad_ptr + rows_k64 * E + idx
    values_k = from_float32(grad_k, grad_ptr.dtype.element_ty)
    if STORE_TRANSPOSED:
        tl.store(tl.trans(ptrs_k), tl.trans(values_k), mask=tl.trans(inside))
    else:
        tl.store(ptrs_k, values_k, mask=inside)


@triton.jit
def topk_router_backward_kernel(
    grad_weights_ptr,  # [T, K] any float dtype, any strides
    logits_ptr,  # [T, E] fp32/fp16/bf16, any strides
    experts_ptr,  # [T, K] int64 contiguous, each row's chosen experts
    grad_ptr,  # [T, E] the logits' dtype, contiguous
    T,  # tokens
    E,  # experts
    stride_t,  # elements between consecutive tokens of logits
    stride_e,  # elements between consecutive experts of logits
    stride_gt,  # elements between consecutive tokens of grad_weights
    stride_gk,  # elements between consecutive choices of grad_weights
    K,  # experts per token
    scaling,  # the forward's scaling factor
    SIGMOID: tl.constexpr,  # scores = sigmoid(logits) (True) or softmax over the row (False)
    RENORMALIZE: tl.constexpr,  # the forward divided the selected scores by their sum
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # next power of two >= E
    BLOCK_K: tl.constexpr,  # next power of two >= K
    DISTINCT: tl.constexpr,  # each row's experts are distinct (the forward's): no repeat to sum
    ROW_VECTOR: tl.constexpr,  # load_vector(BLOCK_E, itemsize)
    ALIGNED_ROWS: tl.constexpr,  # stride_t and E multiples of ROW_VECTOR
    CHOICE_ROWS: tl.constexpr,  # the choice tile as [rows, k] (topk_router.choice_rows), else [k, rows]
    TILES: tl.constexpr,  # row tiles a program, each one's logits loaded during the one before (multi_tile)
    VECTOR_STORES: tl.constexpr,  # E a multiple of ROW_VECTOR: the gradient's rows stored a vector at once
    STORE_TRANSPOSED: tl.constexpr,  # the chosen entries' store from the choice tile's transpose (store_transposed)
):
    first = tl.program_id(0) * TILES
    rows, cols, row_ok, valid, raw = logits_raw_tile(
        logits_ptr, first, T, E, stride_t, stride_e, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS
    )
    if TILES == 1:
        backward_tile(
            grad_weights_ptr, logits_ptr, experts_ptr, grad_ptr, T, E, stride_t, stride_e, stride_gt, stride_gk, K,
            scaling, first, rows, cols, row_ok, valid, raw,
            SIGMOID, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, DISTINCT, CHOICE_ROWS, ROW_VECTOR, VECTOR_STORES,
            STORE_TRANSPOSED,
        )  # fmt: skip
    else:
        # As the forward's tiles (topk_router_kernel): each tile's logits loaded before the tile
        # before it is routed back, none past the program's last tile.
        end = tl.minimum(T, (first + TILES).to(tl.int64) * BLOCK_T)
        for t in range(0, tl.minimum(TILES, tl.cdiv(T, BLOCK_T) - first)):
            tile = first + t
            _rows, _cols, _row_ok, _valid, raw_n = logits_raw_tile(
                logits_ptr, tile + 1, end, E, stride_t, stride_e, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS
            )
            # Only the loaded tile is carried to the next trip; its rows and masks are recomputed
            # (for rows below T): carried, they took more registers (Mixtral 32 -> 38).
            rows, cols, row_ok, valid = tile_indices(tile, T, E, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS)
            backward_tile(
                grad_weights_ptr, logits_ptr, experts_ptr, grad_ptr, T, E, stride_t, stride_e, stride_gt, stride_gk, K,
                scaling, tile, rows, cols, row_ok, valid, raw,
                SIGMOID, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K, DISTINCT, CHOICE_ROWS, ROW_VECTOR, VECTOR_STORES,
                STORE_TRANSPOSED,
            )  # fmt: skip
            raw = raw_n


def load_vector(block_e: int, itemsize: int) -> int:
    """The backward's ROW_VECTOR: 16-byte loads (or the whole row). sm_90 SASS a row at Qwen3-MoE's
    bf16 E = 128: 188 at 8 a thread, 204 at the forward's 4 (row_vector), 266 at 2; its
    ALIGNED_ROWS covers the loads; the gradient's stores take vectors where vector_stores says
    (taken everywhere, they once spilled 16 bytes on sm_80 under triton 3.9's ptxas)."""
    return min(16 // itemsize, block_e)


def vector_stores(num_experts: int, vector: int) -> bool:
    """VECTOR_STORES: the gradient's rows stored ROW_VECTOR entries at once where E is a multiple
    of it but not of 16. A launch tells Triton of E's divisibility by 16 only, so there the
    compiler vectorises the stores itself, and the product with ROW_VECTOR costs instructions
    (Qwen3-MoE 180 -> 184 warp instructions a row); at Mixtral's E = 8 it stored each bf16
    alone, 10 stores a thread where 3 do now (sm_90, triton 3.6: 13 -> 11 warp instructions a
    row)."""
    return num_experts % vector == 0 and num_experts % 16 != 0


def store_transposed(block_t: int, block_k: int, num_warps: int) -> bool:
    """STORE_TRANSPOSED: the chosen entries' gradients stored from the transpose of the [k, rows]
    choice tile, under triton before 3.7 (common.GATHERS_LAST_AXIS_FIRST false) where the tile has
    fewer entries than the program has threads or k <= 2. Their addresses are data, and triton 3.6
    lays such a store out with the other axis first than 3.7 does, so the store's pointers, values
    and mask went through shared memory to that layout (sm_90 under 3.6, warp instructions a row
    and block barriers a program: Mixtral 11 -> 10 and 6 -> 1, Qwen3-MoE 194 -> 180, its float32
    210 -> 196, E = 64, k = 2 83 -> 78, E = 512, k = 10 758 -> 716). Tiles of a choice a thread or
    more with k >= 4 counted more transposed (E = 64, k = 8 74 -> 90), as did every shape under
    3.7, which keeps the tile as it is."""
    fewer = block_t * block_k < 32 * num_warps
    return not GATHERS_LAST_AXIS_FIRST and (fewer or block_k <= 2)


def supports(num_experts: int) -> bool:
    return num_experts <= MAX_EXPERTS


# Elements of the [k, k, rows] tile ([rows, k, k] where CHOICE_ROWS) that sums a row's repeated
# experts (DISTINCT False): a
# program takes fewer rows where k is large, so it stays within this.
_REPEATS_TILE = 4096


def launch_config(num_tokens: int, num_experts: int, k: int, distinct: bool):
    """(grid, BLOCK_T, BLOCK_E, BLOCK_K, num_warps): the forward's row tiles, with fewer rows a
    program where the repeats' tile would pass _REPEATS_TILE."""
    grid, block_t, block_e, num_warps = row_tile_config(num_tokens, num_experts, _TILE, _PER_THREAD)
    block_k = triton.next_power_of_2(max(k, 1))
    if not distinct and block_t * block_k * block_k > _REPEATS_TILE:
        block_t = max(1, _REPEATS_TILE // (block_k * block_k))
        grid = (triton.cdiv(num_tokens, block_t),)
        num_warps = min(16, max(1, block_t * block_e // (32 * _PER_THREAD)))
    return grid, block_t, block_e, block_k, num_warps


def backward_multi_tile(num_tiles: int) -> int:
    """TILES of the backward, the row tiles a program routes back, each tile's logits loaded while
    the program computes the tile before (topk_router.multi_tile's forward counterpart). The
    backward moves about twice the forward's bytes (the logits read, the gradient written): at
    T = 262,144 the H200 ran Qwen3-MoE's at about 60% of the copy rate. One tile a program until a
    GPU has timed more (bench/gpu_router_variants.py times 1, 2 and 4)."""
    return 1


def backward_choice_rows(block_t: int, block_k: int) -> bool:
    """CHOICE_ROWS of the backward: topk_router.choice_rows from k = 5 (8 as a power of two), where
    the [rows, k] tile counted fewer warp instructions under triton 3.7 and 3.9; below it counted
    more (its docstring). The launcher, the AOT entries and bench/triton_sass.py all ask here."""
    return choice_rows(block_t, block_k, least_k=8)


@torch.library.custom_op("moe_kernels_triton::topk_router_backward", mutates_args=())
@on_tensor_device
def topk_router_backward(
    grad_weights: torch.Tensor,
    logits: torch.Tensor,
    experts: torch.Tensor,
    scoring: str,
    renormalize: bool,
    scaling_factor: float,
    distinct_experts: bool = False,
) -> torch.Tensor:
    """Triton launch: grad_weights [T, k] (float), logits [T, E] float32 / float16 / bfloat16 with
    E <= MAX_EXPERTS, experts [T, k] int64; returns d loss / d logits [T, E] in the logits' dtype,
    contiguous. distinct_experts: the caller promises no row repeats an expert (the forward's
    experts, as autograd passes them); without it a repeat's gradients are summed (the
    reference's scatter_add) at some cost. Ids outside [0, E) are dropped."""
    T, E = logits.shape
    k = experts.shape[1]
    grad = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if T > 0 and E > 0:
        grid, block_t, block_e, block_k, num_warps = launch_config(T, E, k, distinct_experts)
        tiles = backward_multi_tile(grid[0])
        vector = load_vector(block_e, logits.element_size())
        topk_router_backward_kernel[(triton.cdiv(grid[0], tiles),)](
            grad_weights,
            logits,
            experts.contiguous(),
            grad,
            T,
            E,
            logits.stride(0),
            logits.stride(1),
            grad_weights.stride(0),
            grad_weights.stride(1),
            k,
            scaling_factor,
            SIGMOID=scoring == "sigmoid",
            RENORMALIZE=renormalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_K=block_k,
            DISTINCT=distinct_experts,
            ROW_VECTOR=vector,
            ALIGNED_ROWS=logits.stride(0) % vector == 0 and E % vector == 0,
            CHOICE_ROWS=backward_choice_rows(block_t, block_k),
            TILES=tiles,
            VECTOR_STORES=vector_stores(E, vector),
            STORE_TRANSPOSED=store_transposed(block_t, block_k, num_warps),
            num_warps=num_warps,
        )
    return grad


@topk_router_backward.register_fake
def _(grad_weights, logits, experts, scoring, renormalize, scaling_factor, distinct_experts=False):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# For the ahead-of-time compile test (python_tests/builds/test_triton_aot.py): Mixtral's renormalised
# softmax, DeepSeek-V3's sigmoid at E = 256, Qwen3-MoE's full softmax, the widest row; and the
# repeats' sum (raw calls) at its largest tile.
def _aot(dt, num_experts, *, sigmoid, renormalize=True, k=8, distinct=True, tiles=1):
    _, block_t, block_e, block_k, num_warps = launch_config(1 << 20, num_experts, k, distinct)
    vector = load_vector(block_e, 4 if dt == "fp32" else 2)
    signature = {
        "grad_weights_ptr": "*fp32",
        "logits_ptr": f"*{dt}",
        "experts_ptr": "*i64",
        "grad_ptr": f"*{dt}",
        "T": "i32",
        "E": "i32",
        "stride_t": "i64",
        "stride_e": "i64",
        "stride_gt": "i64",
        "stride_gk": "i64",
        "K": "i32",
        "scaling": "fp32",
    }
    constexprs = {
        "SIGMOID": sigmoid,
        "RENORMALIZE": renormalize,
        "BLOCK_T": block_t,
        "BLOCK_E": block_e,
        "BLOCK_K": block_k,
        "DISTINCT": distinct,
        "ROW_VECTOR": vector,
        "ALIGNED_ROWS": True,
        "CHOICE_ROWS": backward_choice_rows(block_t, block_k),
        "TILES": tiles,
        "VECTOR_STORES": vector_stores(num_experts, vector),  # as the launcher decides
        "STORE_TRANSPOSED": store_transposed(block_t, block_k, num_warps),
    }
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return topk_router_backward_kernel, signature, constexprs, {"num_warps": num_warps}


AOT_KERNELS = [
    _aot("bf16", 8, sigmoid=False, k=2),
    _aot("fp32", 256, sigmoid=True),
    _aot("bf16", 128, sigmoid=False, renormalize=False),
    _aot("fp16", MAX_EXPERTS, sigmoid=False),
    _aot("bf16", 16, sigmoid=False, distinct=False),  # [8, 8, 64]: the repeats' tile at its limit
    _aot("fp32", 256, sigmoid=True, k=64, distinct=False),  # one row a program
    # Four tiles a program (backward_multi_tile), the next tile's logits held through the tile's work.
    _aot("bf16", 128, sigmoid=False, renormalize=False, tiles=4),
    _aot("bf16", 256, sigmoid=True, tiles=4),
    _aot("bf16", 16, sigmoid=False, distinct=False, tiles=4),
    # The gradient stored a vector at once where E is a multiple of the vector and not of 16
    # (vector_stores): Mixtral's above, and wide rows.
    _aot("bf16", 1000, sigmoid=False),
    _aot("fp32", 1000, sigmoid=True),
]
