"""Triton helpers shared by the kernels: the ranking order every backend uses."""

import triton
import triton.language as tl

# Smallest int64: below every rank pair, used to retire selected or padding elements.
NO_PAIR = tl.constexpr(-9223372036854775808)


@triton.jit
def rank_pair(x, cols):
    """int64 keys ordering (value, index) as every backend does: larger value, then lower index.

    x: float32 tensor; cols: int32 tensor broadcastable to x (the expert/token index).
    NaN ranks above +inf; -0.0 ties with +0.0. Mirrors csrc/include/moe_kernels/common.h.
    """
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0 into +0
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x != x, 0x7FFFFFFF, key)
    return (key.to(tl.int64) << 32) | (4294967295 - cols.to(tl.int64))


@triton.jit
def pair_index(pair):
    """The index encoded in a rank pair, as int32."""
    return (4294967295 - (pair & 4294967295)).to(tl.int32)
