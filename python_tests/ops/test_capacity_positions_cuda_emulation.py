"""The CUDA capacity_positions segment kernels' layout, executed on the host.

csrc/cuda/capacity_positions.cu is only compiled here (no GPU). Its layout is written once in
csrc/include/moe_kernels/capacity_segments.h; python_tests/ops/emulate/capacity_positions_cuda.cpp
(host_emulation.build) runs its three steps with the same blocks, warps, segments, chunks and scan
rows, the lanes of a chunk in order, on each of its paths (capacity_segments::Path): the strided
path and the tile path (its tiles, thread walks, label table and warps' slots), a chunk's peers by
equality (as __match_any_sync gives them) or from its votes (peers_by_votes, one ballot a bit).
What this checks: that the segments and tiles cover the fill order once, in order (both fill
orders, ragged last segments and tiles, k > the warps of a block), the counts table's scan, the
votes' bits, dropped and empty choices, against the reference. What it cannot check: the CUDA
execution itself (the ballots and __match_any_sync, the leader's shuffle, shared memory and its
atomics, the barriers): the GPU tests do.
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
    so.capacity_positions.argtypes = [ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, ptr]
    so.capacity_positions.restype = i64
    so.warps_per_block.argtypes = [i64]
    so.warps_per_block.restype = i64
    so.supported.argtypes = [i64, i64, i64]
    so.supported.restype = ctypes.c_int
    so.segment_choices.restype = i64
    so.tiles_fit.argtypes = [i64, i64, i64, ctypes.c_int]
    so.resolved_path.argtypes = [ctypes.c_int, i64, i64, i64, ctypes.c_int]
    so.label_bits.argtypes = [i64]
    assert so.segment_choices() == 2048  # the segment size the shapes below are chosen around
    return so


# capacity_segments::Path: the launcher's choice, then each path forced.
AUTO, STRIDED_MATCH, STRIDED_VOTES, TILES_VOTES, TILES_MATCH = -1, 0, 1, 2, 3
PATHS = [AUTO, STRIDED_MATCH, STRIDED_VOTES, TILES_VOTES, TILES_MATCH]


def emulate(so, experts, E, C, priority=None, path=AUTO):
    """(positions [T, k], counts [E], segments) of the emulated kernels on `path`; the fill order
    as the CUDA glue builds it (csrc/cuda_ops.cpp): an array only for a priority. segments is -1
    where the path does not fit (and nothing is written)."""
    T, k = experts.shape
    experts = experts.contiguous()
    order = None if priority is None else fill_order(experts, priority)
    positions = torch.full((T, k), -7, dtype=torch.int64)  # every entry must be written
    counts = torch.full((E,), -7, dtype=torch.int64)
    segments = so.capacity_positions(
        experts.data_ptr(), None if order is None else order.contiguous().data_ptr(), T, k, E, C, path,
        positions.data_ptr(), counts.data_ptr(),
    )  # fmt: skip
    return positions, counts, segments


def check(so, experts, E, C, priority=None, path=AUTO):
    positions, counts, segments = emulate(so, experts, E, C, priority, path)
    if segments == -1:
        assert path in (TILES_VOTES, TILES_MATCH), path
        T, k = experts.shape
        assert not so.tiles_fit(E, T, k, priority is not None)
        return segments
    ref_positions, ref_counts = reference.capacity_positions(experts, E, C, priority=priority)
    assert torch.equal(positions, ref_positions), (tuple(experts.shape), E, C, priority is None)
    assert torch.equal(counts, ref_counts)
    return segments


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["random", "empties", "one_expert", "all_empty"])
@pytest.mark.parametrize("priority", [None, "random", "ties"])
def test_segments_match_reference(emulator, kind, priority, path):
    # T = 5000: three token blocks, the last ragged (904 tokens, its last tile of 128 too); k = 3
    # slots, so the default order's 9 segments go (b, s) = (0, 0), (0, 1), (0, 2), (1, 0), ...
    # across a block's warps. k = 12 and 16: more slots than a tile block's 8 warps (two a warp for
    # some), 5 and 8 entries a thread; E = 512 at k = 16: k E at the tile path's limit.
    shapes = [(5000, 64, 3), (4096, 8, 2), (3000, 256, 8), (1, 1, 1), (2049, 5, 1), (2100, 40, 12), (300, 512, 16)]
    for T, E, k in shapes:
        experts = routing_choices(kind, T, E, k, seed=T + k)
        p = priorities(priority, T, k, seed=T)
        for C in sorted({0, 1, -(-T * k // E), T * k}):
            check(emulator, experts, E, C, p, path)


@pytest.mark.parametrize("path", [STRIDED_MATCH, TILES_VOTES])
def test_many_scan_row_blocks(emulator, path):
    """More than one block of the scan's rows (256 segments each): 600 segments, a ragged last
    row block, and the counts' totals from the last one."""
    segment = emulator.segment_choices()
    T, E, k = 600 * segment // 4 - 17, 16, 4
    experts = torch.randint(-1, E, (T, k), generator=torch.Generator().manual_seed(1))
    assert check(emulator, experts, E, -(-T * k // E), path=path) == 4 * -(-T // segment)
    if path == STRIDED_MATCH:
        assert check(emulator, experts, E, T, priorities("ties", T, k)) == -(-T * k // segment)


@pytest.mark.parametrize("path", PATHS)
def test_widest_and_out_of_range(emulator, path):
    """The most experts a block's counters take (one warp a block; the tile path's k E = 8192) and
    ids outside [0, E), which get no slot and are not counted (as on the Triton kernels)."""
    T, k = 3000, 2
    for E in (8192, 4096, 1000, 255, 256, 8):
        experts = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(E))
        wild = experts.clone()
        wild[::5, 0] = E + 3
        wild[1::7, 1] = -5
        wild[2::9, 0] = E  # the labels' E + 1: one past the last expert's
        positions, counts, segments = emulate(emulator, wild, E, 2, path=path)
        if segments == -1:
            assert path in (TILES_VOTES, TILES_MATCH) and E * k > 8192
            continue
        kept = torch.where((wild >= 0) & (wild < E), wild, -1)
        ref = reference.capacity_positions(kept, E, 2)
        assert torch.equal(positions, ref[0]) and torch.equal(counts, ref[1])
    assert [emulator.warps_per_block(E) for E in (1, 8, 1024, 1025, 4096, 8192)] == [8, 8, 8, 7, 2, 1]
    assert emulator.supported(8192, 2**31 - 1, 1) and not emulator.supported(8193, 10, 1)
    assert not emulator.supported(8, 2**30, 2) and not emulator.supported(0, 10, 1)
    # The scan's row blocks on a grid's y axis (65535 blocks of 256 segments): few tokens, many slots.
    assert emulator.supported(8, 1, 65535 * 256) and not emulator.supported(8, 1, 65535 * 256 + 1)


def test_paths_and_their_limits(emulator):
    """Which path the launcher takes (the strided path with match, the one a GPU has timed; the
    tile path, where forced, fits the default order with 2 <= k <= 16 and k E <= 8192), and the
    votes' bits: the bit width of E, so that label E (expert E - 1) and label 0 (no expert) differ."""
    assert [emulator.label_bits(E) for E in (1, 2, 3, 8, 255, 256, 8192)] == [1, 2, 2, 4, 8, 9, 14]
    fits = emulator.tiles_fit
    assert fits(256, 1 << 20, 8, 0) and fits(512, 10, 16, 0) and fits(4096, 10, 2, 0) and not fits(8192, 10, 2, 0)
    assert not fits(256, 1 << 20, 8, 1)  # a priority's order: the strided path
    assert not fits(8, 10, 1, 0) and not fits(8, 10, 17, 0) and not fits(1025, 10, 8, 0)
    assert emulator.resolved_path(AUTO, 256, 1 << 20, 8, 0) == STRIDED_MATCH  # until a GPU times the tiles
    assert emulator.resolved_path(AUTO, 256, 1 << 20, 8, 1) == STRIDED_MATCH
    assert emulator.resolved_path(AUTO, 8, 100, 1, 0) == STRIDED_MATCH
    assert emulator.resolved_path(STRIDED_VOTES, 8, 100, 8, 0) == STRIDED_VOTES
