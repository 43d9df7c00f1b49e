"""bench/cuda_sass.py: the CUDA kernels' registers, spills and loop counts for sm_90 (nvcc and
the cuobjdump Triton ships; no GPU needed)."""

import shutil
import sys
from pathlib import Path

import pytest
from cuda_toolkit import nvcc

from moe_kernels import backends

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import cuda_sass  # noqa: E402

needs_triton = pytest.mark.skipif(not backends.triton_importable(), reason="the disassembler is triton's cuobjdump")


def test_loops_are_backward_branches():
    body = [(0x00, "MOV R1, c[0x0][0x28]"), (0x10, "IADD3 R2, R2, 0x1, RZ"), (0x20, "ISETP.GE.AND P0, PT, R2, R3, PT")]
    body += [(0x30, "@!P0 BRA 0x10"), (0x40, "BRA 0x50"), (0x50, "EXIT")]
    assert cuda_sass.loops(body) == [(0x10, 0x30, 3)]


@needs_triton
@pytest.mark.skipif(shutil.which("c++filt") is None, reason="the kernels' template arguments are c++filt's")
def test_counts_the_capacity_positions_kernels():
    rows = {row["kernel"]: row for row in cuda_sass.report(ROOT / "csrc/cuda/capacity_positions.cu", 50, nvcc())}
    # The strided path's kernels, with each way of finding a chunk's peers (capacity_segments::Path).
    for kernel in ("segment_counts_kernel", "segment_positions_kernel"):
        for peers in ("MatchPeers", "VotePeers"):
            row = rows[f"{kernel}<moe_kernels::{peers}>"]
            assert row["spills"] == 0 and 0 < row["registers"] <= 255
            # The chunk loop: a trip ranks 8 chunks of 32 choices, each a few tens of instructions
            # (the votes' loop over the label's bits inside it, under 50).
            assert len(row["loops"]) == 1 and 8 * 20 < row["loops"][0] < 8 * 150, row
    # The tile path's, at 4 and 8 entries a thread.
    for loads in (4, 8):
        assert rows[f"tile_counts_kernel<{loads}>"]["spills"] == 0
        for peers in ("MatchPeers", "VotePeers"):
            assert rows[f"tile_positions_kernel<{loads}, moe_kernels::{peers}>"]["spills"] == 0
    assert {"column_partials_kernel", "column_scan_kernel", "expert_scan_kernel"} <= set(rows)
