"""Running sums of count tables ([R, C] int8 / int32) for the Triton ops' launches, by Triton
kernels: along_rows (batchwise_mask's words, inclusive) and exclusive_down (capacity_positions'
segment tables, in place). A program takes ROWS entries of the scanned dimension a step for
COLUMNS of the other; one launch where the scanned dimension fits one program's steps, else two
(each chunk's sums, then each chunk's scan after the chunks before it); the last chunk writes the
totals.

torch.cumsum on CUDA scans a flat tensor with CUB's device-wide scan, but a dimension of a 2-D
tensor row by row (the last dimension) or with a thread a column (the first), so a table of a few
long columns leaves the GPU idle: on an H200 (torch 2.11, CUDA time of five calls under
torch.profiler) the cumsum down capacity_positions' [131073, 8] block table took 31.2 ms of the
op's 31.5 ms at T = 1M, k = 8, E = 8, and batchwise_mask's three cumsums 5.9 of its 7.3 ms at
T = 1M, E = 256 (bench/results/gpu-nvidia-h200.md). A flat scan of the table (or its transpose),
less each row's value before it, replaced them, at about the speed of a copy but in several
launches: a zero row's fill, two transposes, the scan (CUB's two or three kernels), two
subtractions and the totals' conversion for capacity_positions' table, each launch a few
microseconds on a GPU, most of the maps' time at permute's sizes (about 37 us of its call at
T k = 131072 on an H200, estimated in docs/dispatch.md), and an int32 copy of batchwise_mask's
int8 word counts (32 MB at T = 1M, E = 256) written and read again. These kernels replaced it."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device

# A step is ROWS entries of the scanned dimension for COLUMNS of the others (64 x 32: a [128, 32]
# tile of 64-bit addresses spilled with unit column strides), and a program takes `steps` steps
# (a chunk), so that there are at most _MAX_CHUNKS chunks: each chunk's sum of the partials before
# it is one load, and the launches are about one wave of programs (each a chain of a few loads),
# not many short ones.
_ROWS = 64
_COLUMNS = 32
_MAX_CHUNKS = 64
_PARTIAL_ROWS = 64  # partial rows summed a step


@triton.jit
def chunk_sums_kernel(
    src_ptr,  # [R, C] int8 / int32, strides (stride_r, stride_c)
    partials_ptr,  # [chunks, C] int32 out: each chunk's sums down each column
    R,
    C,
    stride_r,
    stride_c,
    STEPS,  # steps of ROWS rows a chunk
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """Grid (chunks, column groups)."""
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    total = tl.zeros([COLUMNS], tl.int32)
    for step in range(STEPS):
        r = (tl.program_id(0) * STEPS + step) * ROWS + tl.arange(0, ROWS)
        ok = (r < R)[:, None] & (c < C)[None, :]
        at = src_ptr + r.to(tl.int64)[:, None] * stride_r + c.to(tl.int64)[None, :] * stride_c
        total += tl.sum(tl.load(at, mask=ok, other=0).to(tl.int32), axis=0)
    tl.store(partials_ptr + tl.program_id(0).to(tl.int64) * C + c, total, mask=c < C)


@triton.jit
def column_scan_kernel(
    src_ptr,  # [R, C] int8 / int32, strides (src_stride_r, src_stride_c): the counts
    dst_ptr,  # [R, C] int32 out (may be src), strides (dst_stride_r, dst_stride_c): their sums
    partials_ptr,  # [chunks, C] int32: chunk_sums_kernel's (unread with one chunk)
    totals_ptr,  # [C] int64 out: each column's sum
    R,
    C,
    src_stride_r,
    src_stride_c,
    dst_stride_r,
    dst_stride_c,
    STEPS,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
    INCLUSIVE: tl.constexpr,  # each row's sum over the rows up to it, else before it
):
    """Grid (chunks, column groups): this chunk's rows' running sums down each column, from the
    sum of the chunks before it; the last chunk writes the totals."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    col_ok = (c < C)[None, :]
    before = tl.zeros([COLUMNS], tl.int32)  # each column's sums below 2^31: the callers'
    for first in range(0, chunk, PARTIAL_ROWS):
        q = first + tl.arange(0, PARTIAL_ROWS)
        at = partials_ptr + q.to(tl.int64)[:, None] * C + c[None, :]
        before += tl.sum(tl.load(at, mask=(q < chunk)[:, None] & col_ok, other=0), axis=0)
    for step in range(STEPS):
        r = (chunk * STEPS + step) * ROWS + tl.arange(0, ROWS)
        ok = (r < R)[:, None] & col_ok
        r64, c64 = r.to(tl.int64)[:, None], c.to(tl.int64)[None, :]
        x = tl.load(src_ptr + r64 * src_stride_r + c64 * src_stride_c, mask=ok, other=0).to(tl.int32)
        sums = before[None, :] + tl.cumsum(x, axis=0)
        if not INCLUSIVE:
            sums -= x
        tl.store(dst_ptr + r64 * dst_stride_r + c64 * dst_stride_c, sums, mask=ok)
        before += tl.sum(x, axis=0)
    if chunk == tl.num_programs(0) - 1:
        tl.store(totals_ptr + c, before.to(tl.int64), mask=c < C)


