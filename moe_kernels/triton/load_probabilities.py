"""Smooth load estimator P(x, i) (eqs 8-9 of Shazeer et al. 2017, Appendix A) in Triton: a tile
of rows per program; k+1 rounds of a row max over unique (value, index) keys find the k-th and
(k+1)-th largest noisy logits, then every element of the tile gets its probability at once."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import (
    NO_PAIR,
    on_tensor_device,
    rank_pair,
    row_tile_config,
    take_best_ranked,
    to_float32,
)

# Registers per program as in topk_router: BLOCK_T x BLOCK_E elements, at most 8 per thread.
MAX_EXPERTS = 4096
_TILE = 1024  # elements per program when E is small
_PER_THREAD = 8


def supports(num_experts: int) -> bool:
    """Whether the kernel takes this size; past it moe_kernels.ops.load_probabilities asks
    backends.fallback (the CUDA kernel, else the reference) and the raw op raises."""
    return num_experts <= MAX_EXPERTS


SQRT1_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def load_probabilities_kernel(
    clean_ptr,  # [T, E] x W_g, fp32/fp16/bf16, strides (stride_ct, stride_ce)
    noisy_ptr,  # [T, E] H(x) of eq 4, same dtype, strides (stride_nt, stride_ne)
    stddev_ptr,  # [T, E] Softplus(x W_noise), same dtype, strides (stride_st, stride_se)
    probs_ptr,  # [T, E] contiguous output P, same dtype
    top_ptr,  # [T, K+1] contiguous int64 output: indices of the K+1 largest noisy logits, -1 if none
    T,  # tokens
    E,  # experts
    stride_ct,  # elements between tokens / experts of each input
    stride_ce,
    stride_nt,
    stride_ne,
    stride_st,
    stride_se,
    K,  # experts per token
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # next power of two >= E
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    r64 = rows[:, None].to(tl.int64)
    c64 = cols[None, :].to(tl.int64)
    x = to_float32(tl.load(noisy_ptr + r64 * stride_nt + c64 * stride_ne, mask=valid, other=float("-inf")))
    pair = tl.where(valid, rank_pair(x, cols), NO_PAIR)

    # Phase 1: K+1 selections; keep the K-th pair and value and the (K+1)-th value.
    kth_pair = tl.full([BLOCK_T], NO_PAIR, tl.int64)
    kth = tl.zeros([BLOCK_T], dtype=tl.float32)
    k1th = tl.zeros([BLOCK_T], dtype=tl.float32)
    top_row = rows.to(tl.int64) * (K + 1)
    for s in range(0, K + 1):
        best, idx, value, pair = take_best_ranked(pair, cols)  # the pairs rank x: its value decoded
        kth_pair = tl.where(s == K - 1, best, kth_pair)
        kth = tl.where(s == K - 1, value, kth)
        k1th = tl.where(s == K, value, k1th)
        tl.store(top_ptr + top_row + s, tl.where(s < E, idx, -1).to(tl.int64), mask=row_ok)
    k1th = tl.where(K == E, float("-inf"), k1th)  # no (K+1)-th element: the top K have no threshold

    # Phase 2: kth_excluding per element, then P = Phi(z) (eq 9).
    # The keys are recomputed from x rather than kept from phase 1: one int64 per element fewer
    # in registers (the widest tile spills otherwise).
    selected = rank_pair(x, cols) >= kth_pair[:, None]
    threshold = tl.where(selected, k1th[:, None], kth[:, None])
    clean = to_float32(tl.load(clean_ptr + r64 * stride_ct + c64 * stride_ce, mask=valid, other=0.0))
    stddev = to_float32(tl.load(stddev_ptr + r64 * stride_st + c64 * stride_se, mask=valid, other=1.0))
    diff = clean - threshold
    # The reference's conventions: an infinite difference keeps its sign without the division;
    # no threshold (-inf) means always selected.
    z = tl.where((diff == float("inf")) | (diff == float("-inf")), diff, diff / stddev)
    z = tl.where(threshold == float("-inf"), float("inf"), z)
    probs = 0.5 * (1.0 + tl.math.erf(z * SQRT1_2))
    tl.store(probs_ptr + r64 * E + c64, probs.to(probs_ptr.dtype.element_ty), mask=valid)


def launch_config(num_tokens: int, num_experts: int):
    """(grid, BLOCK_T, BLOCK_E, num_warps) for a [num_tokens, num_experts] input."""
    return row_tile_config(num_tokens, num_experts, _TILE, _PER_THREAD)


def max_registers(num_warps: int) -> int | None:
    """Triton's maxnreg for a launch of num_warps: the register file (64K) shared by the block's
    threads, or None (ptxas's own choice) below 16 warps. At 16 warps ptxas capped itself at 64
    registers and spilled on sm_90 under triton 3.7.1 (the widest tile, E = 4096); allowing 128
    removes the spill at the cost of one block per SM, which a 4096-wide row fills anyway."""
    return 65536 // (32 * num_warps) if num_warps >= 16 else None


@torch.library.custom_op("moe_kernels_triton::load_probabilities", mutates_args=())
@on_tensor_device
def load_probabilities(
    clean_logits: torch.Tensor, noisy_logits: torch.Tensor, noise_stddev: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.load_probabilities (validated there).
    Returns (P [T, E], top [T, k+1] int64)."""
    T, E = noisy_logits.shape
    if not supports(E):
        raise ValueError(
            f"load_probabilities: the Triton kernel supports at most {MAX_EXPERTS} experts, got E={E}; "
            "use MOE_KERNELS_BACKEND=torch"
        )
    probs = noisy_logits.new_empty((T, E))
    top = torch.empty((T, k + 1), dtype=torch.int64, device=noisy_logits.device)
    if T > 0:
        grid, block_t, block_e, num_warps = launch_config(T, E)
        load_probabilities_kernel[grid](
            clean_logits,
            noisy_logits,
            noise_stddev,
            probs,
            top,
            T,
            E,
            clean_logits.stride(0),
            clean_logits.stride(1),
            noisy_logits.stride(0),
            noisy_logits.stride(1),
            noise_stddev.stride(0),
            noise_stddev.stride(1),
            k,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=num_warps,
            maxnreg=max_registers(num_warps),
        )
    return probs, top


@load_probabilities.register_fake
def _(clean_logits, noisy_logits, noise_stddev, k):
    T, E = noisy_logits.shape
    return noisy_logits.new_empty((T, E)), noisy_logits.new_empty((T, k + 1), dtype=torch.int64)


# For python_tests/builds/test_triton_aot.py: each dtype, a many-row tile and the widest single-row tile.
def _aot(dt, num_experts):
    _, block_t, block_e, num_warps = launch_config(1 << 20, num_experts)
    signature = {
        "clean_ptr": f"*{dt}",
        "noisy_ptr": f"*{dt}",
        "stddev_ptr": f"*{dt}",
        "probs_ptr": f"*{dt}",
        "top_ptr": "*i64",
        "T": "i32",
        "E": "i32",
        "stride_ct": "i64",
        "stride_ce": "i64",
        "stride_nt": "i64",
        "stride_ne": "i64",
        "stride_st": "i64",
        "stride_se": "i64",
        "K": "i32",
        "BLOCK_T": "constexpr",
        "BLOCK_E": "constexpr",
    }
    constexprs = {"BLOCK_T": block_t, "BLOCK_E": block_e}
    options = {"num_warps": num_warps, "maxnreg": max_registers(num_warps)}
    return load_probabilities_kernel, signature, constexprs, options


AOT_KERNELS = [
    _aot("fp32", 64),
    _aot("fp32", MAX_EXPERTS),
    _aot("fp16", 256),
    _aot("bf16", 8),
]
