"""Running sums of count tables ([R, C] int8 / int32, contiguous) for the Triton ops' launches.

torch.cumsum on CUDA scans a flat tensor with CUB's device-wide scan, but a dimension of a 2-D
tensor row by row (the last dimension) or with a thread a column (the first), so a table of a few
long columns leaves the GPU idle: on an H200 (torch 2.11, CUDA time of five calls under
torch.profiler) the cumsum down capacity_positions' [131073, 8] block table took 31.2 ms of the
op's 31.5 ms at T = 1M, k = 8, E = 8, and batchwise_mask's three cumsums 5.9 of its 7.3 ms at
T = 1M, E = 256 (bench/results/gpu-nvidia-h200.md).
- along_rows (batchwise_mask's words): the table scanned flat, at about the speed of a copy, and
  each row's running sum that scan less its value before the row begins.
- exclusive_down (capacity_positions' segment tables): down the columns, in place, by Triton
  kernels: one launch where the table fits one program's rows, else two (each chunk's sums, then
  each chunk's scan after the chunks before it), and the totals written by the last chunk. It
  replaced the flat scan of the table's transpose, which took a fill of a zero row, two
  transposes, the scan (CUB's two or three kernels), two subtractions and a conversion of the
  totals: launches that each cost a few microseconds on a GPU, most of the maps' time at
  permute's sizes (about 37 us of its call at T k = 131072 on an H200, estimated in
  docs/dispatch.md)."""

import torch
import triton
import triton.language as tl


def along_rows(counts_RC: torch.Tensor, bound: int) -> torch.Tensor:
    """[R, C] int32: counts_RC's inclusive running sums along each row (dim 1), as
    counts_RC.cumsum(1). counts_RC: [R, C] contiguous integers, R, C >= 1; bound: an upper bound
    of the table's total (a sum over every row), which picks an int32 scan below 2^31, else int64
    (each row's own sums must be below 2^31)."""
    R, C = counts_RC.shape
    flat = counts_RC.reshape(-1).cumsum(0, dtype=torch.int32 if bound < 2**31 else torch.int64).view(R, C)
    # The scan's value before row r: its value at the row's first entry less that entry.
    before_R1 = flat[:, :1] - counts_RC[:, :1]
    return (flat - before_R1).to(torch.int32)


# exclusive_down: rows a step and columns a program; a program takes `steps` steps (a chunk), so
# that there are at most _MAX_CHUNKS chunks and each chunk's sum of the partials before it is short.
_ROWS = 128
_COLUMNS = 32
_MAX_CHUNKS = 1024
_PARTIAL_ROWS = 128  # partial rows summed a step


@triton.jit
def chunk_sums_kernel(
    table_ptr,  # [R, C] int32 contiguous
    partials_ptr,  # [chunks, C] int32 out: each chunk's sums down each column
    R,
    C,
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
        total += tl.sum(tl.load(table_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=ok, other=0), axis=0)
    tl.store(partials_ptr + tl.program_id(0).to(tl.int64) * C + c, total, mask=c < C)


@triton.jit
def column_scan_kernel(
    table_ptr,  # [R, C] int32 contiguous: in, counts; out, each column's sum over the rows before
    partials_ptr,  # [chunks, C] int32: chunk_sums_kernel's (unread with one chunk)
    totals_ptr,  # [C] int64 out: each column's sum
    R,
    C,
    STEPS,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
):
    """Grid (chunks, column groups): this chunk's rows become their exclusive sums down each
    column, in place, from the sum of the chunks before it; the last chunk writes the totals."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    col_ok = (c < C)[None, :]
    before = tl.zeros([COLUMNS], tl.int32)  # sums below 2^31: the caller's bound
    for first in range(0, chunk, PARTIAL_ROWS):
        q = first + tl.arange(0, PARTIAL_ROWS)
        at = partials_ptr + q.to(tl.int64)[:, None] * C + c[None, :]
        before += tl.sum(tl.load(at, mask=(q < chunk)[:, None] & col_ok, other=0), axis=0)
    for step in range(STEPS):
        r = (chunk * STEPS + step) * ROWS + tl.arange(0, ROWS)
        ok = (r < R)[:, None] & col_ok
        at = table_ptr + r.to(tl.int64)[:, None] * C + c[None, :]
        x = tl.load(at, mask=ok, other=0)
        tl.store(at, before[None, :] + tl.cumsum(x, axis=0) - x, mask=ok)
        before += tl.sum(x, axis=0)
    if chunk == tl.num_programs(0) - 1:
        tl.store(totals_ptr + c, before.to(tl.int64), mask=c < C)


def exclusive_down(counts_RC: torch.Tensor) -> torch.Tensor:
    """In place: counts_RC [R, C] int32 contiguous (R, C >= 1, every column's sum below 2^31)
    becomes each column's sum over the rows before each row. Returns the columns' totals [C]
    int64."""
    R, C = counts_RC.shape
    totals = torch.empty(C, dtype=torch.int64, device=counts_RC.device)
    steps = triton.cdiv(triton.cdiv(R, _ROWS), _MAX_CHUNKS)
    chunks = triton.cdiv(R, steps * _ROWS)
    grid = (chunks, triton.cdiv(C, _COLUMNS))
    partials = counts_RC.new_empty((chunks, C)) if chunks > 1 else totals  # unread with one chunk
    if chunks > 1:
        chunk_sums_kernel[grid](counts_RC, partials, R, C, steps, ROWS=_ROWS, COLUMNS=_COLUMNS)
    column_scan_kernel[grid](
        counts_RC, partials, totals, R, C, steps, ROWS=_ROWS, COLUMNS=_COLUMNS, PARTIAL_ROWS=_PARTIAL_ROWS
    )
    return totals


AOT_KERNELS = [
    (
        chunk_sums_kernel,
        {"table_ptr": "*i32", "partials_ptr": "*i32", "R": "i32", "C": "i32", "STEPS": "i32"}
        | {"ROWS": "constexpr", "COLUMNS": "constexpr"},
        {"ROWS": _ROWS, "COLUMNS": _COLUMNS},
        {"num_warps": 4},
    ),
    (
        column_scan_kernel,
        {"table_ptr": "*i32", "partials_ptr": "*i32", "totals_ptr": "*i64", "R": "i32", "C": "i32", "STEPS": "i32"}
        | {"ROWS": "constexpr", "COLUMNS": "constexpr", "PARTIAL_ROWS": "constexpr"},
        {"ROWS": _ROWS, "COLUMNS": _COLUMNS, "PARTIAL_ROWS": _PARTIAL_ROWS},
        {"num_warps": 4},
    ),
]
