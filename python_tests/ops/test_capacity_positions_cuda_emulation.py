"""The CUDA capacity_positions segment kernels' layout, executed on the host.

csrc/cuda/capacity_positions.cu is only compiled here (no GPU). Its layout is written once in
csrc/include/moe_kernels/capacity_segments.h; python_tests/ops/emulate/capacity_positions_cuda.cpp
(host_emulation.build) runs its three steps with the same blocks, warps, segments, chunks and scan
rows, the lanes of a chunk in order. What this checks: that the segments cover the fill order once,
in order (both fill orders, ragged last segments, k > the warps of a block), the counts table's
scan, dropped and empty choices, against the reference. What it cannot check: the CUDA execution
itself (__match_any_sync, the leader's shuffle, shared memory, __syncwarp): the GPU tests do.
"""

import ctypes
import importlib

import host_emulation
import pytest
import torch
from shapes import routing_choices

from moe_kernels import reference

from .test_dispatch import priorities

# The reference's fill order (its module, which the package's `capacity_positions` function hides).
fill_order = importlib.import_module("moe_kernels.reference.capacity_positions")._fill_order
i64, ptr = ctypes.c_int64, ctypes.c_void_p


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    so = ctypes.CDLL(
        str(host_emulation.build("capacity_positions_cuda", tmp_path_factory.mktemp("emulate"), shared=True))
    )
    so.capacity_positions.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr]
    so.capacity_positions.restype = i64
    so.warps_per_block.argtypes = [i64]
    so.warps_per_block.restype = i64
    so.supported.argtypes = [i64, i64, i64]
    so.supported.restype = ctypes.c_int
    so.segment_choices.restype = i64
    assert so.segment_choices() == 2048  # the segment size the shapes below are chosen around
    return so


def emulate(so, experts, E, C, priority=None):
    """(positions [T, k], counts [E], segments) of the emulated kernels; the fill order as the
    CUDA glue builds it (csrc/cuda_ops.cpp): an array only for a priority."""
    T, k = experts.shape
    experts = experts.contiguous()
    order = None if priority is None else fill_order(experts, priority)
    positions = torch.full((T, k), -7, dtype=torch.int64)  # every entry must be written
    counts = torch.full((E,), -7, dtype=torch.int64)
    segments = so.capacity_positions(
        experts.data_ptr(), None if order is None else order.contiguous().data_ptr(), T, k, E, C,
        positions.data_ptr(), counts.data_ptr(),
    )  # fmt: skip
    return positions, counts, segments


def check(so, experts, E, C, priority=None):
    positions, counts, segments = emulate(so, experts, E, C, priority)
    ref_positions, ref_counts = reference.capacity_positions(experts, E, C, priority=priority)
    assert torch.equal(positions, ref_positions), (tuple(experts.shape), E, C, priority is None)
    assert torch.equal(counts, ref_counts)
    return segments


@pytest.mark.parametrize("kind", ["random", "empties", "one_expert", "all_empty"])
@pytest.mark.parametrize("priority", [None, "random", "ties"])
def test_segments_match_reference(emulator, kind, priority):
    # T = 5000: three token blocks, the last ragged (904 tokens); k = 3 slots, so the default
    # order's 9 segments go (b, s) = (0, 0), (0, 1), (0, 2), (1, 0), ... across a block's warps.
    for T, E, k in [(5000, 64, 3), (4096, 8, 2), (3000, 256, 8), (1, 1, 1), (2049, 5, 1)]:
        experts = routing_choices(kind, T, E, k, seed=T + k)
        p = priorities(priority, T, k, seed=T)
        for C in sorted({0, 1, -(-T * k // E), T * k}):
            check(emulator, experts, E, C, p)


def test_many_scan_row_blocks(emulator):
    """More than one block of the scan's rows (256 segments each): 600 segments, a ragged last
    row block, and the counts' totals from the last one."""
    segment = emulator.segment_choices()
    T, E, k = 600 * segment // 4 - 17, 16, 4
    experts = torch.randint(-1, E, (T, k), generator=torch.Generator().manual_seed(1))
    assert check(emulator, experts, E, -(-T * k // E)) == 4 * -(-T // segment)
    assert check(emulator, experts, E, T, priorities("ties", T, k)) == -(-T * k // segment)


def test_widest_and_out_of_range(emulator):
    """The most experts a block's counters take (one warp a block) and ids outside [0, E), which
    get no slot and are not counted (as on the Triton kernels)."""
    T, k = 3000, 2
    for E in (8192, 1000):
        experts = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(E))
        wild = experts.clone()
        wild[::5, 0] = E + 3
        wild[1::7, 1] = -5
        positions, counts, _ = emulate(emulator, wild, E, 2)
        kept = torch.where((wild >= 0) & (wild < E), wild, -1)
        ref = reference.capacity_positions(kept, E, 2)
        assert torch.equal(positions, ref[0]) and torch.equal(counts, ref[1])
    assert [emulator.warps_per_block(E) for E in (1, 8, 1024, 1025, 4096, 8192)] == [8, 8, 8, 7, 2, 1]
    assert emulator.supported(8192, 2**31 - 1, 1) and not emulator.supported(8193, 10, 1)
    assert not emulator.supported(8, 2**30, 2) and not emulator.supported(0, 10, 1)
    # The scan's row blocks on a grid's y axis (65535 blocks of 256 segments): few tokens, many slots.
    assert emulator.supported(8, 1, 65535 * 256) and not emulator.supported(8, 1, 65535 * 256 + 1)
