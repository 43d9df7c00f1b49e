"""dispatch and combine in Triton, tiled along d; every output element has one writer (no atomics):
- dispatch: a program per (block of tokens, d tile) reads its token rows once and writes each of
  their k copies to its slot (TE's permute design: a gather per slot read each token row k times),
  a choice writing only where the slot -> choice map names it; a second pass writes zeros to the
  empty slots alone. With weights it is combine's backward to the buffer.
- combine: a program per (block of tokens, d tile) sums its k weighted rows in float32, s = 0, 1..
  With unit weights it is dispatch's backward.
- row_dots: a program per block of tokens, its k choices one after the other, each walking d: the
  dot products <grad_y[t], row> of combine's (and unpermute's) backward to the weights.
"""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device
from moe_kernels.triton.routing_maps import kept_slots, slot_maps

# 8 rows x 128 columns per program, 4 warps: under triton 3.7.1 (torch 2.13.0's), 16 rows made
# ptxas spill in combine_kernel for sm_90; 8 rows need about 50 registers on sm_80 and sm_90.
_BLOCK_ROWS = 8
_BLOCK_D = 128
# zero_rows_kernel's stores a step: 8 rows x 512 columns (its tile holds zeros only).
_ZERO_BLOCK_D = 512


@triton.jit
def scatter_rows_kernel(
    x_ptr,  # [T, d] contiguous
    dest_ptr,  # [T * K] int64: the output row of choice t * K + s, -1 = none
    source_ptr,  # [S] int64: the choice that fills each output row, -1 = empty (dest's inverse)
    weights_ptr,  # [T * K] float32 (read only if HAS_WEIGHTS)
    out_ptr,  # [S, d] contiguous, x's dtype
    T,
    S,
    d,
    K,
    HAS_WEIGHTS: tl.constexpr,
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for float64 data (as the reference)
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < T
    col_ok = cols < d
    v = tl.load(
        x_ptr + tokens.to(tl.int64)[:, None] * d + cols[None, :],
        mask=token_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    for s in range(0, K):
        j = tokens.to(tl.int64) * K + s
        r = tl.load(dest_ptr + j, mask=token_ok, other=-1)
        ok = (r >= 0) & (r < S)
        # Only the choice the row's source names writes it: one writer per row even where two
        # choices claim one slot (positions not unique: invalid, unchecked on a GPU), and the
        # same choice as the gather from `source` would copy.
        owner = tl.load(source_ptr + tl.where(ok, r, 0), mask=ok, other=-1)
        ok = ok & (owner == j)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + j, mask=ok, other=0.0)
            value = (v.to(ACC) * w[:, None]).to(out_ptr.dtype.element_ty)
        else:
            value = v
        tl.store(out_ptr + tl.where(ok, r, 0)[:, None] * d + cols[None, :], value, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def zero_rows_kernel(
    source_ptr,  # [S] int64: the choice that fills each row, -1 = empty
    dest_ptr,  # [N] int64: the row of each choice (N = T * K)
    out_ptr,  # [S, d] contiguous
    S,
    N,
    d,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Zeros into the rows scatter_rows_kernel does not write: those whose source is -1 (or outside
    [0, N)), or names a choice whose dest is another row (a choice two rows of a malformed map
    name). Every row is then written exactly once. A program per block of rows walks d: it reads
    the block's map once, and a block with no empty row (most of them, at a capacity near the
    load) returns after that. A program per (block, d tile) read the map in every tile, and its
    million programs at 163,840 rows x 7168 took half of dispatch's time on an H200."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < S
    j = tl.load(source_ptr + rows, mask=row_ok, other=-1)
    named = (j >= 0) & (j < N)
    back = tl.load(dest_ptr + tl.where(named, j, 0), mask=row_ok & named, other=-1)
    empty = row_ok & ~(named & (back == rows))
    if tl.max(empty.to(tl.int32), axis=0) == 0:
        return
    zeros = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=out_ptr.dtype.element_ty)
    base = out_ptr + rows.to(tl.int64)[:, None] * d
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        tl.store(base + cols[None, :], zeros, mask=empty[:, None] & (cols < d)[None, :])


@triton.jit
def combine_kernel(
    buffer_ptr,  # [S, d] contiguous (S = E * C)
    slot_ptr,  # [T * K] int64: e * C + p of each kept choice, -1 otherwise
    weights_ptr,  # [T * K] float32
    out_ptr,  # [T, d] contiguous, buffer's dtype
    T,
    d,
    K,
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for float64 data (as the reference)
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < T
    col_ok = cols < d
    acc = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=ACC)
    for s in range(0, K):
        j = rows.to(tl.int64) * K + s
        slot = tl.load(slot_ptr + j, mask=row_ok, other=-1)
        kept = slot >= 0
        w = tl.load(weights_ptr + j, mask=kept, other=0.0)
        v = tl.load(
            buffer_ptr + tl.where(kept, slot, 0)[:, None] * d + cols[None, :],
            mask=kept[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += w[:, None] * v.to(ACC)
    out = out_ptr + rows.to(tl.int64)[:, None] * d + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def row_dots_kernel(
    grad_ptr,  # [T, d] contiguous
    src_ptr,  # [S, d] contiguous
    row_ptr,  # [T * K] int64: the row of src of each choice, -1 = none (its dot is 0)
    out_ptr,  # [T, K] ACC contiguous
    T,
    d,
    K,
    S,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t, s] = <grad[t], src[row[t K + s]]>: the weights' gradient of combine and unpermute. A
    program takes a block of tokens and their k choices one after the other, each walking d: its
    grad tile is re-read k times from cache (it is 8 rows), each chosen row read once. The
    products add up elementwise in a [BLOCK_ROWS, BLOCK_D] tile, summed across it once a choice
    (a row sum a step put a chain of shuffles in every step of the walk)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < T
    for s in range(0, K):
        r = tl.load(row_ptr + rows.to(tl.int64) * K + s, mask=row_ok, other=-1)
        kept = (r >= 0) & (r < S)
        acc = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=ACC)
        for start in range(0, d, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            col_ok = cols < d
            g = tl.load(
                grad_ptr + rows.to(tl.int64)[:, None] * d + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(ACC)
            v = tl.load(
                src_ptr + tl.where(kept, r, 0)[:, None] * d + cols[None, :],
                mask=kept[:, None] & col_ok[None, :],
                other=0.0,
            ).to(ACC)
            acc += g * v
        # 0 for a choice not kept, not acc: inf or NaN in grad times its zero row would be NaN.
        tl.store(out_ptr + rows.to(tl.int64) * K + s, tl.where(kept, tl.sum(acc, axis=1), 0.0), mask=row_ok)


def acc_dtype(dtype):
    """(torch dtype, triton dtype) of the accumulation: float64 for float64 data, else float32."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def _grid(rows, d):
    return (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(d, _BLOCK_D))


@on_tensor_device
def scatter_rows(
    x: torch.Tensor, dest: torch.Tensor, source: torch.Tensor, k: int, weights: torch.Tensor | None
) -> torch.Tensor:
    """out [S, d]: out[r] = weights[j] * x[j // k] for the choice j = source[r] where dest[j] = r
    (weight 1 if None), 0 elsewhere (source[r] = -1, or a choice whose dest is another row).
    dest [T * k]: the row of each choice, -1 for none; source [S]: its inverse on the rows it fills
    (a choice whose dest row names another choice writes nothing)."""
    S, d = source.numel(), x.shape[1]
    T = x.shape[0]
    out = x.new_empty(S, d)
    if out.numel():
        acc, acc_tl = acc_dtype(x.dtype)
        w = (weights if weights is not None else source.new_empty(0)).to(acc).contiguous().reshape(-1)
        dest = dest.contiguous()
        zero_rows_kernel[(triton.cdiv(S, _BLOCK_ROWS),)](
            source, dest, out, S, dest.numel(), d, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=_ZERO_BLOCK_D
        )
        if T * k:
            scatter_rows_kernel[_grid(T, d)](
                x.contiguous(),
                dest,
                source,
                w,
                out,
                T,
                S,
                d,
                k,
                HAS_WEIGHTS=weights is not None,
                ACC=acc_tl,
                BLOCK_ROWS=_BLOCK_ROWS,
                BLOCK_D=_BLOCK_D,
            )
    return out


@on_tensor_device
def gather_sum(src: torch.Tensor, row: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [T, d]: out[t] = sum over s with row[t*k+s] >= 0 of weights[t, s] * src[row[t*k+s]]."""
    T, k = weights.shape
    d = src.shape[1]
    out = src.new_empty(T, d)
    if out.numel():
        acc, acc_tl = acc_dtype(src.dtype)
        combine_kernel[_grid(T, d)](
            src.contiguous(),
            row,
            weights.to(acc).contiguous().reshape(-1),
            out,
            T,
            d,
            k,
            ACC=acc_tl,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_D=_BLOCK_D,
        )
    return out


@torch.library.custom_op("moe_kernels_triton::row_dots", mutates_args=())
@on_tensor_device
def row_dots(grad: torch.Tensor, src: torch.Tensor, row: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] in float32 (float64 for float64 data): <grad[t], src[row[t*k+s]]>, 0 where row is -1
    (or outside src)."""
    T, d = grad.shape
    acc, acc_tl = acc_dtype(src.dtype)
    out = torch.empty((T, k), dtype=acc, device=grad.device)
    if out.numel():
        row_dots_kernel[(triton.cdiv(T, _BLOCK_ROWS),)](
            grad.contiguous(),
            src.contiguous(),
            row.contiguous(),
            out,
            T,
            d,
            k,
            src.shape[0],
            ACC=acc_tl,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_D=_BLOCK_D,
        )
    return out


@row_dots.register_fake
def _(grad, src, row, k):
    return grad.new_empty((grad.shape[0], k), dtype=torch.float64 if src.dtype == torch.float64 else torch.float32)


@torch.library.custom_op("moe_kernels_triton::dispatch", mutates_args=())
def dispatch(
    x: torch.Tensor,
    experts: torch.Tensor,
    positions: torch.Tensor,
    num_experts: int,
    capacity: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """buffer [E, C, d] (weighted by weights[t, s] when given: combine's backward to the buffer)."""
    slot, source = slot_maps(experts, positions, num_experts, capacity)
    rows = scatter_rows(x, slot, source, experts.shape[1], weights)
    return rows.view(num_experts, capacity, x.shape[1])


@dispatch.register_fake
def _(x, experts, positions, num_experts, capacity, weights=None):
    return x.new_empty(num_experts, capacity, x.shape[1])


@torch.library.custom_op("moe_kernels_triton::combine", mutates_args=())
def combine(
    buffer: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """y [T, d] = sum over kept s of weights[t, s] * buffer[experts[t, s], positions[t, s]]."""
    E, C, d = buffer.shape
    return gather_sum(buffer.reshape(E * C, d), kept_slots(experts, positions, E, C), weights)


@combine.register_fake
def _(buffer, experts, positions, weights):
    return buffer.new_empty(experts.shape[0], buffer.shape[2])


def _aot_scatter_rows(dt, has_weights):
    signature = {
        "x_ptr": f"*{dt}",
        "dest_ptr": "*i64",
        "source_ptr": "*i64",
        "weights_ptr": "*fp32",
        "out_ptr": f"*{dt}",
        "T": "i32",
        "S": "i32",
        "d": "i32",
        "K": "i32",
    }
    constexprs = {"HAS_WEIGHTS": has_weights, "ACC": tl.float32, "BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_D": _BLOCK_D}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return scatter_rows_kernel, signature, constexprs, {"num_warps": 4}


def _aot_zero_rows(dt):
    signature = {"source_ptr": "*i64", "dest_ptr": "*i64", "out_ptr": f"*{dt}", "S": "i32", "N": "i32", "d": "i32"}
    constexprs = {"BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_D": _ZERO_BLOCK_D}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return zero_rows_kernel, signature, constexprs, {"num_warps": 4}


def _aot_combine(dt):
    signature = {
        "buffer_ptr": f"*{dt}",
        "slot_ptr": "*i64",
        "weights_ptr": "*fp32",
        "out_ptr": f"*{dt}",
        "T": "i32",
        "d": "i32",
        "K": "i32",
        "ACC": "constexpr",
        "BLOCK_ROWS": "constexpr",
        "BLOCK_D": "constexpr",
    }
    return (
        combine_kernel,
        signature,
        {"ACC": tl.float32, "BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_D": _BLOCK_D},
        {"num_warps": 4},
    )


def _aot_row_dots(dt):
    signature = {
        "grad_ptr": f"*{dt}",
        "src_ptr": f"*{dt}",
        "row_ptr": "*i64",
        "out_ptr": "*fp32",
        "T": "i32",
        "d": "i32",
        "K": "i32",
        "S": "i32",
    }
    constexprs = {"ACC": tl.float32, "BLOCK_ROWS": _BLOCK_ROWS, "BLOCK_D": _BLOCK_D}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return row_dots_kernel, signature, constexprs, {"num_warps": 4}


AOT_KERNELS = [
    _aot_row_dots("bf16"),
    _aot_row_dots("fp32"),
    _aot_scatter_rows("fp32", False),
    _aot_scatter_rows("bf16", True),
    _aot_scatter_rows("fp16", False),
    _aot_zero_rows("bf16"),
    _aot_zero_rows("fp32"),
    _aot_combine("fp32"),
    _aot_combine("bf16"),
    _aot_combine("fp16"),
]
