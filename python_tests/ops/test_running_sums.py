"""moe_kernels.triton.running_sums: the running sums the Triton launches take for torch.cumsum along
a dimension, equal to it on every shape and dtype (in the interpreter here, and on a CUDA device
where there is one)."""

import pytest
import torch
from devices import gpu_skip_reason

from moe_kernels import backends
from moe_kernels.triton import running_sums

# Triton kernels: on CPU tensors in the interpreter pass (which selects `-m triton`), on CUDA ones
# on a GPU.
pytestmark = pytest.mark.triton
GPU_SKIP = gpu_skip_reason(backends.triton_interpreting())
CPU_SKIP = None if backends.triton_interpreting() else "Triton kernels on CPU tensors: the TRITON_INTERPRET=1 pass"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(CPU_SKIP is not None, reason=CPU_SKIP or "")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
@pytest.mark.parametrize("rows, max_chunks, partial_rows", [(64, 64, 64), (4, 3, 2)])
def test_along_rows(device, dtype, rows, max_chunks, partial_rows, monkeypatch):
    """along_rows (batchwise_mask's words: int8 counts) against torch.cumsum along each row; with
    the step, chunk and partial sizes lowered, several chunks of several steps a row."""
    monkeypatch.setattr(running_sums, "_ROWS", rows)
    monkeypatch.setattr(running_sums, "_MAX_CHUNKS", max_chunks)
    monkeypatch.setattr(running_sums, "_PARTIAL_ROWS", partial_rows)
    g = torch.Generator().manual_seed(0)
    for R, C in [(1, 1), (1, 7), (5, 1), (131, 8), (33, 257), (3, 4097)]:
        counts = torch.randint(0, 33, (R, C), generator=g).to(dtype).to(device)
        sums = running_sums.along_rows(counts)
        assert sums.dtype == torch.int32 and sums.is_contiguous()
        assert torch.equal(sums, counts.cumsum(1, dtype=torch.int32)), (R, C)


@pytest.mark.parametrize("device", DEVICES)
def test_total_past_int32(device):
    """A table whose total passes 2^31 while every row's sum stays below: each row is summed on
    its own, so the sums are exact."""
    counts = torch.full((4, 3), 2**29, dtype=torch.int32, device=device)
    assert torch.equal(running_sums.along_rows(counts), counts.cumsum(1, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, max_chunks, partial_rows", [(64, 64, 64), (4, 3, 2), (4, 1000, 2)])
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
