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

from moe_kernels.triton.common import from_float32, on_tensor_device, row_tile_config, sigmoid_accurate, to_float32
from moe_kernels.triton.topk_router import (
    _PER_THREAD,
    _TILE,
    MAX_EXPERTS,
    logits_tile,
    softmax_parts,
    softmax_score,
)


@triton.jit
def _choice(
    s, experts_ptr, choices, grad_weights_ptr, grads, stride_gk, logit_rows, stride_e, row_ok, E,
    vmax, denom, masked_row, SIGMOID: tl.constexpr,
):  # fmt: skip
    """Choice s of each row: (its expert, its weight's gradient, whether the expert is in [0, E),
    its score). The score is recomputed from its logit, read again (from cache), not gathered
    across the row's threads; a choice outside [0, E) (a raw call's) reads -inf: score 0."""
    idx = tl.load(experts_ptr + choices + s, mask=row_ok, other=-1)
    g = to_float32(tl.load(grad_weights_ptr + grads + s * stride_gk, mask=row_ok, other=0.0))
    inside = row_ok & (idx >= 0) & (idx < E)
    logit = to_float32(tl.load(logit_rows + idx * stride_e, mask=inside, other=float("-inf")))
    if SIGMOID:
        p = sigmoid_accurate(logit)
    else:
        p = tl.where(inside, softmax_score(logit, vmax, denom, masked_row), 0.0)
    return idx, g, inside, p


@triton.jit
def topk_router_backward_kernel(
    grad_weights_ptr,  # [T, K] any float dtype, any strides
    logits_ptr,  # [T, E] fp32/fp16/bf16, any strides
    experts_ptr,  # [T, K] int64 contiguous, each row's chosen experts (distinct)
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
    ROW_VECTOR: tl.constexpr,  # load_vector(BLOCK_E, itemsize)
    ALIGNED_ROWS: tl.constexpr,  # stride_t and E multiples of ROW_VECTOR
):
    rows, cols, row_ok, valid, x = logits_tile(
        logits_ptr, T, E, stride_t, stride_e, BLOCK_T, BLOCK_E, ROW_VECTOR, ALIGNED_ROWS
    )
    if SIGMOID:
        scores = tl.where(valid, sigmoid_accurate(x), 0.0)
        vmax = tl.zeros((BLOCK_T,), tl.float32)  # the softmax's row values: unused by sigmoid
        denom = vmax
        masked_row = row_ok
    else:
        scores, vmax, denom, masked_row = softmax_parts(x, valid, cols)
    choices = rows.to(tl.int64) * K
    grads = rows.to(tl.int64) * stride_gt
    logit_rows = logits_ptr + rows.to(tl.int64) * stride_t

    # The chosen scores' sum (the renormalisation's total) and sum_s g_s p_s, in choice order.
    total = tl.zeros((BLOCK_T,), tl.float32)
    weighted = tl.zeros((BLOCK_T,), tl.float32)
    if RENORMALIZE:
        for s in range(0, K):
            idx, g, inside, p = _choice(
                s, experts_ptr, choices, grad_weights_ptr, grads, stride_gk, logit_rows, stride_e, row_ok, E,
                vmax, denom, masked_row, SIGMOID,
            )  # fmt: skip
            total += p
            weighted += g * p
    zero = total == 0
    safe = tl.where(zero, 1.0, total)
    dot = weighted / safe

    # g'_s scattered onto the row (G'), and sum_s g'_s p_s for the softmax's shift.
    spread = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    shift = tl.zeros((BLOCK_T,), tl.float32)
    for s in range(0, K):
        idx, g, inside, p = _choice(
            s, experts_ptr, choices, grad_weights_ptr, grads, stride_gk, logit_rows, stride_e, row_ok, E,
            vmax, denom, masked_row, SIGMOID,
        )  # fmt: skip
        if RENORMALIZE:
            g = tl.where(zero, 0.0, scaling / safe * (g - dot))
        else:
            g = scaling * g
        shift += g * p
        hit = inside[:, None] & (cols[None, :] == idx[:, None].to(tl.int32))
        spread += tl.where(hit, g[:, None], 0.0)
    if SIGMOID:
        # 0 off the choices (spread is 0 there, the scores finite), NaN at a NaN logit: the
        # reference's sigmoid over the whole row backpropagates 0 * sigmoid'(NaN) = NaN.
        grad = tl.where(x != x, x, spread * scores * (1.0 - scores))
    else:
        grad = scores * (spread - shift[:, None])
    out = grad_ptr + rows[:, None].to(tl.int64) * E + cols[None, :]
    tl.store(out, from_float32(grad, grad_ptr.dtype.element_ty), mask=valid)


def load_vector(block_e: int, itemsize: int) -> int:
    """The backward's ROW_VECTOR: 16-byte loads (or the whole row). The forward's 4-a-thread rows
    (row_vector) gained the backward nothing in sm_90 SASS (308 against 316 warp instructions a
    row at E = 128); its ALIGNED_ROWS covers the loads only (vector stores of the gradient too
    spilled 16 bytes on sm_80 under triton 3.9's ptxas)."""
    return min(16 // itemsize, block_e)


def supports(num_experts: int) -> bool:
    return num_experts <= MAX_EXPERTS


@torch.library.custom_op("moe_kernels_triton::topk_router_backward", mutates_args=())
@on_tensor_device
def topk_router_backward(
    grad_weights: torch.Tensor,
    logits: torch.Tensor,
    experts: torch.Tensor,
    scoring: str,
    renormalize: bool,
    scaling_factor: float,
) -> torch.Tensor:
    """Triton launch: grad_weights [T, k] (float), logits [T, E] float32 / float16 / bfloat16 with
    E <= MAX_EXPERTS, experts [T, k] int64 (the forward's); returns d loss / d logits [T, E] in the
    logits' dtype, contiguous."""
    T, E = logits.shape
    grad = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if T > 0 and E > 0:
        grid, block_t, block_e, num_warps = row_tile_config(T, E, _TILE, _PER_THREAD)
        vector = load_vector(block_e, logits.element_size())
        topk_router_backward_kernel[grid](
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
            experts.shape[1],
            scaling_factor,
            SIGMOID=scoring == "sigmoid",
            RENORMALIZE=renormalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            ROW_VECTOR=vector,
            ALIGNED_ROWS=logits.stride(0) % vector == 0 and E % vector == 0,
            num_warps=num_warps,
        )
    return grad


@topk_router_backward.register_fake
def _(grad_weights, logits, experts, scoring, renormalize, scaling_factor):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# For the ahead-of-time compile test (python_tests/builds/test_triton_aot.py): Mixtral's renormalised
# softmax, DeepSeek-V3's sigmoid at E = 256, the widest row.
def _aot(dt, num_experts, *, sigmoid, renormalize=True):
    _, block_t, block_e, num_warps = row_tile_config(1 << 20, num_experts, _TILE, _PER_THREAD)
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
        "ROW_VECTOR": load_vector(block_e, 4 if dt == "fp32" else 2),
        "ALIGNED_ROWS": True,
    }
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return topk_router_backward_kernel, signature, constexprs, {"num_warps": num_warps}


AOT_KERNELS = [
    _aot("bf16", 8, sigmoid=False),
    _aot("fp32", 256, sigmoid=True),
    _aot("bf16", 128, sigmoid=False, renormalize=False),
    _aot("fp16", MAX_EXPERTS, sigmoid=False),
]
