"""moe_kernels.triton.running_sums: the running sums the Triton launches take for torch.cumsum along
a dimension, equal to it on every shape, dtype and bound (on the CPU here, and on a CUDA device
where there is one, whose flat scan is CUB's)."""

import pytest
import torch
from devices import gpu_skip_reason

from moe_kernels import backends
from moe_kernels.triton import running_sums

GPU_SKIP = gpu_skip_reason(backends.triton_interpreting())
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_matches_cumsum(device, dtype):
    g = torch.Generator().manual_seed(0)
    for R, C in [(1, 1), (1, 7), (5, 1), (131, 8), (33, 257), (4097, 3)]:
        counts = torch.randint(0, 33, (R, C), generator=g).to(dtype).to(device)
        for bound in (counts.numel() * 32, 2**31):  # the int32 and the int64 scan
            rows = running_sums.along_rows(counts, bound=bound)
            assert rows.dtype == torch.int32 and rows.is_contiguous()
            assert torch.equal(rows, counts.cumsum(1, dtype=torch.int32)), (R, C, bound)


@pytest.mark.parametrize("device", DEVICES)
def test_total_past_int32(device):
    """A table whose total passes 2^31 while every row's sum stays below: the sums are exact. This
    cannot tell the bound's int64 scan from an int32 one: a wrapped int32 flat scan less its
    wrapped row start is exact too, so the bound is a guard, not a tested branch."""
    counts = torch.full((4, 3), 2**29, dtype=torch.int32, device=device)
    total = 12 * 2**29
    assert torch.equal(running_sums.along_rows(counts, bound=total), counts.cumsum(1, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, max_chunks, partial_rows", [(256, 1024, 256), (4, 3, 2), (4, 1000, 2)])
def test_exclusive_down(device, rows, max_chunks, partial_rows, monkeypatch):
    """exclusive_down (the Triton column scan, in place) against torch: each row the sum of the
    rows before it, and the totals; one program's rows (one launch) and, with the step, chunk and
    partial sizes lowered, several chunks of several steps whose sums carry over."""
    monkeypatch.setattr(running_sums, "_ROWS", rows)
    monkeypatch.setattr(running_sums, "_MAX_CHUNKS", max_chunks)
    monkeypatch.setattr(running_sums, "_PARTIAL_ROWS", partial_rows)
    g = torch.Generator().manual_seed(1)
    for R, C in [(1, 1), (1, 7), (5, 1), (50, 8), (131, 33), (600, 70)]:
        counts = torch.randint(0, 33, (R, C), generator=g, dtype=torch.int32).to(device)
        table = counts.clone()
        totals = running_sums.exclusive_down(table)
        assert totals.dtype == torch.int64 and torch.equal(totals, counts.sum(0, dtype=torch.int64)), (R, C)
        assert torch.equal(table, counts.cumsum(0, dtype=torch.int32) - counts), (R, C)
