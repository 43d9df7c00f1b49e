"""Fused top-k + softmax in Triton: a tile of rows per program, k rounds of a row max over
unique (value, index) keys, so ties and NaN behave exactly as in the reference."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import NO_PAIR, on_tensor_device, rank_pair, row_tile_config, take_best, to_float32

# One program holds BLOCK_T x BLOCK_E logits in registers (a float and two int64 keys each);
# at most 8 per thread keeps them there (checked by ptxas in the AOT test), so a row of E logits
# needs E / 256 warps, at most 16.
MAX_EXPERTS = 4096
_TILE = 1024  # logits per program when E is small
_PER_THREAD = 8


def supports(num_experts: int) -> bool:
    """Whether the kernel takes this size; past it moe_kernels.ops.topk_softmax asks
    backends.fallback (the CUDA kernel, else the reference) and the raw op raises."""
    return num_experts <= MAX_EXPERTS


@triton.jit
def topk_softmax_kernel(
    logits_ptr,  # [T, E] fp32/fp16/bf16, any strides
    weights_ptr,  # [T, K] contiguous, logits' dtype
    experts_ptr,  # [T, K] contiguous int64
    T,  # tokens
    E,  # experts
    stride_t,  # elements between consecutive tokens of logits
    stride_e,  # elements between consecutive experts of logits
    K,  # experts per token
    RENORMALIZE: tl.constexpr,  # softmax over the K selected (True) or over all E (False)
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # next power of two >= E
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    x = to_float32(
        tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :].to(tl.int64) * stride_e,
            mask=valid,
            other=float("-inf"),
        )
    )
    pairs = tl.where(valid, rank_pair(x, cols), NO_PAIR)

    # Phase 1: the softmax denominator. The first selection is the row max (NaN included).
    _best, idx, vmax, pair = take_best(pairs, x, cols)
    masked_row = vmax == float("-inf")  # fully masked token: weights 0, never NaN
    if RENORMALIZE:
        denom = tl.where(masked_row, 0.0, tl.exp(vmax - vmax))
        for _ in range(1, K):
            _best, idx, v, pair = take_best(pair, x, cols)
            denom += tl.where(masked_row, 0.0, tl.exp(v - vmax))
    else:
        terms = tl.where(valid & ~masked_row[:, None], tl.exp(x - vmax[:, None]), 0.0)
        denom = tl.sum(terms, axis=1)

    # Phase 2: the same selections again (registers are cheaper than a store/barrier/load of
    # phase 1's picks), now writing experts and weights in rank order.
    pair = pairs
    out = rows.to(tl.int64) * K
    for s in range(0, K):
        _best, idx, v, pair = take_best(pair, x, cols)
        w = tl.where(masked_row, 0.0, tl.exp(v - vmax) / denom)
        tl.store(experts_ptr + out + s, idx.to(tl.int64), mask=row_ok)
        tl.store(weights_ptr + out + s, w.to(weights_ptr.dtype.element_ty), mask=row_ok)


def launch_config(num_tokens: int, num_experts: int):
    """(grid, BLOCK_T, BLOCK_E, num_warps) for a [num_tokens, num_experts] input."""
    return row_tile_config(num_tokens, num_experts, _TILE, _PER_THREAD)


@torch.library.custom_op("moe_kernels_triton::topk_softmax", mutates_args=())
@on_tensor_device
def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.topk_softmax (validated there)."""
    T, E = logits.shape
    if not supports(E):
        raise ValueError(
            f"topk_softmax: the Triton kernel supports at most {MAX_EXPERTS} experts, got E={E}; "
            "use MOE_KERNELS_BACKEND=cuda or torch"
        )
    weights = logits.new_empty((T, k))
    experts = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T > 0:
        grid, block_t, block_e, num_warps = launch_config(T, E)
        topk_softmax_kernel[grid](
            logits,
            weights,
            experts,
            T,
            E,
            logits.stride(0),
            logits.stride(1),
            k,
            RENORMALIZE=renormalize,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=num_warps,
        )
    return weights, experts


# An opaque custom op (not triton_op): the interpreter reads data pointers, which fake tensors
# forbid, so torch.compile must see the shapes from here rather than trace the launch.
@topk_softmax.register_fake
def _(logits, k, renormalize):
    T = logits.shape[0]
    return logits.new_empty((T, k)), logits.new_empty((T, k), dtype=torch.int64)


# For the ahead-of-time compile test (python_tests/test_triton_aot.py): (kernel, signature,
# constexprs, options) for the specialisations that matter: each dtype, both softmax modes, a
# many-row tile and the widest single-row tile, with the launcher's num_warps.
def _aot(dt, renormalize, num_experts):
    _, block_t, block_e, num_warps = launch_config(1 << 20, num_experts)
    signature = {
        "logits_ptr": f"*{dt}",
        "weights_ptr": f"*{dt}",
        "experts_ptr": "*i64",
        "T": "i32",
        "E": "i32",
        "stride_t": "i64",
        "stride_e": "i64",
        "K": "i32",
        "RENORMALIZE": "constexpr",
        "BLOCK_T": "constexpr",
        "BLOCK_E": "constexpr",
    }
    constexprs = {"RENORMALIZE": renormalize, "BLOCK_T": block_t, "BLOCK_E": block_e}
    return topk_softmax_kernel, signature, constexprs, {"num_warps": num_warps}


AOT_KERNELS = [
    _aot("fp32", True, 64),
    _aot("fp32", False, MAX_EXPERTS),
    _aot("fp16", True, 256),
    _aot("bf16", False, 8),
]
