"""Running sums of count tables ([R, C] int8 / int32, contiguous) for the Triton ops' launches, each
from one scan of the whole table as a flat vector.

torch.cumsum on CUDA scans a flat tensor with CUB's device-wide scan, but a dimension of a 2-D
tensor row by row (the last dimension) or with a thread a column (the first), so a table of a few
long columns leaves the GPU idle: on an H200 (torch 2.11, CUDA time of five calls under
torch.profiler) the cumsum down capacity_positions' [131073, 8] block table took 31.2 ms of the
op's 31.5 ms at T = 1M, k = 8, E = 8, and batchwise_mask's three cumsums 5.9 of its 7.3 ms at
T = 1M, E = 256 (bench/results/gpu-nvidia-h200.md). Here the table is scanned flat, at about the
speed of a copy, and each row's running sum is that scan less its value before the row begins."""

import torch


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


def down_columns(counts_RC: torch.Tensor, bound: int) -> torch.Tensor:
    """[R, C] int32 contiguous: counts_RC's inclusive running sums down each column (dim 0), as
    counts_RC.cumsum(0); arguments as along_rows. The table goes through its transpose, so the
    flat scan runs down the columns (two copies of the table more, each at copy speed)."""
    return along_rows(counts_RC.t().contiguous(), bound).t().contiguous()
