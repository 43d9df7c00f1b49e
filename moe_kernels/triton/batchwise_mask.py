"""Batchwise top-m mask (eq 18, Shazeer et al. 2017 Appendix F) in Triton: one program per expert,
a radix select over the 32-bit order keys of the expert's column (4 bits per pass, MSB first,
each pass a loop over T in tiles), then one pass in token order that keeps the keys above the
m-th largest and the first of its ties, compacting the kept tokens with a running prefix sum."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device, rank_pair, to_float32

_BLOCK_T = 256  # tokens per tile: BLOCK_T x 16 bin comparisons per histogram step
_NUM_WARPS = 4


@triton.jit
def _order_keys(x):
    """int64 keys in [0, 2^32) ordered as the ranking order: NaN highest, -0 == +0, -inf lowest.
    The high half of rank_pair (a signed 32-bit key) shifted to unsigned."""
    return (rank_pair(x, tl.zeros(x.shape, tl.int32)) >> 32) + 2147483648


@triton.jit
def batchwise_mask_kernel(
    scores_ptr,  # [T, E] fp32/fp16/bf16, any strides
    mask_ptr,  # [T, E] contiguous bool, zero-initialised by the launcher
    tokens_ptr,  # [E, M] contiguous int64
    T,  # tokens
    E,  # experts
    stride_t,  # elements between consecutive tokens of scores
    stride_e,  # elements between consecutive experts of scores
    M,  # tokens per expert, 1 <= M <= T
    BLOCK_T: tl.constexpr,  # tokens per tile
    RADIX_BITS: tl.constexpr,  # bits per radix pass (32 must be a multiple)
):
    e = tl.program_id(0)
    BINS: tl.constexpr = 1 << RADIX_BITS
    PASSES: tl.constexpr = 32 // RADIX_BITS
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, BLOCK_T)
    column = scores_ptr + e.to(tl.int64) * stride_e
    prefix = tl.full((), 0, tl.int64)  # the leading digits of the M-th largest key found so far
    remaining = tl.full((), 0, tl.int64) + M  # its rank among the keys sharing those digits

    for p in tl.static_range(PASSES):
        shift = 32 - RADIX_BITS * (p + 1)  # a constant: static_range unrolls the passes
        hist = tl.zeros([BINS], tl.int64)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + offs
            valid = t < T
            x = to_float32(tl.load(column + t.to(tl.int64) * stride_t, mask=valid, other=0.0))
            key = _order_keys(x)
            match = valid & ((key >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
            d = (key >> shift) & (BINS - 1)
            hit = match[:, None] & (d[:, None] == bins[None, :])
            hist += tl.sum(hit.to(tl.int64), axis=0)
        # The digit of the remaining-th largest candidate: the largest bin whose count from the
        # top reaches `remaining` (counts from the top decrease with the bin).
        from_top = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0), axis=1)
        digit = tl.max(tl.where(from_top >= remaining, bins, 0), axis=0).to(tl.int64)
        above = tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        remaining -= above
        prefix = prefix | (digit << shift)

    # prefix is the M-th largest key; keep every key above it and the first `remaining` ties.
    ties_before = tl.full((), 0, tl.int64)
    kept_before = tl.full((), 0, tl.int64)
    out_tokens = tokens_ptr + e.to(tl.int64) * M
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs
        valid = t < T
        x = to_float32(tl.load(column + t.to(tl.int64) * stride_t, mask=valid, other=0.0))
        key = _order_keys(x)
        tie = (valid & (key == prefix)).to(tl.int64)
        tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie
        keep = valid & ((key > prefix) | ((tie != 0) & (tie_rank < remaining)))
        kept = keep.to(tl.int64)
        pos = kept_before + tl.cumsum(kept, axis=0) - kept
        tl.store(mask_ptr + t.to(tl.int64) * E + e, tl.full([BLOCK_T], 1, tl.int1), mask=keep)
        tl.store(out_tokens + pos, t.to(tl.int64), mask=keep)
        ties_before += tl.sum(tie, axis=0)
        kept_before += tl.sum(kept, axis=0)


@torch.library.custom_op("moe_kernels_triton::batchwise_mask", mutates_args=())
@on_tensor_device
def batchwise_mask(scores: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch; arguments as moe_kernels.ops.batchwise_mask (validated there)."""
    T, E = scores.shape
    mask = torch.zeros((T, E), dtype=torch.bool, device=scores.device)
    tokens = torch.empty((E, m), dtype=torch.int64, device=scores.device)
    if m > 0 and E > 0:
        batchwise_mask_kernel[(E,)](
            scores,
            mask,
            tokens,
            T,
            E,
            scores.stride(0),
            scores.stride(1),
            m,
            BLOCK_T=_BLOCK_T,
            RADIX_BITS=4,
            num_warps=_NUM_WARPS,
        )
    return mask, tokens


# An opaque custom op (not triton_op): the interpreter reads data pointers, which fake tensors
# forbid, so torch.compile must see the shapes from here rather than trace the launch.
@batchwise_mask.register_fake
def _(scores, m):
    T, E = scores.shape
    return scores.new_empty((T, E), dtype=torch.bool), scores.new_empty((E, m), dtype=torch.int64)


def _aot(dt):
    signature = {
        "scores_ptr": f"*{dt}",
        "mask_ptr": "*i1",
        "tokens_ptr": "*i64",
        "T": "i32",
        "E": "i32",
        "stride_t": "i64",
        "stride_e": "i64",
        "M": "i32",
        "BLOCK_T": "constexpr",
        "RADIX_BITS": "constexpr",
    }
    constexprs = {"BLOCK_T": _BLOCK_T, "RADIX_BITS": 4}
    return batchwise_mask_kernel, signature, constexprs, {"num_warps": _NUM_WARPS}


AOT_KERNELS = [_aot("fp32"), _aot("fp16"), _aot("bf16")]