@on_tensor_device
def _down(src: torch.Tensor, dst: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """dst [R, C] int32 (any strides; may be src) = the running sums of src [R, C] (int8 / int32,
    any strides) down each column; returns the columns' totals [C] int64."""
    R, C = src.shape
    totals = torch.empty(C, dtype=torch.int64, device=src.device)
    steps = triton.cdiv(triton.cdiv(R, _ROWS), _MAX_CHUNKS)
    chunks = triton.cdiv(R, steps * _ROWS)
    grid = (chunks, triton.cdiv(C, _COLUMNS))
    partials = torch.empty((chunks, C), dtype=torch.int32, device=src.device) if chunks > 1 else dst
    if chunks > 1:  # with one chunk no partial is read
        chunk_sums_kernel[grid](src, partials, R, C, *src.stride(), steps, ROWS=_ROWS, COLUMNS=_COLUMNS)
    column_scan_kernel[grid](
        src, dst, partials, totals, R, C, *src.stride(), *dst.stride(), steps,
        ROWS=_ROWS, COLUMNS=_COLUMNS, PARTIAL_ROWS=_PARTIAL_ROWS, INCLUSIVE=inclusive,
    )  # fmt: skip
    return totals


def along_rows(counts_RC: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 contiguous: counts_RC's inclusive running sums along each row (dim 1), as
    counts_RC.cumsum(1). counts_RC: [R, C] int8 / int32, R, C >= 1, each row's sum below 2^31."""
    out = torch.empty(counts_RC.shape, dtype=torch.int32, device=counts_RC.device)
    _down(counts_RC.t(), out.t(), inclusive=True)
    return out


def exclusive_down(counts_RC: torch.Tensor) -> torch.Tensor:
    """In place: counts_RC [R, C] int32 (R, C >= 1, every column's sum below 2^31) becomes each
    column's sum over the rows before each row. Returns the columns' totals [C] int64."""
    return _down(counts_RC, counts_RC, inclusive=False)


def _aot(kernel, src: str, unit_r: bool):
    """An AOT_KERNELS entry: `src` counts ("i8" / "i32") whose scanned dimension has stride 1
    (along_rows) or whose columns have (exclusive_down), as a launch specialises it."""
    signature = {"src_ptr": f"*{src}"}
    if kernel is column_scan_kernel:
        signature.update(dst_ptr="*i32")
    signature.update(partials_ptr="*i32")
    if kernel is column_scan_kernel:
        signature.update(totals_ptr="*i64")
    signature.update(R="i32", C="i32")
    strides = ("src_stride_r", "src_stride_c", "dst_stride_r", "dst_stride_c")
    strides = strides if kernel is column_scan_kernel else ("stride_r", "stride_c")
    constexprs = {"ROWS": _ROWS, "COLUMNS": _COLUMNS}
    for name in strides:
        if name.endswith("_r") == unit_r:
            constexprs[name] = 1
        else:
            signature[name] = "i32"
    signature["STEPS"] = "i32"
    if kernel is column_scan_kernel:
        constexprs.update(PARTIAL_ROWS=_PARTIAL_ROWS, INCLUSIVE=unit_r)
    ordered = {}
    for name in kernel.arg_names:
        ordered[name] = signature.get(name, "constexpr")
    return kernel, ordered, constexprs, {"num_warps": 4}


AOT_KERNELS = [
    _aot(chunk_sums_kernel, "i32", unit_r=False),
    _aot(column_scan_kernel, "i32", unit_r=False),
    _aot(chunk_sums_kernel, "i8", unit_r=True),
    _aot(column_scan_kernel, "i8", unit_r=True),
]
