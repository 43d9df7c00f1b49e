"""Triton helpers shared by the kernels: the ranking order every backend uses, the launch shape of
the row kernels, and the device every launch runs on."""

import functools

import torch
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


@triton.jit
def take_best(pair, x, cols):
    """The largest remaining rank pair of every row of a [BLOCK_R, BLOCK_W] tile:
    (the pair, its index, its value in x, the pairs with it retired to NO_PAIR)."""
    best = tl.max(pair, axis=1)
    idx = pair_index(best)
    hit = cols[None, :] == idx[:, None]
    value = tl.sum(tl.where(hit, x, 0.0), axis=1)
    return best, idx, value, tl.where(hit, NO_PAIR, pair)


def row_tile_config(num_rows: int, row_width: int, tile: int, per_thread: int):
    """Launch shape of the kernels that hold whole rows in registers: (grid, BLOCK_ROWS,
    BLOCK_WIDTH, num_warps). BLOCK_WIDTH is row_width rounded up to a power of two; a program takes
    as many rows as fit in `tile` elements (at least one), and enough warps that each thread holds
    at most `per_thread` elements (at most 16 warps), which the AOT test checks against spills."""
    block_w = triton.next_power_of_2(max(row_width, 1))
    block_r = max(1, min(tile // block_w, triton.next_power_of_2(max(num_rows, 1))))
    num_warps = min(16, max(1, block_r * block_w // (32 * per_thread)))
    return (triton.cdiv(num_rows, block_r),), block_r, block_w, num_warps


def on_tensor_device(launcher):
    """Decorator of every function that launches a kernel (python_tests/test_triton_launch_device.py
    checks): runs it with the current CUDA device set to the device of its first tensor argument.

    A Triton launch goes to the current device and its current stream, not the tensors' device, so
    inputs on cuda:1 while cuda:0 is current would run on the wrong GPU. Under TRITON_INTERPRET=1
    the tensors are on the CPU: nothing is set. Sits under @torch.library.custom_op (the schema is
    inferred through functools.wraps)."""

    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is None or tensor.device.type != "cuda":
            return launcher(*args, **kwargs)
        with torch.cuda.device(tensor.device):
            return launcher(*args, **kwargs)

    return launch
